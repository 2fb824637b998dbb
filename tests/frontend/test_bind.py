"""``--bind``: a bound input's If nodes replaced by the branch taken, checked against onnxruntime
running the unbound model with that input fed (hand-made graphs with clashing names and a
nested If; optimum's merged decoder layout, float and quantized by onnxruntime), and the greedy
tokens of a bound merged decoder against onnxruntime driving the merged model as optimum does."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.frontend.bind import bind_inputs, parse_bind_options
from qtvm.pipeline import compile_model  # the compiler's TVM first
from tests.frontend.transformers_exports import merged_decoder

vi = helper.make_tensor_value_info


def _run(model: onnx.ModelProto, feeds: dict, evaluator: str = "onnxruntime") -> list:
    """The model's outputs by onnxruntime, or by ONNX's reference evaluator (onnxruntime gives
    None for a value an If branch outputs twice)."""
    if evaluator == "reference":
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(model).run(None, feeds)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _clashing_if_model() -> onnx.ModelProto:
    """``y, z, w, k = If(cond)`` whose branches use names another If's branches use ("t", "u"),
    hold an initializer, give one value as two outputs, nest an If on the same input, and read
    an input only one branch reads."""
    f = lambda name: vi(name, TensorProto.FLOAT, None)  # noqa: E731

    def graph(name, nodes, outputs, initializers=()):
        return helper.make_graph(nodes, name, [], [f(o) for o in outputs], list(initializers))

    inner = dict(then_branch=graph("inner_then", [helper.make_node("Mul", ["t", "two"], ["u"])], ["u"]),
                 else_branch=graph("inner_else", [helper.make_node("Neg", ["t"], ["u"])], ["u"]))
    then = graph("then", [helper.make_node("Add", ["x", "c"], ["t"]),
                          helper.make_node("If", ["cond"], ["v"], **inner),
                          helper.make_node("Sub", ["t", "x"], ["q"]),
                          helper.make_node("Mul", ["only_then", "two"], ["k"])],
                 ["v", "t", "q", "k"], [numpy_helper.from_array(np.array([1.5, -2, 3], np.float32), "c")])
    other = graph("else", [helper.make_node("Sub", ["x", "r"], ["t"]), helper.make_node("Identity", ["twos"], ["k"]),
                           helper.make_node("Identity", ["x"], ["x1"])], ["t", "t", "x1", "k"])
    unbound = dict(then_branch=graph("flag_then", [helper.make_node("Abs", ["x"], ["t"])], ["t"]),
                   else_branch=graph("flag_else", [helper.make_node("Exp", ["x"], ["u"])], ["u"]))
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("If", ["cond"], ["y", "z", "w", "k_out"], then_branch=then, else_branch=other),
             helper.make_node("If", ["flag"], ["s"], **unbound),
             helper.make_node("Add", ["y", "w"], ["yw"]),
             helper.make_node("Add", ["yw", "s"], ["out"])]
    inputs = [vi("x", TensorProto.FLOAT, ["n", 3]), vi("cond", TensorProto.BOOL, [1]),
              vi("only_then", TensorProto.FLOAT, [2]), vi("flag", TensorProto.BOOL, [])]
    g = helper.make_graph(nodes, "g", inputs, [vi("out", TensorProto.FLOAT, ["n", 3]), vi("z", TensorProto.FLOAT, ["n", 3]),
                                               vi("k_out", TensorProto.FLOAT, [2])],
                          [numpy_helper.from_array(np.float32(2), "two"), numpy_helper.from_array(np.full(2, 2, np.float32), "twos")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("taken", ["1", "0", "true", "False"])
def test_bound_model_computes_what_the_model_does_with_that_input(taken):
    model = _clashing_if_model()
    onnx.checker.check_model(model)
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    notes = bind_inputs(bound, {"cond": taken})
    onnx.checker.check_model(bound)
    cond = taken in ("1", "true")
    assert [n.input[0] for n in bound.graph.node if n.op_type == "If"] == ["flag"]
    assert notes[1].startswith(f"{2 if cond else 1} If nodes on bound inputs replaced")
    assert [i.name for i in bound.graph.input] == ["x", *(["only_then"] if cond else []), "flag"]
    for flag in (True, False):
        feeds = {"x": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
                 "only_then": np.array([3, -1], np.float32), "flag": np.array(flag)}
        want = _run(model, {**feeds, "cond": np.array([cond])}, "reference")
        for evaluator in ("reference", "onnxruntime"):
            got = _run(bound, {k: v for k, v in feeds.items() if k != "only_then" or cond}, evaluator)
            assert len(got) == len(want) == 3
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)  # Exp: numpy vs onnxruntime


def test_bind_errors_name_every_problem():
    model = _clashing_if_model()
    with pytest.raises(QtvmError) as e:
        bind_inputs(model, {"nope": "1", "x": "2", "cond": "maybe"})
    message = str(e.value)
    assert "'nope' is not an input" in message and "'x': its shape ['n', 3] is not fixed" in message
    assert "'maybe' is not a bool" in message and "the model's inputs: x, cond, only_then, flag" in message
    with pytest.raises(QtvmError, match="--bind 'cond' is not NAME=VALUE"):
        parse_bind_options(["cond"])
    assert parse_bind_options(["a=1", " b = 2.5 "]) == {"a": "1", "b": "2.5"}


def _ort_greedy_merged(model: onnx.ModelProto, prompt: np.ndarray, new: int) -> np.ndarray:
    """onnxruntime running a merged decoder as optimum does: the prompt on the no-past branch
    (use_cache_branch False, a dummy past of length 1 it never reads), then one token at a
    time on the with-past branch with the presents fed back."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    batch = prompt.shape[0]
    caches = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    state = {i.name: np.full((batch, i.shape[1], 1, i.shape[3]), 7, np.float32) for i in caches}
    mask, ids, out, use_cache = np.ones(prompt.shape, np.int64), prompt, [prompt], False
    for _ in range(new):
        logits, *presents = sess.run(None, {"input_ids": ids, "attention_mask": mask, **state,
                                            "use_cache_branch": np.array([use_cache])})
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        out.append(token)
        state = {i.name: p for i, p in zip(caches, presents)}
        ids, mask, use_cache = token, np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1), True
    return np.concatenate(out, axis=1)


def test_merged_decoder_bound_to_its_cache_branch_generates_as_onnxruntime(hf_model, tmp_path):
    """The with-past branch serves the first step too (a past of length 0): the tokens equal
    optimum's two-branch protocol's; both bindings pass `qtvm check` against the merged model
    (past lengths 0 and more, the mask restated as past + seq for the cache branch)."""
    from qtvm import runtime
    from qtvm.check import check

    merged = tmp_path / "decoder_model_merged.onnx"
    model = merged_decoder(onnx.load(str(hf_model("llama", "legacy", kv=True))))
    onnx.save(model, str(merged))
    result = compile_model(merged, tmp_path / "with_past.so", "host", "none", binds={"use_cache_branch": "1"})
    assert any("attention_mask's length restated as 'past + seq'" in n for n in result.notes)
    module = runtime.load(result.path)
    assert "use_cache_branch" not in [i["name"] for i in module.inputs]
    assert module.session().mode.startswith("in-place")
    prompt = np.array([[3, 141, 59, 26, 53]], np.int64)
    np.testing.assert_array_equal(module.generate(prompt, 12), _ort_greedy_merged(model, prompt, 12))
    report = check(merged, result.path, bindings=[{"batch": 2, "seq": 3, "past": 0}, {"batch": 1, "seq": 1, "past": 5}])
    assert report.ok, report.rows
    no_past = compile_model(merged, tmp_path / "no_past.so", "host", "none", binds={"use_cache_branch": "0"},
                            kv_step=False)
    assert [i["name"] for i in runtime.load(no_past.path).inputs] == ["input_ids", "attention_mask"]
    assert check(merged, no_past.path).ok


def test_quantized_merged_decoder_bound(hf_model, tmp_path):
    """A merged decoder quantized by onnxruntime's MatMulNBitsQuantizer (as transformers.js ships
    its q4 models: MatMulNBits inside both branches): bound, its kernels are packed ones and the
    artefact passes `qtvm check`."""
    from qtvm.check import check
    from tests.quantized_models import ort_matmul_nbits

    merged = tmp_path / "decoder_model_merged_q4.onnx"
    model = ort_matmul_nbits(merged_decoder(onnx.load(str(hf_model("llama", "legacy", kv=True)))), 4, 32, False)
    assert any(n.op_type == "MatMulNBits" for g in (b.g for b in model.graph.node[0].attribute) for n in g.node)
    onnx.save(model, str(merged))
    result = compile_model(merged, tmp_path / "q4.so", "host", "none", binds={"use_cache_branch": "1"})
    assert result.metadata["prequantized_matmuls"] == result.metadata["quantized_matmuls"] > 0
    report = check(merged, result.path)
    assert report.ok, report.rows


@pytest.mark.parametrize("declared,restated", [("seq", True), ("attention_mask_sequence_length", True),
                                               ("past", False)])
def test_merged_decoder_mask_restated_where_its_declaration_cannot_hold(hf_model, declared, restated):
    """The mask's length declared as the ids' or under a name of its own is restated past + seq
    for the with-past branch; one the other inputs use (here the past length) is left as it is,
    and a model without an If keeps its declarations whatever is bound."""
    model = merged_decoder(onnx.load(str(hf_model("llama", "legacy", kv=True))))
    model.graph.input[1].type.tensor_type.shape.dim[1].dim_param = declared
    notes = bind_inputs(model, {"use_cache_branch": "1"})
    dims = [d.dim_param for d in model.graph.input[1].type.tensor_type.shape.dim]
    assert dims == ["batch", "past + seq" if restated else declared]
    assert any("attention_mask's length restated" in n for n in notes) == restated
    plain = onnx.load(str(hf_model("llama", "legacy", kv=True)))
    plain.graph.input[1].type.tensor_type.shape.dim[1].dim_param = "seq"
    plain.graph.input.append(vi("flag", TensorProto.BOOL, [1]))
    bind_inputs(plain, {"flag": "1"})
    assert [d.dim_param for d in plain.graph.input[1].type.tensor_type.shape.dim] == ["batch", "seq"]


def test_a_half_precision_input_is_bound_to_its_type():
    """A bfloat16 input could not be bound ("its dtype bfloat16 cannot be bound": numpy does not
    count ml_dtypes' bfloat16 as floating); float16 and bfloat16 take the value in their type."""
    import ml_dtypes

    from qtvm.frontend.bind import bound_value

    for elem, dtype in [(TensorProto.FLOAT16, np.float16), (TensorProto.BFLOAT16, ml_dtypes.bfloat16)]:
        value = bound_value(helper.make_tensor_value_info("t", elem, [2]), "0.1")
        assert value.dtype == dtype and value.tolist() == [dtype(0.1)] * 2
