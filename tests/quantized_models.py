"""Quantized ONNX test models, built by hand with onnx.helper (awkward shapes) or by onnxruntime's quantizers.

Each hand-built layer also returns its float64 [K, N] weight computed straight from
the codes by the operator's definition, independently of qtvm's reader.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]


def pack_low_first(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., L] codes -> [..., ceil(L * bits / 8)] uint8, lowest bits first (MatMulNBits' packing)."""
    per = 8 // bits
    pad = (-codes.shape[-1]) % per
    c = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), codes.dtype)], -1).astype(np.uint16)
    c = c.reshape(*c.shape[:-1], -1, per)
    return sum(c[..., j] << (bits * j) for j in range(per)).astype(np.uint8)


def matmul_nbits_layer(name: str, x: str, y: str, k: int, n: int, bits: int, block: int, zp: str = "packed",
                       g_idx: bool = False, bias: bool = False, accuracy_level: int | None = None, seed: int = 0):
    """(node, initializers, float64 weight [K, N]) of one MatMulNBits; zp: packed | float | none."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    codes = rng.integers(0, 2 ** bits, (n, blocks * block))
    scales = rng.uniform(0.01, 0.1, (n, blocks)).astype(np.float32)
    inits = [numpy_helper.from_array(pack_low_first(codes.reshape(n, blocks, block), bits), f"{name}_B"),
             numpy_helper.from_array(scales.reshape(-1), f"{name}_scales")]
    inputs = [x, f"{name}_B", f"{name}_scales", ""]
    if zp == "packed":
        zeros = rng.integers(0, 2 ** bits, (n, blocks))
        inits.append(numpy_helper.from_array(pack_low_first(zeros, bits).reshape(-1), f"{name}_zp"))
    elif zp == "float":
        zeros = rng.uniform(0, 2 ** bits - 1, (n, blocks)).astype(np.float32)
        inits.append(numpy_helper.from_array(zeros.reshape(-1), f"{name}_zp"))
    else:
        zeros = np.full((n, blocks), 2 ** (bits - 1))
    if zp != "none":
        inputs[3] = f"{name}_zp"
    rows = np.arange(k) // block
    if g_idx:
        rows = rng.permutation(rows)  # act-order: every block keeps its row count
        inits.append(numpy_helper.from_array(rows.astype(np.int32), f"{name}_g_idx"))
        inputs.append(f"{name}_g_idx")
    if bias:
        b = rng.standard_normal(n).astype(np.float32)
        inits.append(numpy_helper.from_array(b, f"{name}_bias"))
        inputs += [""] * (5 - len(inputs)) + [f"{name}_bias"]
    while inputs[-1] == "":
        inputs.pop()
    attrs = dict(K=k, N=n, bits=bits, block_size=block)
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", inputs, [y], name=name, domain="com.microsoft", **attrs)
    col = np.arange(n)[:, None]
    w = ((codes[:, :k] - zeros[col, rows[None, :]]) * scales[col, rows[None, :]]).T.astype(np.float64)
    return node, inits, w


def blocked_dq_layer(name: str, x: str, y: str, k: int, n: int, block: int, signed: bool, zero_points: bool = True,
                     gemm: bool = False, bits: int = 4, seed: int = 0):
    """(nodes, initializers, float64 weight [K, N]) of DequantizeLinear(int4/uint4, block_size) -> MatMul, or
    -> Gemm(transB=1) with the weight stored [N, K] and blocked along axis 1 (K)."""
    rng = np.random.default_rng(seed)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if signed else (0, 2 ** bits)
    dtype = {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4,
             (8, True): TensorProto.INT8, (8, False): TensorProto.UINT8}[bits, signed]
    q = rng.integers(lo, hi, (k, n))
    groups = -(-k // block)
    scales = rng.uniform(0.01, 0.1, (groups, n)).astype(np.float32)
    zeros = rng.integers(lo, hi, (groups, n)) if zero_points else np.zeros((groups, n), np.int64)
    rows = np.arange(k) // block
    w = ((q - zeros[rows]) * scales[rows]).astype(np.float64)
    stored, s, z, axis = (q.T, scales.T, zeros.T, 1) if gemm else (q, scales, zeros, 0)
    inits = [helper.make_tensor(f"{name}_q", dtype, stored.shape, stored.reshape(-1).tolist()),
             numpy_helper.from_array(np.ascontiguousarray(s), f"{name}_scale")]
    dq_in = [f"{name}_q", f"{name}_scale"]
    if zero_points:
        inits.append(helper.make_tensor(f"{name}_zp", dtype, z.shape, z.reshape(-1).tolist()))
        dq_in.append(f"{name}_zp")
    nodes = [helper.make_node("DequantizeLinear", dq_in, [f"{name}_w"], name=f"{name}_dq", axis=axis,
                              block_size=block)]
    if gemm:
        nodes.append(helper.make_node("Gemm", [x, f"{name}_w"], [y], name=name, transB=1))
    else:
        nodes.append(helper.make_node("MatMul", [x, f"{name}_w"], [y], name=name))
    return nodes, inits, w


def model_of(layers, inputs, outputs, opsets=OPSETS) -> onnx.ModelProto:
    """layers: [(nodes or node, initializers, w)]; inputs/outputs: [(name, dims)] float tensors."""
    nodes, inits = [], []
    for node, layer_inits, _ in layers:
        nodes += node if isinstance(node, list) else [node]
        inits += layer_inits
    graph = helper.make_graph(nodes, "quantized",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in outputs], inits)
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def branchy_model(k: int = 70, n: int = 37):
    """y = If(c, MatMulNBits(x) [int4, g16, accuracy_level 4], Gemm(x, DequantizeLinear(int4, g32)^T)), each
    branch holding its own initializers, plus a top-level MatMulNBits feeding both (x2); the float64 weights."""
    top_node, top_inits, w_top = matmul_nbits_layer("top", "x", "x2", k, k, 4, 32, "float", seed=5)
    then_node, then_inits, w_then = matmul_nbits_layer("then_mm", "x2", "t", k, n, 4, 16, accuracy_level=4, seed=6)
    else_nodes, else_inits, w_else = blocked_dq_layer("else_mm", "x2", "e", k, n, 32, signed=True, gemm=True, seed=7)
    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", n])  # noqa: E731
    then = helper.make_graph([then_node], "then", [], [out("t")], then_inits)
    other = helper.make_graph(else_nodes, "else", [], [out("e")], else_inits)
    graph = helper.make_graph(
        [top_node, helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [out("y")], top_inits)
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=10), w_top, w_then, w_else


# -- onnxruntime's quantizers on the float MLP of tests/conftest.py ---------------------------------
def ort_matmul_nbits(model: onnx.ModelProto, bits: int, block: int, symmetric: bool, qdq: bool = False):
    """onnxruntime's MatMulNBitsQuantizer (QOperator: MatMulNBits; QDQ: blocked DequantizeLinear)."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer edits its input
    fmt = QuantFormat.QDQ if qdq else QuantFormat.QOperator
    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, bits=bits, quant_format=fmt)
    q = MatMulNBitsQuantizer(copy, bits=bits, block_size=block, is_symmetric=symmetric, algo_config=cfg)
    q.process()
    return q.model.model


def ort_static_qdq(model: onnx.ModelProto, tmp_path, per_channel: bool = True) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    k = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": np.random.default_rng(i).standard_normal((4, k)).astype(np.float32)}
                                 for i in range(4)])

        def get_next(self):
            return next(self.batches, None)

    src, out = tmp_path / "float.onnx", tmp_path / "static.onnx"
    onnx.save(model, str(src))
    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(str(src), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel)
    return onnx.load(str(out))


def ort_dynamic(model: onnx.ModelProto, tmp_path, per_channel: bool = False, signed: bool = True):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, out = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(model, str(src))
    logging.getLogger().setLevel(logging.ERROR)
    quantize_dynamic(str(src), str(out), weight_type=QuantType.QInt8 if signed else QuantType.QUInt8,
                     per_channel=per_channel)
    return onnx.load(str(out))
