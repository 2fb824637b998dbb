"""ONNX-level repairs before import: an op form TVM's converter gets wrong, rewritten into
standard ops it gets right (each checked by ONNX's node tests in tests/conformance).

- LayerNormalization whose Mean / InvStdDev outputs are used: TVM's converter returns them
  with the wrong shape; the node is decomposed (mean, centred variance, 1/sqrt) as ONNX's
  own function body defines it. Without those outputs the node is left to TVM's fused op.
- Softplus and Mish: TVM computes log(1 + exp(x)), which loses every digit of a small
  exp(x) to the 1 (relative error 1e-3 at x = -10, 100% at x = -30); rewritten as
  relu(x) + log1p(exp(-|x|)) with log1p by a series (see ``_softplus``).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtvm.frontend.onnx import weightless_copy


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _ranks_and_types(model: onnx.ModelProto) -> tuple[dict, dict]:
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_copy(model), strict_mode=False)
    except Exception:  # noqa: BLE001 -- without inference, nodes of unknown rank are left alone
        inferred = model
    ranks, types = {}, {}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        t = v.type.tensor_type
        if v.type.HasField("tensor_type") and t.HasField("shape"):
            ranks[v.name] = len(t.shape.dim)
        if v.type.HasField("tensor_type") and t.elem_type:
            types[v.name] = t.elem_type
    for init in inferred.graph.initializer:
        ranks[init.name], types[init.name] = len(init.dims), init.data_type
    return ranks, types


class _Emitter:
    """Appends nodes and constants with names unique to one rewritten node."""

    def __init__(self, prefix: str, opset: int):
        self.prefix, self.opset, self.nodes, self.inits, self.n = prefix, opset, [], [], 0

    def name(self) -> str:
        self.n += 1
        return f"{self.prefix}/{self.n}"

    def const(self, value: np.ndarray) -> str:
        name = self.name()
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        output = output or self.name()
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=self.name(), **attrs))
        return output

    def reduce_mean(self, x: str, axes: list[int], output: str | None = None) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(np.array(axes, np.int64))], output, keepdims=1)
        return self.op("ReduceMean", [x], output, axes=axes, keepdims=1)


def _layer_norm(node, rank: int, elem_type: int, opset: int, index: int) -> _Emitter:
    axis = _attr(node, "axis", -1)
    axes = list(range(axis % rank, rank))
    eps = float(_attr(node, "epsilon", 1e-5))
    stash = TensorProto.FLOAT if _attr(node, "stash_type", 1) == 1 else elem_type
    e = _Emitter(f"qtvm_layer_norm_{index}", opset)
    x = node.input[0]
    if stash != elem_type:
        x = e.op("Cast", [x], to=stash)
    np_type = helper.tensor_dtype_to_np_dtype(stash)
    mean = e.reduce_mean(x, axes, node.output[1] if len(node.output) > 1 and node.output[1] else None)
    centred = e.op("Sub", [x, mean])
    var = e.reduce_mean(e.op("Mul", [centred, centred]), axes)
    inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, e.const(np.array(eps, np_type))])])],
               node.output[2] if len(node.output) > 2 and node.output[2] else None)
    normed = e.op("Mul", [centred, inv])
    if stash != elem_type:  # the statistics keep the stash type, as ONNX's spec has them
        normed = e.op("Cast", [normed], to=elem_type)
    scaled = e.op("Mul", [normed, node.input[1]])
    if len(node.input) > 2 and node.input[2]:
        e.op("Add", [scaled, node.input[2]], node.output[0])
    else:
        e.op("Identity", [scaled], node.output[0])
    return e


def _softplus(node, elem_type: int, opset: int, index: int) -> _Emitter:
    """relu(x) + log1p(exp(-|x|)), log1p(t) = 2 atanh(s), s = t / (2 + t) <= 1/3, by its odd
    series to s^17 (truncation below 3e-9 relative): only products and sums of positive terms,
    nothing a simplifier can cancel (TVM folds (1 + t) - 1 to t, which defeats the usual trick)."""
    e = _Emitter(f"qtvm_softplus_{index}", opset)
    x = node.input[0]
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)

    def c(v):
        return e.const(np.array(v, np_type))

    t = e.op("Exp", [e.op("Neg", [e.op("Abs", [x])])])
    s_ = e.op("Div", [t, e.op("Add", [t, c(2.0)])])
    s2 = e.op("Mul", [s_, s_])
    poly = c(2.0 / 17)
    for k in range(15, 0, -2):  # Horner over s^2: 2/15 + s2 * (...), down to 2/1
        poly = e.op("Add", [e.op("Mul", [s2, poly]), c(2.0 / k)])
    log1p = e.op("Mul", [s_, poly])
    sp = e.op("Add", [e.op("Relu", [x]), log1p], node.output[0] if node.op_type == "Softplus" else None)
    if node.op_type == "Mish":  # x * tanh(softplus(x))
        e.op("Mul", [x, e.op("Tanh", [sp])], node.output[0])
    return e


def _needs_repair(node) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "LayerNormalization":
        return any(len(node.output) > p and node.output[p] for p in (1, 2))
    return node.op_type in ("Softplus", "Mish")


def repair(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with the forms above rewritten (the model itself when none applies)."""
    targets = [i for i, n in enumerate(model.graph.node) if _needs_repair(n)]
    if not targets:
        return model
    ranks, types = _ranks_and_types(model)
    opset = _opset(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for i, node in enumerate(out.graph.node):
        x = node.input[0] if node.input else None
        if i in targets and node.op_type in ("Softplus", "Mish") and types.get(x) in _FLOATS:
            e = _softplus(node, types[x], opset, i)
        elif i in targets and node.op_type == "LayerNormalization" and x in ranks and x in types:
            e = _layer_norm(node, ranks[x], types[x], opset, i)
        else:
            nodes.append(node)
            continue
        nodes.extend(e.nodes)
        out.graph.initializer.extend(e.inits)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out
