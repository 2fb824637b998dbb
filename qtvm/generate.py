"""Greedy generation over a KV cache (runtime side; libtvm_runtime only).

An artefact compiled from a past_key_values export carries ``qtvm_kv_step``
(``relay_passes.kv_cache``): the caches are buffers this module owns, allocated once for
the artefact's maximum length, and the step writes each token's keys and values into
them in place. The attention sees the cache with its length rounded up to a multiple of
64 (``kv_length``) and the mask zero on the padding, so its shapes change once every 64
tokens. The buffers hold ``[batch, heads, kv_length, dim]`` contiguously (keys that feed
the attention's ``q @ k^T`` as ``[batch, heads, dim, kv_length]``): when the rounded length
grows (every 64 tokens) each row is moved once, in place, to its new stride; between those
moves nothing of the cache is copied.

An artefact without the step (a model the rewrite declined) runs ``main`` with the
presents fed back as it was exported: a copy of the cache per token, said by ``mode``.
"""
from __future__ import annotations

import numpy as np

from qtvm.errors import QtvmError
from qtvm.hugepages import NewMemoryOnHugePages


def _aligned(shape, dtype):
    """(numpy array, TVM tensor) on the same 64-byte aligned memory."""
    import tvm_ffi

    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + 64, np.uint8)
    off = -raw.ctypes.data % 64
    a = raw[off:off + n].view(dtype).reshape(shape)
    return a, tvm_ffi.from_dlpack(a)


def _move_rows(flat: np.ndarray, rows: int, old: int, new: int) -> None:
    """``rows`` rows of ``old`` values at the front of ``flat`` re-laid at stride ``new``."""
    kept = flat[:rows * old].reshape(rows, old).copy()
    dst = flat[:rows * new].reshape(rows, new)
    dst[:, :old] = kept
    dst[:, old:] = 0


def positions_from_mask(mask: np.ndarray, n: int) -> np.ndarray:
    """Position ids of the last ``n`` columns of ``mask`` ([batch, total]), as transformers'
    generate computes them for a model that takes ``position_ids``: the count of real tokens
    before each one (a left-padded row starts at 0), padding at 1."""
    positions = np.cumsum(mask, axis=1, dtype=np.int64) - 1
    positions[mask == 0] = 1
    return np.ascontiguousarray(positions[:, -n:])


def _position_input(inputs: list, ids: str) -> str | None:
    """The name of a ``position_ids``-like input ([batch, seq] integers besides the token ids)."""
    return next((s["name"] for s in inputs if s["name"] != ids and "position" in s["name"]
                 and len(s["shape"]) == 2 and s["dtype"].startswith("int")), None)


def position_limit(metadata: dict) -> int | None:
    """The most tokens the model's position tables hold (the smallest of its ``dim_limits``,
    e.g. past + seq <= 1024 for GPT-2), None without tables: the cache length's default."""
    return min((metadata.get("dim_limits") or {}).values(), default=None)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class KVSession:
    """One generation's state: the caches (preallocated for ``max_length`` tokens), the
    mask, and how many tokens the cache holds (``length``)."""

    mode = "in-place cache (qtvm_kv_step)"

    def __init__(self, module, batch: int = 1):
        import tvm
        import tvm_ffi

        info = module.metadata["kv_step"]
        self.module, self.info = module, info
        self.max_length, self.pad = int(info["max_length"]), int(info["pad"])
        if not 1 <= batch <= int(info["max_batch"]):
            raise QtvmError(f"batch {batch} is outside this artefact's KV-cache step (batch 1 .. {info['max_batch']})",
                            "recompile with --max-batch")
        self.batch = batch
        specs = {s["name"]: s for s in module.inputs}
        self._order = [s["name"] for s in module.inputs]
        self._ids_name, self._positions_name = info["ids"], info.get("positions")
        module._use_device()  # a GPU artefact: its device, and the VM placed on it
        self._device = module._device  # None: the CPU, where the buffers are numpy's too
        self._step = module.entry(info["function"])
        self._step_last = module.entry(info["last_function"]) if info.get("last_function") else None
        self._shape = tvm_ffi.Shape
        # Caches: one flat buffer each, [batch, heads, L, dim] for the current L, on the artefact's
        # device. On a GPU nothing is zeroed here: _relayout writes every view the step reads
        # (the rows kept, their padding zeroed) and each feed uploads the mask's view whole.
        self._rows = {}
        self._buffers, self._flat = {}, {}
        layouts = info.get("layouts") or ["bhld"] * len(info["caches"])
        with NewMemoryOnHugePages(written=False):  # every step reads the caches: 2 MiB pages
            for name, layout in zip(info["caches"], layouts):
                spec = specs[name]
                _, heads, _, dim = spec["shape"]
                dtype = info.get("cache_dtype") or spec["dtype"]  # --kv-cache fp16: float16 buffers
                self._rows[name] = (int(heads), int(dim), dtype, layout)
                self._buffers[name] = tvm.runtime.empty((batch * int(heads) * self.max_length * int(dim),), dtype,
                                                        self._device)
        for name, buf in self._buffers.items():
            if self._device is None:
                self._flat[name] = np.from_dlpack(buf)
                self._flat[name][:] = 0  # padded keys must be finite: probability 0 times a value
        self._mask_dtype = specs[info["mask"]]["dtype"]
        self._mask_buf = tvm.runtime.empty((batch * self.max_length,), self._mask_dtype, self._device)
        # edited here, in place on the CPU; on a GPU a host copy, uploaded after each edit
        self._mask_flat = np.from_dlpack(self._mask_buf) if self._device is None else \
            np.zeros(batch * self.max_length, self._mask_dtype)
        self._mask_flat[:] = 0
        self.length = 0
        self._layout = 0  # the L the buffers are laid out for (0: nothing yet)
        self._views: dict = {}
        self._ids: dict = {}  # n -> (staging array [batch, n] or None on a GPU, its tensor): no allocation per token
        self._positions: dict = {}  # the same for position_ids, where the model takes them

    # -- cache layout ----------------------------------------------------------------------
    def _relayout(self, new: int) -> None:
        """Move every row from length ``self._layout`` to ``new`` (> it) in its buffer (rows:
        (batch, head) of [length, dim] blocks, or (batch, head, dim) of transposed keys);
        the padding after each row is zeroed (masked keys must still be finite). On a GPU the
        used part goes through host memory once (one copy each way per buffer, every 64 tokens:
        transposed keys would be a copy per value on the device)."""
        old = self._layout
        for name, buf in self._buffers.items():
            heads, dim, dtype, layout = self._rows[name]
            rows, width = (self.batch * heads, dim) if layout == "bhld" else (self.batch * heads * dim, 1)
            if self._device is None:
                _move_rows(self._flat[name], rows, old * width, new * width)
                continue
            moved = np.zeros((rows, new * width), dtype)
            if old:
                moved[:, :old * width] = buf._create_view((rows, old * width), dtype).numpy()
            buf._create_view(moved.shape, dtype).copyfrom(moved)
        _move_rows(self._mask_flat, self.batch, old, new)
        self._layout = new
        self._views = {name: buf._create_view(self._shape_of(name, new), self._rows[name][2])
                       for name, buf in self._buffers.items()}
        self._views[self.info["mask"]] = self._mask_buf._create_view((self.batch, new), self._mask_dtype)

    def _staged(self, cache: dict, values: np.ndarray):
        """``values`` ([batch, n] int64) in the tensor kept for their n: host memory the step
        reads in place on the CPU, a device tensor written by one copy on a GPU."""
        tensor = cache.get(values.shape[1])
        if tensor is None:
            import tvm

            tensor = cache[values.shape[1]] = _aligned(values.shape, np.int64) if self._device is None else \
                (None, tvm.runtime.empty(values.shape, "int64", self._device))
        if tensor[0] is None:
            tensor[1].copyfrom(values)
        else:
            tensor[0][...] = values
        return tensor[1]

    def _shape_of(self, name: str, length: int) -> tuple:
        heads, dim, _, layout = self._rows[name]
        return (self.batch, heads, length, dim) if layout == "bhld" else (self.batch, heads, dim, length)

    def mask(self) -> np.ndarray:
        """The mask as the step sees it, [batch, kv_length] (a view)."""
        return self._mask_flat[:self.batch * self._layout].reshape(self.batch, self._layout)

    def cache(self, name: str) -> np.ndarray:
        """Cache ``name``'s first ``length`` positions, [batch, heads, length, dim] (a copy)."""
        heads, dim, dtype, layout = self._rows[name]
        shape = self._shape_of(name, self._layout)
        full = self._flat[name][:int(np.prod(shape))].reshape(shape) if self._device is None else \
            self._buffers[name]._create_view(shape, dtype).numpy()
        if layout == "bhdl":  # keys kept transposed for the attention
            return full[..., :self.length].transpose(0, 1, 3, 2).copy()
        return full[:, :, :self.length].copy()

    # -- steps ---------------------------------------------------------------------------
    def feed(self, ids, attention_mask=None, last: bool = False) -> np.ndarray:
        """Append ``ids`` ([batch, n] int64) and return their logits ([batch, n, vocab]; with
        ``last``, the last position's only, [batch, 1, vocab], computed for that row alone
        where the artefact has ``relay_passes.last_logits``' step). ``attention_mask``
        ([batch, n], 0 for padding such as a left-padded prompt) defaults to ones. Past the
        maximum length nothing is written: QtvmError."""
        ids = np.ascontiguousarray(ids, dtype=np.int64) if not isinstance(ids, np.ndarray) or \
            ids.dtype != np.int64 else np.ascontiguousarray(ids)
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] < 1:
            raise QtvmError(f"ids have shape {list(ids.shape)}, expected [{self.batch}, n >= 1]")
        n = ids.shape[1]
        total = self.length + n
        if total > self.max_length:
            raise QtvmError(f"generation past the maximum length: the cache holds {self.length} tokens and "
                            f"{n} more would make {total} > {self.max_length}",
                            "stop earlier, or recompile with a larger --max-length")
        layout = _round_up(total, self.pad)
        if layout != self._layout:
            self._relayout(layout)
        m = self.mask()
        m[:, self.length:total] = 1 if attention_mask is None else np.asarray(attention_mask).reshape(self.batch, n)
        fed = {self._ids_name: self._staged(self._ids, ids)}
        if self._positions_name is not None:
            fed[self._positions_name] = self._staged(self._positions, positions_from_mask(m[:, :total], n))
        views = self._views
        if self._device is not None:
            views[self.info["mask"]].copyfrom(m)
        args = [fed[name] if name in fed else views[name] for name in self._order]
        step = self._step_last if last and n > 1 and self._step_last is not None else self._step
        out = step(*args, self._shape((self.length, layout // self.pad)))
        logits = np.from_dlpack(out) if self._device is None else out.numpy()
        self.length = total
        return logits[:, -1:] if last else logits  # the VM's fresh output (CPU: a view of it; GPU: its copy)


class ConcatSession:
    """The fallback for artefacts without ``qtvm_kv_step``: ``main`` as exported, its
    presents fed back (copies of the whole cache per token)."""

    mode = "presents fed back (main)"

    def __init__(self, module, batch: int = 1, max_length: int | None = None):
        self.module, self.batch, self.length = module, batch, 0
        # default: the model's position limits, as the in-place step's --max-length (``pipeline._kv_step``)
        self.max_length = max_length or position_limit(module.metadata) or 1 << 30
        ins = module.inputs
        self._ids = next(s["name"] for s in ins if s["name"] == "input_ids"
                         or (s["shape"] == ["batch", "seq"] and "position" not in s["name"]))
        self._positions = _position_input(ins, self._ids)
        self._mask = next((s["name"] for s in ins if s["name"] not in (self._ids, self._positions)
                           and len(s["shape"]) == 2), None)
        self._caches = [s for s in ins if len(s["shape"]) == 4]
        outs = [s["name"] for s in module.outputs]
        self._logits, self._presents = outs[0], outs[1:]
        if len(self._presents) != len(self._caches) or self._mask is None:
            raise QtvmError("this artefact is not a KV-cache export (past_key_values inputs, present outputs)",
                            "export the model with past_key_values")
        self._state = {s["name"]: np.zeros((batch, s["shape"][1], 0, s["shape"][3]), s["dtype"])
                       for s in self._caches}
        self._mask_values = np.zeros((batch, 0), np.int64)

    def feed(self, ids, attention_mask=None, last: bool = False) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.shape[1]
        if self.length + n > self.max_length:
            raise QtvmError(f"generation past the maximum length: the cache holds {self.length} tokens and "
                            f"{n} more would make {self.length + n} > {self.max_length}")
        new = np.ones((self.batch, n), np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
        mask = np.concatenate([self._mask_values, new], axis=1)
        feeds = {self._ids: ids, self._mask: mask, **self._state}
        if self._positions is not None:
            feeds[self._positions] = positions_from_mask(mask, n)
        out = self.module.run(feeds)
        self._state = {c["name"]: out[p] for c, p in zip(self._caches, self._presents)}
        self._mask_values, self.length = mask, self.length + n
        return out[self._logits][:, -1:] if last else out[self._logits]


def session(module, batch: int = 1, max_length: int | None = None):
    """A KV session for ``module``: the in-place step where the artefact has one."""
    if module.metadata.get("kv_step"):
        return KVSession(module, batch)
    return ConcatSession(module, batch, max_length)


def generate(module, input_ids, max_new_tokens: int, attention_mask=None, eos_token_id: int | None = None,
             session_obj=None) -> np.ndarray:
    """Greedy decoding: the prompt ``input_ids`` ([batch, n] or [n]) and ``max_new_tokens``
    tokens after it, each the argmax of the last position's logits ([batch, n + new]).
    Rows that produced ``eos_token_id`` keep producing it. Refused before any work when
    the tokens to feed (n + max_new_tokens - 1) exceed the cache's maximum length."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise QtvmError(f"input_ids have shape {list(ids.shape)}, expected [batch, n] with n >= 1")
    if max_new_tokens < 1:
        raise QtvmError(f"max_new_tokens is {max_new_tokens}", "ask for at least one token")
    s = session_obj or session(module, ids.shape[0])
    need = s.length + ids.shape[1] + max_new_tokens - 1
    if need > s.max_length:
        model_limit = position_limit(module.metadata)
        raise QtvmError(f"generation past the maximum length: {ids.shape[1]} prompt tokens + {max_new_tokens} new "
                        f"need a cache of {need} > {s.max_length}",
                        f"generate fewer tokens (the model's position tables hold {model_limit})"
                        if model_limit is not None and s.max_length >= model_limit else
                        "generate fewer tokens, or recompile with a larger --max-length")
    logits = s.feed(ids, attention_mask, last=True)
    out = [ids]
    done = np.zeros(ids.shape[0], bool)
    for i in range(max_new_tokens):
        token = logits[:, -1].argmax(-1).astype(np.int64)
        if eos_token_id is not None:
            token = np.where(done, eos_token_id, token)
            done |= token == eos_token_id
        out.append(token[:, None])
        if i + 1 < max_new_tokens:
            logits = s.feed(token[:, None])
    return np.concatenate(out, axis=1)


def _check_setup(module, seed: int, tokens: int):
    """(batch min(2, max_batch), a seeded generator, the token id bound) for a compile-time check
    feeding ``tokens`` tokens; None where the cache holds fewer."""
    info = module.metadata["kv_step"]
    if int(info["max_length"]) < tokens:
        return None
    vocab = module.outputs[0]["shape"][-1]
    return min(2, int(info["max_batch"])), np.random.default_rng(seed), vocab if isinstance(vocab, int) else 2


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| relative to the largest |want| (1 where that is 0)."""
    return float(np.abs(got - want).max()) / (float(np.abs(want).max()) or 1.0)


def step_errors(module, seed: int = 0) -> dict[str, float] | None:
    """The step against ``main`` on random inputs: a 3-token prompt (past 0) then one token,
    at batch min(2, max_batch). {what was compared: its error relative to the largest
    value of main's}: logits per feed, then each cache's rows; None where the cache holds
    fewer than 4 tokens."""
    setup = _check_setup(module, seed, 4)
    if setup is None:
        return None
    batch, rng, high = setup
    reference = ConcatSession(module, batch)
    step = KVSession(module, batch)
    errors = {}
    for n in (3, 1):
        ids = rng.integers(0, high, (batch, n)).astype(np.int64)
        what = f"logits at past {reference.length}, {n} tokens"
        errors[what] = _relative_error(step.feed(ids), reference.feed(ids))
    for spec, name in zip(reference._caches, reference._state):
        errors[f"cache '{name}'"] = _relative_error(step.cache(spec["name"]), reference._state[name])
    return errors


def first_over(errors: dict[str, float], tol: float) -> str | None:
    """The first of ``step_errors``' errors over ``tol`` (or not finite), said; else None."""
    for what, err in errors.items():
        if not np.isfinite(err) or err > tol:
            return f"{what}: {err:.2e} from main's (relative to its largest value)"
    return None


def check_last(module, seed: int = 0, tol: float = 1e-3) -> str | None:
    """The last-position step (``relay_passes.last_logits``) against the step's last row:
    a 5-token prompt then a 3-token one, at batch min(2, max_batch). None when they agree
    within ``tol`` (relative to the largest logit), else what differed."""
    setup = _check_setup(module, seed, 8)
    if setup is None:
        return None
    batch, rng, high = setup
    full, last = KVSession(module, batch), KVSession(module, batch)
    for n in (5, 3):
        ids = rng.integers(0, high, (batch, n)).astype(np.int64)
        want, got = full.feed(ids)[:, -1:], last.feed(ids, last=True)
        err = _relative_error(got, want) if got.shape == want.shape else np.inf
        if not np.isfinite(err) or err > tol:
            return f"the last position's logits differ from the step's by {err:.2e} (relative), {n} tokens"
    return None
