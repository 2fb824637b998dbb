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
    """A copy of ``model`` whose constant matmul weights went through ``fmt``.

    Each weight matmul (``qtvm.frontend.onnx.weight_sources``, the quantizer's rule) reads
    a new initializer holding the dequantized weight in the layout it consumes, so a
    weight shared with a non-matmul (a tied embedding table) stays float where qtvm
    keeps it float.
    """
    from qtvm.frontend.onnx import weight_sources

    out = onnx.ModelProto()
    out.CopyFrom(model)
    sources = weight_sources(out)
    inits = {t.name: t for t in out.graph.initializer}
    reads: dict[str, int] = {}  # how many node inputs read each tensor
    for node in out.graph.node:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    direct: dict[str, set] = {}  # initializer -> the layouts (Gemm transB) of the matmuls reading it directly
    direct_reads: dict[str, int] = {}
    for src in sources:
        if src.node.input[1] == src.name:
            direct.setdefault(src.name, set()).add(_trans_b(src.node))
            direct_reads[src.name] = direct_reads.get(src.name, 0) + 1
    made: dict[tuple, str] = {}
    for src in sources:
        trans_b = src.node.op_type == "Gemm" and _trans_b(src.node)
        key = (src.name, src.transposed, trans_b)  # the quantized [K, N] weight, the layout the node reads
        if key not in made:
            kn = src.array.T if src.transposed else src.array
            deq = fmt.quantize(np.ascontiguousarray(kn), name=src.name).dequantize()
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
    used = {i for n in out.graph.node for i in n.input} | {o.name for o in out.graph.output}
    kept = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def _trans_b(node: onnx.NodeProto) -> bool:
    return any(a.name == "transB" and a.i for a in node.attribute)
