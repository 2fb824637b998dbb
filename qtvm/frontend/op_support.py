"""What qtvm refuses before import, because TVM's importer would give wrong numbers or crash.

Found by running ONNX's own node tests through the pipeline (tests/conformance): every
rule below is a case that compiled and returned wrong values, or crashed past the importer,
in TVM 0.27. A refusal is a sentence naming the node, the op and the attribute, so a user
knows what to change; ``unsupported_features`` returns all of them at once.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from qtvm.frontend.onnx import tensor_array, weightless_copy

#: Element types qtvm compiles and its runtime passes through numpy.
SUPPORTED_DTYPES = {
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.BOOL,
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
}

#: Ops on sequences and optionals: qtvm's graphs carry tensors only.
NON_TENSOR_OPS = {
    "SequenceConstruct", "SequenceEmpty", "SequenceAt", "SequenceInsert", "SequenceErase",
    "SequenceLength", "SequenceMap", "SplitToSequence", "ConcatFromSequence",
    "Optional", "OptionalGetElement", "OptionalHasElement",
}


#: Inputs TVM's importer needs as compile-time values (initializers, Constant nodes, or values
#: folded from shapes): fed as graph inputs they fail in its converters (or, for Expand, are
#: taken as the output shape without ONNX's broadcasting). Positions per op.
CONSTANT_INPUTS = {
    **{op: (1,) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                           "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "Reshape", "Expand",
                           "Split", "CumSum", "TopK", "OneHot")},
    "ConstantOfShape": (0,), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "DFT": (1, 2),
}
_PARAMETER_NAMES = {"Reshape": "shape", "Expand": "shape", "Split": "split", "CumSum": "axis", "TopK": "k",
                    "OneHot": "depth", "ConstantOfShape": "shape", "Pad": "pads/constant_value/axes",
                    "Resize": "roi/scales/sizes", "DFT": "dft_length/axis"}


def _dtype_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


def _node_name(node: onnx.NodeProto, index: int) -> str:
    return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (node {index})"


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _has_input(node: onnx.NodeProto, i: int) -> bool:
    return len(node.input) > i and node.input[i] != ""


def _has_output(node: onnx.NodeProto, i: int) -> bool:
    return len(node.output) > i and node.output[i] != ""


_INDEX_DTYPES = (TensorProto.INT64, TensorProto.INT32)


def compile_time_names(model: onnx.ModelProto) -> set[str]:
    """Names of values known before the model runs: initializers and Constant nodes' outputs."""
    return ({t.name for t in model.graph.initializer}
            | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output if o})


def _value_types(model: onnx.ModelProto):
    """(what, value name, TypeProto) of every graph input, output and annotated value."""
    g = model.graph
    for what, values in (("input", g.input), ("output", g.output), ("value", g.value_info)):
        for v in values:
            yield what, v.name, v.type


def _dtype_problems(model: onnx.ModelProto) -> list[str]:
    problems: dict[str, list[str]] = {}

    def note(elem_type: int, where: str):
        if elem_type not in SUPPORTED_DTYPES:
            problems.setdefault(f"{_dtype_name(elem_type)} tensors", []).append(where)

    # An empty integer vector known at compile time is a shape or an axes list (ConstantOfShape of a
    # scalar): the import folds it; onnxruntime's quantizers annotate it as a [0] value.
    empty_ok = compile_time_names(model)
    for what, name, ty in _value_types(model):
        kind = ty.WhichOneof("value")
        if kind != "tensor_type":
            label = (kind or "untyped").removesuffix("_type")
            problems.setdefault(f"{label} values", []).append(f"{what} '{name}'")
            continue
        if ty.tensor_type.elem_type:
            note(ty.tensor_type.elem_type, f"{what} '{name}'")
        if any(d.HasField("dim_value") and d.dim_value == 0 for d in ty.tensor_type.shape.dim) and not (
                what == "value" and name in empty_ok and ty.tensor_type.elem_type in _INDEX_DTYPES):
            problems.setdefault("zero-size tensors", []).append(f"{what} '{name}'")
    # Low-bit codes a DequantizeLinear reads are qtvm's to repack (qtvm/frontend/quantized.py).
    dequantized = {name for n in model.graph.node if n.op_type == "DequantizeLinear"
                   for i, name in enumerate(n.input) if i != 1}  # codes and zero points, not scales
    for init in model.graph.initializer:
        if init.name not in dequantized:
            note(init.data_type, f"initializer '{init.name}'")
        if 0 in init.dims and init.data_type not in _INDEX_DTYPES:
            problems.setdefault("zero-size tensors", []).append(f"initializer '{init.name}'")
    for i, node in enumerate(model.graph.node):
        if node.op_type == "Cast" and _attr(node, "to") is not None:
            note(_attr(node, "to"), _node_name(node, i))
        if node.op_type == "Constant":
            value = _attr(node, "value")
            if isinstance(value, TensorProto):
                note(value.data_type, _node_name(node, i))
    return [f"{label} ({', '.join(where[:3])}{', ...' if len(where) > 3 else ''})"
            for label, where in sorted(problems.items())]


def _op_problems(node: onnx.NodeProto) -> list[str]:
    """Attribute and output combinations TVM 0.27's converters get wrong."""
    op = node.op_type
    out = []
    if op in NON_TENSOR_OPS:
        out.append("sequence/optional values are not supported")
    elif op == "BatchNormalization" and _attr(node, "training_mode", 0):
        out.append("training_mode=1 is not supported (inference graphs only)")
    elif op == "Dropout" and (_has_input(node, 2) or _has_output(node, 1)):
        out.append("the training_mode input and the mask output are not supported (inference graphs only)")
    elif op == "IsInf" and (_attr(node, "detect_positive", 1) != 1 or _attr(node, "detect_negative", 1) != 1):
        out.append("detect_positive/detect_negative are ignored by TVM's converter")
    elif op == "NonMaxSuppression":
        out.append("TVM's converter returns no boxes")
    elif op == "RoiAlign" and _attr(node, "mode", b"avg") in (b"max", "max"):
        out.append("mode='max' is computed wrong by TVM's converter")
    elif op == "SpaceToDepth" and _attr(node, "mode", b"DCR") not in (b"DCR", "DCR"):
        out.append("mode='CRD' is ignored by TVM's converter")
    elif op == "ConvTranspose" and _attr(node, "output_shape") is not None:
        out.append("the output_shape attribute is ignored by TVM's converter; use pads/output_padding")
    return out


def _value_facts(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """(element type, rank) of every value the model states or ONNX shape inference finds."""
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_copy(model), strict_mode=False)
    except Exception:  # noqa: BLE001 -- inference is a help here, not a requirement
        inferred = model
    types = {t.name: t.data_type for t in inferred.graph.initializer}
    ranks = {t.name: len(t.dims) for t in inferred.graph.initializer}
    for _, name, ty in _value_types(inferred):
        if ty.WhichOneof("value") == "tensor_type":
            if ty.tensor_type.elem_type:
                types[name] = ty.tensor_type.elem_type
            if ty.tensor_type.HasField("shape"):
                ranks[name] = len(ty.tensor_type.shape.dim)
    for node in inferred.graph.node:
        if node.op_type == "Constant" and isinstance(_attr(node, "value"), TensorProto):
            types[node.output[0]] = _attr(node, "value").data_type
            ranks[node.output[0]] = len(_attr(node, "value").dims)
    return types, ranks


_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_UNSIGNED = {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
_INTS = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64} | _UNSIGNED


def _typed_problems(node: onnx.NodeProto, types: dict[str, int], ranks: dict[str, int]) -> list[str]:
    """Rules that depend on an input's element type or rank."""
    first = types.get(node.input[0]) if node.input else None
    rank = ranks.get(node.input[0]) if node.input else None
    if node.op_type == "RMSNormalization":
        axis = _attr(node, "axis", -1)
        if axis == 0 or rank is None or axis == -rank:
            return ["normalizing over every axis (axis=0), or over an input of unknown rank, fails in TVM's "
                    "converter"]
    if node.op_type == "Mod" and not _attr(node, "fmod", 0) and first in _FLOATS:
        return ["floor-mod of float tensors (fmod=0) is wrong at zero and infinite divisors in TVM's converter; "
                "use fmod=1 or integers"]
    if node.op_type == "Pow" and first in _INTS:
        return ["Pow of integer tensors is not supported (TVM's power is float-only)"]
    if node.op_type.startswith("Reduce") and first == TensorProto.BOOL:
        return ["reductions of bool tensors fail in TVM; cast to an integer type first"]
    if node.op_type == "TopK" and first in _UNSIGNED:
        return [f"TopK of {_dtype_name(first)} tensors fails at run time in TVM; cast to int64 first"]
    return []


def _resize_problems(node: onnx.NodeProto, constants: dict[str, TensorProto]) -> list[str]:
    """Resize forms TVM 0.27 computes wrong or cannot convert (ONNX's resize node tests)."""
    out = []
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    ctm = _attr(node, "coordinate_transformation_mode", b"half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    if _attr(node, "antialias", 0):
        out.append("antialias=1 is not supported")
    if ctm == "half_pixel_symmetric":
        out.append("coordinate_transformation_mode='half_pixel_symmetric' is not supported")
    if _attr(node, "axes") is not None:
        out.append("the axes attribute is not supported")
    if mode in ("linear", "cubic") and _has_input(node, 2):
        scales = tensor_array(constants[node.input[2]]) if node.input[2] in constants else None
        if scales is not None and any(v < 1 or v != int(v) for v in scales.ravel().tolist()):
            out.append(f"{mode} resize by non-integer or downscaling scales is computed wrong by TVM's "
                       "converter; give the output sizes instead")
    return out


def _constants(model: onnx.ModelProto) -> dict[str, TensorProto]:
    """Initializers and Constant nodes' values, by name (as protos: converted where read)."""
    out = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and isinstance(_attr(node, "value"), TensorProto):
            out[node.output[0]] = _attr(node, "value")
    return out


def unsupported_features(model: onnx.ModelProto) -> list[str]:
    """Every node, attribute and dtype qtvm refuses, each named, in graph order."""
    problems = _dtype_problems(model)
    types, ranks = _value_facts(model)
    constants = _constants(model)
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = {i.name for i in model.graph.input if i.name not in inits}
    for i, node in enumerate(model.graph.node):
        resize = _resize_problems(node, constants) if node.op_type == "Resize" else []
        runtime = [node.input[p] for p in CONSTANT_INPUTS.get(node.op_type, ())
                   if p < len(node.input) and node.input[p] in graph_inputs]
        if runtime:
            what = _PARAMETER_NAMES.get(node.op_type, "axes")
            resize.append(f"its {what} input must be a constant (an initializer or Constant node), not the "
                          f"graph input{'s' if len(runtime) > 1 else ''} {', '.join(repr(r) for r in runtime)}")
        for p in _op_problems(node) + _typed_problems(node, types, ranks) + resize:
            problems.append(f"{_node_name(node, i)}: {p}")
    return problems
