"""ONNX's Attention (opsets 23-25) and RotaryEmbedding (opset 23) through qtvm's converters
(qtvm/frontend/attention.py), against ONNX's reference evaluator (the spec's numpy code;
onnxruntime 1.32 cannot run every form) at several bindings of each symbolic dim: a KV cache
whose past is 0 and more, grouped KV heads, masks shorter than the keys, a static cache with
per-batch lengths, 3-D inputs, softcap, the extra outputs; then the transformers exports
torch.onnx makes at opset 23 (dynamo), whose decoders use both ops."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from qtvm import dims
from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model  # the compiler's TVM first (qtvm.runtime alone loads the runtime library)

F32, BOOL, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64


def _model(node, inputs, outputs, opset=23):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, d) for n, t, d in inputs],
                              [helper.make_tensor_value_info(n, t, d) for n, t, d in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _compile(tmp_path, model, name="m"):
    from qtvm import runtime

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return runtime.load(compile_model(path, tmp_path / f"{name}.so", "host", "none").path)


def _feeds(model, binding: dict, rng, special=None) -> dict:
    """Random inputs for ``binding`` (dim name or 'past + seq' -> value); ``special``: name -> fn(shape)."""
    out = {}
    for i in model.graph.input:
        shape = []
        for d in i.type.tensor_type.shape.dim:
            shape.append(d.dim_value if d.HasField("dim_value") else int(dims.evaluate(d.dim_param, binding)))
        elem = i.type.tensor_type.elem_type
        if special and i.name in special:
            out[i.name] = special[i.name](shape, rng)
        elif elem == BOOL:
            out[i.name] = rng.random(shape) < 0.8
        elif elem == I64:
            out[i.name] = rng.integers(0, 8, shape).astype(np.int64)
        else:
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def _against_reference(module, model, bindings, special=None, tol=2e-5):
    rng = np.random.default_rng(0)
    ref = ReferenceEvaluator(model)
    names = [o.name for o in model.graph.output]
    for binding in bindings:
        feeds = _feeds(model, binding, rng, special)
        got = module.run(feeds)
        for name, want in zip(names, ref.run(None, feeds)):
            assert got[name].shape == want.shape, (binding, name, got[name].shape, want.shape)
            np.testing.assert_allclose(got[name], want, rtol=tol, atol=tol, err_msg=f"{name} at {binding}")


def _mask_with_a_dead_row(shape, rng):
    """Random, with the last query row masked everywhere: the spec gives that row zeros, where a
    plain softmax over -inf gives NaN."""
    if len(shape) == 4:  # bool
        mask = rng.random(shape) < 0.8
        mask[..., -1, :] = False
        return mask
    mask = rng.standard_normal(shape).astype(np.float32)
    mask[-1, :] = -np.inf
    return mask


def test_gqa_with_past_causal_and_bool_mask(tmp_path):
    """4-D, 4 query heads over 2 KV heads, a cache of symbolic length (0 included), causal
    (bottom-right: the new tokens see the whole past) and a bool mask over past + seq."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "present_k", "present_v"],
                            is_causal=1)
    model = _model(node, [("q", F32, ["batch", 4, "seq", 8]), ("k", F32, ["batch", 2, "seq", 8]),
                          ("v", F32, ["batch", 2, "seq", 6]), ("mask", BOOL, ["batch", 1, "seq", "past + seq"]),
                          ("pk", F32, ["batch", 2, "past", 8]), ("pv", F32, ["batch", 2, "past", 6])],
                   [("y", F32, ["batch", 4, "seq", 6]), ("present_k", F32, ["batch", 2, "past + seq", 8]),
                    ("present_v", F32, ["batch", 2, "past + seq", 6])])
    module = _compile(tmp_path, model)
    bindings = [{"batch": 1, "seq": 1, "past": 0}, {"batch": 2, "seq": 3, "past": 5},
                {"batch": 3, "seq": 1, "past": 9}, {"batch": 1, "seq": 7, "past": 0}]
    _against_reference(module, model, bindings, {"mask": _mask_with_a_dead_row})


def test_3d_heads_softcap_short_float_mask_and_probabilities(tmp_path):
    """3-D inputs split by q_num_heads / kv_num_heads, a scale and softcap, a float mask with
    fewer columns than keys (padded with -inf), and the softmax output (mode 3)."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y", "", "", "probs"], q_num_heads=4,
                            kv_num_heads=2, scale=0.3, softcap=2.5, qk_matmul_output_mode=3)
    model = _model(node, [("q", F32, ["batch", "seq", 32]), ("k", F32, ["batch", "kv", 16]),
                          ("v", F32, ["batch", "kv", 12]), ("mask", F32, ["seq", "cols"])],
                   [("y", F32, ["batch", "seq", 24]), ("probs", F32, ["batch", 4, "seq", "kv"])])
    module = _compile(tmp_path, model)
    bindings = [{"batch": 1, "seq": 1, "kv": 1, "cols": 1}, {"batch": 2, "seq": 3, "kv": 5, "cols": 2},
                {"batch": 2, "seq": 4, "kv": 4, "cols": 4}]
    _against_reference(module, model, bindings, {"mask": _mask_with_a_dead_row})


def test_static_cache_nonpad_lengths_and_window(tmp_path):
    """Opset 24's nonpad_kv_seqlen (a static cache: per batch the keys past its length are
    padding, the causal frontier at length - q_len) and opset 25's window bounds."""
    node = helper.make_node("Attention", ["q", "k", "v", "", "", "", "lengths"], ["y"], is_causal=1,
                            left_window_size=3)
    model = _model(node, [("q", F32, ["batch", 2, "seq", 8]), ("k", F32, ["batch", 2, 10, 8]),
                          ("v", F32, ["batch", 2, 10, 8]), ("lengths", I64, ["batch"])],
                   [("y", F32, ["batch", 2, "seq", 8])], opset=25)
    module = _compile(tmp_path, model)
    lengths = {"lengths": lambda shape, rng: rng.integers(4, 11, shape).astype(np.int64)}
    _against_reference(module, model, [{"batch": 1, "seq": 1}, {"batch": 3, "seq": 4}], lengths)


@pytest.mark.parametrize("interleaved,rotary_dim", [(0, 0), (1, 4)])
def test_rotary_embedding_4d_with_position_ids(tmp_path, interleaved, rotary_dim):
    """Caches indexed by position ids, full or partial rotation, halves or interleaved pairs."""
    half = (rotary_dim or 8) // 2
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=interleaved,
                            rotary_embedding_dim=rotary_dim)
    model = _model(node, [("x", F32, ["batch", 3, "seq", 8]), ("cos", F32, [32, half]), ("sin", F32, [32, half]),
                          ("pos", I64, ["batch", "seq"])], [("y", F32, ["batch", 3, "seq", 8])])
    module = _compile(tmp_path, model, f"rope{interleaved}")
    pos = {"pos": lambda shape, rng: rng.integers(0, 32, shape).astype(np.int64)}
    _against_reference(module, model, [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 5}], pos)


def test_rotary_embedding_3d_with_per_token_caches(tmp_path):
    """3-D input split by num_heads, caches per (batch, token): what torch exports for a decoder."""
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], num_heads=2)
    model = _model(node, [("x", F32, ["batch", "seq", 16]), ("cos", F32, ["batch", "seq", 4]),
                          ("sin", F32, ["batch", "seq", 4])], [("y", F32, ["batch", "seq", 16])])
    _against_reference(_compile(tmp_path, model), model, [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 6}])


def test_refusals_name_the_problem(tmp_path):
    three_d = _model(helper.make_node("Attention", ["q", "k", "v"], ["y"]),
                     [("q", F32, [1, 2, 8]), ("k", F32, [1, 2, 8]), ("v", F32, [1, 2, 8])], [("y", F32, [1, 2, 8])])
    with pytest.raises(QtvmError, match="q_num_heads and kv_num_heads"):
        _compile(tmp_path, three_d, "a")
    ambiguous = _model(helper.make_node("Attention", ["q", "k", "v"], ["y", "", "", "qk"], softcap=3.0),
                       [("q", F32, [1, 2, 3, 8]), ("k", F32, [1, 2, 3, 8]), ("v", F32, [1, 2, 3, 8])],
                       [("y", F32, [1, 2, 3, 8]), ("qk", F32, [1, 2, 3, 3])])
    with pytest.raises(QtvmError, match="mode 0 with a softcap is ambiguous"):
        _compile(tmp_path, ambiguous, "b")


@pytest.mark.parametrize("family,kv", [("llama", True), ("gpt2", False)])
def test_transformers_opset23_export(hf_dir, hf_compiled, tmp_path, family, kv):
    """torch.onnx (dynamo) at opset 23: LLaMA's attention and rotary embedding become Attention and
    RotaryEmbedding (onnxruntime 1.32 refuses its per-token cos/sin caches); GPT-2's attention with a
    bool mask. Compiled once, against the reference evaluator at several lengths, past 0 included."""
    from tests.frontend.transformers_exports import cached_export, feeds

    path = cached_export(hf_dir, family, "dynamo23", kv)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Attention" in ops and (family != "llama" or "RotaryEmbedding" in ops)
    module = _compile(tmp_path, onnx.load(str(path)), family)
    ref = ReferenceEvaluator(str(path))
    names = ref.output_names
    for batch, seq, past in ([(1, 1, 0), (2, 3, 0), (1, 1, 5), (2, 2, 4)] if kv else [(1, 1, 0), (2, 7, 0)]):
        x = feeds(module.inputs, batch, seq, past, seed=batch + seq + past)
        got = module.run(x)
        for name, want in zip(names, ref.run(None, x)):
            err = np.abs(got[name] - want).max() / np.abs(want).max()
            assert got[name].shape == want.shape and err < 1e-5, (name, batch, seq, past, err)
    if kv:  # the KV step reads the converted attention as it reads the decomposed one: in place
        from qtvm import runtime

        assert module.metadata["kv_step"]["fused_attention"] == 4  # 2 layers x (keys, values)
        decomposed = runtime.load(hf_compiled(family, "dynamo", "none", kv=True).path)
        ids = np.random.default_rng(0).integers(0, 256, (1, 5)).astype(np.int64)
        assert np.array_equal(module.generate(ids, 12), decomposed.generate(ids, 12))
