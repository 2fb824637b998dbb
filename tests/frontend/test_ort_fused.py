"""onnxruntime's fused BERT ops written as standard ops at load (qtvm/frontend/ort_fused.py): each
decomposition against onnxruntime's own kernel of the fused op (the file as stored, run by
onnxruntime, against the loaded graph run by onnxruntime) at several bindings, padded masks
included; compiled, against the fused op; refusals by name; a BERT through onnxruntime's
transformer optimizer (Attention, EmbedLayerNormalization, SkipLayerNormalization, BiasGelu)
compiled at int4 and checked with padded masks."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import load_onnx
from qtvm.pipeline import compile_model  # the compiler's TVM first

MS = "com.microsoft"
F32, I32 = TensorProto.FLOAT, TensorProto.INT32
BINDINGS = [(1, 1), (2, 7), (3, 5)]


def _model(nodes, inputs, outputs, inits, opset):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _attention(mask: str, opset: int, unidirectional: int = 0, bias: bool = False, v_size: int = 24,
               sizes_attr: bool = True):
    """x [b, s, 16] -> Attention(num_heads 2, q/k 16, v ``v_size``) with ``mask``: none, key
    lengths [b], raw [b, s] or [b, s, s]; ``bias``: an attention_bias [1, 2, s, s] input;
    ``sizes_attr``: qkv_hidden_sizes stated (onnxruntime's quantizer leaves such a node float)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((16, 32 + v_size)) * 0.3).astype(np.float32), "w")
    b = numpy_helper.from_array((rng.standard_normal(32 + v_size) * 0.1).astype(np.float32), "b")
    inputs = [("x", F32, ["batch", "seq", 16])]
    names = ["x", "w", "b"]
    if mask != "none":
        inputs.append(("mask", I32, {"lengths": ["batch"], "raw2d": ["batch", "seq"],
                                     "raw3d": ["batch", "seq", "seq"]}[mask]))
        names.append("mask")
    if bias:
        inputs.append(("bias", F32, [1, 2, "seq", "seq"]))
        names += [""] * (4 - len(names)) + ["", "bias"]
    sizes = {"qkv_hidden_sizes": [16, 16, v_size]} if sizes_attr else {}
    node = helper.make_node("Attention", names, ["y"], domain=MS, num_heads=2, unidirectional=unidirectional,
                            mask_filter_value=-5000.0, **sizes)
    return _model([node], inputs, [("y", F32, ["batch", "seq", v_size])], [w, b], opset)


def _attention_feeds(mask: str, batch: int, seq: int, bias: bool, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, seq, 16)).astype(np.float32)}
    lengths = np.maximum(seq - np.arange(batch) * 2, 1)  # row r padded by 2r at the right
    if mask == "lengths":
        feeds["mask"] = lengths.astype(np.int32)
    elif mask == "raw2d":
        feeds["mask"] = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    elif mask == "raw3d":
        feeds["mask"] = rng.integers(0, 2, (batch, seq, seq)).astype(np.int32)
        feeds["mask"][..., 0] = 1
    if bias:
        feeds["bias"] = rng.standard_normal((1, 2, seq, seq)).astype(np.float32)
    return feeds


def _loaded(tmp_path, model, name="m"):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path, load_onnx(path)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("mask,unidirectional,bias", [("none", 0, False), ("lengths", 0, False), ("raw2d", 0, True),
                                                      ("raw3d", 0, False), ("none", 1, False), ("raw2d", 1, True)])
def test_attention_written_as_standard_ops_is_onnxruntimes_kernel(tmp_path, mask, unidirectional, bias, opset):
    """Key lengths, raw 2-D and 3-D masks, causal, an attention bias, V heads wider than Q/K's, a
    mask_filter_value: the standard ops onnxruntime runs give its fused kernel's outputs."""
    model = _attention(mask, opset, unidirectional, bias)
    path, loaded = _loaded(tmp_path, model)
    assert [n.op_type for n in loaded.graph.node].count("MatMul") == 3  # x @ W, Q K^T, P V
    assert not any(n.domain == MS for n in loaded.graph.node)
    onnx.checker.check_model(loaded)
    for batch, seq in BINDINGS:
        feeds = _attention_feeds(mask, batch, seq, bias)
        [want], [got] = _run(model, feeds), _run(loaded, feeds)
        assert np.abs(got - want).max() <= 2e-6, (batch, seq)


@pytest.mark.parametrize("mask,unidirectional", [("lengths", 0), ("raw2d", 1)])
def test_attention_compiles_to_the_fused_ops_outputs(tmp_path, mask, unidirectional):
    """Compiled float and int4-g32 (the QKV weight is packed as a MatMul weight): float within
    float rounding of onnxruntime's fused kernel; int4 within it of onnxruntime on the decomposed
    graph with the weight dequantized (qtvm check's reference)."""
    from qtvm import runtime
    from qtvm.check import check

    model = _attention(mask, 17, unidirectional)
    path, _ = _loaded(tmp_path, model)
    module = runtime.load(compile_model(path, tmp_path / "f.so", "host", "none").path)
    for batch, seq in BINDINGS:
        feeds = _attention_feeds(mask, batch, seq, False)
        [want] = _run(model, feeds)
        assert np.abs(module.run(feeds)["y"] - want).max() <= 2e-6
    result = compile_model(path, tmp_path / "q.so", "host", "int4-g32")
    assert result.metadata["quantized_matmuls"] == 1
    assert any("fused Attention x1 written as standard ops" in n for n in result.notes)
    report = check(path, result.path, feeds=_attention_feeds(mask, 2, 7, False), bindings=[{"batch": 2, "seq": 7}])
    assert report.ok and report.rows[0].err_vs_float > 10 * report.rows[0].err_own  # quantized, and held to it


def _attention_with_past(mask: str, unidirectional: int):
    """GPT-2's fused attention with a cache: x [b, s, 16], past [2, b, 2, past, 8] -> y, present;
    ``mask`` none, raw [b, past + s] or key lengths [b]."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((16, 48)) * 0.3).astype(np.float32), "w")
    b = numpy_helper.from_array((rng.standard_normal(48) * 0.1).astype(np.float32), "b")
    inputs = [("x", F32, ["batch", "seq", 16]), ("past", F32, [2, "batch", 2, "past", 8])]
    names = ["x", "w", "b", "", "past"]
    if mask != "none":
        inputs.append(("mask", I32, {"raw2d": ["batch", "past + seq"], "lengths": ["batch"]}[mask]))
        names[3] = "mask"
    node = helper.make_node("Attention", names, ["y", "present"], domain=MS, num_heads=2,
                            unidirectional=unidirectional)
    return _model([node], inputs, [("y", F32, ["batch", "seq", 16]), ("present", F32, [2, "batch", 2, "past + seq", 8])],
                  [w, b], 17)


def _past_feeds(mask: str, batch: int, seq: int, past: int, seed: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, seq, 16)).astype(np.float32),
             "past": rng.standard_normal((2, batch, 2, past, 8)).astype(np.float32)}
    starts = np.minimum(np.arange(batch) * 2, past)  # row r left-padded by 2r (within the past)
    if mask == "raw2d":
        feeds["mask"] = (np.arange(past + seq)[None, :] >= starts[:, None]).astype(np.int32)
    elif mask == "lengths":
        feeds["mask"] = np.maximum(past + seq - np.arange(batch), 1).astype(np.int32)
    return feeds


PAST_BINDINGS = [(1, 1, 0), (1, 1, 5), (2, 3, 4), (3, 1, 7)]  # batch, seq, past (0: the prompt)


@pytest.mark.parametrize("mask,unidirectional", [("none", 1), ("raw2d", 1), ("raw2d", 0), ("lengths", 1)])
def test_attention_with_a_past_state_is_onnxruntimes_kernel(tmp_path, mask, unidirectional):
    """A past state (GPT-2 through onnxruntime's optimizer with a cache): y and present of the
    standard ops are the fused kernel's, causal from each query's position after the past, at
    prompt (past 0) and decode bindings, left-padded rows."""
    model = _attention_with_past(mask, unidirectional)
    _, loaded = _loaded(tmp_path, model)
    assert not any(n.domain == MS for n in loaded.graph.node)
    for batch, seq, past in PAST_BINDINGS:
        feeds = _past_feeds(mask, batch, seq, past)
        want, got = _run(model, feeds), _run(loaded, feeds)
        assert got[1].shape == (2, batch, 2, past + seq, 8)
        for w_, g in zip(want, got):
            assert np.abs(g - w_).max() <= 2e-6, (batch, seq, past)


def test_attention_with_a_past_state_compiles(tmp_path):
    """Compiled float, the cache an input and present an output: within float rounding of the
    fused kernel at each binding."""
    from qtvm import runtime

    model = _attention_with_past("raw2d", 1)
    path, _ = _loaded(tmp_path, model)
    module = runtime.load(compile_model(path, tmp_path / "f.so", "host", "none").path)
    for batch, seq, past in PAST_BINDINGS:
        feeds = _past_feeds("raw2d", batch, seq, past)
        want = _run(model, feeds)
        got = module.run(feeds)
        assert np.abs(got["y"] - want[0]).max() <= 2e-6 and np.abs(got["present"] - want[1]).max() <= 1e-7


def _embed(opset: int, segments: bool, mask: bool, positions: bool, with_sum: bool = True):
    rng = np.random.default_rng(2)
    tables = {"word": (30, 16), "pos": (40, 16), "seg": (2, 16)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in tables.items()]
    inits += [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32), "gamma"),
              numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "beta")]
    inputs = [("ids", I32, ["batch", "seq"])]
    names = ["ids", "segment_ids" if segments else "", "word", "pos", "seg" if segments else "", "gamma", "beta",
             "mask" if mask else "", "position_ids" if positions else ""]
    for used, name in ((segments, "segment_ids"), (mask, "mask"), (positions, "position_ids")):
        if used:
            inputs.append((name, I32, ["batch", "seq"]))
    outputs = [("y", F32, ["batch", "seq", 16]), ("mask_index", I32, ["batch"]), ("sum", F32, ["batch", "seq", 16])]
    outputs = outputs if with_sum else outputs[:2]  # onnxruntime's quantizer leaves a node with the sum float
    node = helper.make_node("EmbedLayerNormalization", names, [o[0] for o in outputs], domain=MS, epsilon=1e-5)
    return _model([node], inputs, outputs, inits, opset)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("segments,mask,positions", [(True, True, False), (False, False, False), (True, True, True)])
def test_embed_layer_norm_written_as_standard_ops_is_onnxruntimes_kernel(tmp_path, opset, segments, mask, positions):
    """word[ids] + position[0..S-1 or position_ids] + segment[segment_ids], layer-normed (opset 17's
    LayerNormalization, before it its function body); mask_index the mask's row sums (zeros
    without one); the sum as output 2: against onnxruntime's fused kernel, then compiled."""
    from qtvm import runtime

    model = _embed(opset, segments, mask, positions)
    path, loaded = _loaded(tmp_path, model)
    assert not any(n.domain == MS for n in loaded.graph.node)
    module = runtime.load(compile_model(path, tmp_path / "m.so", "host", "none").path)
    rng = np.random.default_rng(3)
    for batch, seq in BINDINGS:
        feeds = {"ids": rng.integers(0, 30, (batch, seq)).astype(np.int32)}
        if segments:
            feeds["segment_ids"] = rng.integers(0, 2, (batch, seq)).astype(np.int32)
        if mask:
            feeds["mask"] = rng.integers(0, 2, (batch, seq)).astype(np.int32)
        if positions:
            feeds["position_ids"] = rng.integers(0, 40, (batch, seq)).astype(np.int32)
        want = _run(model, feeds)
        got = module.run(feeds)
        for name, w, g in zip(["y", "mask_index", "sum"], want, _run(loaded, feeds)):
            assert np.abs(g.astype(np.float64) - w).max() <= 2e-6, (name, batch, seq)
            assert np.abs(got[name].astype(np.float64) - w).max() <= 2e-6, (name, batch, seq)


def _quantize_dynamic(tmp_path, model, per_channel: bool, name: str) -> onnx.ModelProto:
    """onnxruntime's quantize_dynamic of ``model``: Attention -> QAttention (x by
    DynamicQuantizeLinear, W int8 per tensor or per column), EmbedLayerNormalization ->
    QEmbedLayerNormalization (uint8 tables)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, out = tmp_path / f"{name}_float.onnx", tmp_path / f"{name}.onnx"
    onnx.save(model, str(src))
    quantize_dynamic(str(src), str(out), per_channel=per_channel, weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": TensorProto.FLOAT})
    return onnx.load(str(out))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("mask", ["lengths", "raw2d"])
def test_quantize_dynamics_qattention_is_onnxruntimes_kernel(tmp_path, mask, per_channel):
    """QAttention from onnxruntime's quantizer: the Attention of x and W dequantized (W's int8
    codes read as quantized ONNX: one packed matmul), against onnxruntime's integer kernel at
    each binding, loaded and compiled."""
    from qtvm import runtime

    model = _quantize_dynamic(tmp_path, _attention(mask, 17, v_size=16, sizes_attr=False), per_channel, "qa")
    assert [n.op_type for n in model.graph.node].count("QAttention") == 1
    path, loaded = _loaded(tmp_path, model, "qa_saved")
    assert not any(n.domain == MS for n in loaded.graph.node)
    result = compile_model(path, tmp_path / "qa.so", "host", "none")
    assert result.metadata.get("quantized_matmuls", 0) == 1
    assert any("fused QAttention x1" in n for n in result.notes)
    module = runtime.load(result.path)
    for batch, seq in BINDINGS:
        feeds = _attention_feeds(mask, batch, seq, False)
        [want], [got] = _run(model, feeds), _run(loaded, feeds)
        assert np.abs(got - want).max() <= 1e-5, (batch, seq)  # integer GEMM then scales vs dequantized
        assert np.abs(module.run(feeds)["y"] - want).max() <= 1e-5, (batch, seq)


def test_quantize_dynamics_qembed_layer_norm_is_onnxruntimes_kernel(tmp_path):
    """QEmbedLayerNormalization (uint8 tables, scales, zero points): EmbedLayerNormalization of
    the tables dequantized, against onnxruntime's kernel, loaded and compiled."""
    from qtvm import runtime

    model = _quantize_dynamic(tmp_path, _embed(14, True, True, False, with_sum=False), False, "qe")
    assert [n.op_type for n in model.graph.node].count("QEmbedLayerNormalization") == 1
    path, loaded = _loaded(tmp_path, model, "qe_saved")
    assert not any(n.domain == MS for n in loaded.graph.node)
    module = runtime.load(compile_model(path, tmp_path / "qe.so", "host", "none").path)
    rng = np.random.default_rng(6)
    names = [o.name for o in model.graph.output]
    for batch, seq in BINDINGS:
        feeds = {"ids": rng.integers(0, 30, (batch, seq)).astype(np.int32),
                 "segment_ids": rng.integers(0, 2, (batch, seq)).astype(np.int32),
                 "mask": rng.integers(0, 2, (batch, seq)).astype(np.int32)}
        want, got = _run(model, feeds), module.run(feeds)
        for name, w, g in zip(names, want, _run(loaded, feeds)):
            assert np.abs(g.astype(np.float64) - w).max() <= 2e-6, (name, batch, seq)
            assert np.abs(got[name].astype(np.float64) - w).max() <= 2e-6, (name, batch, seq)


def test_a_qattention_refused_is_named_as_in_the_file(tmp_path):
    """A QAttention of a form not modelled is refused under its own name, not the Attention it is read as."""
    model = _quantize_dynamic(tmp_path, _attention("raw2d", 17, v_size=16, sizes_attr=False), False, "qr")
    node = next(n for n in model.graph.node if n.op_type == "QAttention")
    node.attribute.append(helper.make_attribute("do_rotary", 1))
    path = tmp_path / "qr_rotary.onnx"
    onnx.save(model, str(path))
    with pytest.raises(QtvmError, match=f"com.microsoft.QAttention '{node.name}': qtvm does not read its rotary"):
        load_onnx(path)


def test_forms_not_modelled_are_refused_by_name(tmp_path):
    """A shared past/present buffer, rotary inside the op, the [2 x batch] key-range mask, a 4-D mask: each named,
    in one line, on load (not left to a wrong answer)."""
    base = _attention("none", 17)
    cases = {"shared past/present buffer": dict(attrs={"past_present_share_buffer": 1}),
             "past_sequence_length": dict(inputs=["x", "w", "b", "", "", "", "plen"], extra=("plen", I32, [1])),
             "rotary": dict(attrs={"do_rotary": 1}),
             "2 x batch": dict(inputs=["x", "w", "b", "mask"], extra=("mask", I32, ["two_batch"])),
             "rank 4": dict(inputs=["x", "w", "b", "mask"], extra=("mask", I32, ["batch", 1, 8, 8]))}
    for i, (what, case) in enumerate(cases.items()):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        node = model.graph.node[0]
        if "inputs" in case:
            del node.input[:]
            node.input.extend(case["inputs"])
            model.graph.input.append(helper.make_tensor_value_info(*case["extra"]))
        for k, v in case.get("attrs", {}).items():
            node.attribute.append(helper.make_attribute(k, v))
        path = tmp_path / f"refused{i}.onnx"
        onnx.save(model, str(path))
        with pytest.raises(QtvmError, match=what) as e:
            load_onnx(path)
        assert "\n" not in str(e.value) and "com.microsoft.Attention" in str(e.value)


def _optimized_bert(tmp_path) -> str:
    """A tiny eager-attention BERT, transformers' legacy export, through onnxruntime's optimizer:
    Attention, EmbedLayerNormalization, SkipLayerNormalization, BiasGelu (the SDPA export is not
    fused into Attention)."""
    import torch
    import transformers as tf
    from onnxruntime.transformers.optimizer import optimize_model

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=128)
    config._attn_implementation = "eager"
    bert = tf.BertModel(config, add_pooling_layer=False).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    args = (torch.randint(0, 64, (2, 7)), torch.ones(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long))
    plain = tmp_path / "bert.onnx"
    torch.onnx.export(Hidden(), args, str(plain), input_names=names, output_names=["hidden"], opset_version=14,
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "hidden"]}, dynamo=False)
    optimized = optimize_model(str(plain), model_type="bert", num_heads=4, hidden_size=64)
    path = tmp_path / "bert_optimized.onnx"
    optimized.save_model_to_file(str(path))
    return path


def test_bert_through_onnxruntimes_optimizer_compiles_and_matches(tmp_path):
    """The optimizer's BERT was refused (com.microsoft Attention and EmbedLayerNormalization); now
    float within 1e-6 of onnxruntime running the fused file, int4-g32 (the 8 weights, QKV ones
    included) held by qtvm check to the dequantized model, right-padded masks included."""
    from qtvm.check import check

    path = _optimized_bert(tmp_path)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Attention", "EmbedLayerNormalization", "SkipLayerNormalization", "BiasGelu"} <= ops
    rng = np.random.default_rng(5)
    mask = np.ones((3, 9), np.int64)
    mask[1, 6:], mask[2, 2:] = 0, 0
    feeds = {"input_ids": rng.integers(0, 64, (3, 9)), "attention_mask": mask,
             "token_type_ids": rng.integers(0, 2, (3, 9))}
    for quant in ("none", "int4-g32"):
        result = compile_model(path, tmp_path / f"{quant}.so", "host", quant)
        assert result.metadata.get("quantized_matmuls", 0) == (0 if quant == "none" else 8)
        for given in (None, feeds):
            report = check(path, result.path, feeds=given, bindings=[{"batch": 3, "seq": 9}] if given else None)
            assert report.ok, [(r.binding, r.err_own) for r in report.rows]
            if quant == "none":
                assert max(r.err_vs_float for r in report.rows) <= 1e-6  # the fused file, run by onnxruntime


def test_bert_through_the_optimizer_and_quantize_dynamic_compiles_and_matches(tmp_path):
    """onnxruntime's BERT quantization recipe (optimize_model, then quantize_dynamic: QAttention,
    QEmbedLayerNormalization, MatMulInteger): every matmul read as quantized, checked against
    onnxruntime on the quantized file at qtvm check's bindings and with padded masks."""
    from qtvm.check import check

    model = _quantize_dynamic(tmp_path, onnx.load(str(_optimized_bert(tmp_path))), False, "bert_q")
    ops = {n.op_type for n in model.graph.node}
    assert {"QAttention", "QEmbedLayerNormalization", "MatMulInteger"} <= ops
    path = tmp_path / "bert_q.onnx"
    rng = np.random.default_rng(7)
    mask = np.ones((3, 9), np.int64)
    mask[1, 6:], mask[2, 2:] = 0, 0
    feeds = {"input_ids": rng.integers(0, 64, (3, 9)), "attention_mask": mask,
             "token_type_ids": rng.integers(0, 2, (3, 9))}
    result = compile_model(path, tmp_path / "bert_q.so", "host", "none")
    assert result.metadata.get("quantized_matmuls", 0) == 8
    for given in (None, feeds):
        report = check(path, result.path, feeds=given, bindings=[{"batch": 3, "seq": 9}] if given else None)
        assert report.ok and max(r.err_vs_float for r in report.rows) <= 1e-5, [(r.binding, r.err_vs_float) for r in report.rows]
