"""Shared fixtures: small ONNX models and one compiled tiny LLaMA per session."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
# The compiler's TVM, before any test imports qtvm.runtime (which would otherwise load the
# runtime-only library and leave this process unable to compile). Runtime-only behaviour is
# tested in subprocesses.
import tvm  # noqa: F401
from onnx import TensorProto, helper, numpy_helper


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    from qtvm.models.tiny_llama import export_onnx

    return export_onnx(tmp_path_factory.mktemp("model") / "tiny_llama.onnx")


@pytest.fixture(scope="session")
def tiny_llama_int4(tiny_llama_path, tmp_path_factory):
    """(artefact path, CompileResult) for int4-g128 on the host."""
    from qtvm.pipeline import compile_model

    result = compile_model(tiny_llama_path, tmp_path_factory.mktemp("art") / "tiny_int4.so", "host", "int4-g128")
    return result.path, result


def mlp_model(k: int = 100, hidden: int = 70, n: int = 37, seed: int = 0) -> onnx.ModelProto:
    """x[batch, k] -> Gemm(transB=1, bias) -> Relu -> MatMul -> y; plus x @ x^T-style computed matmul."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((hidden, k)).astype(np.float32) * 0.1  # Gemm B with transB=1: [N, K]
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = rng.standard_normal((hidden, n)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="relu"),
        helper.make_node("MatMul", ["hr", "w2"], ["y"], name="fc2"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt"),
        helper.make_node("MatMul", ["x", "xt"], ["gram"], name="gram"),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n]),
         helper.make_tensor_value_info("gram", TensorProto.FLOAT, ["batch", "batch"])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def mlp_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(path))
    return path
