"""The float model a quantized artefact should match: same graph, weights
replaced by the format's dequantized values, for onnxruntime to run; for an
``--act int8`` artefact, each matmul's activations rounded as its kernel rounds them."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtvm.formats import QuantFormat
from qtvm.formats.base import add_csr


class UnmodelledRounding(Exception):
    """The int8-activation reference cannot express this graph's rounding (the caller
    falls back to the fp32-activation reference and its looser bound)."""


JITTER_INPUT = "qtvm_jitter/"  # name prefix of the jitter inputs ``dequantized_model(..., jitter=True)`` adds


def dequantized_model(model: onnx.ModelProto, fmt: QuantFormat, int8_facts=None, jitter: bool = False,
                      quantized: dict | None = None, experts: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` whose constant matmul weights went through ``fmt``.

    Each weight matmul (``qtvm.frontend.onnx.weight_sources``, the quantizer's rule) reads
    a new initializer holding the dequantized weight in the layout it consumes, so a
    weight shared with a non-matmul (a tied embedding table) stays float where qtvm
    keeps it float.

    ``int8_facts`` (the artefact's target's ``KernelFacts``): the matmuls that target runs
    with int8 activations (``KernelFacts.int8_rounding``, the pass's own decision) read
    their input rounded the same way, part by part for a composite format, so an
    ``--act int8`` artefact can be held to float rounding too. Raises
    ``UnmodelledRounding`` where ONNX cannot say it here (opset < 11, Gemm with transA).
    ``jitter``: each rounded input is first multiplied by a new float32 graph input
    ``JITTER_INPUT<n>`` of shape [K] (fed 1 + small noise, as a different float summation
    order perturbs x; all ones give the plain reference): the difference it makes is what the
    rounding steps that move with the last bits cost this model.
    ``quantized``: QuantizedTensors already made, by (weight name, read transposed) (the quantize
    report's, e.g. GPTQ's); the other weights go through ``fmt``.
    ``experts``: the mixture-of-experts weights the routed matmuls gather (``routed_sources``)
    go through ``fmt`` too, each expert's matrix on its own (an artefact whose target packed
    them: metadata ``routed_experts``), their inputs rounded as ``int8_facts`` says.
    """
    from qtvm.frontend.onnx import graph_scopes, weight_sources

    out = onnx.ModelProto()
    out.CopyFrom(model)
    scopes = list(graph_scopes(out.graph))  # the graph and its subgraphs (If branches): one object each
    sources = weight_sources(out, scopes)
    inits = {t.name: t for t in out.graph.initializer}
    reads: dict[str, int] = {}  # how many node inputs (in any graph) read each tensor
    for graph, _ in scopes:
        for node in graph.node:
            for name in node.input:
                reads[name] = reads.get(name, 0) + 1
    direct: dict[str, set] = {}  # initializer -> the layouts (Gemm transB) of the matmuls reading it directly
    direct_reads: dict[str, int] = {}
    for src in sources:
        if src.node.input[1] == src.name:
            direct.setdefault(src.name, set()).add(_trans_b(src.node))
            direct_reads[src.name] = direct_reads.get(src.name, 0) + 1
    made: dict[tuple, str] = {}
    quantized = dict(quantized or {})  # (name, transposed) -> QuantizedTensor
    before: dict[tuple, list] = {}  # (id of a graph, node index) -> nodes to insert ahead of it
    after: dict[tuple, list] = {}
    rounder = _Rounder(out, before, jitter) if int8_facts is not None else None
    stored_types = [src.tensor.data_type for src in sources]  # as read: a weight may be replaced in place below
    for number, src in enumerate(sources):
        if stored_types[number] != onnx.TensorProto.FLOAT:
            _in_float32(src, number, stored_types[number], before, after)
        trans_b = src.node.op_type == "Gemm" and _trans_b(src.node)
        key = (src.name, src.transposed, trans_b)  # the quantized [K, N] weight, the layout the node reads
        if (src.name, src.transposed) not in quantized:
            kn = src.array.astype(np.float32, copy=False)
            kn = kn.T if src.transposed else kn
            quantized[src.name, src.transposed] = fmt.quantize(np.ascontiguousarray(kn), name=src.name)
        qt = quantized[src.name, src.transposed]
        stacked = rounder.round_input(_at(src), src.node, qt, int8_facts) if rounder is not None else None
        if stacked is not None:  # parts rounding apart: x' @ W', x' their inputs side by side
            tensor = numpy_helper.from_array(np.ascontiguousarray(stacked.T if trans_b else stacked))
            tensor.name = f"{src.name}.qtvm_parts{len(out.graph.initializer)}"
            out.graph.initializer.append(tensor)
            src.node.input[1] = tensor.name
            continue
        if key not in made:
            deq = qt.dequantize()
            stored = numpy_helper.from_array(np.ascontiguousarray(deq.T if trans_b else deq).astype(np.float32))
            only_matmuls = direct_reads.get(src.name) == reads.get(src.name) and direct.get(src.name) == {trans_b}
            if src.node.input[1] == src.name and src.name in inits and only_matmuls:
                made[key] = src.name  # read only by matmuls like this one: replaced in place
                stored.name = src.name
                inits[src.name].CopyFrom(stored)
            else:
                made[key] = stored.name = f"{src.name}.qtvm_dequantized{len(made)}"
                out.graph.initializer.append(stored)
        src.node.input[1] = made[key]
    if experts:
        _dequantize_experts(out, fmt, before, after, rounder, int8_facts)
    for graph, _ in reversed(scopes):  # a branch before the graph holding it (its nodes are copied)
        if not any(at[0] == id(graph) for at in (*before, *after)):
            continue
        nodes = []
        for index, node in enumerate(graph.node):
            nodes += before.get((id(graph), index), []) + [onnx.NodeProto()]
            nodes[-1].CopyFrom(node)
            nodes += after.get((id(graph), index), [])
        del graph.node[:]
        graph.node.extend(nodes)
    used = {name for graph, _ in scopes for n in graph.node for name in n.input}
    used |= {o.name for graph, _ in scopes for o in graph.output}  # a branch may output a weight as is
    kept = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def _dequantize_experts(model: onnx.ModelProto, fmt: QuantFormat, before: dict, after: dict,
                        rounder: "_Rounder | None", int8_facts) -> None:
    """Each routed matmul's gathered weight replaced by a new float32 initializer: every
    expert's matrix through ``fmt`` in the [K, N] orientation the kernel packs (W[e].T where
    the export stores [N, K]); half precision experts' matmuls computed as qtvm does
    (``_in_float32``); with ``rounder``, the input rounded where the target's routed kernel
    takes int8 activations (``KernelFacts.routed_int8_rounding``)."""
    from qtvm.frontend.onnx import routed_sources

    made: dict[str, str] = {}
    for number, src in enumerate(routed_sources(model)):
        if src.tensor.data_type != onnx.TensorProto.FLOAT:
            _in_float32(src, f"experts{number}", src.tensor.data_type, before, after, inputs=[1 - src.side])
            for info in model.graph.value_info:  # the gather now yields float32 (a dynamo export types it)
                if info.name == src.gather.output[0]:
                    info.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        k = int(src.tensor.dims[2 if src.side == 0 else 1])
        rounding = int8_facts.routed_int8_rounding(fmt, k) if rounder is not None else None
        if rounding is not None:  # x is [S, K, 1] or [S, 1, K]: rounded as rows of K
            x = 1 - src.side
            src.node.input[x] = rounder.round_activations(_at(src), src.node.input[x], fmt.padded_k(k), k, rounding)
        if src.name not in made:
            w = numpy_helper.to_array(src.tensor).astype(np.float32, copy=False)
            deq = []
            for e in range(w.shape[0]):
                kn = np.ascontiguousarray(w[e].T if src.side == 0 else w[e])
                d = fmt.quantize(kn).dequantize()
                deq.append(d.T if src.side == 0 else d)
            stored = numpy_helper.from_array(np.ascontiguousarray(np.stack(deq)).astype(np.float32))
            made[src.name] = stored.name = f"{src.name}.qtvm_dequantized_experts"
            model.graph.initializer.append(stored)
        src.gather.input[0] = made[src.name]


def _at(src) -> tuple:
    """Where nodes go ahead of or after ``src``'s matmul: (id of its graph, its index there)."""
    return id(src.graph), src.index


def _in_float32(src, number, low: int, before: dict, after: dict, inputs: list[int] | None = None) -> None:
    """A half precision matmul as qtvm computes it (``relay_passes.fp32_accumulate``): float32
    inputs (the weight becomes a float32 initializer here), a float32 product, cast back.
    ``number``: the source's own, so the names made are unique across the graph's subgraphs;
    ``low``: the weight's stored type, which the product is cast back to; ``inputs``: the
    node's inputs to cast (default: the activations, and a Gemm's bias)."""
    node = src.node
    if inputs is None:
        inputs = [0, 2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else [0]
    for i in inputs:
        wide = f"{node.input[i]}.qtvm_float32_{number}"
        before.setdefault(_at(src), []).append(onnx.helper.make_node(
            "Cast", [node.input[i]], [wide], name=wide, to=onnx.TensorProto.FLOAT))
        node.input[i] = wide
    y = node.output[0]
    node.output[0] = f"{y}.qtvm_float32"
    after.setdefault(_at(src), []).append(onnx.helper.make_node("Cast", [node.output[0]], [y], name=f"{y}.qtvm_cast", to=low))


def _trans_b(node: onnx.NodeProto) -> bool:
    return any(a.name == "transB" and a.i for a in node.attribute)


class _Rounder:
    """Emits, in front of a matmul, the int8 rounding of its input (``schedules.facts.ActRounding``)."""

    def __init__(self, model: onnx.ModelProto, before: dict, jitter: bool = False):
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < 11:
            raise UnmodelledRounding(f"opset {opset} has no Round/Pad with tensor inputs (needs 11)")
        self.model, self.opset, self.count, self.jitter = model, opset, 0, jitter
        self.before = before  # (graph, node index) -> nodes to insert ahead of it (the caller inserts them)
        self.at: tuple = ()

    def round_input(self, at: tuple, node: onnx.NodeProto, qt, facts) -> np.ndarray | None:
        """Round ``node``'s input as the target's kernels for ``qt`` do. Returns the stacked
        [K', N] weight when the format's kernel parts round apart (mixed-2-4-16's 4-bit rows:
        the node then reads Concat(part inputs) @ stacked), else None (it keeps its weight)."""
        self.at = at
        if any(a.name == "transA" and a.i for a in node.attribute):
            raise UnmodelledRounding(f"{node.op_type} '{node.name}' has transA")
        parts = qt.fmt.kernel_parts(qt, **facts.parts_options)
        roundings = [facts.int8_rounding(part.fmt, part.k) for _, part in parts.dense]
        x = node.input[0]
        if all(r is None for r in roundings):
            return None
        if len(parts.dense) == 1 and parts.dense[0][0] is None and parts.sparse is None:
            node.input[0] = self._rounded(x, qt.fmt.padded_k(qt.k), qt.k, roundings[0])
            return None
        pieces, weights = [], []
        for (rows, part), rounding in zip(parts.dense, roundings):
            piece = x if rows is None else self._emit("Gather", [x, self._const(np.asarray(rows, np.int64))], axis=-1)
            if rounding is not None:
                piece = self._rounded(piece, part.fmt.padded_k(part.k), part.k, rounding)
            pieces.append(piece)
            weights.append(part.dequantize().astype(np.float32))
        if parts.sparse is not None:
            pieces.append(x)
            weights.append(add_csr(np.zeros((qt.k, qt.n), np.float32), parts.sparse))
        node.input[0] = self._emit("Concat", pieces, axis=-1)
        return np.concatenate(weights, axis=0)

    def round_activations(self, at: tuple, x: str, kp: int, k: int, rounding) -> str:
        """``x`` rounded ahead of the node at ``at`` (a routed matmul's input: one weight, no parts)."""
        self.at = at
        return self._rounded(x, kp, k, rounding)

    def _rounded(self, x: str, kp: int, k: int, rounding) -> str:
        """x[..., k] -> x_hat: zero-padded to kp, per ``rounding.block`` values q = round(x * 127 / a)
        clipped to +-127, x_hat = q * (a / 127), a = max |x| (the kernels' float32 arithmetic)."""
        e, c = self._emit, self._const
        block = rounding.block
        flat = e("Reshape", [x, c(np.array([-1, k], np.int64))])
        if self.jitter:
            name = f"{JITTER_INPUT}{len(self.model.graph.input)}"
            self.model.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [k]))
            flat = e("Mul", [flat, name])
        if kp > k:
            flat = e("Pad", [flat, c(np.array([0, 0, 0, kp - k], np.int64))])
        blocks = e("Reshape", [flat, c(np.array([-1, kp // block, block], np.int64))])
        mags = e("Abs", [blocks])
        if self.opset >= 18:
            amax = e("ReduceMax", [mags, c(np.array([-1], np.int64))], keepdims=1)
        else:
            amax = e("ReduceMax", [mags], axes=[-1], keepdims=1)
        inv = e("Div", [c(np.float32(127.0)), e("Max", [amax, c(np.float32(1e-30))])])
        q = e("Clip", [e("Round", [e("Mul", [blocks, inv])]), c(np.float32(-127.0)), c(np.float32(127.0))])
        hat = e("Reshape", [e("Mul", [q, e("Div", [amax, c(np.float32(127.0))])]), c(np.array([-1, kp], np.int64))])
        if kp > k:
            hat = e("Slice", [hat, c(np.array([0], np.int64)), c(np.array([k], np.int64)), c(np.array([1], np.int64))])
        hat = e("Reshape", [hat, e("Shape", [x])])
        if rounding.max_rows is None:
            return hat
        rows = e("Div", [e("Size", [x]), c(np.int64(k))])
        return e("Where", [e("Less", [rows, c(np.int64(rounding.max_rows + 1))]), hat, x])

    def _const(self, value: np.ndarray) -> str:
        tensor = numpy_helper.from_array(np.asarray(value))
        tensor.name = self._name("c")
        self.model.graph.initializer.append(tensor)
        return tensor.name

    def _emit(self, op: str, inputs: list, **attrs) -> str:
        """A node computing ``op`` ahead of the matmul being rewritten; its output's name."""
        out = self._name(op)
        self.before.setdefault(self.at, []).append(onnx.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def _name(self, what: str) -> str:
        self.count += 1
        return f"qtvm_act_int8/{what}_{self.count}"


def bfloat16_in_float32(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` computed in float32, every bfloat16 value rounded to bfloat16 where a node makes
    it (a Cast to bfloat16 and back after it): what the bfloat16 model computes, in ops
    onnxruntime's CPU kernels have (it has next to no bfloat16 ones). Its bfloat16 inputs and
    outputs are float32 ones (the same values: onnxruntime's Python API takes no bfloat16).
    None where it cannot be rewritten so: subgraphs, or a value whose type shape inference
    leaves unknown."""
    from qtvm.frontend.onnx import subgraphs

    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    if any(subgraphs(node) for node in model.graph.node):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    del graph.value_info[:]  # inferred afresh (a reference's rewrites leave some stale)
    try:
        typed = onnx.shape_inference.infer_shapes(out, strict_mode=False)
    except Exception:  # noqa: BLE001 -- shape inference raises anything
        return None
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*typed.graph.value_info, *typed.graph.input, *typed.graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    for i, t in enumerate(graph.initializer):
        if t.data_type == bf16:
            wide = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)
            graph.initializer[i].CopyFrom(wide)
    for v in (*graph.input, *graph.output):  # fed and read as float32 (onnxruntime's Python API has no bfloat16)
        if v.type.tensor_type.elem_type == bf16:
            v.type.tensor_type.elem_type = f32
    outputs = {o.name for o in graph.output}
    renamed: dict[str, str] = {}  # a bfloat16 value -> its float32 copy, as rounded
    nodes = []
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT and attr.i == bf16:
                attr.i = f32
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == bf16:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        rounds = []
        for index, name in enumerate(node.output):
            if name and name not in types:
                return None
            if name and types[name] == bf16:
                raw, rounded = f"{name}.qtvm_raw", f"{name}.qtvm_bf16"
                node.output[index], renamed[name] = raw, (name if name in outputs else f"{name}.qtvm_f32")
                rounds += [onnx.helper.make_node("Cast", [raw], [rounded], to=bf16),
                           onnx.helper.make_node("Cast", [rounded], [renamed[name]], to=f32)]
        nodes += [node, *rounds]
    del graph.node[:]
    graph.node.extend(nodes)
    return out
