"""GPTQ checkpoints in the AutoGPTQ / GPTQModel layout: write qtvm's GPTQ results, read them into a model.

The layout, per quantized Linear ``P`` (in_features K, out_features N, b bits, group g),
as AutoGPTQ's ``QuantLinear`` defines it (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
and qlinear_cuda.py: ``__init__`` buffers, ``pack``, and the dequantizing ``forward``):

  P.qweight  int32 [K / 32 * b, N]   codes packed along K: for b in {2, 4, 8}, value j of a
                                     word at bits [b j, b j + b); for b = 3, 32 values in 3
                                     words as one 96-bit little-endian field (values 10 and
                                     21 straddle words). The same layout as qtvm's uniform
                                     ``qweight`` (``UniformFormat.pack``).
  P.qzeros   int32 [ceil(K / g), N / 32 * b]   zero points packed the same way, along N.
                                     v1 (``checkpoint_format="gptq"``, AutoGPTQ): the stored
                                     value is zero - 1 (``pack`` does ``zeros -= 1``; forward
                                     adds 1 back). v2 (``"gptq_v2"``, GPTQModel): the zero
                                     itself (GPTQModel's ``convert_gptq_v1_to_v2_format`` in
                                     gptqmodel/utils/model.py adds 1 to every packed field).
  P.scales   float16 [ceil(K / g), N]
  P.g_idx    int32 [K]               the group of each input row: i // g, or GPTQ's
                                     act-order (desc_act) assignment.
  w[k, n] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n])

K and N must be multiples of 32 / b (32 for 3-bit) for AutoGPTQ's buffers; this
writer pads a ragged K or N to whole words (as GPTQModel's ceil-sized buffers do)
and the reader accepts both. A v1 file cannot store a zero point of 0 (zero - 1
wraps to the all-ones field, which readers decode as 2^b): the writer refuses it
and names the layer (write ``gptq_v2`` instead). Scales are written as float16,
the layout's type, so a round trip rounds them once.

Reading into an ONNX model: ``GptqCheckpoint.apply`` replaces float MatMul/Gemm
weights by the checkpoint's codes (no float copy). Name rule (also in
``qtvm compile --help``): a checkpoint layer ``P`` (the prefix of ``P.qweight``)
maps to the MatMul/Gemm whose B initializer is named ``P.weight`` or ``P``, or
whose node is named ``/P/MatMul`` with ``.`` for ``/`` (torch's exporter:
``/layers.0/attn/q_proj/MatMul`` -> ``layers.0.attn.q_proj``); exact names first,
then unique dotted suffixes (``model.layers.0.q_proj`` matches ``layers.0.q_proj``).
Every quantized layer must match exactly one weight of the right shape; all that
do not are named in one error. Float tensors of the checkpoint are ignored (the
ONNX model keeps its own); so are biases.
"""
from __future__ import annotations

import os

import numpy as np

from qtvm.errors import QtvmError
from qtvm.formats.base import QuantizedTensor
from qtvm.formats.blockwise import BlockQuantized
from qtvm.formats.gptq import ActOrderFormat, group_zeros
from qtvm.formats.uniform import VALID_BITS, UniformFormat
from qtvm.safetensors import load_metadata, load_safetensors, save_safetensors

FORMATS = ("gptq", "gptq_v2")
PARTS = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED = ("qweight", "qzeros", "scales")


def _run(bits: int) -> tuple[int, int]:
    """(values, int32 words) of one indivisible packed run."""
    return (32, 3) if bits == 3 else (32 // bits, 1)


def packed_rows(length: int, bits: int) -> int:
    values, words = _run(bits)
    return -(-length // values) * words


def pack_along_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """[L, C] codes -> [packed_rows(L), C] int32 (L padded with zero codes to whole runs)."""
    values, _ = _run(bits)
    padded = np.zeros((-(-codes.shape[0] // values) * values, codes.shape[1]), np.uint32)
    padded[:codes.shape[0]] = codes
    return UniformFormat(bits, None).pack(padded)


def unpack_along_rows(words: np.ndarray, bits: int, length: int) -> np.ndarray:
    values, per = _run(bits)
    return UniformFormat(bits, None).unpack(words, words.shape[0] // per * values)[:length]


# -- writing ---------------------------------------------------------------------------------
def autogptq_tensors(prefix: str, qt: QuantizedTensor, checkpoint_format: str = "gptq",
                     scale_dtype=np.float16) -> dict[str, np.ndarray]:
    """The four AutoGPTQ tensors of one qtvm uniform / -qz / act-order tensor."""
    if checkpoint_format not in FORMATS:
        raise QtvmError(f"unknown GPTQ checkpoint format '{checkpoint_format}'", f"use one of {', '.join(FORMATS)}")
    fmt = qt.fmt
    base = fmt.base if isinstance(fmt, ActOrderFormat) else fmt
    if not isinstance(base, UniformFormat):
        raise QtvmError(f"layer '{prefix}' is {fmt.name}; the GPTQ layout stores uniform formats only")
    k, n, bits = qt.k, qt.n, base.bits
    gs = base.group_size_for(k)
    groups = -(-k // gs)
    codes = base.unpack(qt.arrays["qweight"], base.padded_k(k))[:k]
    zeros = group_zeros(base, qt.arrays, k)[:groups]
    if not np.array_equal(zeros, np.round(zeros)) or zeros.min() < 0 or zeros.max() > base.qmax:
        raise QtvmError(f"layer '{prefix}' has zero points that are not {bits}-bit integers")
    stored = zeros.astype(np.int64)
    if checkpoint_format == "gptq":
        if (stored == 0).any():
            raise QtvmError(f"layer '{prefix}' has zero points of 0, which the v1 GPTQ layout cannot store "
                            "(it writes zero - 1)", "write checkpoint_format='gptq_v2'")
        stored -= 1
    scales = qt.arrays["scales"][:groups].astype(scale_dtype)  # float32: qtvm's own exact round trip
    if not np.all(np.isfinite(scales)):
        raise QtvmError(f"layer '{prefix}' has scales beyond {np.dtype(scale_dtype).name}'s range",
                        "rescale the layer")
    g_idx = qt.arrays.get("g_idx")
    g_idx = (np.arange(k) // gs if g_idx is None else np.asarray(g_idx)).astype(np.int32)
    return {f"{prefix}.qweight": pack_along_rows(codes, bits),
            f"{prefix}.qzeros": np.ascontiguousarray(pack_along_rows(stored.T.astype(np.uint32), bits).T),
            f"{prefix}.scales": scales,
            f"{prefix}.g_idx": g_idx}


def write_autogptq(path: str | os.PathLike, layers: dict[str, QuantizedTensor], checkpoint_format: str = "gptq",
                   extra: dict[str, np.ndarray] | None = None, scale_dtype=np.float16):
    """Write ``{prefix: tensor}`` (plus float ``extra`` tensors) as one safetensors file, atomically
    (``scale_dtype`` float32 keeps the scales exact; float16 is the layout's convention)."""
    tensors = {}
    for prefix, qt in layers.items():
        tensors.update(autogptq_tensors(prefix, qt, checkpoint_format, scale_dtype))
    tensors.update(extra or {})
    meta = {"format": "pt", "quantizer": "qtvm", "checkpoint_format": checkpoint_format}
    bases = {(qt.fmt.base if isinstance(qt.fmt, ActOrderFormat) else qt.fmt) for qt in layers.values()}
    if len({(b.bits, b.group_size) for b in bases}) == 1:
        b = bases.pop()
        meta.update(bits=str(b.bits), group_size=str(b.group_size or -1),
                    desc_act=str(any(isinstance(qt.fmt, ActOrderFormat) for qt in layers.values())).lower())
    return save_safetensors(path, tensors, meta)


# -- reading -----------------------------------------------------------------------------------
def _shape(a) -> str:
    return "[" + ", ".join(map(str, a.shape)) + "]"


class GptqCheckpoint:
    """The quantized layers of a safetensors checkpoint, by prefix."""

    def __init__(self, path: str | os.PathLike, checkpoint_format: str | None = None):
        hint = "pass a GPTQ checkpoint (.safetensors with qweight/qzeros/scales per layer)"
        tensors = load_safetensors(path, hint)
        self.path = path
        self.metadata = load_metadata(path, hint)
        fmt = checkpoint_format or self.metadata.get("checkpoint_format", "gptq")
        if fmt not in FORMATS:
            raise QtvmError(f"unknown GPTQ checkpoint format '{fmt}'", f"use one of {', '.join(FORMATS)}")
        self.checkpoint_format = fmt
        self.layers: dict[str, dict[str, np.ndarray]] = {}
        self.float_tensors = 0
        for name, a in tensors.items():
            prefix, _, part = name.rpartition(".")
            if prefix and part in PARTS:
                self.layers.setdefault(prefix, {})[part] = a
            else:
                self.float_tensors += 1
        if not self.layers:
            raise QtvmError(f"'{path}' holds no GPTQ layers (no *.qweight tensors)", hint)
        missing = [f"{p}.{part}" for p, parts in sorted(self.layers.items()) for part in REQUIRED if part not in parts]
        if missing:
            raise QtvmError(f"GPTQ checkpoint '{path}' lacks {', '.join(missing)}",
                            "every quantized layer needs qweight, qzeros and scales")

    def _bits(self, parts, k: int, n: int) -> list[int]:
        want = self.metadata.get("bits")
        bits = [b for b in VALID_BITS if parts["qweight"].shape == (packed_rows(k, b), n)
                and parts["qzeros"].shape[1:] == (packed_rows(n, b),)]
        return [b for b in bits if want is None or str(b) == want]

    def _group(self, parts, k: int) -> int | None:
        groups = parts["scales"].shape[0]
        want = self.metadata.get("group_size")
        if want is not None and want.lstrip("-").isdigit():
            return None if int(want) <= 0 else int(want)
        if groups == 1:
            return None
        if "g_idx" in parts:
            return int(np.bincount(parts["g_idx"].astype(np.int64).clip(0)).max())
        return k // groups if k % groups == 0 else -1

    def layer(self, prefix: str, k: int, n: int) -> BlockQuantized | str:
        """The layer as a [K, N] weight, or a description of why its tensors do not fit."""
        parts = self.layers[prefix]
        shapes = " ".join(f"{part} {_shape(parts[part])}" for part in PARTS if part in parts)
        bad = f"{shapes} do not fit K={k}, N={n}"
        bits = self._bits(parts, k, n)
        if len(bits) != 1:
            return bad
        bits = bits[0]
        group = self._group(parts, k)
        groups = parts["scales"].shape[0]
        if parts["scales"].shape != (groups, n) or (group is not None and (group <= 0 or -(-k // group) != groups)):
            return bad
        if "g_idx" in parts and parts["g_idx"].shape != (k,):
            return bad
        if parts["qweight"].dtype != np.int32 or parts["qzeros"].dtype != np.int32 or \
                parts["scales"].dtype not in (np.float16, np.float32):
            return f"{shapes}: qweight/qzeros must be int32 and scales float16/float32"
        codes = unpack_along_rows(parts["qweight"], bits, k).astype(np.uint8)
        zeros = unpack_along_rows(np.ascontiguousarray(parts["qzeros"].T), bits, n).T.astype(np.float32)
        if self.checkpoint_format == "gptq":
            zeros += 1
        g_idx = parts.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.astype(np.int64)
            if g_idx.min() < 0 or g_idx.max() >= groups:
                return f"g_idx values span [{g_idx.min()}, {g_idx.max()}] but there are {groups} groups"
        try:
            return BlockQuantized(f"GPTQ layer '{prefix}'", bits, codes, parts["scales"].astype(np.float32), zeros,
                                  0, group, g_idx)
        except QtvmError as e:
            return e.problem.replace(f"GPTQ layer '{prefix}' has ", "")

    # -- mapping onto an ONNX model (called by qtvm.frontend.quantized.lower_quantized) ----------
    def apply(self, lowering) -> None:
        from qtvm.frontend.onnx import passes_weight

        graph = lowering.graph
        producer = {o: n for n in graph.node for o in n.output}
        weights = {}  # initializer -> (candidate names, [(node, reads [N, K], stored [N, K])])
        for node in graph.node:
            reads_nk = lowering.weight_use(node)
            if reads_nk is None or len(node.input) < 2:
                continue
            name, flips = node.input[1], 0  # through Identity and 2-D Transpose (a dynamo export's tied lm_head)
            while name not in lowering.inits and name in producer and passes_weight(producer[name]):
                flips += producer[name].op_type == "Transpose"
                name = producer[name].input[0]
            if name not in lowering.inits:
                continue
            init = lowering.inits[name]
            if len(init.dims) != 2 or init.data_type not in (1, 10, 16):  # float, float16, bfloat16
                continue
            names = weights.setdefault(init.name, (set(), []))
            names[0].add(init.name[:-len(".weight")] if init.name.endswith(".weight") else init.name)
            if node.name:
                path = node.name.strip("/").split("/")
                if len(path) > 1 and path[-1].split("_")[0] == node.op_type:
                    names[0].add(".".join(path[:-1]))
            names[1].append((node, reads_nk, reads_nk != bool(flips % 2)))
        matches = _match(sorted(self.layers), {init: names for init, (names, _) in weights.items()})
        problems = []
        for prefix in sorted(self.layers):
            found = matches.get(prefix, [])
            if len(found) != 1:
                shapes = " ".join(f"{p} {_shape(a)}" for p, a in self.layers[prefix].items())
                problems.append(f"{prefix} ({shapes}) matches " +
                                ("no MatMul/Gemm weight" if not found else "several: " + ", ".join(found)))
        taken: dict[str, list[str]] = {}
        for prefix, found in matches.items():
            for init in found:
                taken.setdefault(init, []).append(prefix)
        problems += [f"ONNX weight '{init}' is matched by {', '.join(ps)}" for init, ps in taken.items() if len(ps) > 1]
        planned = []
        for prefix, found in sorted(matches.items()):
            if len(found) != 1 or len(taken[found[0]]) != 1:
                continue
            init = lowering.inits[found[0]]
            uses = weights[found[0]][1]
            if len({use[1:] for use in uses}) != 1:
                problems.append(f"{prefix}: ONNX weight '{init.name}' is read in two layouts (directly and "
                                "transposed); one packed copy cannot serve both")
                continue
            rows, cols = init.dims
            k, n = (cols, rows) if uses[0][2] else (rows, cols)
            layer = self.layer(prefix, k, n)
            if isinstance(layer, str):
                problems.append(f"{prefix}: {layer} of ONNX weight '{init.name}' [{rows}, {cols}]")
                continue
            planned.append((layer, init, uses))
        if problems:
            raise QtvmError(f"GPTQ checkpoint '{self.path}' does not fit the model: {'; '.join(problems)}",
                            "see `qtvm compile --help` for the name rule")
        for layer, init, uses in planned:
            if uses[0][1]:  # the node reads [N, K] (Gemm transB): the weight in that orientation
                layer = BlockQuantized(layer.origin, layer.bits, np.ascontiguousarray(layer.codes.T),
                                       np.ascontiguousarray(layer.scales.T), np.ascontiguousarray(layer.zeros.T),
                                       1, layer.group_size, layer.g_idx)
            marker = lowering.add_marker(layer, "GPTQ")
            for node, *_ in uses:
                node.input[1] = marker
                lowering.out.matmul_nodes.append(node.name or node.op_type)
        _drop_dead_weight_paths(graph)
        if self.float_tensors:
            lowering.out.notes.append(f"GPTQ checkpoint: {self.float_tensors} float tensors ignored (the ONNX "
                                      "model's own weights are used)")


def _drop_dead_weight_paths(graph) -> None:
    """Identity/Transpose nodes nothing reads any more (their matmul now reads a marker): left,
    the import would transpose the float weight for no one."""
    from qtvm.frontend.onnx import graph_reads, passes_weight

    while True:
        read = graph_reads(graph) | {o.name for o in graph.output}
        dead = [i for i, n in enumerate(graph.node) if passes_weight(n) and not set(n.output) & read]
        if not dead:
            return
        for i in reversed(dead):
            del graph.node[i]


def _match(prefixes: list[str], candidates: dict[str, set[str]]) -> dict[str, list[str]]:
    """prefix -> ONNX initializers it names: exact names first, then dotted suffixes either way."""
    out = {}
    for prefix in prefixes:
        exact = [init for init, names in candidates.items() if prefix in names]
        if exact:
            out[prefix] = exact
            continue
        out[prefix] = [init for init, names in candidates.items()
                       if any(prefix.endswith("." + c) or c.endswith("." + prefix) for c in names)]
    return out
