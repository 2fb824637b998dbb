"""onnxruntime's contrib ops that onnxruntime-genai's builder writes (qtvm/frontend/ort_contrib.py),
against onnxruntime itself at several bindings of each symbolic dim: GroupQueryAttention's
first prompt, token generation, a prompt after a past, rows of different lengths, packed and
separate QKV, rotary (halves, interleaved, partial), a local window, softcap; the norms with
their residual sums; GatherBlockQuantized at 2, 4 and 8 bits; then whole models made by the
builder, compiled, checked, and decoded greedily against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm import dims
from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model  # the compiler's TVM first (qtvm.runtime alone loads the runtime library)
from tests.frontend.genai_builder_models import FAMILIES, REFUSED, cached_model, float_activations

F32, I32, I64, U8 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8
MS = "com.microsoft"


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, d) for n, t, d in inputs],
                              [helper.make_tensor_value_info(n, t, d) for n, t, d in outputs],
                              initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                             ir_version=9)


def _compile(tmp_path, model, name="m"):
    from qtvm import runtime

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return runtime.load(compile_model(path, tmp_path / f"{name}.so", "host", "none").path)


def _shape(value_info, binding):
    return [d.dim_value if d.HasField("dim_value") else int(dims.evaluate(d.dim_param, binding))
            for d in value_info.type.tensor_type.shape.dim]


def _against_onnxruntime(module, model, runs, tol=2e-5):
    """runs: [(binding, feeds or None, outputs to compare or None for all)]; random float
    inputs where feeds do not give them."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    names = [o.name for o in model.graph.output]
    for binding, given, compared in runs:
        feeds = dict(given or {})
        for i in model.graph.input:
            if i.name not in feeds:
                feeds[i.name] = rng.standard_normal(_shape(i, binding)).astype(np.float32)
        got = module.run(feeds)
        for name, want in zip(names, sess.run(None, feeds)):
            if compared is not None and name not in compared:
                continue
            assert got[name].shape == want.shape, (binding, name, got[name].shape, want.shape)
            np.testing.assert_allclose(got[name], want, rtol=tol, atol=tol, err_msg=f"{name} at {binding}")


# -- GroupQueryAttention -----------------------------------------------------------------------

def _gqa_model(heads=4, kv_heads=2, size=16, packed=True, rotary=None, interleaved=0, **attrs):
    """query [batch, seq, ...], caches [batch, kv_heads, past, size]; seqlens_k and
    total_sequence_length are inputs; rotary: columns of the cos/sin tables (None: no rotary)."""
    width = (heads + 2 * kv_heads) * size if packed else heads * size
    inputs = [("query", F32, ["batch", "seq", width])]
    if not packed:
        inputs += [("key", F32, ["batch", "seq", kv_heads * size]), ("value", F32, ["batch", "seq", kv_heads * size])]
    inputs += [("past_key", F32, ["batch", kv_heads, "past", size]), ("past_value", F32, ["batch", kv_heads, "past", size]),
               ("seqlens_k", I32, ["batch"]), ("total_sequence_length", I32, [])]
    inits = []
    names = ["query", "" if packed else "key", "" if packed else "value", "past_key", "past_value", "seqlens_k",
             "total_sequence_length"]
    if rotary:
        angles = np.arange(64)[:, None] * (1.0 / 10000 ** (np.arange(rotary) / rotary))[None, :]
        inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
                 numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache")]
        names += ["cos_cache", "sin_cache"]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"], domain=MS,
                            num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(bool(rotary)),
                            rotary_interleaved=interleaved, **attrs)
    outputs = [("out", F32, ["batch", "seq", heads * size]),
               ("present_key", F32, ["batch", kv_heads, "past + seq", size]),
               ("present_value", F32, ["batch", kv_heads, "past + seq", size])]
    return _model([node], inputs, outputs, inits)


def _lengths(batch, seq, past, short=()):
    """seqlens_k (total - 1 per row; rows in ``short`` have 2 fewer cached keys) and the total."""
    seqlens = np.full(batch, past + seq - 1, np.int32)
    for b in short:
        seqlens[b] -= 2
    return {"seqlens_k": seqlens, "total_sequence_length": np.array(past + seq, np.int32)}


def _gqa_runs(short_rows=True):
    """First prompt (batched), token generation (batched), a prompt after a past (batch 1, which
    onnxruntime requires), one token after a single cached one; rows of different lengths
    compare the attention output only (qtvm's present keeps every past row: module docstring)."""
    runs = []
    for batch, seq, past in ((2, 5, 0), (3, 1, 6), (1, 4, 7), (1, 1, 1)):
        b = {"batch": batch, "seq": seq, "past": past}
        runs.append((b, _lengths(batch, seq, past), None))
    if short_rows:
        runs.append(({"batch": 3, "seq": 1, "past": 6}, _lengths(3, 1, 6, short=(1,)), ["out"]))
    return runs


@pytest.mark.parametrize("packed,rotary,interleaved", [(True, 8, 0), (False, 8, 1), (True, None, 0)],
                         ids=["packed-rotary", "separate-interleaved", "packed-no-rotary"])
def test_gqa_against_onnxruntime(tmp_path, packed, rotary, interleaved):
    model = _gqa_model(packed=packed, rotary=rotary, interleaved=interleaved)
    _against_onnxruntime(_compile(tmp_path, model), model, _gqa_runs())


def test_gqa_partial_rotary_window_softcap_scale(tmp_path):
    """head 32 with 16 rotated features; a window of 3 keys before the query; softcap and scale."""
    model = _gqa_model(heads=2, kv_heads=1, size=32, rotary=8, local_window_size=3, softcap=2.0, scale=0.3)
    runs = _gqa_runs() + [({"batch": 1, "seq": 9, "past": 0}, _lengths(1, 9, 0), None)]
    _against_onnxruntime(_compile(tmp_path, model), model, runs)


def test_gqa_refusals_name_what_is_unread(tmp_path):
    model = _gqa_model(rotary=8, smooth_softmax=1, qk_output=1)
    with pytest.raises(QtvmError, match="smooth_softmax=1, qk_output=1"):
        _compile(tmp_path, model)
    model = _gqa_model(rotary=8)
    node = model.graph.node[0]
    node.input.extend(["seqlens_k", "", "", "query"])  # position_ids, attention_bias, head_sink, k_scale
    with pytest.raises(QtvmError, match="position_ids, k_scale"):
        _compile(tmp_path, model)


def test_gqa_pins_a_named_head_size(tmp_path):
    """The builder names the caches' head size (``kv_cache_dim``): the import pins it to the
    query's head size, so inputs, metadata and bindings carry the constant."""
    model = _gqa_model(rotary=8)
    for vi in list(model.graph.input) + list(model.graph.output):
        t = vi.type.tensor_type
        if vi.name.startswith(("past", "present")):
            t.shape.dim[3].ClearField("dim_value")
            t.shape.dim[3].dim_param = "kv_cache_dim"
    module = _compile(tmp_path, model)
    assert [i["shape"] for i in module.inputs if i["name"] == "past_key"] == [["batch", 2, "past", 16]]
    _against_onnxruntime(module, model, [({**b, "kv_cache_dim": 16}, f, c) for b, f, c in _gqa_runs(False)])


# -- norms ------------------------------------------------------------------------------------

def test_norms_and_residual_sums(tmp_path):
    rng = np.random.default_rng(1)
    gamma, beta, bias = (numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), n)
                         for n in ("gamma", "beta", "bias"))
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["rms", "inv_std"], epsilon=1e-5),
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"],
                         ["skip_rms", "", "", "sum1"], domain=MS, epsilon=1e-6),
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"], ["skip_ln", "", "", "sum2"],
                         domain=MS, epsilon=1e-5),
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["skip_rms_nobias"], domain=MS),
    ]
    d3 = ["batch", "seq", 64]
    outs = [("rms", F32, d3), ("inv_std", F32, ["batch", "seq", 1]), ("skip_rms", F32, d3), ("sum1", F32, d3),
            ("skip_ln", F32, d3), ("sum2", F32, d3), ("skip_rms_nobias", F32, d3)]
    model = _model(nodes, [("x", F32, d3), ("skip", F32, d3)], outs, [gamma, beta, bias])
    runs = [({"batch": b, "seq": s}, None, None) for b, s in ((1, 1), (2, 7), (3, 2))]
    _against_onnxruntime(_compile(tmp_path, model), model, runs)


def test_skip_norm_mean_output_refused(tmp_path):
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "g"], ["y", "mean"], domain=MS)]
    model = _model(nodes, [("x", F32, ["n", 8])], [("y", F32, ["n", 8]), ("mean", F32, ["n", 1])],
                   [numpy_helper.from_array(np.ones(8, np.float32), "g")])
    with pytest.raises(QtvmError, match="'mean' output"):
        _compile(tmp_path, model)


# -- the transformer optimizer's elementwise fusions -------------------------------------------

def _fusions(elem):
    values = np.random.default_rng(2).standard_normal(64).astype(np.float16)  # float16 values in either type
    bias = numpy_helper.from_array(values.astype(helper.tensor_dtype_to_np_dtype(elem)), "bias")
    nodes = [helper.make_node("Gelu", ["x"], ["gelu"], domain=MS),
             helper.make_node("BiasGelu", ["x", "bias"], ["bias_gelu"], domain=MS),
             helper.make_node("FastGelu", ["x", "bias"], ["fast_gelu"], domain=MS),
             helper.make_node("FastGelu", ["x"], ["fast_gelu_nobias"], domain=MS),
             helper.make_node("QuickGelu", ["x"], ["quick_gelu"], domain=MS, alpha=1.5)]
    d3 = ["batch", "seq", 64]
    outs = [(n.output[0], elem, d3) for n in nodes]
    return _model(nodes, [("x", elem, d3)], outs, [bias])


def test_optimizer_fusions_against_onnxruntime(tmp_path):
    """Gelu, BiasGelu, FastGelu (with and without its bias) and QuickGelu: what
    onnxruntime's transformer optimizer writes for BERT's and GPT-2's MLPs (they were refused as
    unsupported ops); float32 at three bindings, and float16 within one rounding of onnxruntime's
    float32 result (its CPU kernels of these ops compute in float32)."""
    model = _fusions(F32)
    runs = [({"batch": b, "seq": s}, None, None) for b, s in ((1, 1), (2, 7), (3, 2))]
    _against_onnxruntime(_compile(tmp_path, model), model, runs)

    module = _compile(tmp_path, _fusions(TensorProto.FLOAT16), "half")
    rng = np.random.default_rng(4)
    feeds = {"x": (rng.standard_normal((2, 5, 64)) * 3).astype(np.float16)}
    got = module.run(feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {n: v.astype(np.float32) for n, v in feeds.items()})
    for name, w in zip([o.name for o in model.graph.output], want):
        half = w.astype(np.float16)  # one rounding
        # + 1e-6: in the far negative tail (x < -4) 1 + erf and 1 + tanh cancel in float32, where TVM's
        # and onnxruntime's approximations differ by up to 5e-7 (the outputs reach 9: ulp 0.008)
        ulp = np.spacing(np.abs(half)).astype(np.float32) + 1e-6
        assert (np.abs(got[name].astype(np.float32) - half.astype(np.float32)) <= ulp).all(), name


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_transformer_optimizer_output_compiles_and_matches(hf_model, tmp_path, family, half):
    """transformers' legacy export through onnxruntime's transformer optimizer (BERT's MLP becomes
    BiasGelu, GPT-2's FastGelu, the residual norms SkipLayerNormalization), and its float16
    conversion (keep_io_types: Casts after their readers, put in order on load): compiled at
    int4-g32, `qtvm check` against onnxruntime on the same file at three bindings."""
    from onnxruntime.transformers.optimizer import optimize_model

    from qtvm.check import check

    optimized = optimize_model(str(hf_model(family, "legacy")), model_type=family, num_heads=4, hidden_size=64)
    if half:
        optimized.convert_float_to_float16(keep_io_types=True)
    ops = {n.op_type for n in optimized.model.graph.node}
    assert {"SkipLayerNormalization", "BiasGelu" if family == "bert" else "FastGelu"} <= ops
    path = tmp_path / "optimized.onnx"
    optimized.save_model_to_file(str(path))
    result = compile_model(path, tmp_path / "m.so", "host", "int4-g32")
    assert result.metadata["quantized_matmuls"] > 0
    report = check(path, result.path)
    assert len(report.rows) >= 3 and report.ok, [(r.binding, r.name, r.err_own, report.tolerance) for r in report.rows]


# -- GatherBlockQuantized ----------------------------------------------------------------------

def test_gather_block_quantized(tmp_path):
    """A 2-D index tensor with a negative index; 4 bits without zero points (8 implied) and with
    packed ones, 8 and 2 bits; 37 rows, 64 columns in blocks of 16/32."""
    rng = np.random.default_rng(2)
    rows, k = 37, 64
    nodes, inits, outs = [], [], []
    for bits, block, zp in ((4, 32, False), (4, 16, True), (8, 32, True), (2, 16, False)):
        tag = f"b{bits}_{block}_{int(zp)}"
        data = rng.integers(0, 256, (rows, k * bits // 8)).astype(np.uint8)
        scales = (rng.random((rows, k // block)) + 0.5).astype(np.float32)
        names = [f"data_{tag}", "ids", f"scales_{tag}"]
        inits += [numpy_helper.from_array(data, names[0]), numpy_helper.from_array(scales, names[2])]
        if zp:
            packed_zp = rng.integers(0, 256, (rows, -(-(k // block) * bits // 8))).astype(np.uint8)
            inits.append(numpy_helper.from_array(packed_zp, f"zp_{tag}"))
            names.append(f"zp_{tag}")
        nodes.append(helper.make_node("GatherBlockQuantized", names, [f"out_{tag}"], domain=MS, bits=bits,
                                      block_size=block, gather_axis=0, quantize_axis=1))
        outs.append((f"out_{tag}", F32, ["batch", "seq", k]))
    model = _model(nodes, [("ids", I64, ["batch", "seq"])], outs, inits)
    runs = []
    for b, s in ((1, 1), (2, 5)):
        ids = rng.integers(0, rows, (b, s)).astype(np.int64)
        ids[0, 0] = -1
        runs.append(({"batch": b, "seq": s}, {"ids": ids}, None))
    _against_onnxruntime(_compile(tmp_path, model), model, runs, tol=1e-6)


# -- models made by onnxruntime-genai's builder --------------------------------------------

def _ort_greedy(path, inputs: list[dict], prompt: np.ndarray, new: int) -> np.ndarray:
    """onnxruntime's greedy decoding of a builder model, presents fed back; empty caches shaped
    as the artefact's ``inputs`` say (the head size the import pinned)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    caches = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    shapes = {i["name"]: i["shape"] for i in inputs}
    state = {c.name: np.zeros((1, shapes[c.name][1], 0, shapes[c.name][3]), np.float32) for c in caches}
    ids, out, length = prompt[None, :], [], 0
    for _ in range(new):
        length += ids.shape[1]
        res = sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, length), np.int64), **state})
        token = int(res[0][0, -1].argmax())
        out.append(token)
        state = {c.name: r for c, r in zip(caches, res[1:])}
        ids = np.array([[token]], np.int64)
    return np.array(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builder_model(hf_dir, tmp_path, family):
    """Compiled as the builder wrote it (int4 MatMulNBits, accuracy_level 4): the in-place KV step
    is built; ``qtvm check`` against onnxruntime at its default bindings (float activations in
    onnxruntime, as the artefact's) is within float rounding; greedy tokens equal onnxruntime's."""
    from qtvm import runtime
    from qtvm.check import check
    from qtvm.generate import generate

    path = cached_model(hf_dir, family)
    artefact = compile_model(path, tmp_path / f"{family}.so", "host", "int4-g128").path
    module = runtime.load(artefact)
    assert "kv_step" in module.metadata
    report = check(path, artefact)
    assert report.ok, [(r.binding, r.output, r.err_own) for r in report.rows if r.err_own > report.tolerance]
    assert "accuracy_level 0" in report.reference
    prompt = np.array([5, 17, 99, 3, 250], np.int64)
    reference = _ort_greedy(float_activations(path, tmp_path / "acc0.onnx"), module.inputs, prompt, 8)
    np.testing.assert_array_equal(generate(module, prompt, 8)[0, len(prompt):], reference)


def test_builder_model_half_cache(hf_dir, tmp_path):
    """``--kv-cache fp16`` on a builder model: its GroupQueryAttention, lowered to the exported
    attention's form, still reads the cache in place (every attention matmul rewritten), and
    greedy tokens equal onnxruntime's with float32 caches."""
    from qtvm import runtime
    from qtvm.generate import generate

    path = cached_model(hf_dir, "llama")
    module = runtime.load(compile_model(path, tmp_path / "llama16.so", "host", "int4-g128", kv_cache="fp16").path)
    info = module.metadata["kv_step"]
    assert info["cache_dtype"] == "float16" and info["fused_attention"] == 4
    prompt = np.array([5, 17, 99, 3, 250], np.int64)
    reference = _ort_greedy(float_activations(path, tmp_path / "acc0.onnx"), module.inputs, prompt, 8)
    np.testing.assert_array_equal(generate(module, prompt, 8)[0, len(prompt):], reference)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_builder_model_refused_by_name(hf_dir, tmp_path, family):
    """What qtvm does not model yet (Gemma 2's sliding-window cache: its sliding layers keep only
    the window) is refused at import, by name, with nothing written."""
    with pytest.raises(QtvmError, match=REFUSED[family]):
        compile_model(cached_model(hf_dir, family), tmp_path / f"{family}.so", "host", "int4-g128")
    assert not list(tmp_path.iterdir())
