"""Quantized ONNX in: compiled artefacts against onnxruntime running the same quantized model.

onnxruntime dequantizes exactly, so qtvm (fp32 activations, packed kernels) must agree to
float rounding, at every binding of the symbolic batch (1 and 3 take the GEMV, 64 and 67
the prefill kernel).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtvm.errors import QtvmError
from qtvm.frontend.quantized import lower_quantized
from tests.conftest import mlp_model
from tests.quantized_models import (OPSETS, blocked_dq_layer, branchy_model, matmul_nbits_layer, model_of, ort_dynamic,
                                    ort_matmul_nbits, ort_static_qdq)

BATCHES = (1, 3, 64, 67)
TARGET = "llvm -mcpu=znver3"  # AVX2: runs on every supported x86 host


def compile_and_load(model: onnx.ModelProto, tmp_path, name: str = "m", **kw):
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    result = compile_model(path, tmp_path / f"{name}.so", kw.pop("target", TARGET), kw.pop("quant", "none"), **kw)
    return runtime.load(result.path), result


def ort_session(model: onnx.ModelProto, optimized: bool = True):
    options = ort.SessionOptions()
    # onnxruntime fuses DequantizeLinear(blocked) -> MatMul into MatMulNBits with int8 activations
    # (accuracy level 4) unless told otherwise: keep its fp32 activations, as qtvm's default.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if not optimized:  # the graph's literal semantics (no QDQ fusion)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def rel(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def assert_matches_ort(module, session, k: int, tol: float = 2e-6, shape=lambda b, k: (b, k), name: str = "x"):
    for b in BATCHES:
        x = np.random.default_rng(b).standard_normal(shape(b, k)).astype(np.float32)
        got = module.run({name: x})
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, {name: x})))
        for out, w in want.items():
            assert got[out].shape == w.shape
            assert rel(got[out], w) < tol, (b, out, rel(got[out], w))


# -- hand-built MatMulNBits: every variant in one model, awkward K (70: no multiple of 16/32/128) and N ----
def nbits_layers(k=70, n=37):
    specs = [  # name, bits, block, zero points, g_idx, bias, accuracy_level
        ("b4_g16_none", 4, 16, "none", False, False, None),
        ("b4_g32_packed", 4, 32, "packed", False, True, 1),  # 4 would make onnxruntime round x to int8
        ("b4_g128_float", 4, 128, "float", False, False, None),
        ("b4_g32_gidx_float", 4, 32, "float", True, False, None),
        ("b4_g16_gidx_none", 4, 16, "none", True, True, None),
        ("b8_g32_packed", 8, 32, "packed", False, False, None),
        ("b8_g64_none", 8, 64, "none", False, False, None),
        ("b2_g16_packed", 2, 16, "packed", False, False, None),
    ]
    return [matmul_nbits_layer(name, "x", name, k, n, bits, block, zp, g, bias, acc, seed=i)
            for i, (name, bits, block, zp, g, bias, acc) in enumerate(specs)]


@pytest.fixture(scope="module")
def nbits_artefact(tmp_path_factory):
    layers = nbits_layers()
    model = model_of(layers, [("x", ["batch", 70])], [(node.name, ["batch", 37]) for node, _, _ in layers])
    module, result = compile_and_load(model, tmp_path_factory.mktemp("nbits"))
    return model, layers, module, result


def test_matmul_nbits_matches_onnxruntime(nbits_artefact):
    model, layers, module, result = nbits_artefact
    assert result.metadata["prequantized_matmuls"] == len(layers) == result.metadata["quantized_matmuls"]
    assert "MatMulNBits int4-g16-qz x2" in result.metadata["prequantized"]
    assert "MatMulNBits int8-g64-qz x1" in result.metadata["prequantized"]
    assert any("accuracy_level=1 noted" in note for note in result.notes)
    assert_matches_ort(module, ort_session(model), 70)


def test_matmul_nbits_weights_in_an_external_file_are_read_through_its_pages(tmp_path):
    """External codes, scales and zero points are views of the file until re-laid (the stored
    bytes never become memory the compile holds); the artefact matches onnxruntime."""
    import mmap

    from qtvm import runtime
    from qtvm.frontend.onnx import load_onnx
    from qtvm.frontend.quantized import _Lowering
    from qtvm.pipeline import compile_model
    from tests.conftest import save_with_external_data

    layers = nbits_layers()
    model = model_of(layers, [("x", ["batch", 70])], [(node.name, ["batch", 37]) for node, _, _ in layers])
    save_with_external_data(model, tmp_path / "ext.onnx")
    lowering = _Lowering(load_onnx(tmp_path / "ext.onnx", lazy=True), in_place=True)
    codes = lowering.array("b4_g32_packed_B")
    assert isinstance(codes.base, np.ndarray) and isinstance(codes.base.base, memoryview)
    assert isinstance(codes.base.base.obj, mmap.mmap)
    result = compile_model(tmp_path / "ext.onnx", tmp_path / "ext.so", TARGET, "none")
    assert result.metadata["prequantized_matmuls"] == len(layers)
    assert_matches_ort(runtime.load(result.path), ort.InferenceSession(
        str(tmp_path / "ext.onnx"), providers=["CPUExecutionProvider"]), 70)


def test_matmul_nbits_equals_the_operator_definition(nbits_artefact):
    """The same layers against the weights computed from the codes by the spec (float64)."""
    model, layers, module, _ = nbits_artefact
    x = np.random.default_rng(5).standard_normal((67, 70))
    got = module.run({"x": x.astype(np.float32)})
    for node, inits, w in layers:
        want = x @ w
        if len(node.input) > 5:  # bias
            want = want + onnx.numpy_helper.to_array(next(t for t in inits if t.name == node.input[5]))
        assert rel(got[node.name], want) < 2e-6, node.name


def test_g_idx_with_packed_zero_points_follows_the_spec(tmp_path):
    """onnxruntime 1.32 ignores uint8 zero points when g_idx is given; qtvm follows the definition."""
    layer = matmul_nbits_layer("act", "x", "y", 96, 33, 4, 32, "packed", g_idx=True, seed=3)
    model = model_of([layer], [("x", ["batch", 96])], [("y", ["batch", 33])])
    module, _ = compile_and_load(model, tmp_path)
    for b in (1, 64):
        x = np.random.default_rng(b).standard_normal((b, 96))
        assert rel(module.run({"x": x.astype(np.float32)})["y"], x @ layer[2]) < 2e-6


def test_three_d_activations_and_seq_dims(tmp_path):
    layer = matmul_nbits_layer("l", "x", "y", 80, 45, 4, 32, "packed", seed=1)
    model = model_of([layer], [("x", ["batch", "seq", 80])], [("y", ["batch", "seq", 45])])
    module, _ = compile_and_load(model, tmp_path)
    session = ort_session(model)
    for b, s in [(1, 1), (3, 1), (1, 64), (2, 33)]:
        x = np.random.default_rng(s).standard_normal((b, s, 80)).astype(np.float32)
        assert rel(module.run({"x": x})["y"], session.run(None, {"x": x})[0]) < 2e-6


def test_int8_activations_on_matmul_nbits(tmp_path):
    """--act int8 applies to the model's own quantized weights too: error visible and bounded."""
    layer = matmul_nbits_layer("l", "x", "y", 256, 40, 4, 32, "packed", seed=2)
    model = model_of([layer], [("x", ["batch", 256])], [("y", ["batch", 40])])
    module, result = compile_and_load(model, tmp_path, activations="int8")
    assert result.metadata["activations"] == "int8"
    assert not [n for n in result.notes if "int8 activations not available" in n]
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    err = rel(module.run({"x": x})["y"], ort_session(model).run(None, {"x": x})[0])
    assert 1e-5 < err < 0.05


# -- blocked DequantizeLinear (opset 21) -------------------------------------------------------------
def test_blocked_dequantize_linear_int4_uint4(tmp_path):
    layers = [blocked_dq_layer("s4_g32", "x", "s4_g32", 70, 37, 32, signed=True, seed=0),
              blocked_dq_layer("u4_g16_nozp", "x", "u4_g16_nozp", 70, 37, 16, signed=False, zero_points=False, seed=1),
              blocked_dq_layer("s4_g64_gemm", "x", "s4_g64_gemm", 70, 37, 64, signed=True, gemm=True, seed=2),
              blocked_dq_layer("u4_g48", "x", "u4_g48", 70, 37, 48, signed=False, seed=3),  # no preset has g48
              blocked_dq_layer("s8_g32", "x", "s8_g32", 70, 37, 32, signed=True, bits=8, seed=4)]
    model = model_of(layers, [("x", ["batch", 70])], [(nodes[-1].name, ["batch", 37]) for nodes, _, _ in layers],
                     opsets=OPSETS[:1])
    module, result = compile_and_load(model, tmp_path)
    assert result.metadata["prequantized_matmuls"] == 5
    assert "DequantizeLinear int4-g48-qz x1" in result.metadata["prequantized"]
    assert not any("left in float" in n for n in result.notes), result.notes
    assert_matches_ort(module, ort_session(model), 70)
    assert_matches_ort(module, ort_session(model, optimized=False), 70)
    x = np.random.default_rng(9).standard_normal((3, 70))
    got = module.run({"x": x.astype(np.float32)})
    for nodes, _, w in layers:
        assert rel(got[nodes[-1].name], x @ w) < 2e-6


# -- onnxruntime's quantizers -----------------------------------------------------------------------
@pytest.mark.parametrize("bits,block,symmetric,qdq", [
    (4, 16, False, False), (4, 32, True, False), (4, 128, False, False), (8, 32, False, False),
    (4, 32, False, True), (4, 16, True, True)], ids=str)
def test_matmul_nbits_quantizer_models(tmp_path, bits, block, symmetric, qdq):
    model = ort_matmul_nbits(mlp_model(), bits, block, symmetric, qdq)
    kinds = {n.op_type for n in model.graph.node}
    assert ("DequantizeLinear" if qdq else "MatMulNBits") in kinds
    module, result = compile_and_load(model, tmp_path)
    assert result.metadata["prequantized_matmuls"] == 1  # onnxruntime's quantizer skips the Gemm
    assert_matches_ort(module, ort_session(model), 100)


@pytest.mark.parametrize("per_channel", [False, True])
def test_dynamic_quantization_runs_on_packed_kernels(tmp_path, per_channel):
    """quantize_dynamic's MatMulInteger (Gemm and MatMul): int8 codes on the fp32 kernels."""
    model = ort_dynamic(mlp_model(), tmp_path, per_channel)
    module, result = compile_and_load(model, tmp_path)
    assert result.metadata["prequantized"] == "MatMulInteger int8-col-f16 x2"  # unit scales: float16 holds them
    assert_matches_ort(module, ort_session(model), 100)
    assert_matches_ort(module, ort_session(model, optimized=False), 100)


def test_static_qdq_int8_runs_on_packed_kernels(tmp_path):
    """quantize_static (QDQ, per-channel): the weight DequantizeLinear of the Gemm (transB, scales
    along N) and of the MatMul become int8 per-column kernels; activations keep their Q/DQ."""
    model = ort_static_qdq(mlp_model(), tmp_path)
    module, result = compile_and_load(model, tmp_path)
    assert result.metadata["prequantized"] == "DequantizeLinear int8-col-qz x2"
    assert_matches_ort(module, ort_session(model, optimized=False), 100)
    assert_matches_ort(module, ort_session(model), 100)


def test_per_row_scales_stay_float_and_say_why(tmp_path):
    """Per-axis DequantizeLinear with scales along K cannot be grouped along K: TVM runs it, in float."""
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (40, 24)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, 40).astype(np.float32)
    nodes = [onnx.helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq_rows", axis=0),
             onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inits = [onnx.numpy_helper.from_array(q, "q"), onnx.numpy_helper.from_array(scale, "s")]
    model = model_of([(nodes, inits, None)], [("x", ["batch", 40])], [("y", ["batch", 24])], opsets=OPSETS[:1])
    module, result = compile_and_load(model, tmp_path, quant="int4-g32")
    assert any("stays in float: DequantizeLinear 'dq_rows'" in n and "along K" in n for n in result.notes), result.notes
    assert result.metadata["quantized_matmuls"] == 0
    assert_matches_ort(module, ort_session(model), 40)


def test_preset_still_quantizes_the_float_weights(tmp_path):
    """--quant applies to the float Gemm the MatMulNBits quantizer skipped."""
    model = ort_matmul_nbits(mlp_model(), 4, 32, False)
    _, result = compile_and_load(model, tmp_path, quant="int4-g32")
    assert result.metadata["quantized_matmuls"] == 2 and result.metadata["prequantized_matmuls"] == 1


# -- bad input: one error naming the problem ----------------------------------------------------------
def test_unsupported_bits_and_blocks_are_named():
    for bits, block, needle in [(3, 32, "bits=3"), (4, 8, "block_size=8"), (4, 24, "block_size=24")]:
        node, inits, _ = matmul_nbits_layer("bad", "x", "y", 64, 8, 4, 32)
        for a in node.attribute:
            if a.name == "bits":
                a.i = bits
            if a.name == "block_size":
                a.i = block
        model = model_of([(node, inits, None)], [("x", ["batch", 64])], [("y", ["batch", 8])])
        with pytest.raises(QtvmError, match=f"MatMulNBits 'bad' has {needle}"):
            lower_quantized(model)


def test_blocked_dq_along_the_output_axis_is_an_error():
    nodes, inits, _ = blocked_dq_layer("l", "x", "y", 64, 32, 16, signed=True)
    nodes[0].attribute[0].i = 1  # axis 1 on a [K, N] MatMul weight: blocks along N
    for t in inits[1:]:
        t.CopyFrom(onnx.numpy_helper.from_array(np.ones((64, 2), np.float32), t.name) if t.name.endswith("scale")
                   else onnx.helper.make_tensor(t.name, onnx.TensorProto.INT4, (64, 2), [0] * 128))
    model = model_of([(nodes, inits, None)], [("x", ["batch", 64])], [("y", ["batch", 32])], opsets=OPSETS[:1])
    with pytest.raises(QtvmError, match="blocked DequantizeLinear 'l_dq' cannot run on qtvm's kernels: its blocks "
                                        "run along the output axis"):
        lower_quantized(model)


def test_blocked_dq_feeding_something_else_is_an_error():
    nodes, inits, _ = blocked_dq_layer("l", "x", "y", 64, 32, 16, signed=True)
    nodes.append(onnx.helper.make_node("Relu", ["l_w"], ["r"], name="relu_of_weight"))
    model = model_of([(nodes, inits, None)], [("x", ["batch", 64])], [("y", ["batch", 32]), ("r", [64, 32])],
                     opsets=OPSETS[:1])
    with pytest.raises(QtvmError, match="it feeds Relu 'relu_of_weight'"):
        lower_quantized(model)


def test_lowering_leaves_no_codes_behind():
    """The lowered graph holds markers, not the codes (nor any float copy of the weights)."""
    layers = nbits_layers()
    model = model_of(layers, [("x", ["batch", 70])], [(node.name, ["batch", 37]) for node, _, _ in layers])
    from qtvm.frontend.onnx import unsupported_ops

    assert unsupported_ops(model) == []  # validate() lets MatMulNBits through to the lowering
    lowered = lower_quantized(model)
    assert not lowered.model.graph.initializer or all(t.name.endswith("_bias") for t in lowered.model.graph.initializer)
    assert [o.domain for o in lowered.model.opset_import] == [""]
    assert {n.op_type for n in lowered.model.graph.node} <= {"MatMul", "Add"}
    onnx.checker.check_model(lowered.model)


def test_weights_read_inside_subgraphs_are_left_alone():
    """A dequantized weight an If branch also reads cannot be replaced: it stays in float, said so."""
    q = onnx.numpy_helper.from_array(np.ones((16, 8), np.int8), "q")
    s = onnx.numpy_helper.from_array(np.full(8, 0.5, np.float32), "s")
    branch = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["w"], ["o"])], "b", [],
                                    [onnx.helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [16, 8])])
    nodes = [onnx.helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq", axis=1),
             onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             onnx.helper.make_node("If", ["c"], ["z"], name="branchy", then_branch=branch, else_branch=branch)]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 16]),
                     onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 8]),
         onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [16, 8])], [q, s])
    model = onnx.helper.make_model(graph, opset_imports=OPSETS[:1], ir_version=10)
    lowered = lower_quantized(model)
    assert not lowered.weights
    assert any("stays in float: DequantizeLinear 'dq' (it feeds If 'branchy'" in n for n in lowered.notes)
    assert {t.name for t in lowered.model.graph.initializer} == {"q", "s"}


def test_lowering_in_place_or_on_a_copy():
    """The compiler lowers the model it loaded in place (no second copy of the weights); the
    default leaves the caller's model as it was."""
    layers = nbits_layers()
    model = model_of(layers, [("x", ["batch", 70])], [(node.name, ["batch", 37]) for node, _, _ in layers])
    before = model.SerializeToString()
    copied = lower_quantized(model)
    assert copied.model is not model and model.SerializeToString() == before
    lowered = lower_quantized(model, in_place=True)
    assert lowered.model is model and not any(n.op_type == "MatMulNBits" for n in model.graph.node)
    assert sorted(lowered.weights) == sorted(copied.weights)


def test_repacking_holds_the_packed_weights_about_once():
    """Python-side peak memory of lowering a MatMulNBits model and re-laying every weight for the
    kernels, against its packed bytes: the codes stay packed until each layer is re-laid, in whole
    words (the old path unpacked every weight at once, a byte a code, and widened each layer to
    64-bit codes: ~10x the model's packed bytes)."""
    import tracemalloc

    k, n = 2048, 3072
    layers = [matmul_nbits_layer(f"l{i}", "x" if i == 0 else f"y{i - 1}", f"y{i}", *((k, n) if i % 2 == 0 else (n, k)),
                                 4, 128, seed=i) for i in range(4)]
    model = model_of(layers, [("x", ["batch", k])], [("y3", ["batch", k])])
    packed = sum(len(t.raw_data) for t in model.graph.initializer if t.name.endswith("_B"))
    del layers
    tracemalloc.start()
    try:
        lowered = lower_quantized(model, in_place=True)
        kernels = [weight.for_matmul()[0] for weight in lowered.weights.values()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(qt.arrays["qweight"].nbytes for qt in kernels) == packed  # 4-bit words: the file's bytes
    assert peak < 3 * packed, (peak / packed, packed)


def test_accuracy_levels_noted_once_a_level():
    """A builder's model sets accuracy_level on every MatMulNBits (111 in a 1B LLaMA): one note a level."""
    layers = [matmul_nbits_layer(f"l{i}", "x", f"y{i}", 64, 16, 4, 32, accuracy_level=4 if i else 1, seed=i)
              for i in range(4)]
    model = model_of(layers, [("x", ["batch", 64])], [(f"y{i}", ["batch", 16]) for i in range(4)])
    notes = [n for n in lower_quantized(model).notes if "accuracy_level" in n]
    assert notes == ["MatMulNBits 'l0': accuracy_level=1 noted (onnxruntime's activation precision); qtvm's "
                     "activations follow --act",
                     "3 MatMulNBits ('l1', ...): accuracy_level=4 noted (onnxruntime's activation "
                     "precision; 4 asks for int8, as --act int8 does here); qtvm's activations follow --act"]


# -- quantized weights inside If branches (onnxruntime's quantizer quantizes a merged decoder's branches) --
def test_quantized_weights_inside_if_branches_run_on_packed_kernels(tmp_path):
    """TVM's importer has no MatMulNBits and ignores block_size: a branch's quantized weights were
    left to it ("Operator MatMulNBits not implemented"); now each branch is lowered in its own
    scope, its markers read from the outer graph, and its unused codes dropped."""
    from qtvm.frontend.onnx import graph_scopes

    model, w_top, w_then, w_else = branchy_model()
    lowered = lower_quantized(model)
    scopes = [g for g, _ in graph_scopes(lowered.model.graph)]
    assert len(scopes) == 3 and len(lowered.weights) == 3
    assert not {n.op_type for g in scopes for n in g.node} & {"MatMulNBits", "DequantizeLinear"}
    assert not [t.name for g in scopes[1:] for t in g.initializer]  # the branches' codes went with their nodes
    assert all(o.domain != "com.microsoft" for o in lowered.model.opset_import)
    onnx.checker.check_model(lowered.model)
    module, result = compile_and_load(model, tmp_path)
    assert result.metadata["prequantized_matmuls"] == 3
    assert not any("left in float" in n for n in result.notes), result.notes
    for flag, w in ((True, w_then), (False, w_else)):
        for b in (1, 3):
            x = np.random.default_rng(b).standard_normal((b, 70))
            got = module.run({"x": x.astype(np.float32), "c": np.array(flag)})["y"]
            assert rel(got, x @ w_top @ w) < 2e-6, (flag, b)
