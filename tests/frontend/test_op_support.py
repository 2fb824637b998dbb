"""Refusals before import: each rule names the node, the op and what to change, all at once."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from onnx import TensorProto, helper

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import validate
from qtvm.frontend.op_support import unsupported_features


def _model(nodes, inputs, outputs, opset=20, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _f(name, dims, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, dims)


@pytest.mark.parametrize("node,needle", [
    (helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="linear", name="rs"), "Resize 'rs': linear resize by non-integer"),
    (helper.make_node("Resize", ["x", "", "", "sz"], ["y"], antialias=1), "antialias=1"),
    (helper.make_node("TopK", ["u", "k"], ["y", "i"]), "TopK of uint64"),
    (helper.make_node("ReduceMax", ["b"], ["y"]), "reductions of bool"),
    (helper.make_node("BatchNormalization", ["x", "s", "s", "s", "s"], ["y"], training_mode=1), "training_mode=1"),
    (helper.make_node("Dropout", ["x"], ["y", "mask"]), "mask output"),
    (helper.make_node("IsInf", ["x"], ["y"], detect_negative=0), "detect_positive/detect_negative"),
    (helper.make_node("NonMaxSuppression", ["x", "x"], ["y"]), "NonMaxSuppression"),
    (helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2, mode="CRD"), "mode='CRD'"),
    (helper.make_node("ConvTranspose", ["x", "x"], ["y"], output_shape=[4, 4]), "output_shape"),
    (helper.make_node("Mod", ["x", "x"], ["y"], fmod=0), "floor-mod of float tensors"),
    (helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=0), "RMSNormalization"),
])
def test_rules(node, needle):
    inits = [onnx.numpy_helper.from_array(np.array([1, 1, 0.5, 0.5], np.float32), "sc"),
             onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.int64), "sz")]
    model = _model([node], [_f("x", [2, 3]), _f("s", [3]), _f("u", [4], TensorProto.UINT64),
                            _f("k", [1], TensorProto.INT64), _f("b", [4], TensorProto.BOOL)],
                   [_f("y", [2, 3])], opset=23, inits=inits)
    problems = unsupported_features(model)
    assert any(needle in p for p in problems), problems


def test_accepted_forms_are_not_refused():
    nodes = [helper.make_node("LayerNormalization", ["x", "s"], ["y"]),
             helper.make_node("Mod", ["i", "i"], ["m"], fmod=0),  # integer floor-mod is right
             helper.make_node("RMSNormalization", ["x", "s"], ["r"], axis=-1),
             helper.make_node("Dropout", ["x"], ["d"])]
    model = _model(nodes, [_f("x", [2, 3]), _f("s", [3]), _f("i", [4], TensorProto.INT64)],
                   [_f("y", [2, 3]), _f("m", [4], TensorProto.INT64), _f("r", [2, 3]), _f("d", [2, 3])], opset=23)
    assert unsupported_features(model) == []


def test_zero_size_tensors_named():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [_f("x", [0, 3])], [_f("y", [0, 3])])
    assert unsupported_features(model) == ["zero-size tensors (input 'x', output 'y')"]


@pytest.mark.parametrize("shape_from", ["constant", "initializer"])
def test_an_empty_shape_known_at_compile_time_is_not_refused(tmp_path, shape_from):
    """ConstantOfShape of an empty int64 shape is a scalar; onnxruntime's quantize_dynamic
    annotates that shape as a [0] value (BLOOM, OPT and T5 legacy exports were refused), and
    other tools store it as an initializer. A float zero-size value is still refused."""
    import onnxruntime as ort

    from qtvm import runtime
    from qtvm.pipeline import compile_model

    empty = onnx.numpy_helper.from_array(np.zeros(0, np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["fill"],
                              value=onnx.numpy_helper.from_array(np.array([2.5], np.float32))),
             helper.make_node("Add", ["x", "fill"], ["y"])]
    if shape_from == "constant":
        nodes.insert(0, helper.make_node("Constant", [], ["shape"], value=empty))
    model = _model(nodes, [_f("x", ["batch", 3])], [_f("y", ["batch", 3])], opset=17,
                   inits=[empty] if shape_from == "initializer" else [])
    model.graph.value_info.extend([_f("shape", [0], TensorProto.INT64), _f("fill", [])])
    assert unsupported_features(model) == []
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module = runtime.load(compile_model(path, tmp_path / "m.so", "host", "none").path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        x = {"x": np.arange(batch * 3, dtype=np.float32).reshape(batch, 3)}
        np.testing.assert_array_equal(module.run(x)["y"], session.run(None, x)[0])
    model.graph.value_info.append(_f("x_empty", [0, 3]))
    assert unsupported_features(model) == ["zero-size tensors (value 'x_empty')"]


def test_dtypes_and_sequences_named():
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT8E4M3FN, name="to_fp8"),
             helper.make_node("Identity", ["x"], ["y"])]
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)
    model = _model(nodes, [_f("x", [2]), seq], [_f("y", [2]), _f("c", [2], TensorProto.FLOAT8E4M3FN)])
    problems = unsupported_features(model)
    assert any(p.startswith("float8e4m3fn tensors (") and "Cast 'to_fp8'" in p for p in problems), problems
    assert any(p.startswith("sequence values (input 's')") for p in problems), problems


def test_validate_names_ops_and_features_in_one_line():
    nodes = [helper.make_node("Det", ["x"], ["d"]),
             helper.make_node("IsInf", ["x"], ["y"], detect_positive=0, name="inf")]
    model = _model(nodes, [_f("x", [2, 2])], [_f("y", [2, 2], TensorProto.BOOL), _f("d", [])])
    with pytest.raises(QtvmError) as err:
        validate(model)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("unsupported ONNX ops: Det; IsInf 'inf': detect_positive") and "re-export" in text
