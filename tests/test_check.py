"""`qtvm check`: the mean-pooling graph that the old generic rule miscompiled, a 1x1 Conv +
Sigmoid, and a deliberate mismatch, through the real CLI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.check import check, default_bindings, format_report, parse_shape, random_feeds, tied_dims
from qtvm.errors import QtvmError


def _pool_model(seed: int) -> onnx.ModelProto:
    """x[batch, seq, 200] -> ReduceMean over seq (keepdims 0) -> Gemm: a sentence embedding head."""
    w = np.random.default_rng(seed).standard_normal((16, 200)).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Gemm", ["m", "w"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 200])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_model() -> onnx.ModelProto:
    w = np.random.default_rng(1).standard_normal((8, 8, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Sigmoid", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 4])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("make,quant", [(_pool_model, "none"), (_pool_model, "int4-g32"), (_conv_model, "none")])
def test_right_artefacts_pass(tmp_path, make, quant):
    model = tmp_path / "m.onnx"
    onnx.save(make(0) if make is _pool_model else make(), str(model))
    art = tmp_path / "m.so"
    assert _cli("compile", model, "--quant", quant, "-o", art).returncode == 0
    run = _cli("check", model, art, "--shape", "batch=1,seq=1", "--shape", "batch=2,seq=67",
               "--shape", "batch=3,seq=64")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK:" in run.stdout and run.stderr == ""
    assert run.stdout.count("\n") >= 4  # header, one row per binding, footer


def test_mismatch_exits_1(tmp_path):
    """An artefact checked against a model with other weights: the own error is large."""
    a, b, art = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "a.so"
    onnx.save(_pool_model(0), str(a))
    onnx.save(_pool_model(1), str(b))
    assert _cli("compile", a, "--quant", "none", "-o", art).returncode == 0
    run = _cli("check", b, art)
    assert run.returncode == 1 and "MISMATCH" in run.stdout and "above tolerance" in run.stdout


def test_bad_input_is_one_line(tmp_path):
    run = _cli("check", tmp_path / "missing.onnx", tmp_path / "missing.so")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "does not exist" in run.stderr
    with pytest.raises(QtvmError, match="name=size"):
        parse_shape("batch:2")


def test_default_bindings_differ_per_dim():
    """Dims differ in each binding, and one binding has every dim 1 (M = 1: the decode kernels)."""
    assert default_bindings(["batch", "seq"]) == [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 3},
                                                  {"batch": 3, "seq": 17}, {"batch": 17, "seq": 1}]
    assert default_bindings(["seq"]) == [{"seq": 1}, {"seq": 3}, {"seq": 17}]


def test_given_inputs(tmp_path, tiny_llama_int4, tiny_llama_path):
    report = check(tiny_llama_path, tiny_llama_int4[0], feeds={"input_ids": np.array([[1, 2, 3]], np.int64)})
    assert report.ok and len(report.rows) == 1 and report.rows[0].shape == (1, 3, 512)
    assert 1e-2 < report.rows[0].err_vs_float and report.rows[0].err_own < 1e-5


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_kv_cache_export_dims_follow_from_symbols(hf_model, hf_compiled, exporter):
    """A KV-cache export's mask is [batch, past + seq]: its size follows from the symbols
    (qtvm check binds batch, seq and past). The dynamo exporter names the mask's length a
    symbol of its own (``s53``): the artefact's kv_step ties it to past + seq, and a binding
    that sets it apart is refused by onnxruntime (one line)."""
    from qtvm.runtime import load

    result = hf_compiled("llama", exporter, "none", kv=True)
    report = check(hf_model("llama", exporter, kv=True), result.path)
    assert report.ok
    plain = {(("batch", 1), ("past", 1), ("seq", 1)), (("batch", 1), ("past", 17), ("seq", 3)),
             (("batch", 3), ("past", 1), ("seq", 17)), (("batch", 17), ("past", 3), ("seq", 1))}
    tied = tied_dims(load(result.path).metadata)
    if exporter == "legacy":
        assert tied == {} and {tuple(sorted(r.binding.items())) for r in report.rows} == plain
        return
    [(mask_len, expr)] = tied.items()
    assert expr == "past + seq" and mask_len not in ("past", "seq")
    assert {tuple(sorted((k, v) for k, v in r.binding.items() if k != mask_len)) for r in report.rows} == plain
    assert all(r.binding[mask_len] == r.binding["past"] + r.binding["seq"] for r in report.rows)
    with pytest.raises(QtvmError, match=f"cannot run the model at .*{mask_len}=9"):
        check(hf_model("llama", exporter, kv=True), result.path, bindings=[{"batch": 2, "seq": 3, "past": 17,
                                                                             mask_len: 9}])


# -- --act int8 artefacts: a reference rounded as the kernels round ----------------------------
def _one_matmul_model(k: int = 1000, n: int = 70, opset: int = 17, trans_a: bool = False) -> onnx.ModelProto:
    """x[batch, seq, K] @ W: K = 1000 pads to the 32-value blocks and to 128-row groups."""
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    if trans_a:
        node = helper.make_node("Gemm", ["x", "w"], ["y"], transA=1)
        x, y = helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, "m"]), ["m", n]
    else:
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        x, y = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k]), ["batch", "seq", n]
    graph = helper.make_graph([node], "one", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


# (format, rows whose activations its kernels round): every row (the byte-plane kernels of
# every 2/3/4-bit and E0M4 format round alike, per 32 values), or BCQ's decode GEMV's only
# (M <= 2, per group); mixed-2-4-16 rounds the gathered rows of its 4-bit part, not its 2-bit
# ones. (Measured with int3-g128, int2-g64 and e0m4-g32 too: <= 3.4e-7.)
INT8_FORMATS = [("int4-g128", "all"), ("bcq3-g128", "decode"), ("mixed-2-4-16", "all")]
BINDINGS = [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 2}, {"batch": 3, "seq": 5}]


@pytest.mark.parametrize("quant,rounds", INT8_FORMATS)
def test_int8_reference_rounds_as_the_kernels(tmp_path, quant, rounds):
    """One matmul has no upstream rounding to move: against the reference that rounds its
    input as the kernels do, the artefact is float-exact at every M; against the
    fp32-activation reference it is not, where its kernels round (so the rounding is modelled,
    not absent)."""
    from qtvm.check import INT8_ACT_FLOOR, _session
    from qtvm.formats import get_format
    from qtvm.reference import dequantized_model
    from qtvm.runtime import load

    model = tmp_path / "one.onnx"
    onnx.save(_one_matmul_model(), str(model))
    art = tmp_path / "one.so"
    assert _cli("compile", model, "--quant", quant, "--act", "int8", "-o", art).returncode == 0
    report = check(model, art, bindings=BINDINGS)
    assert "rounded to int8 as the kernels round them" in report.reference
    assert [r.err_own < 1e-6 for r in report.rows] == [True] * 3, [r.err_own for r in report.rows]
    assert report.ok and report.tolerance >= INT8_ACT_FLOOR

    plain = _session(dequantized_model(onnx.load(str(model)), get_format(quant)))
    rng = np.random.default_rng(0)
    for binding, row in zip(BINDINGS, report.rows):
        x = rng.standard_normal((binding["batch"], binding["seq"], 1000)).astype(np.float32)
        got = load(art).run({"x": x})["y"]
        err = np.abs(got - plain.run(None, {"x": x})[0]).max() / np.abs(got).max()
        rounded = rounds == "all" or binding["batch"] * binding["seq"] <= 2
        assert (err > 1e-4) == rounded, (binding, err)


def test_int8_mismatch_still_exits_1(tmp_path):
    """The flip-noise bound is not so loose that an artefact of other weights passes."""
    a, b, art = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "a.so"
    onnx.save(_pool_model(0), str(a))
    onnx.save(_pool_model(1), str(b))
    assert _cli("compile", a, "--quant", "int4-g32", "--act", "int8", "-o", art).returncode == 0
    run = _cli("check", b, art)
    assert run.returncode == 1 and "MISMATCH" in run.stdout and "flip noise" in run.stdout


def test_unmodelled_rounding_declines(tmp_path):
    """Where ONNX cannot say the rounding (opset < 11: no Round; Gemm transA), the reference
    keeps fp32 activations and the report says so."""
    from qtvm.check import INT8_UNMODELLED_TOLERANCE, _dequantized_reference
    from qtvm.reference import UnmodelledRounding, dequantized_model
    from qtvm.formats import get_format
    from qtvm.target import parse_target
    from schedules import facts

    host = facts(parse_target("llvm -mcpu=icelake-server"))
    with pytest.raises(UnmodelledRounding, match="opset 10"):
        dequantized_model(_one_matmul_model(opset=10), get_format("int4-g128"), int8_facts=host)
    with pytest.raises(UnmodelledRounding, match="transA"):
        dequantized_model(_one_matmul_model(trans_a=True), get_format("int4-g128"), int8_facts=host)
    meta = {"format": "int4-g128", "activations": "int8", "quantized_matmuls": 1,
            "target": "llvm -mcpu=icelake-server"}
    reference, what, tol = _dequantized_reference(_one_matmul_model(opset=10), meta)
    assert "not modelled: opset 10" in what and tol == INT8_UNMODELLED_TOLERANCE
    assert [i.name for i in reference.graph.input] == ["x"]  # no jitter inputs: nothing rounded


def test_mask_inputs_are_ones():
    feeds = random_feeds([{"name": "attention_mask", "dtype": "int64", "shape": ["b", 4]},
                          {"name": "input_ids", "dtype": "int64", "shape": ["b", 4]}], {"b": 2},
                         np.random.default_rng(0), int_high=16)
    assert (feeds["attention_mask"] == 1).all() and feeds["input_ids"].max() > 1


def test_onnxruntime_refusing_a_binding_is_one_line():
    """Dims that must agree but were bound apart (a dynamo KV export's mask length is its own
    symbol, in truth past + seq): onnxruntime's refusal comes back as a QtvmError naming the
    binding and the fix, not an internal error."""
    from qtvm.check import _run, _session

    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "agree", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
                                               helper.make_tensor_value_info("b", TensorProto.FLOAT, ["m"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    sess = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(QtvmError, match=r"cannot run the model at n=2,m=3 .*--shape") as err:
        _run(sess, {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}, {"n": 2, "m": 3})
    assert "\n" not in str(err.value) and "ONNXRuntimeError" not in str(err.value)


def test_int8_with_prequantized_layers_declines(tmp_path, mlp_path):
    """A model that brings MatMulNBits layers: onnxruntime runs them on unrounded x, so the
    int8 reference would miss their rounding (it measured 1e-2 against a 2e-3 bound): the check
    keeps the fp32-activation reference and its looser bound, and says why."""
    from tests.quantized_models import ort_matmul_nbits

    model = tmp_path / "nbits.onnx"
    onnx.save(ort_matmul_nbits(onnx.load(str(mlp_path)), 4, 32, False), str(model))
    for quant in ("int4-g128", "none"):  # with --quant none it was held to float rounding: a false MISMATCH
        art = tmp_path / f"nbits_{quant}.so"
        assert _cli("compile", model, "--quant", quant, "--act", "int8", "-o", art).returncode == 0
        report = check(model, art)
        assert report.ok and "not modelled: 1 matmuls came quantized in the model" in report.reference, quant


class _FailingOrt:
    """An onnxruntime session that cannot run the model (as 1.32 fails opset 23's RotaryEmbedding
    with per-token caches)."""

    def get_inputs(self):
        raise AssertionError("not asked once the reference evaluator took over")

    def run(self, names, feed):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Foo")


def _add_model(dims_a=("n",), dims_b=("n",)):
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(dims_a)),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, list(dims_b))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims_a))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_reference_evaluator_where_onnxruntime_cannot_run(monkeypatch):
    """onnxruntime failing on a model ONNX's reference evaluator runs: the session answers with
    the reference's values from then on and records onnxruntime's reason, without its code prefix."""
    import qtvm.check as qcheck

    monkeypatch.setattr(qcheck, "_ort_session", lambda model, path=None: _FailingOrt())
    sess = qcheck._session(_add_model())
    a, b = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    assert np.array_equal(sess.run(None, {"a": a, "b": b})[0], a + b)
    assert sess.fallback == "onnxruntime cannot run the model (Non-zero status code returned while running Foo)"
    assert [i.name for i in sess.get_inputs()] == ["a", "b"] and [o.name for o in sess.get_outputs()] == ["y"]


def test_onnxruntime_error_stands_when_the_reference_fails_too(monkeypatch):
    """Inputs neither can run (dims bound apart): onnxruntime's one-line refusal, as before."""
    import qtvm.check as qcheck

    monkeypatch.setattr(qcheck, "_ort_session", lambda model, path=None: _FailingOrt())
    sess = qcheck._session(_add_model(("n",), ("m",)))
    with pytest.raises(QtvmError, match=r"onnxruntime cannot run the model at n=2,m=3 \(Non-zero status"):
        qcheck._run(sess, {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}, {"n": 2, "m": 3})
    assert sess.fallback is None


def test_group_query_attention_prompt_rule():
    """onnxruntime runs GroupQueryAttention on a prompt after a past only at batch 1: such a
    default binding runs as a first prompt; token steps and batch-1 prompts stay as they are."""
    from qtvm.check import _onnxruntime_prompt_rule

    node = helper.make_node("GroupQueryAttention", ["q"], ["y"], domain="com.microsoft")
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    meta = {"kv_step": {"ids": "input_ids", "caches": ["past.0"], "axis": 2},
            "inputs": [{"name": "input_ids", "shape": ["b", "s"]}, {"name": "past.0", "shape": ["b", 2, "p", 16]}]}
    given = [{"b": 3, "s": 17, "p": 1}, {"b": 17, "s": 1, "p": 3}, {"b": 1, "s": 3, "p": 17}]
    assert _onnxruntime_prompt_rule(model, meta, given) == [{"b": 3, "s": 17, "p": 0}, *given[1:]]
    model.graph.node[0].op_type = "Attention"  # another op: no rule
    assert _onnxruntime_prompt_rule(model, meta, given) == given


def test_accuracy_level_4_compared_at_level_0():
    from qtvm.check import _float_activations

    nodes = [helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", accuracy_level=level)
             for level in (4, 1, 0)]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    assert _float_activations(model) == 1
    assert [n.attribute[0].i for n in model.graph.node] == [0, 1, 0]


def _qdq_model(seed: int) -> onnx.ModelProto:
    """x[batch, seq, 64] -> QuantizeLinear/DequantizeLinear (uint8, as onnxruntime's static
    quantizer writes for activations) -> MatMul -> the same again -> MatMul: two rounding steps."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}") for i in (0, 1)]
    inits += [numpy_helper.from_array(np.float32(s), f"s{i}") for i, s in ((0, 0.03), (1, 0.3))]
    inits += [numpy_helper.from_array(np.uint8(128), "z")]
    nodes = []
    for i, (x, y) in enumerate((("x", "h"), ("h", "y"))):
        nodes += [helper.make_node("QuantizeLinear", [x, f"s{i}", "z"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", f"s{i}", "z"], [f"d{i}"]),
                  helper.make_node("MatMul", [f"d{i}", f"w{i}"], [y])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_models_that_round_their_own_activations_measure_the_flip_noise(tmp_path):
    """A model with activation QuantizeLinear rounds where a last-bit difference upstream can
    move a step: its reference is jittered at those nodes (fed 0 it is the model, bit for bit),
    the tolerance is measured, and an artefact of other weights still fails."""
    import onnxruntime as ort

    from qtvm.check import _activation_quantizers, _jittered_quantizers
    from qtvm.reference import JITTER_INPUT

    a, b, art = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "a.so"
    onnx.save(_qdq_model(0), str(a))
    onnx.save(_qdq_model(1), str(b))
    jittered = _jittered_quantizers(_qdq_model(0), _activation_quantizers(_qdq_model(0)))
    x = {"x": np.random.default_rng(2).standard_normal((2, 5, 64)).astype(np.float32)}
    plain = ort.InferenceSession(str(a), providers=["CPUExecutionProvider"]).run(None, x)[0]
    session = ort.InferenceSession(jittered.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {**x, JITTER_INPUT + "qdq": np.zeros((), np.float32)})[0], plain)
    assert _cli("compile", a, "--quant", "none", "-o", art).returncode == 0
    report = check(a, art)
    assert report.ok and "activation quantizers" in report.reference and "flip noise" in report.rule
    run = _cli("check", b, art)
    assert run.returncode == 1 and "MISMATCH" in run.stdout


def test_activation_quantizers_found_at_run_time_values_only():
    from qtvm.check import _activation_quantizers

    model = _qdq_model(0)
    assert _activation_quantizers(model) == [0, 3]
    model.graph.node[0].input[0] = "w1"  # a weight's quantizer: folded, nothing to jitter
    assert _activation_quantizers(model) == [3]
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    assert _activation_quantizers(model) == []  # the jitter's float32 arithmetic would not type-check


def test_large_models_reach_onnxruntime_as_files(tmp_path, monkeypatch):
    """onnxruntime reads the checked model from its own file, and a reference past protobuf's
    2 GiB (here: past a limit lowered to 0) from a temporary file with its weights beside it;
    the report is the one the in-memory sessions give."""
    import qtvm.check as qcheck
    from qtvm.pipeline import compile_model

    model = tmp_path / "m.onnx"
    onnx.save(_pool_model(0), str(model))
    art = compile_model(model, tmp_path / "m.so", "host", "int4-g32").path
    before = check(model, art, [{"batch": 2, "seq": 5}])
    sources = []
    real = qcheck._ort_session
    monkeypatch.setattr(qcheck, "_ort_session", lambda m, path=None: (sources.append(path), real(m, path))[1])
    monkeypatch.setattr(qcheck, "SERIALIZED_LIMIT", 0)
    saved = []
    real_save = onnx.save_model
    monkeypatch.setattr(onnx, "save_model", lambda m, f, **kw: (saved.append(kw), real_save(m, f, **kw))[1])
    after = check(model, art, [{"batch": 2, "seq": 5}])
    assert sources == [model, None]  # the file itself, then the dequantized reference ...
    assert [kw.get("save_as_external_data") for kw in saved] == [True]  # ... through a temporary file
    assert [(r.err_own, r.err_vs_float) for r in after.rows] == [(r.err_own, r.err_vs_float) for r in before.rows]


def _half_mlp(seed: int, k: int = 200, hidden: int = 72, n: int = 40) -> onnx.ModelProto:
    """A float16 model: Gemm(transB, bias) -> Relu -> MatMul, q/k-like pair sharing the input
    (K = 200: not a multiple of the group; N = 40, 72: not of the vector width)."""
    rng = np.random.default_rng(seed)
    f16 = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float16)  # noqa: E731
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("MatMul", ["hr", "w2"], ["y"]),
             helper.make_node("MatMul", ["x", "w3"], ["z"])]
    graph = helper.make_graph(
        nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", n]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT16, ["batch", hidden])],
        [numpy_helper.from_array(f16(hidden, k), "w1"), numpy_helper.from_array(f16(hidden), "b1"),
         numpy_helper.from_array(f16(hidden, n), "w2"), numpy_helper.from_array(f16(k, hidden), "w3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_half_precision_models_are_quantized_and_checked(tmp_path, act):
    """A float16 model's weights are quantized (read as float32; they were left float and
    called "not a constant") and checked against onnxruntime on the same weights dequantized,
    computed as qtvm does (float32 inputs, product cast back), at float16's tolerance; a model
    of other weights still fails."""
    from qtvm.formats import PRESETS
    from qtvm.runtime import load

    model, other, art = tmp_path / "m.onnx", tmp_path / "other.onnx", tmp_path / "m.so"
    onnx.save(_half_mlp(0), str(model))
    onnx.save(_half_mlp(1), str(other))
    run = _cli("compile", model, "--quant", "int4-g128", "--act", act, "-o", art)
    assert run.returncode == 0, run.stderr
    meta = load(art).metadata
    assert meta["quantized_matmuls"] == 3 and "left in float" not in run.stdout + run.stderr
    assert meta["float_weight_bytes"] == 2 * (72 * 200 + 72 * 40 + 200 * 72)  # float16: 2 bytes a weight
    if act == "fp32":  # the numpy reference of the format, on the weights read as float32
        weights = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in _half_mlp(0).graph.initializer}
        deq = lambda w: PRESETS["int4-g128"].quantize(w).dequantize()  # noqa: E731
        x = np.random.default_rng(2).standard_normal((3, 200)).astype(np.float16)
        h = np.maximum(((x.astype(np.float32) @ deq(weights["w1"].T)) + weights["b1"]).astype(np.float16), 0)
        want = {"y": (h.astype(np.float32) @ deq(weights["w2"])).astype(np.float16),
                "z": (x.astype(np.float32) @ deq(weights["w3"])).astype(np.float16)}
        got = load(art).run({"x": x})
        for name, w in want.items():
            np.testing.assert_allclose(got[name].astype(np.float32), w.astype(np.float32), rtol=2e-3, atol=2e-3)
    run = _cli("check", model, art)
    assert run.returncode == 0 and "OK:" in run.stdout, run.stdout + run.stderr
    if act == "fp32":
        assert "4 x float16's epsilon" in run.stdout
    run = _cli("check", other, art)
    assert run.returncode == 1 and "MISMATCH" in run.stdout


def _branch_model(dtype: int, seed: int = 0) -> onnx.ModelProto:
    """y = If(c, MatMul(Softmax(x @ w1), w3), -(x @ w2)) + Softmax(x @ w2) @ w3: w1 read only inside
    the then-branch, w2 and w3 read by two matmuls each (one of w3's inside the branch)."""
    rng = np.random.default_rng(seed)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    w = {name: numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np_type), name)
         for name, shape in (("w1", (40, 24)), ("w2", (40, 24)), ("w3", (24, 24)))}
    vi = lambda name, dims: helper.make_tensor_value_info(name, dtype, dims)  # noqa: E731
    then = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["a"]),
                              helper.make_node("Softmax", ["a"], ["s"], axis=-1),
                              helper.make_node("MatMul", ["s", "w3"], ["t"])], "then", [], [vi("t", ["b", 24])])
    other = helper.make_graph([helper.make_node("Neg", ["y0"], ["e"])], "else", [], [vi("e", ["b", 24])])
    nodes = [helper.make_node("MatMul", ["x", "w2"], ["y0"]),
             helper.make_node("If", ["c"], ["chosen"], then_branch=then, else_branch=other),
             helper.make_node("Softmax", ["y0"], ["s2"], axis=-1),
             helper.make_node("MatMul", ["s2", "w3"], ["v"]),
             helper.make_node("Add", ["chosen", "v"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []), vi("x", ["b", 40])],
                              [vi("y", ["b", 24])], list(w.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("dtype,act", [(TensorProto.FLOAT, "fp32"), (TensorProto.FLOAT, "int8"),
                                       (TensorProto.FLOAT16, "fp32"), (TensorProto.FLOAT16, "int8")])
def test_weights_inside_if_branches_are_dequantized_in_the_reference(tmp_path, dtype, act):
    """The compiler quantizes an If branch's weight matmuls; the reference dequantizes the same
    ones (it read the top-level graph only: it dropped the branch's weight, "Unable to find input
    'w1'", and a float16 weight shared by two matmuls was widened for the first only); a model of
    other weights still fails."""
    model, other, art = tmp_path / "m.onnx", tmp_path / "other.onnx", tmp_path / "m.so"
    onnx.save(_branch_model(dtype), str(model))
    onnx.save(_branch_model(dtype, seed=1), str(other))
    run = _cli("compile", model, "--quant", "int4-g32", "--act", act, "-o", art)
    assert run.returncode == 0, run.stderr
    for flag in (True, False):
        feeds = {"c": np.array(flag), "x": np.random.default_rng(3).standard_normal((3, 40)).astype(
            helper.tensor_dtype_to_np_dtype(dtype))}
        report = check(str(model), str(art), feeds=feeds)
        assert report.ok, format_report(report)
        report = check(str(other), str(art), feeds=feeds)
        assert not report.ok


def test_quantized_branches_checked_at_float_activations_with_inputs_partly_given(tmp_path):
    """A MatMulNBits at accuracy_level 4 inside an If branch is relaxed to float activations in the
    reference as a top-level one is (it was not: onnxruntime's int8 activations made a MISMATCH); a
    given input fixes its own dims and the others are drawn at random at each binding of the rest."""
    from tests.quantized_models import branchy_model

    model, art = tmp_path / "m.onnx", tmp_path / "m.so"
    onnx.save(branchy_model()[0], str(model))
    run = _cli("compile", model, "-o", art)
    assert run.returncode == 0, run.stderr
    for flag in (True, False):
        report = check(str(model), str(art), feeds={"c": np.array(flag)})
        assert report.ok, format_report(report)
        assert [r.binding["batch"] for r in report.rows] == [1, 3, 17]
    with pytest.raises(QtvmError, match="'cx', which the artefact does not take"):
        check(str(model), str(art), feeds={"cx": np.array(True)})
    with pytest.raises(QtvmError, match="--input x has 1 dims; the artefact's 'x' has 2"):
        check(str(model), str(art), feeds={"x": np.zeros(70, np.float32)})


def test_blocked_int4_dequantize_along_k_is_checked_at_float_activations(tmp_path):
    """onnxruntime fuses DequantizeLinear(int4, blocked along K) -> MatMul into a MatMulNBits with
    int8 activations unless told otherwise: the check compared qtvm's exact product with that
    (own error 0.06-0.1, a MISMATCH); its sessions ask for float activations."""
    from tests.quantized_models import blocked_dq_layer, model_of

    layer = blocked_dq_layer("w", "x", "y", 256, 96, 32, signed=True, seed=0)
    model, art = tmp_path / "m.onnx", tmp_path / "m.so"
    onnx.save(model_of([layer], [("x", ["batch", 256])], [("y", ["batch", 96])]), str(model))
    run = _cli("compile", model, "-o", art)
    assert run.returncode == 0, run.stderr
    report = check(str(model), str(art))
    assert report.ok and max(r.err_own for r in report.rows) < 1e-5, format_report(report)


def test_half_precision_found_inside_branches():
    """A float32 model whose If branch computes in float16 gets float16's tolerance floor (a Cast or a
    float16 initializer only inside the branch was not seen)."""
    from qtvm.check import _half_precision

    model = _branch_model(TensorProto.FLOAT)
    assert _half_precision(model) is None
    then = next(a.g for a in model.graph.node[1].attribute if a.name == "then_branch")
    then.node.append(helper.make_node("Cast", ["t"], ["t16"], to=TensorProto.FLOAT16))
    assert _half_precision(model)[0] == "float16"
    del then.node[-1]
    then.initializer.append(numpy_helper.from_array(np.zeros(2, np.float16), "h"))
    assert _half_precision(model)[0] == "float16"


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_routed_experts_are_dequantized_in_the_reference(tmp_path, act):
    """An artefact whose mixture-of-experts weights were packed (metadata ``routed_experts``) is
    held to onnxruntime on those experts dequantized; with the float experts the own error is
    the format's (a false miscompile)."""
    from qtvm.pipeline import compile_model
    from tests.conftest import moe_model

    path = tmp_path / "moe.onnx"
    onnx.save(moe_model(), str(path))
    result = compile_model(path, tmp_path / "moe.so", "host", "int4-g32", activations=act)
    assert result.metadata["routed_experts"] == 2
    report = check(path, result.path, feeds={"ids": np.array([2, -1, 0], np.int64)})
    assert report.ok, format_report(report)
    assert all(row.err_own < 1e-5 < row.err_vs_float for row in report.rows)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_half_precision_experts_are_packed_and_checked(tmp_path, dtype):
    """A half precision export's experts (gathered, then read as float32 by fp32_accumulate)
    are packed like float32 ones (they stayed float), and the reference computes their matmuls
    as qtvm does: float32 inputs, the experts dequantized, the product cast back."""
    from qtvm.pipeline import compile_model
    from tests.conftest import moe_model

    path, model = tmp_path / "moe.onnx", moe_model(dtype=dtype)
    # typed as the dynamo exporter types its intermediates (the reference's gather yields float32)
    model.graph.value_info.append(helper.make_tensor_value_info("g1", dtype, None))
    onnx.save(model, str(path))
    result = compile_model(path, tmp_path / "moe.so", "host", "int4-g32")
    assert result.metadata["routed_experts"] == 2 and result.metadata["quantized_matmuls"] == 2
    report = check(path, result.path, feeds={"ids": np.array([2, -1, 0], np.int64)})
    assert report.ok, format_report(report)
    assert all(row.err_own < row.err_vs_float for row in report.rows)


def test_a_failing_reference_evaluator_is_named_as_such():
    """Where ONNX's reference evaluator stood in for onnxruntime and fails too, the error names
    it and onnxruntime's reason, not "onnxruntime cannot run the model" with the evaluator's
    message (a bfloat16 PhiMoE: onnxruntime has no bfloat16 MatMul, the evaluator's GatherElements
    refused its shapes)."""
    from qtvm.check import _run

    class Evaluating:
        fallback = "onnxruntime cannot run the model (no bfloat16 MatMul)"
        stand_in = "ONNX's reference evaluator"

        def get_outputs(self):
            return []

        def run(self, names, feed):
            raise ValueError("Except for dimension -1, all dimensions of index and self should be the same size.")

    with pytest.raises(QtvmError, match=r"ONNX's reference evaluator fails on the model at batch=1 \(Except for "
                                        r".*stood in for onnxruntime: onnxruntime cannot run the model \(no bfloat16"):
        _run(Evaluating(), {}, {"batch": 1})


def test_a_bfloat16_model_is_checked_in_float32_rounded_as_it_goes(tmp_path):
    """onnxruntime has no bfloat16 MatMul or Add: the reference is the model in float32 with
    every bfloat16 value rounded to bfloat16 where a node makes it (``bfloat16_in_float32``):
    numpy's same arithmetic, exactly; qtvm check then runs on it, not on ONNX's reference
    evaluator (which failed on a bfloat16 PhiMoE's GatherElements and BERT's shapes)."""
    import ml_dtypes
    import onnxruntime as ort

    from qtvm.pipeline import compile_model
    from qtvm.reference import bfloat16_in_float32

    bf16 = TensorProto.BFLOAT16
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 16)).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(0.5, ml_dtypes.bfloat16))),
             helper.make_node("Mul", ["t", "c"], ["m"]), helper.make_node("Cast", ["m"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["f"], ["y"], to=bf16)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", bf16, ["b", 24])],
                              [helper.make_tensor_value_info("y", bf16, ["b", 16]),
                               helper.make_tensor_value_info("h", bf16, ["b", 16])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    emulated = bfloat16_in_float32(model)
    session = ort.InferenceSession(emulated.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 24)).astype(ml_dtypes.bfloat16)
    y, h = session.run(None, {"x": x.astype(np.float32)})
    r = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    want_h = r(x.astype(np.float32) @ w.astype(np.float32))
    np.testing.assert_array_equal(h, want_h)
    np.testing.assert_array_equal(y, r(r(np.tanh(want_h)) * np.float32(0.5)))
    path, art = tmp_path / "m.onnx", tmp_path / "m.so"
    onnx.save(model, str(path))
    compile_model(path, art, "host", "none")
    report = check(path, art)
    assert report.ok and "rounded to bfloat16 where it is made" in report.reference, format_report(report)
