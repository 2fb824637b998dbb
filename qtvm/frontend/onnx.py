"""ONNX file -> Relax IRModule with symbolic dims, with errors a user can act on."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qtvm.errors import QtvmError

WEIGHT_OPS = ("MatMul", "Gemm")
# Custom-domain ops qtvm reads itself before TVM's importer (qtvm/frontend/quantized.py).
QTVM_READS = {("com.microsoft", "MatMulNBits")}


@dataclass
class OnnxSummary:
    """What the quantizer will see, by ONNX node name."""

    weight_matmuls: list[str] = field(default_factory=list)  # B is a constant initializer
    float_matmuls: list[str] = field(default_factory=list)  # B is computed at run time
    inputs: list[tuple[str, str, list]] = field(default_factory=list)  # name, dtype, dims
    outputs: list[tuple[str, str, list]] = field(default_factory=list)


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise QtvmError(f"model file '{path}' does not exist", "check the path")
    if path.is_dir():
        raise QtvmError(f"'{path}' is a directory, not an ONNX file", "pass the .onnx file itself")
    try:
        model = onnx.load(str(path))
    except Exception:  # protobuf raises DecodeError and friends for non-ONNX bytes
        raise QtvmError(f"'{path}' is not a readable ONNX model (not ONNX, or truncated)",
                        "re-export the model or check the download") from None
    if not model.graph.node or not model.opset_import:
        raise QtvmError(f"'{path}' is not a readable ONNX model (no graph nodes or opset)",
                        "re-export the model or check the download")
    return model


def validate(model: onnx.ModelProto, name: str = "model") -> None:
    """Unsupported ops, attributes and dtypes first (all named at once), then the ONNX checker."""
    from qtvm.frontend.op_support import unsupported_features

    missing = unsupported_ops(model)
    problems = ([f"unsupported ONNX ops: {', '.join(missing)}"] if missing else []) + unsupported_features(model)
    if problems:
        raise QtvmError("; ".join(problems), "re-export without them, or file an issue naming them")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        first = str(e).strip().splitlines()[0].rstrip(".")
        raise QtvmError(f"{name} fails the ONNX checker: {first}", "re-export the model") from None


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Every op type TVM's ONNX importer lacks (domain-qualified if not default)."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"Constant", "If"}
    missing = set()
    for node in model.graph.node:
        custom_domain = node.domain not in ("", "ai.onnx")
        if (node.domain, node.op_type) in QTVM_READS:
            continue
        if custom_domain or node.op_type not in known:
            missing.add(f"{node.domain}.{node.op_type}" if custom_domain else node.op_type)
    return sorted(missing)


def _dims(value_info) -> list:
    shape = value_info.type.tensor_type.shape
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in shape.dim]


def summarize(model: onnx.ModelProto) -> OnnxSummary:
    inits = {t.name for t in model.graph.initializer}
    inits |= {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    s = OnnxSummary()
    for i, node in enumerate(model.graph.node):
        if node.op_type in WEIGHT_OPS and node.domain in ("", "ai.onnx"):
            name = node.name or f"{node.op_type}_{i}"
            (s.weight_matmuls if node.input[1] in inits else s.float_matmuls).append(name)
    to_str = onnx.helper.tensor_dtype_to_np_dtype
    graph_inputs = [v for v in model.graph.input if v.name not in inits]
    s.inputs = [(v.name, str(to_str(v.type.tensor_type.elem_type)), _dims(v)) for v in graph_inputs]
    s.outputs = [(v.name, str(to_str(v.type.tensor_type.elem_type)), _dims(v)) for v in model.graph.output]
    return s


def import_onnx(model: onnx.ModelProto):
    """Relax IRModule with weights bound as constants and dim_params as symbols."""
    from qtvm.frontend.rewrites import repair

    validate(model)
    model = repair(model)
    from tvm import relax

    import contextlib
    import io
    import re

    said = io.StringIO()  # TVM's importer prints "Error converting operator X, with inputs: ..."
    try:
        with contextlib.redirect_stdout(said):
            return relax.frontend.onnx.from_onnx(model, keep_params_in_input=False)
    except Exception as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        op = re.search(r"Error converting operator (\w+)", said.getvalue())
        where = f"the {op.group(1)} node" if op else "a node"
        raise QtvmError(f"TVM's ONNX importer cannot convert {where}: {last}",
                        "re-export the model with constant attributes/inputs for it, or file an issue") from None
