from __future__ import annotations

import onnx
import pytest
import tvm

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import import_onnx, load_onnx, summarize, unsupported_ops
from tests.conftest import mlp_model


def test_summary_splits_constant_and_computed_weights():
    s = summarize(mlp_model())
    assert s.weight_matmuls == ["fc1", "fc2"] and s.float_matmuls == ["gram"]
    assert s.inputs == [("x", "float32", ["batch", 100])]
    assert ("gram", "float32", ["batch", "batch"]) in s.outputs


def test_import_keeps_symbolic_batch():
    mod = import_onnx(mlp_model())
    params = mod["main"].params
    batch, k = params[0].ty.shape.values
    assert isinstance(batch, tvm.tirx.Var) and batch.name == "batch" and int(k) == 100


def test_unsupported_ops_all_named():
    model = mlp_model()
    model.graph.node.append(onnx.helper.make_node("Det", ["x"], ["d"]))
    model.graph.node.append(onnx.helper.make_node("FusedMatMul", ["x"], ["q"], domain="com.microsoft"))
    assert unsupported_ops(model) == ["Det", "com.microsoft.FusedMatMul"]
    with pytest.raises(QtvmError, match="unsupported ONNX ops: Det, com.microsoft.FusedMatMul"):
        import_onnx(model)


def test_load_errors(tmp_path):
    with pytest.raises(QtvmError, match="does not exist"):
        load_onnx(tmp_path / "nope.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"\x00\x01garbage")
    with pytest.raises(QtvmError, match="not a readable ONNX model"):
        load_onnx(tmp_path / "bad.onnx")
