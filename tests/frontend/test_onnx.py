from __future__ import annotations

import onnx
import pytest
import tvm

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import import_onnx, load_onnx, summarize, unsupported_ops
from tests.conftest import mlp_model, moe_model


def test_summary_splits_constant_and_computed_weights():
    s = summarize(mlp_model())
    assert s.weight_matmuls == ["fc1", "fc2"] and s.float_matmuls == ["gram"]
    assert s.inputs == [("x", "float32", ["batch", 100])]
    assert ("gram", "float32", ["batch", "batch"]) in s.outputs


def test_routed_matmuls_are_named_as_the_float_ones():
    """A mixture of experts' routed matmuls are among the computed-weight matmuls, under the
    same names, unnamed nodes too (by position): the compile output drops exactly those from
    "left in float" once packed (it listed unnamed ones as float)."""
    summary = summarize(moe_model())
    assert summary.routed_matmuls == ["MatMul_2", "MatMul_7"]
    assert set(summary.routed_matmuls) <= set(summary.float_matmuls)


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


def _tied_model():
    """A tied embedding/lm_head as dynamo exports it: Gather(W, ids) and MatMul(h, Transpose(W))."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["W", "ids"], ["h"], name="embed"),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="tie"),
             helper.make_node("MatMul", ["h", "Wt"], ["logits"], name="lm_head")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 40])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_tied_lm_head_counted_once(tmp_path):
    """Quantized, summarized as a weight matmul, not also 'left in float'; the reference
    dequantizes the lm_head's copy and keeps the embedding table float, as qtvm does."""
    import numpy as np
    import onnxruntime as ort

    from qtvm.formats import get_format
    from qtvm.pipeline import compile_model
    from qtvm.reference import dequantized_model
    from qtvm import runtime

    model = _tied_model()
    s = summarize(model)
    assert s.weight_matmuls == ["lm_head"] and s.float_matmuls == []
    path = tmp_path / "tied.onnx"
    onnx.save(model, str(path))
    result = compile_model(path, tmp_path / "tied.so", "host", "int4-g16")
    assert result.metadata["quantized_matmuls"] == 1
    assert not [n for n in result.notes if "left in float" in n]
    deq = dequantized_model(model, get_format("int4-g16"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in deq.graph.initializer}
    np.testing.assert_array_equal(inits["W"], onnx.numpy_helper.to_array(model.graph.initializer[0]))
    lm_head = next(n for n in deq.graph.node if n.name == "lm_head")
    assert lm_head.input[1] != "Wt" and not np.array_equal(inits[lm_head.input[1]], inits["W"].T)
    ids = np.array([[0, 5, 39], [7, 7, 1]], np.int64)
    got = runtime.load(result.path).run({"ids": ids})["logits"]
    want = ort.InferenceSession(deq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5


def test_control_flow_graph_still_imports():
    """A graph with If goes through TVM's own importer (its branches), as before."""
    from onnx import TensorProto, helper

    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n"])  # noqa: E731
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [out("t")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [out("e")])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []), out("x")], [out("y")])
    mod = import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10))
    assert [p.name for p in mod["main"].params] == ["c", "x"]


def test_weights_and_ops_inside_if_branches_are_seen():
    """A branch's weight matmul is a weight source (the quantizer packs it; the summary and the
    reference read the same set) whose graph is the branch, through an outer Transpose; an op
    TVM lacks inside a branch is named with the others, not found by TVM's importer later."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from qtvm.frontend.onnx import weight_sources

    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", 4])  # noqa: E731
    w = numpy_helper.from_array(np.ones((4, 8), np.float32), "w")
    then = helper.make_graph([helper.make_node("MatMul", ["x", "wt"], ["t"], name="branch_mm")], "then", [],
                             [out("t")])
    other = helper.make_graph([helper.make_node("Det", ["x"], ["e"])], "else", [], [out("e")])
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [out("y")], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    [src] = weight_sources(model)
    assert (src.name, src.transposed, src.node.name, src.graph.name) == ("w", True, "branch_mm", "then")
    assert summarize(model).weight_matmuls == ["branch_mm"]
    assert unsupported_ops(model) == ["Det"]


def test_checker_and_shape_inference_see_no_weight_data(monkeypatch):
    """onnx's checker and shape inference serialize the model they are given (a copy of
    every weight, and past 2 GiB an error: onnxruntime-genai's 3B int4 files); qtvm gives
    them a copy whose large initializers carry no data, and still catches a malformed graph."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from qtvm.frontend import rewrites
    from qtvm.frontend.onnx import validate, weightless_copy

    w = numpy_helper.from_array(np.ones((512, 256), np.float32), "w")  # 512 KiB
    ln_scale = numpy_helper.from_array(np.ones(256, np.float32), "g")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("LayerNormalization", ["h", "g"], ["y"], name="ln", axis=-1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 256])], [w, ln_scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    seen = []
    real_check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (seen.append(m.ByteSize()), real_check(m))[1])
    validate(model)
    assert seen and max(seen) < 64 * 1024  # the 512 KiB weight did not go to the checker
    assert model.graph.initializer[0].raw_data == w.raw_data  # the model itself untouched
    light = weightless_copy(model)
    assert [list(t.dims) for t in light.graph.initializer] == [[512, 256], [256]] and light.ByteSize() < 64 * 1024
    ranks, types = rewrites._ranks_and_types(model)  # inferred on the weightless copy
    assert ranks["h"] == 2 and types["h"] == TensorProto.FLOAT and ranks["w"] == 2
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[1].input[0] = "nowhere"
    with pytest.raises(QtvmError, match="fails the ONNX checker"):
        validate(broken)


def test_lazy_load_leaves_external_weights_in_their_file(tmp_path):
    """``load_onnx(lazy=True)`` (the compile's): external initializers stay in their file until
    read one at a time (``tensor_array``); the compiled model computes x @ w as the eager one."""
    import numpy as np

    from qtvm.frontend.onnx import tensor_array
    from qtvm.pipeline import compile_model
    from qtvm.runtime import load
    from tests.conftest import matmul_model

    model, w = matmul_model(96, 80)
    onnx.save(model, str(tmp_path / "mm.onnx"), save_as_external_data=True, location="mm.onnx.data",
              size_threshold=0)
    lazy = load_onnx(tmp_path / "mm.onnx", lazy=True)
    t = lazy.graph.initializer[0]
    assert t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data
    assert any(e.key == "location" and e.value == str((tmp_path / "mm.onnx.data").resolve()) for e in t.external_data)
    np.testing.assert_array_equal(tensor_array(t), w)
    assert not t.raw_data  # reading did not load it into the model
    out = compile_model(tmp_path / "mm.onnx", tmp_path / "mm.so", quant="none").path
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_allclose(load(out).run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    (tmp_path / "mm.onnx.data").rename(tmp_path / "elsewhere.data")
    with pytest.raises(QtvmError, match="external weight files are missing: mm.onnx.data"):
        load_onnx(tmp_path / "mm.onnx", lazy=True)


@pytest.mark.parametrize("quant", ["none", "int4-g128"])
def test_external_weights_are_mapped_where_aligned_and_copied_elsewhere(tmp_path, quant):
    """The import views a 64-byte-aligned external weight in its file (pages the kernel may
    reclaim, not a copy the compile holds) and copies one it cannot view; either way the
    artefact computes what the model with its weights inline does, bit for bit."""
    import mmap

    import numpy as np

    from qtvm.frontend.importer import Importer
    from qtvm.pipeline import compile_model
    from qtvm.runtime import load
    from tests.conftest import mlp_model, save_with_external_data

    model = mlp_model()
    onnx.save(model, str(tmp_path / "inline.onnx"))
    path = tmp_path / "ext.onnx"
    save_with_external_data(model, path, {"w1": 64, "b1": 4, "w2": 8})  # w1 at 64; b1, w2 unaligned
    lazy = load_onnx(path, lazy=True)
    arrays = {t.name: Importer(lazy).mapped.array(t) for t in lazy.graph.initializer}
    assert arrays["b1"] is None and arrays["w2"] is None
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    np.testing.assert_array_equal(arrays["w1"], onnx.numpy_helper.to_array(w1))
    base = arrays["w1"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)  # the file's pages, not a copy
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    outs = []
    for name in ("inline", "ext"):
        artefact = compile_model(tmp_path / f"{name}.onnx", tmp_path / f"{name}.so", quant=quant).path
        outs.append(load(artefact).run({"x": x}))
    for key in outs[0]:
        np.testing.assert_array_equal(outs[1][key], outs[0][key])


def test_silero_vads_lstm_inside_its_if_branches_is_named():
    """silero-vad's If variants hold an LSTM in their branches: named up front (TVM's importer
    failed on them later with "Reshape expects the input tensor to have known shape")."""
    from pathlib import Path

    silero = pytest.importorskip("silero_vad", reason="silero-vad is installed by .ci/run")
    for name in ("silero_vad.onnx", "silero_vad_16k_op15.onnx", "silero_vad_half.onnx"):
        assert unsupported_ops(onnx.load(Path(silero.__file__).parent / "data" / name)) == ["LSTM"], name


def test_nodes_out_of_order_are_sorted_on_load(tmp_path):
    """onnxruntime's float16 converter (keep_io_types) appends the inputs' Casts after the nodes
    reading them; onnxruntime runs that file, ONNX's checker refused it ("must be topologically
    sorted"). load_onnx puts each node after what it reads, in If branches too and counting the
    outer names a branch reads; the first ready node in the file goes first. The converted model
    compiles and matches onnxruntime; a graph no order fixes is left for the checker to name."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from qtvm import runtime
    from qtvm.frontend.onnx import validate
    from qtvm.pipeline import compile_model

    out = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])  # noqa: E731
    then = helper.make_graph([helper.make_node("Neg", ["u"], ["t"], name="b2"),
                              helper.make_node("Add", ["r", "x"], ["u"], name="b1")], "then", [], [out("t")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="e1")], "else", [], [out("e")])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
             helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Abs", ["x"], ["z"], name="abs")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []), out("x")],
                              [out("y"), out("z")])
    path = tmp_path / "shuffled.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    model = load_onnx(path)
    assert [n.name for n in model.graph.node] == ["relu", "if", "abs"]
    branch = next(a.g for a in model.graph.node[1].attribute if a.name == "then_branch")
    assert [n.name for n in branch.node] == ["b1", "b2"]
    validate(model)
    feeds = {"c": np.array(True), "x": np.array([-1.5, 2.0], np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    assert [a.tolist() for a in run(model)] == [[1.5, -4.0], [1.5, 2.0]]

    half = tmp_path / "mlp16.onnx"
    onnx.save(convert_float_to_float16(mlp_model(), keep_io_types=True), str(half))
    module = runtime.load(compile_model(half, tmp_path / "mlp16.so", "host", "none").path)
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    got = module.run({"x": x})
    want = ort.InferenceSession(str(half), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(got["y"] - want[0]).max() <= 4 * 2 ** -10 * np.abs(want[0]).max()

    graph.node.append(helper.make_node("Sin", ["missing"], ["w"], name="sin"))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    broken = load_onnx(path)
    assert [n.name for n in broken.graph.node] == ["if", "relu", "abs", "sin"]  # as stored
    with pytest.raises(QtvmError, match="fails the ONNX checker"):
        validate(broken)
