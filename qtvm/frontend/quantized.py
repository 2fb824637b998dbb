"""Quantized ONNX in: the model's own quantized weights become qtvm packed kernels.

Read, before TVM's importer runs (it has no MatMulNBits converter and ignores
DequantizeLinear's ``block_size``), in the graph and in every If/Loop body (each
in its own scope: onnxruntime's quantizer quantizes a merged decoder's branches too):

- ``com.microsoft.MatMulNBits`` (onnxruntime's ``MatMulNBitsQuantizer``): B
  [N, k_blocks, block_size * bits / 8] uint8, codes packed low bits first along K;
  scales [N * k_blocks]; zero points packed the same way ([N * ceil(k_blocks * bits / 8)]
  uint8), or unpacked in the scales' type (float, any value), or absent (then
  2^(bits - 1)); optional g_idx [K] (each row's block), bias [N]; w = (q - zp) * scale.
  2, 4 and 8 bits (3, 5, 6, 7: an error naming them). ``accuracy_level`` (onnxruntime's
  activation precision) is reported; qtvm's activations follow ``--act``.
  onnxruntime 1.32's CPU kernel ignores uint8 zero points when g_idx is given (it
  uses 2^(bits - 1)); qtvm follows the operator's definition (the zero point of the
  row's g_idx block), as it does without g_idx.
- ``DequantizeLinear`` of a constant int4/uint4/int8/uint8 matrix (blocked, opset 21
  ``block_size`` + ``axis``; per-axis; per-tensor) whose every consumer is a MatMul
  or Gemm weight (input B): signed codes are shifted to unsigned (q + 2^(bits-1), the
  zero point too), which leaves q - zp unchanged.
- ``MatMulInteger`` by a constant int8/uint8 matrix (``quantize_dynamic``):
  y = (a - a_zp) @ (B - b_zp) is computed as float(a - a_zp) @ W with W the int8
  codes (scale 1, zero point b_zp) on the fp32 kernels; a Cast to float after it is
  folded, any other consumer gets round + Cast to int32. (|a - a_zp| <= 255, so the
  products are exact; sums past 2^24 round as any fp32 sum does.)
- GPTQ checkpoints (``qtvm.formats.gptq_checkpoint``): float MatMul/Gemm weights
  matched by name are replaced by the checkpoint's codes.

How the weights reach the kernels: each such matmul becomes a plain
``MatMul(x, marker)`` (a Gemm keeps its node, B renamed), where ``marker`` is a new
graph input of the weight's shape: a typed placeholder that TVM imports as a
parameter. ``relay_passes/quantized_onnx.py`` hands each marker's repacked tensor
(``qtvm.formats.blockwise``) to the packed-kernel emitter of
``relay_passes/quantize_weights.py`` and drops the markers from the signature.
Quantized weights that cannot run on the kernels either stay in float with a note
saying why (a per-axis int8 DequantizeLinear whose scales vary along K: TVM runs it),
or are a compile-time error naming them (what TVM cannot run either).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import MappedWeights, graph_reads, graph_scopes, subgraphs, tensor_array
from qtvm.formats.blockwise import BlockQuantized, PackedCodes, unpack_low_first

MARKER_PREFIX = "qtvm_prequantized_"
MS_DOMAIN = "com.microsoft"
INT_TYPES = {TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False),
             TensorProto.INT8: (8, True), TensorProto.UINT8: (8, False)}


@dataclass
class LoweredModel:
    """The ONNX model with markers, and what each marker stands for."""

    model: onnx.ModelProto
    weights: dict[str, BlockQuantized] = field(default_factory=dict)  # marker -> stored weight
    kinds: dict[str, str] = field(default_factory=dict)  # marker -> MatMulNBits | DequantizeLinear | ...
    matmul_nodes: list[str] = field(default_factory=list)  # ONNX MatMul/Gemm names whose weight is a marker
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """e.g. 'MatMulNBits int4-g32-qz x2, DequantizeLinear int8-col-qz x1' (the format each runs in)."""
        counts = Counter(f"{self.kinds[m]} {w.format.name}" for m, w in self.weights.items())
        return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _name(node, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


class _Lowering:
    def __init__(self, model: onnx.ModelProto, in_place: bool):
        if not in_place:
            model, original = onnx.ModelProto(), model
            model.CopyFrom(original)
        self.model = model
        self.out = LoweredModel(self.model)
        self._arrays: dict[str, np.ndarray] = {}
        self._mapped = MappedWeights()  # stored codes stay the file's pages until re-laid
        self._enter(model.graph, {})

    def _enter(self, graph: onnx.GraphProto, outer_inits: dict) -> None:
        """Make ``graph`` (the model's, or an If/Loop body) the scope the helpers below read: its
        nodes and outputs, its initializers and its enclosing graphs' (ONNX names are unique
        across scopes, so a body reads an outer initializer by its name)."""
        self.graph = graph
        self.inits = {**outer_inits, **{t.name: t for t in graph.initializer}}
        # Names read inside nested bodies: such a tensor has uses this scope's walk cannot rewrite.
        self.in_subgraphs = {name for node in graph.node for g in subgraphs(node) for name in graph_reads(g)}

    # -- helpers ---------------------------------------------------------------------------
    def array(self, name: str) -> np.ndarray | None:
        if name not in self.inits:
            return None
        if name not in self._arrays:
            mapped = self._mapped.array(self.inits[name])
            self._arrays[name] = mapped if mapped is not None else tensor_array(self.inits[name])
        return self._arrays[name]

    def consumers(self, tensor: str) -> list[tuple[onnx.NodeProto, int]]:
        """Top-level (node, input index) uses; a use inside a subgraph counts as (the If/Loop node, -1)."""
        uses = [(n, i) for n in self.graph.node for i, name in enumerate(n.input) if name == tensor]
        if tensor in self.in_subgraphs:
            uses += [(n, -1) for n in self.graph.node if any(tensor in graph_reads(g) for g in subgraphs(n))]
        return uses

    def add_marker(self, weight: BlockQuantized, kind: str) -> str:
        name = f"{MARKER_PREFIX}{len(self.out.weights)}"
        self.out.weights[name] = weight
        self.out.kinds[name] = kind
        # A graph input of the model (a body reads it from its outer scope, as it reads x).
        self.model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(weight.shape)))
        return name

    @staticmethod
    def weight_use(node) -> bool | None:
        """For a consumer of a weight at input 1: transposed (Gemm transB) or not; None if not a weight use."""
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "MatMul":
            return False
        if node.op_type == "Gemm":
            return bool(_attrs(node).get("transB", 0))
        return None

    # -- MatMulNBits -------------------------------------------------------------------------
    def matmul_nbits(self, node, index: int) -> list:
        name = f"MatMulNBits '{_name(node, index)}'"
        a = _attrs(node)
        k, n, bits, bs = int(a.get("K", 0)), int(a.get("N", 0)), int(a.get("bits", 4)), int(a.get("block_size", 0))
        if bits not in (2, 4, 8):
            raise QtvmError(f"{name} has bits={bits}; qtvm reads 2, 4 and 8-bit MatMulNBits",
                            "re-quantize it with bits=4 or bits=8")
        if bs < 16 or bs % 16:
            raise QtvmError(f"{name} has block_size={bs}; qtvm's kernels take blocks that are multiples of 16",
                            "re-quantize it with block_size 16, 32, 64 or 128")
        inputs = list(node.input) + [""] * (6 - len(node.input))
        b, scales = self.array(inputs[1]), self.array(inputs[2])
        if b is None or scales is None:
            raise QtvmError(f"{name} takes its weight or scales from a computed tensor",
                            "qtvm reads MatMulNBits weights stored as initializers")
        if scales.dtype != np.float32:
            raise QtvmError(f"{name} has {scales.dtype} scales and activations; qtvm reads float32 MatMulNBits",
                            "quantize the float32 model")
        blocks = -(-k // bs)
        blob = bs * bits // 8
        if b.shape != (n, blocks, blob) or scales.size != n * blocks:
            raise QtvmError(f"{name}: B {list(b.shape)} and scales {list(scales.shape)} do not match K={k}, N={n}, "
                            f"block_size={bs} (expected B [{n}, {blocks}, {blob}], {n * blocks} scales)")
        scales = scales.reshape(n, blocks)
        zp = self.array(inputs[3]) if inputs[3] else None
        if inputs[3] and zp is None:
            raise QtvmError(f"{name} takes its zero points from a computed tensor",
                            "qtvm reads MatMulNBits zero points stored as initializers")
        if zp is None:
            zeros = np.full((n, blocks), 2 ** (bits - 1), np.float32)
        elif zp.dtype == np.uint8:
            per_row = -(-blocks * bits // 8)
            if zp.size != n * per_row:
                raise QtvmError(f"{name}: uint8 zero points {list(zp.shape)} do not match N={n} x {per_row} bytes")
            zeros = unpack_low_first(zp.reshape(n, per_row), bits)[:, :blocks].astype(np.float32)
        elif zp.dtype == scales.dtype and zp.size == n * blocks:
            zeros = zp.reshape(n, blocks).astype(np.float32)
        else:
            raise QtvmError(f"{name}: zero points {zp.dtype} {list(zp.shape)} are neither packed uint8 nor one "
                            f"{scales.dtype} per block")
        g_idx = None
        if inputs[4]:
            g_idx = self.array(inputs[4])
            if g_idx is None or g_idx.shape != (k,):
                raise QtvmError(f"{name}: g_idx must be a constant [{k}] int32 initializer")
            g_idx = g_idx.astype(np.int64)
            if g_idx.min() < 0 or g_idx.max() >= blocks:
                raise QtvmError(f"{name}: g_idx values span [{g_idx.min()}, {g_idx.max()}]; it has {blocks} blocks")
        codes = PackedCodes(b.reshape(n, blocks * blob), bits, k)
        weight = BlockQuantized(name, bits, codes, np.ascontiguousarray(scales.T), np.ascontiguousarray(zeros.T), 0, bs,
                                g_idx)
        marker = self.add_marker(weight, "MatMulNBits")
        if "accuracy_level" in a:
            self._accuracy_levels.setdefault(int(a["accuracy_level"]), []).append(_name(node, index))
        y = node.output[0]
        if inputs[5]:
            mm = helper.make_node("MatMul", [inputs[0], marker], [y + "_qtvm_nobias"], name=_name(node, index))
            return [mm, helper.make_node("Add", [mm.output[0], inputs[5]], [y], name=_name(node, index) + "_bias")]
        return [helper.make_node("MatMul", [inputs[0], marker], [y], name=_name(node, index))]

    # -- DequantizeLinear -> MatMul/Gemm ---------------------------------------------------------
    def dequantize_linear(self, node, index: int) -> bool:
        """True when the node was replaced by a marker (then it is dropped)."""
        a = _attrs(node)
        block = int(a.get("block_size", 0))
        name = f"DequantizeLinear '{_name(node, index)}'"
        x = self.inits.get(node.input[0])
        if x is None or x.data_type not in INT_TYPES or len(x.dims) != 2:
            if block:
                raise QtvmError(f"blocked {name} dequantizes something other than a constant 2-D int4/uint4/int8/"
                                "uint8 matrix; qtvm reads blocked DequantizeLinear only as a MatMul/Gemm weight")
            return False
        uses = self.consumers(node.output[0])
        transposed = [self.weight_use(c) if i == 1 else None for c, i in uses]
        outputs = {o.name for o in self.graph.output}
        if not uses or None in transposed or node.output[0] in outputs:
            others = ", ".join(f"{c.op_type} '{c.name}'" for (c, i), t in zip(uses, transposed) if t is None)
            why = f"it feeds {others}" if others else "it is a graph output"
            if block:
                raise QtvmError(f"blocked {name}: {why}; qtvm reads blocked DequantizeLinear only as a MatMul/Gemm "
                                "weight (input B)")
            self.out.notes.append(f"stays in float: {name} ({why}, not only MatMul/Gemm weights)")
            return False
        bits, signed = INT_TYPES[x.data_type]
        q = self.array(node.input[0]).astype(np.int32)
        scale = self.array(node.input[1])
        zp_name = node.input[2] if len(node.input) > 2 else ""
        zp = self.array(zp_name) if zp_name else None
        if scale is None or (zp_name and zp is None):
            why = "its scale or zero point is computed at run time"
            if block:
                raise QtvmError(f"blocked {name}: {why}; qtvm needs them as initializers")
            self.out.notes.append(f"stays in float: {name} ({why})")
            return False
        if scale.dtype != np.float32:
            raise QtvmError(f"{name} has {scale.dtype} scales; qtvm reads float32 quantized models",
                            "quantize the float32 model")
        offset = 2 ** (bits - 1) if signed else 0
        codes = (q + offset).astype(np.uint8)
        zeros = (zp.astype(np.float32) if zp is not None else np.zeros(scale.shape, np.float32)) + offset
        rows, cols = q.shape
        axis = int(a.get("axis", 1)) % 2
        if scale.size == 1 and not block:
            weight = BlockQuantized(name, bits, codes, scale.reshape(1, 1).astype(np.float32),
                                    zeros.reshape(1, 1), None, None)
        elif block:
            # Blocks of `block` elements along `axis`: scale has that axis reduced to ceil(len / block).
            group_axis = axis
            expect = (-(-rows // block), cols) if axis == 0 else (rows, -(-cols // block))
            if scale.shape != expect or zeros.shape != expect:
                raise QtvmError(f"{name}: scale {list(scale.shape)} does not match blocks of {block} along axis "
                                f"{axis} of [{rows}, {cols}] (expected {list(expect)})")
            weight = BlockQuantized(name, bits, codes, scale, zeros, group_axis, block)
        else:
            # Per-axis: one scale per index of `axis`, so the group spans the other axis.
            length = (rows, cols)[axis]
            if scale.shape != (length,) or zeros.shape != (length,):
                raise QtvmError(f"{name}: scale {list(scale.shape)} does not match axis {axis} of [{rows}, {cols}]")
            shape = (1, cols) if axis == 1 else (rows, 1)
            weight = BlockQuantized(name, bits, codes, scale.reshape(shape), zeros.reshape(shape), 1 - axis, None)
        reasons = {weight.why_not(t) for t in transposed} - {None}
        if reasons:
            if block:
                raise QtvmError(f"blocked {name} cannot run on qtvm's kernels: {reasons.pop()}")
            self.out.notes.append(f"stays in float: {name} ({reasons.pop()}; TVM runs it)")
            return False
        marker = self.add_marker(weight, "DequantizeLinear")
        names = {id(n): _name(n, i) for i, n in enumerate(self.graph.node)}  # as ``summarize`` names them
        for consumer, i in uses:
            consumer.input[i] = marker
            self.out.matmul_nodes.append(names[id(consumer)])
        return True

    # -- MatMulInteger --------------------------------------------------------------------------
    def matmul_integer(self, node, index: int) -> list | None:
        name = f"MatMulInteger '{_name(node, index)}'"
        inputs = list(node.input) + [""] * (4 - len(node.input))
        b = self.inits.get(inputs[1])
        if b is None or b.data_type not in (TensorProto.INT8, TensorProto.UINT8) or len(b.dims) != 2:
            self.out.notes.append(f"stays in float: {name} (its B is not a constant 2-D int8/uint8 matrix)")
            return None
        q = self.array(inputs[1]).astype(np.int32)
        k, n = q.shape
        bzp = self.array(inputs[3]) if inputs[3] else np.zeros((), np.int32)
        azp = inputs[2]
        scalar_azp = (not azp) or self._producer_is(azp, "DynamicQuantizeLinear") or (
            self.array(azp) is not None and self.array(azp).size == 1)
        if bzp is None or bzp.size not in (1, n) or not scalar_azp:
            self.out.notes.append(f"stays in float: {name} (its zero points are computed or not per-tensor/per-"
                                  "column)")
            return None
        offset = 128 if b.data_type == TensorProto.INT8 else 0
        zeros = np.broadcast_to(bzp.astype(np.float32).reshape(-1), (n,)).reshape(1, n) + offset
        weight = BlockQuantized(name, 8, (q + offset).astype(np.uint8), np.ones((1, n), np.float32),
                                np.ascontiguousarray(zeros), 0, None)
        marker = self.add_marker(weight, "MatMulInteger")
        base = _name(node, index)
        nodes = [helper.make_node("Cast", [inputs[0]], [base + "_qtvm_af"], to=TensorProto.FLOAT)]
        x = nodes[-1].output[0]
        if azp:
            nodes.append(helper.make_node("Cast", [azp], [base + "_qtvm_azf"], to=TensorProto.FLOAT))
            nodes.append(helper.make_node("Sub", [x, nodes[-1].output[0]], [base + "_qtvm_a"]))
            x = nodes[-1].output[0]
        y = node.output[0]
        uses = self.consumers(y)
        outputs = {o.name for o in self.graph.output}
        if len(uses) == 1 and uses[0][0].op_type == "Cast" and _attrs(uses[0][0]).get("to") == TensorProto.FLOAT \
                and y not in outputs:
            cast = uses[0][0]
            nodes.append(helper.make_node("MatMul", [x, marker], [cast.output[0]], name=base))
            self._dropped_outputs.add(cast.output[0])  # the Cast to float is folded into the MatMul
        else:
            nodes.append(helper.make_node("MatMul", [x, marker], [base + "_qtvm_yf"], name=base))
            nodes.append(helper.make_node("Round", [nodes[-1].output[0]], [base + "_qtvm_yr"]))
            nodes.append(helper.make_node("Cast", [nodes[-1].output[0]], [y], to=TensorProto.INT32))
        return nodes

    def _producer_is(self, tensor: str, op_type: str) -> bool:
        return any(n.op_type == op_type and tensor in n.output for n in self.graph.node)

    # -- the walk ---------------------------------------------------------------------------------
    def run(self, gptq=None) -> LoweredModel:
        self._dropped_outputs: set[str] = set()
        self._accuracy_levels: dict[int, list[str]] = {}  # MatMulNBits accuracy_level -> the nodes
        self._lower_nodes()
        for level, names in sorted(self._accuracy_levels.items()):  # one line a level, not one a node
            which = f"MatMulNBits '{names[0]}'" if len(names) == 1 else f"{len(names)} MatMulNBits ('{names[0]}', ...)"
            int8 = "; 4 asks for int8, as --act int8 does here" if level == 4 else ""
            self.out.notes.append(f"{which}: accuracy_level={level} noted (onnxruntime's activation precision"
                                  f"{int8}); qtvm's activations follow --act")
        if gptq is not None:
            gptq.apply(self)
        self._drop_unused_initializers()
        return self.out

    def _lower_nodes(self) -> None:
        """Rewrite the current scope's nodes, and each If/Loop body's first (in its own scope):
        ORT's quantizer quantizes the matmuls inside branches too (e.g. a merged decoder's)."""
        new_nodes = []
        for index, original in enumerate(list(self.graph.node)):
            # A copy: consumers of a DequantizeLinear are renamed in the graph before the walk reaches them.
            node = onnx.NodeProto()
            node.CopyFrom(original)
            if node.op_type == "Cast" and node.output[0] in self._dropped_outputs:
                continue
            for body in subgraphs(node):
                scope = self.graph, self.inits, self.in_subgraphs
                self._enter(body, self.inits)
                self._lower_nodes()
                self.graph, self.inits, self.in_subgraphs = scope
            if node.domain == MS_DOMAIN and node.op_type == "MatMulNBits":
                replaced = self.matmul_nbits(node, index)
                self.out.matmul_nodes.append(_name(node, index))
                new_nodes.extend(replaced)
            elif node.domain in ("", "ai.onnx") and node.op_type == "DequantizeLinear" \
                    and self.dequantize_linear(node, index):
                continue
            elif node.domain in ("", "ai.onnx") and node.op_type == "MatMulInteger":
                replaced = self.matmul_integer(node, index)
                if replaced is None:
                    new_nodes.append(node)
                else:
                    self.out.matmul_nodes.append(_name(node, index))
                    new_nodes.extend(replaced)
            else:
                if node.domain in ("", "ai.onnx") and node.op_type in ("QLinearMatMul", "ConvInteger", "QLinearConv"):
                    self.out.notes.append(f"stays on TVM's integer op, not qtvm's kernels: {node.op_type} "
                                          f"'{_name(node, index)}'")
                new_nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(new_nodes)

    def _drop_unused_initializers(self):
        for graph, _ in graph_scopes(self.model.graph):
            used = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
            used |= {name for n in graph.node for g in subgraphs(n) for name in graph_reads(g)}
            keep = [t for t in graph.initializer if t.name in used]
            del graph.initializer[:]
            graph.initializer.extend(keep)
        if not any(n.domain == MS_DOMAIN for graph, _ in graph_scopes(self.model.graph) for n in graph.node):
            keep_ops = [o for o in self.model.opset_import if o.domain != MS_DOMAIN]
            del self.model.opset_import[:]
            self.model.opset_import.extend(keep_ops)


def has_quantized_weights(model: onnx.ModelProto) -> bool:
    """Cheap test: does the model hold anything ``lower_quantized`` reads?"""
    return any((n.domain == MS_DOMAIN and n.op_type == "MatMulNBits")
               or (n.domain in ("", "ai.onnx") and n.op_type in ("DequantizeLinear", "MatMulInteger"))
               for graph, _ in graph_scopes(model.graph) for n in graph.node)


def lower_quantized(model: onnx.ModelProto, gptq=None, in_place: bool = False) -> LoweredModel:
    """A copy of ``model`` (``model`` itself with ``in_place``: no second copy of a large
    model's weights) with every quantized weight matmul on a marker (see the module doc).

    ``gptq``: a ``qtvm.formats.gptq_checkpoint.GptqCheckpoint`` whose layers replace
    float MatMul/Gemm weights matched by name.
    """
    if gptq is None and not has_quantized_weights(model):
        return LoweredModel(model)  # nothing to read: no copy of a (possibly large) float model
    return _Lowering(model, in_place).run(gptq)
