"""Thin runtime: load an artefact and run it, with only libtvm_runtime loaded.

Importing this module before ``tvm`` imports tvm with TVM_USE_RUNTIME_LIB=1,
so a deployment process never maps the compiler library; the variable is
then restored, so child processes get a normal TVM. Kernels run on every
physical core of the process's CPU set (TVM_NUM_THREADS overrides; TVM's own
default is half the logical CPUs). The API is user-facing:

    m = qtvm.runtime.load("model.so")
    m.inputs, m.outputs          # [{name, dtype, shape}], symbolic dims by name
    outs = m.run({"input_ids": ids})   # {output name: numpy array}
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from qtvm import dims as dimexpr
from qtvm.errors import QtvmError
from qtvm.hugepages import NewMemoryOnHugePages
from qtvm.hostinfo import host_cpu_flags
from qtvm.quiet import tvm_output_captured


def _default_threads() -> None:
    """Run on every physical core unless TVM_NUM_THREADS says otherwise. TVM reads the
    variable once, when its thread pool starts (the first parallel kernel), so this
    must happen before anything runs; it is kept for child processes too."""
    from qtvm.hostinfo import physical_cores

    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))


def _import_runtime_only_tvm() -> None:
    if "tvm" in sys.modules:  # a compiler process already: nothing to choose
        return
    previous = os.environ.get("TVM_USE_RUNTIME_LIB")
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    try:
        import tvm  # noqa: F401  (loads libtvm_runtime only)
    finally:
        if previous is None:
            del os.environ["TVM_USE_RUNTIME_LIB"]
        else:
            os.environ["TVM_USE_RUNTIME_LIB"] = previous


_default_threads()
_import_runtime_only_tvm()

METADATA_FUNC = "qtvm_metadata"


class Module:
    def __init__(self, path: str | os.PathLike, weights_in_file: bool = False):
        """``weights_in_file``: the weights are read through the file's pages, not copied
        (``qtvm.deploy.weights.FileWeights``; slower kernels): for a check beside a compile."""
        import tvm.runtime
        from tvm.runtime.vm import VirtualMachine

        path = Path(path)
        if not path.is_file():
            raise QtvmError(f"artefact '{path}' does not exist", "compile one with `qtvm compile`")
        weights = NewMemoryOnHugePages().start()  # the constants TVM allocates while loading
        with tvm_output_captured():  # TVM logs a warning per planned memory scope while loading
            lib, self._weights = _load_library(path, weights_in_file)
        self._vm = VirtualMachine(lib, tvm.cpu())
        try:
            raw = self._vm[METADATA_FUNC]().numpy().tobytes()
        except Exception:
            raise QtvmError(f"'{path}' has no qtvm metadata (not built by qtvm?)", "recompile it with `qtvm compile`") from None
        self.metadata = json.loads(raw)
        missing = sorted(set(self.metadata.get("required_cpu_flags", [])) - host_cpu_flags())
        if missing:
            raise QtvmError(f"'{path}' was built for {self.metadata['target']} and needs CPU features "
                            f"{', '.join(missing)} that this CPU lacks",
                            "recompile with --target host")
        self._tensor = tvm.runtime.tensor
        self._main = self.entry("main")
        self._path, self._lib, self._device = path, lib, None
        self.device = self.metadata.get("device", "cpu")
        # CPU kernels stream the constants loaded above; a GPU artefact's run from device memory,
        # so moving its host copies would only slow the load (QTVM_HUGEPAGES=0: off everywhere)
        self.huge_page_bytes = weights.finish() if self.device == "cpu" else 0
        if self.device == "cuda":
            _check_cuda_arch(path, self.metadata, missing_ok=True)  # a wrong GPU is refused now, none at run
        self._io = _TensorIO()
        self._checked: set = set()  # input signatures (names, shapes, dtypes) already validated

    def entry(self, name: str):
        """The VM function ``name``, called with the artefact's weights appended where it takes
        them (``qtvm.deploy.weights``: trailing parameters named after the weight they hold)."""
        from qtvm.deploy.weights import weight_index

        func = self._vm[name]
        if self._weights is None:
            return func
        arity = int(self._vm.module["get_function_arity"](name))
        names = [self._vm.module["get_function_param_name"](name, i) for i in range(arity)]
        held = [weight_index(n) for n in names]
        if not any(i is not None for i in held):
            return func
        weights = [self._weights.tensors[i] for i in held if i is not None]
        return lambda *args: func(*args, *weights)

    @property
    def inputs(self) -> list[dict]:
        return self.metadata["inputs"]

    @property
    def outputs(self) -> list[dict]:
        return self.metadata["outputs"]

    def check_inputs(self, feeds: dict) -> list[np.ndarray]:
        """Names, dtypes, ranks and symbolic dims consistent; arrays in input order."""
        names = [i["name"] for i in self.inputs]
        unknown = sorted(set(feeds) - set(names))
        missing = [n for n in names if n not in feeds]
        if unknown or missing:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                    ([f"unknown {', '.join(unknown)}"] if unknown else [])
            raise QtvmError(f"wrong inputs: {'; '.join(parts)}", f"the model takes {', '.join(names)}")
        bound: dict[str, tuple[int, str]] = {}
        composite = []  # (input, axis, size, dim expression such as 'past + seq')
        may_be_zero = set(self.metadata.get("may_be_zero", []))
        limits = self.metadata.get("dim_limits", {})
        minimums = self.metadata.get("dim_minimums", {})
        arrays = []
        for spec in self.inputs:
            name, a = spec["name"], np.asarray(feeds[spec["name"]])
            if a.dtype != np.dtype(spec["dtype"]):
                raise QtvmError(f"input '{name}' has dtype {a.dtype}, expected {spec['dtype']}",
                                f"convert it with .astype('{spec['dtype']}')")
            dims = spec["shape"]
            if a.ndim != len(dims):
                raise QtvmError(f"input '{name}' has rank {a.ndim} (shape {list(a.shape)}), expected "
                                f"rank {len(dims)} {dims}")
            for axis, (size, dim) in enumerate(zip(a.shape, dims)):
                if isinstance(dim, int) and size != dim:
                    raise QtvmError(f"input '{name}' has size {size} on axis {axis}, expected {dim} "
                                    f"(shape {dims})")
                if isinstance(dim, str) and dim != "?" and dimexpr.parse(dim) is not None:
                    composite.append((name, axis, size, dim))
                elif isinstance(dim, str) and dim != "?":
                    if size < 1 and not (size == 0 and dim in may_be_zero):
                        raise QtvmError(f"input '{name}' has size {size} on axis {axis} ('{dim}'); sizes must be >= 1")
                    if size < minimums.get(dim, 0):
                        raise QtvmError(f"input '{name}' has {dim} = {size}, but this model takes {dim} >= "
                                        f"{minimums[dim]} (a convolution or pooling window over it would "
                                        f"cover nothing)", f"pad the input to at least {minimums[dim]}")
                    if dim in limits and size > limits[dim]:
                        raise QtvmError(f"input '{name}' has {dim} = {size}, but this model takes {dim} <= "
                                        f"{limits[dim]} (the length of its position tables)",
                                        f"split the input into pieces of at most {limits[dim]}")
                    first = bound.setdefault(dim, (size, name))
                    if first[0] != size:
                        raise QtvmError(f"dimension '{dim}' is {first[0]} in input '{first[1]}' but {size} in "
                                        f"input '{name}'", "inputs that share a dimension name must agree")
            arrays.append(a if a.flags.c_contiguous else a.copy(order="C"))  # keeps 0-d arrays 0-d
        sizes = {k: v[0] for k, v in bound.items()}
        for name, axis, size, dim in composite:
            want = dimexpr.evaluate(dim, sizes)
            if want is not None and want != size:
                raise QtvmError(f"input '{name}' has size {size} on axis {axis}, expected {dim} = {want}")
        for dim, top in limits.items():  # limits on expressions (``past + seq`` <= a mask table's length)
            value = dimexpr.evaluate(dim, sizes) if dimexpr.parse(dim) is not None else None
            if value is not None and value > top:
                names = " and ".join(f"{k} = {v}" for k, v in sizes.items() if k in dimexpr.symbols(dim))
                raise QtvmError(f"the inputs have {dim} = {value} ({names}), but this model takes {dim} <= {top} "
                                f"(the length of its position tables)",
                                f"keep {dim} at most {top} (shorten the prompt or the cache)")
        return arrays

    def _use_device(self):
        """A GPU artefact gets its device (and a VM placed on it) at its first run."""
        if self.device == "cpu" or self._device is not None:
            return
        import tvm
        from tvm.runtime.vm import VirtualMachine

        _check_cuda_arch(self._path, self.metadata, missing_ok=False)
        self._device = tvm.cuda(0)
        self._vm = VirtualMachine(self._lib, [self._device, tvm.cpu()])
        self._main = self.entry("main")
        self._tensor = lambda a: tvm.runtime.tensor(a, device=self._device)

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        """Outputs as numpy arrays of their own (never views of the inputs or of each other).
        One call at a time per Module: CPU inputs go through per-input staging buffers."""
        arrays = self._validated(feeds)
        self._use_device()
        if self.device != "cpu":  # device tensors: TVM's copies in and out
            result = self._main(*[self._tensor(a) for a in arrays])
            values = [result] if len(self.outputs) == 1 else list(result)
            return {spec["name"]: _to_numpy(v, spec["dtype"]) for spec, v in zip(self.outputs, values)}
        result = self._main(*[self._io.tensor(i, a) for i, a in enumerate(arrays)])
        values = [result] if len(self.outputs) == 1 else list(result)
        return self._io.outputs(values, [spec["dtype"] for spec in self.outputs],
                                [spec["name"] for spec in self.outputs])

    def _validated(self, feeds: dict) -> list[np.ndarray]:
        """check_inputs, skipped for a signature (names, shapes, dtypes) seen before: every
        check depends on those alone."""
        try:
            arrays = [np.asarray(feeds[spec["name"]]) for spec in self.inputs]
        except KeyError:
            return self.check_inputs(feeds)
        key = (len(feeds), *((a.shape, a.dtype.str) for a in arrays))
        if key in self._checked:
            return arrays
        arrays = self.check_inputs(feeds)
        if len(self._checked) > 256:
            self._checked.clear()
        self._checked.add(key)
        return arrays


    # -- generation (models exported with past key/values) ---------------------------------
    def session(self, batch: int = 1):
        """A KV-cache session (``qtvm.generate``): ``feed(ids)`` appends tokens and returns
        their logits; the caches are allocated once for the artefact's maximum length."""
        from qtvm import generate

        return generate.session(self, batch)

    def generate(self, input_ids, max_new_tokens: int, attention_mask=None,
                 eos_token_id: int | None = None) -> np.ndarray:
        """Greedy decoding: [batch, n] prompt ids -> [batch, n + max_new_tokens] (see
        ``qtvm.generate.generate``)."""
        from qtvm import generate

        return generate.generate(self, input_ids, max_new_tokens, attention_mask, eos_token_id)


class _TensorIO:
    """numpy <-> TVM at the call boundary without TVM's own copies.

    In: each input is copied into a staging buffer of its own (kept per input position,
    shape and dtype; 64-byte aligned, as TVM requires of memory it is handed), ~1 us for
    small arrays, where ``tvm.runtime.tensor`` allocates and copies (~11 us). A large
    array that is already aligned goes in as it is (DLPack, no copy).
    Out: outputs are numpy views of the VM's result tensors (fresh memory each call),
    unless one overlaps an input or an earlier output (Relax makes a reshape of an input
    a view): that one is copied, so every output is an array of its own."""

    ALIGN = 64
    ZERO_COPY_BYTES = 1 << 16

    def __init__(self):
        import tvm_ffi

        self._from_dlpack = tvm_ffi.from_dlpack
        self._staging: dict = {}
        self._in_ranges: list = []

    def tensor(self, i: int, a: np.ndarray):
        if i == 0:
            self._in_ranges = []
        if a.dtype.kind not in "biuf":  # bfloat16 and such (ml_dtypes): numpy has no DLPack for them
            return _empty(a)
        if a.nbytes >= self.ZERO_COPY_BYTES and a.flags.c_contiguous:
            ptr = a.ctypes.data
            if ptr % self.ALIGN == 0:
                self._in_ranges.append((ptr, ptr + a.nbytes))
                return self._from_dlpack(a)
        key = (i, a.shape, a.dtype.str)
        entry = self._staging.get(key)
        if entry is None:
            raw = np.empty(a.nbytes + self.ALIGN, np.uint8)
            off = -raw.ctypes.data % self.ALIGN
            buf = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            if len(self._staging) > 64:
                self._staging.clear()
            ptr = buf.ctypes.data
            entry = self._staging[key] = (buf, self._from_dlpack(buf) if a.size else _empty(a),
                                          (ptr, ptr + buf.nbytes))
        buf, t, span = entry
        if a.size:
            buf[...] = a
            self._in_ranges.append(span)
        return t

    def outputs(self, values, dtypes, names) -> dict:
        out, taken = {}, list(self._in_ranges)
        for name, v, dtype in zip(names, values, dtypes):
            if not hasattr(v, "numpy"):
                out[name] = _to_numpy(v, dtype)
                continue
            try:
                a = np.from_dlpack(v)
            except (BufferError, TypeError, RuntimeError, ValueError):  # a dtype numpy cannot take over
                out[name] = v.numpy()
                continue
            lo = v.data_ptr()
            hi = lo + a.nbytes
            if a.nbytes and any(lo < h and l < hi for l, h in taken):
                a = a.copy()
            else:
                taken.append((lo, hi))
            out[name] = a
        return out


def _empty(a: np.ndarray):
    """TVM's own copy (empty arrays, dtypes DLPack cannot carry from numpy)."""
    import tvm.runtime

    return tvm.runtime.tensor(a)


def _to_numpy(value, dtype: str) -> np.ndarray:
    """A VM result as numpy: tensors as they are; a shape (ONNX Shape's output, computed
    from symbolic dims) or a scalar as an array of the output's declared dtype."""
    if hasattr(value, "numpy"):
        return value.numpy()
    import tvm_ffi

    if isinstance(value, tvm_ffi.Shape):
        return np.array(list(value), dtype=dtype)
    return np.array(value, dtype=dtype)


def load(path: str | os.PathLike) -> Module:
    return Module(path)


def _load_fresh(path: Path, load_module):
    """``load_module(path)``, where dlopen hands back the library already loaded from a path even
    after the file there was replaced (recompiling to the same path in a notebook, then loading
    it again), so a file that changed since this process first loaded its path is loaded from a
    private copy."""
    import shutil
    import tempfile

    st = path.stat()
    key, sig = str(path.resolve()), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _LOADED_FILES.setdefault(key, sig) == sig:
        return load_module(str(path))
    with tempfile.TemporaryDirectory(prefix="qtvm-reload-") as tmp:  # unlinked once mapped
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        return load_module(str(copy))


# -- GPU artefacts ------------------------------------------------------------------------
#: resolved artefact path -> (device, inode, size, mtime) of the file first loaded from it
_LOADED_FILES: dict[str, tuple] = {}


def _load_with_weights(path: str, in_file: bool = False):
    """TVM's module of the library at ``path`` and its weights blob copied out of it, or (``in_file``,
    where it can) read through the file's pages (None where its weights are the VM's constants:
    ``qtvm.deploy.weights``)."""
    import tvm.runtime

    from qtvm.deploy import weights

    lib = tvm.runtime.load_module(path)
    address = weights.find(path)
    if address is None:
        return lib, None
    mapped = weights.FileWeights.of(address) if in_file else None
    return lib, (mapped if mapped is not None else weights.LoadedWeights(address))


def _load_library(path: Path, weights_in_file: bool = False):
    """The artefact's library and weights (``_load_fresh``); a CUDA artefact first loads TVM's
    CUDA runtime (``qtvm.cuda``: the driver, or a stub where there is none, so the artefact
    still opens and says why it cannot run)."""
    try:
        return _load_fresh(path, lambda p: _load_with_weights(p, weights_in_file))
    except Exception as err:  # noqa: BLE001 -- TVM raises several kinds
        message = str(err)
    if "load_from_bytes.cuda" in message:
        from qtvm.cuda import load_cuda_runtime

        load_cuda_runtime(allow_stub=True)
        try:
            return _load_fresh(path, lambda p: _load_with_weights(p, weights_in_file))
        except Exception:  # noqa: BLE001
            pass
    elif "load_from_bytes.opencl" in message:
        raise QtvmError(f"'{path}' was built for OpenCL and this TVM runtime has no OpenCL support",
                        "run it with a TVM runtime built with USE_OPENCL=ON (on the device); "
                        "`qtvm inspect` still reads it")
    raise QtvmError(f"'{path}' is not a loadable qtvm artefact", "recompile it with `qtvm compile`")


def _check_cuda_arch(path: Path, metadata: dict, missing_ok: bool) -> None:
    """Refuse a CUDA artefact for a GPU older than it was built for; say so when there is none."""
    from qtvm.cuda import device_arch, sm_number

    required = str(metadata.get("required_gpu_arch", "sm_80"))
    have = device_arch()
    if have is None:
        if missing_ok:
            return
        raise QtvmError(f"'{path}' runs on an NVIDIA GPU ({required} or newer) but no CUDA device is present",
                        "run it on a machine with an NVIDIA GPU and driver, or recompile with --target host")
    if sm_number(have) < sm_number(required):
        raise QtvmError(f"'{path}' was built for {required} and this GPU is {have}",
                        f"recompile with --target cuda -arch={have}")


def inspect(path: str | os.PathLike) -> dict:
    """An artefact's metadata, also where its device code cannot be loaded here (OpenCL
    artefacts, whose runtime this TVM lacks): then read from the embedded JSON constant."""
    try:
        return Module(path).metadata
    except QtvmError:
        path = Path(path)
        if not path.is_file():
            raise
        data = path.read_bytes()
        start = data.find(b'{"format": ')
        if start < 0:
            raise
        try:
            meta, _ = json.JSONDecoder().raw_decode(data[start:start + (1 << 20)].decode("utf-8", "replace"))
        except ValueError:
            raise QtvmError(f"'{path}' has no readable qtvm metadata", "recompile it with `qtvm compile`") from None
        return meta
