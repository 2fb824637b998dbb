"""The float model a quantized artefact should match: same graph, weights
replaced by the format's dequantized values, for onnxruntime to run."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtvm.formats import QuantFormat


def _weight_inputs(model: onnx.ModelProto):
    """(initializer, transposed) for each MatMul/Gemm whose B is an initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
            continue
        if node.input[1] not in inits:
            continue
        trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        yield inits[node.input[1]], trans_b


def dequantized_model(model: onnx.ModelProto, fmt: QuantFormat) -> onnx.ModelProto:
    """A copy of ``model`` whose constant matmul weights went through ``fmt``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    done = set()
    for init, trans_b in _weight_inputs(out):
        w = numpy_helper.to_array(init)
        if init.name in done or w.ndim != 2 or w.dtype != np.float32:
            continue
        kn = w.T if trans_b else w
        deq = fmt.quantize(np.ascontiguousarray(kn), name=init.name).dequantize()
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(deq.T if trans_b else deq), init.name))
        done.add(init.name)
    return out
