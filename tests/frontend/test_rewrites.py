"""ONNX-level repairs: the rewritten graph computes what onnxruntime computes on the original."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.frontend.rewrites import repair


def _layer_norm_model(axis: int, dtype, stash: int, with_bias: bool, opset: int):
    inputs = ["x", "scale"] + (["bias"] if with_bias else [])
    node = helper.make_node("LayerNormalization", inputs, ["y", "mean", "inv"], axis=axis, epsilon=1e-3,
                            stash_type=stash)
    rng = np.random.default_rng(0)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 5)[axis % 3 - 1:] if axis % 3 else (3, 4, 5))
                                     .astype(np_dtype), "scale")]
    if with_bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(inits[0].dims).astype(np_dtype), "bias"))
    stat = TensorProto.FLOAT if stash == 1 else dtype
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", dtype, [3, 4, 5])],
                              [helper.make_tensor_value_info("y", dtype, None),
                               helper.make_tensor_value_info("mean", stat, None),
                               helper.make_tensor_value_info("inv", stat, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("axis", [-1, 1, 0, -2])
@pytest.mark.parametrize("dtype,stash", [(TensorProto.FLOAT, 1), (TensorProto.FLOAT16, 1)])
@pytest.mark.parametrize("opset", [17, 18])
def test_layer_norm_with_statistics(axis, dtype, stash, opset):
    model = _layer_norm_model(axis, dtype, stash, with_bias=axis != 0, opset=opset)
    fixed = repair(model)
    assert all(n.op_type != "LayerNormalization" for n in fixed.graph.node)
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    got = ort.InferenceSession(fixed.SerializeToString()).run(None, {"x": x})
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-3 if dtype == TensorProto.FLOAT16 else 1e-5, atol=1e-3 if dtype == TensorProto.FLOAT16 else 1e-6)


def test_layer_norm_without_statistics_is_left_alone():
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y"])
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert repair(model) is model


@pytest.mark.parametrize("op", ["Softplus", "Mish"])
def test_softplus_and_mish_keep_their_digits(op):
    """Against float64 at x where exp(x) underflows 1 + exp(x): relative error a few ulps."""
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    fixed = repair(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert all(n.op_type != op for n in fixed.graph.node)
    x = np.concatenate([np.linspace(-80, 80, 20001), [-9.979998, -30.0, 0.0, 1e-8, -1e-8]]).astype(np.float32)
    got = ort.InferenceSession(fixed.SerializeToString()).run(None, {"x": x})[0].astype(np.float64)
    x64 = x.astype(np.float64)
    sp = np.logaddexp(0.0, x64)
    want = sp if op == "Softplus" else x64 * np.tanh(sp)
    nz = np.abs(want) > 1e-37
    assert (np.abs(got - want)[nz] / np.abs(want[nz])).max() < 8 * 2.0 ** -24
