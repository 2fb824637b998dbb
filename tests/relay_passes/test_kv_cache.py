"""The in-place KV-cache step (relay_passes.kv_cache): its structure, the step against main
on several bindings (batch 1 and 2, past 0 / 3 / 64 / 67, one token and several) with
garbage in the padded cache rows, and the cases it declines."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.pipeline import build_module, compile_model  # the compiler's TVM first
from qtvm.errors import QtvmError
from relay_passes.kv_cache import PAD, STEP_FUNC
from tests.gpu import needs_nvcc

LENGTH = "kv_blocks * T.int64(64)"  # kv_length as the step's shapes print
from tests.frontend.transformers_exports import feeds


def _dim(d):
    return int(d.value) if hasattr(d, "value") else str(d)


def _round(n: int) -> int:
    return -(-n // PAD) * PAD


def run_step(module, x: dict, past: int, rng, garbage: bool = True):
    """The step on main's inputs ``x`` (past caches [B, H, past, D]): caches laid out for
    kv_length = past + seq rounded up to 64, random finite values in the padded rows and
    a zero mask there. Returns (logits, caches [B, H, L, D], what the padding held)."""
    import tvm
    import tvm_ffi

    info = module.metadata["kv_step"]
    ids = x[info["ids"]]
    batch, seq = ids.shape
    total = past + seq
    length = _round(total)
    args, caches, before = [], {}, {}
    layouts = dict(zip(info["caches"], info["layouts"]))
    for spec in module.inputs:
        name = spec["name"]
        if name == info["ids"]:
            args.append(tvm.runtime.tensor(ids))
        elif name == info["mask"]:
            mask = np.zeros((batch, length), np.int64)
            mask[:, :total] = x[name]
            args.append(tvm.runtime.tensor(mask))
        else:
            b, heads, _, dim = x[name].shape
            dtype = info.get("cache_dtype", "float32")  # --kv-cache fp16: past rows rounded as the session holds them
            buf = rng.standard_normal((b, heads, length, dim)).astype(dtype) if garbage else \
                np.zeros((b, heads, length, dim), dtype)
            buf[:, :, :past] = x[name]
            before[name] = buf.copy()
            # keys the attention reads as k^T are kept transposed: [b, h, dim, length]
            caches[name] = tvm.runtime.tensor(buf.transpose(0, 1, 3, 2).copy() if layouts[name] == "bhdl" else buf)
            args.append(caches[name])
    logits = module.entry(STEP_FUNC)(*args, tvm_ffi.Shape((past, length // PAD)))
    back = {k: v.numpy().transpose(0, 1, 3, 2) if layouts[k] == "bhdl" else v.numpy() for k, v in caches.items()}
    return logits.numpy(), back, before


@pytest.mark.parametrize("exporter", ["legacy"])
def test_step_structure(hf_model, exporter):
    """Caches become buffers written in place (one call_tir_inplace per cache, no concat of
    them): values [batch, heads, kv_length, dim], keys transposed [batch, heads, dim,
    kv_length], both multiplied in the attention as they are (no repeat of the KV heads, no
    transpose); presents are not outputs; the symbols carry upper bounds for memory planning."""
    mod, meta, _, notes = build_module(hf_model("llama", exporter, kv=True), "host", "none", max_length=100,
                                       max_batch=3)
    info = meta["kv_step"]
    assert info["caches"] == [f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]
    assert (info["ids"], info["mask"], info["max_length"], info["max_batch"]) == ("input_ids", "attention_mask", 100, 3)
    func = mod[STEP_FUNC]
    shapes = [[_dim(d) for d in p.ty.shape.values] for p in func.params[:-1]]
    assert shapes[0] == ["batch", "seq"] and shapes[1] == ["batch", LENGTH]
    assert shapes[2::2] == [["batch", 2, 16, LENGTH]] * 2 and shapes[3::2] == [["batch", 2, LENGTH, 16]] * 2, shapes
    assert info["layouts"] == ["bhdl", "bhld"] * 2 and info["fused_attention"] == 4
    text = func.script()
    assert text.count("R.call_tir_inplace") == 4 and "past_key_values_0_key," in text
    assert "R.concat((past_key" not in text and "R.broadcast_to" not in text and "R.expand_dims(lv" in text
    grouped = [line for line in text.splitlines() if "R.matmul(" in line and "(batch, 2, seq * 2, " in line]
    assert len(grouped) == 4, grouped  # q and p grouped by KV head: [batch, kv heads, 2 heads x seq, .]
    assert [_dim(d) for d in func.ret_ty.shape.values] == ["batch", "seq", 256]  # logits only
    bounds = {k: int(v) for k, v in func.attrs["tir_var_upper_bound"].items()}
    assert bounds == {"batch": 3, "seq": 100, "kv_blocks": 2, "kv_past": 100}
    assert not [n for n in notes if "KV" in n]


@pytest.mark.parametrize("family,exporter", [("llama", "legacy"), ("llama", "dynamo"), ("gemma2", "dynamo"),
                                             ("gemma3", "legacy"), ("qwen3", "dynamo"), ("gpt2", "legacy")])
def test_step_equals_main(hf_compiled, family, exporter):
    """Logits and cache rows of the step equal main's logits and presents; the padded rows
    (random values, mask 0) change nothing and are left as they were. Gemma 2 and 3 have
    sliding-window layers (window 4 here: pasts of 3 to 67 reach past it and the 64-key pad). Positions that are
    themselves padding (the left-padded second row at past 0) attend to no key at all:
    their outputs mean nothing in either function (main averages over past + seq keys,
    the step over kv_length), so they are not compared."""
    from qtvm import runtime

    module = runtime.load(hf_compiled(family, exporter, "none", kv=True).path)
    rng = np.random.default_rng(1)
    # seq 40 and 35: Qwen3's grouped rows (4 heads a kv head) reach 64 and run q @ K^T's key-panel nest;
    # seq 70: every family's, GPT-2's one row a head (MHA) padded to whole tiles
    for batch, seq, past in [(1, 1, 0), (2, 3, 0), (1, 1, 3), (2, 3, 3), (1, 1, 64), (2, 1, 63), (2, 3, 67),
                             (1, 40, 0), (2, 35, 20), (1, 70, 0), (2, 66, 5)]:
        x = feeds(module.inputs, batch, seq, past, seed=past * 10 + seq + batch)
        want = module.run(x)
        logits, caches, before = run_step(module, x, past, rng)
        real = x["attention_mask"][:, past:] == 1  # [batch, seq]: query positions that are tokens
        assert real.sum() >= batch * seq - 2
        scale = np.abs(want["logits"]).max()
        err = np.abs(logits - want["logits"])[real].max() / scale
        assert err < 1e-5, f"batch {batch} seq {seq} past {past}: logits rel err {err:.2e}"
        total = past + seq
        keys = x["attention_mask"] == 1  # [batch, total]
        for name, cache in caches.items():
            present = want[name.replace("past_key_values", "present")]
            np.testing.assert_allclose(cache[:, :, :total].transpose(0, 2, 1, 3)[keys],
                                       present.transpose(0, 2, 1, 3)[keys], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(cache[:, :, total:], before[name][:, :, total:])


@pytest.mark.parametrize("family,exporter", [("llama", "legacy"), ("qwen3", "dynamo"), ("gpt2", "legacy")])
def test_half_cache_step_within_rounding_of_main(hf_compiled, family, exporter):
    """``--kv-cache fp16``: float16 cache buffers; main is fed the past as the cache holds it
    (rounded), so what differs is the new rows' rounding, carried through the layers: rows
    written and logits within 3e-3 of main's (relative to the largest), at grouped rows, one
    row a head and the key-panel nest (seq 40 / 70); the padded rows are left alone."""
    from qtvm import runtime

    result = hf_compiled(family, exporter, "none", kv=True, kv_cache="fp16")
    module = runtime.load(result.path)
    assert module.metadata["kv_step"]["cache_dtype"] == "float16"
    assert any(n.startswith("KV caches held in float16 (--kv-cache fp16): the step's logits within") for n in
               result.notes), result.notes
    rng = np.random.default_rng(2)
    errors = []
    for batch, seq, past in [(1, 1, 0), (2, 3, 3), (2, 1, 63), (1, 40, 0), (1, 70, 0), (2, 66, 5)]:
        x = feeds(module.inputs, batch, seq, past, seed=past * 10 + seq + batch)
        for name in module.metadata["kv_step"]["caches"]:  # main sees the past as the cache holds it
            x[name] = x[name].astype(np.float16).astype(np.float32)
        want = module.run(x)
        logits, caches, before = run_step(module, x, past, rng)
        real = x["attention_mask"][:, past:] == 1
        err = np.abs(logits - want["logits"])[real].max() / np.abs(want["logits"]).max()
        errors.append(err)
        assert err < 3e-3, f"batch {batch} seq {seq} past {past}: logits rel err {err:.2e}"
        total, keys = past + seq, x["attention_mask"] == 1
        for name, cache in caches.items():
            assert cache.dtype == np.float16
            present = want[name.replace("past_key_values", "present")].transpose(0, 2, 1, 3)[keys]
            rows = cache[:, :, :total].transpose(0, 2, 1, 3)[keys].astype(np.float32)
            assert np.abs(rows - present).max() < 3e-3 * np.abs(present).max(), name
            np.testing.assert_array_equal(cache[:, :, total:], before[name][:, :, total:])
    assert max(errors) > 0  # the cache is rounded: bit-for-bit logits would mean float32 was read


def test_half_cache_session_generates_like_main(hf_compiled):
    """The generation session over a ``--kv-cache fp16`` artefact: float16 buffers (half the
    bytes of the float32 artefact's), and logits within 3e-3 of main fed its own presents,
    over a 5-token prompt and 30 single tokens (the past crosses a 64-key block)."""
    from qtvm import runtime
    from qtvm.generate import ConcatSession, KVSession

    half = runtime.load(hf_compiled("llama", "legacy", "none", kv=True, kv_cache="fp16").path)
    full = runtime.load(hf_compiled("llama", "legacy", "none", kv=True).path)
    step, reference, plain = KVSession(half, 2), ConcatSession(half, 2), KVSession(full, 2)
    assert {b.dtype for b in step._flat.values()} == {np.dtype(np.float16)}
    assert sum(b.nbytes for b in step._flat.values()) * 2 == sum(b.nbytes for b in plain._flat.values())
    rng = np.random.default_rng(3)
    for n in [5] + [1] * 30 + [3]:
        ids = rng.integers(0, 100, (2, n)).astype(np.int64)
        got, want = step.feed(ids), reference.feed(ids)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert 0 < err < 3e-3, f"past {reference.length - n}: logits rel err {err:.2e}"
    name = half.metadata["kv_step"]["caches"][0]
    assert step.cache(name).dtype == np.float16 and step.cache(name).shape[2] == reference.length


def _mini_kv_model(extra_use: bool = False) -> onnx.ModelProto:
    """Single-head attention over a KV cache: ids -> embedding = q = k = v, present =
    Concat(past, k), masked softmax, logits = context @ W. ``extra_use``: the past input
    also feeds a second output (the rewrite must decline)."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((16, 4)).astype(np.float32)
    w = rng.standard_normal((4, 16)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["e"]),
        helper.make_node("Unsqueeze", ["e", "one"], ["k"]),
        helper.make_node("Concat", ["past", "k"], ["present"], axis=2),
        helper.make_node("Transpose", ["present"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["k", "kt"], ["scores"]),
        helper.make_node("Unsqueeze", ["attention_mask", "one_two"], ["m4"]),
        helper.make_node("Cast", ["m4"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["mf", "fone"], ["m0"]),
        helper.make_node("Mul", ["m0", "big"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present"], ["ctx"]),
        helper.make_node("Squeeze", ["ctx", "one"], ["c"]),
        helper.make_node("MatMul", ["c", "w"], ["logits"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 16]),
               helper.make_tensor_value_info("present", TensorProto.FLOAT, ["batch", 1, "past + seq", 4])]
    if extra_use:
        nodes.append(helper.make_node("ReduceSum", ["past"], ["total"], keepdims=1))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, [1, 1, 1, 1]))
    inits = [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "one_two"),
             numpy_helper.from_array(np.array(1.0, np.float32), "fone"),
             numpy_helper.from_array(np.array(1e9, np.float32), "big")]
    graph = helper.make_graph(nodes, "mini_kv", [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "past + seq"]),
        helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", 1, "past", 4])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def test_declines_a_past_used_elsewhere(tmp_path, capfd):
    """A past input read by anything but its append: no step, a note, nothing of TVM's on stderr."""
    import gc

    path = tmp_path / "extra.onnx"
    onnx.save(_mini_kv_model(extra_use=True), str(path))
    mod, meta, _, notes = build_module(path, "host", "none")
    assert "kv_step" not in meta and STEP_FUNC not in [gv.name_hint for gv in mod.functions]
    assert any("no in-place KV-cache step ('past' is used other than by the concat" in n for n in notes), notes
    gc.collect()  # the builder of the abandoned step is gone: TVM would warn of an unfinished block
    assert capfd.readouterr().err == ""


def test_no_step_without_a_cache(tiny_llama_int4):
    _, result = tiny_llama_int4
    assert "kv_step" not in result.metadata
    assert not [n for n in result.notes if "KV" in n]


def test_step_that_disagrees_with_main_is_dropped(tmp_path, monkeypatch):
    """The compile runs the step against main; a step that disagrees is not shipped (the
    artefact keeps main, generation falls back to feeding presents back) and says why."""
    from qtvm import generate

    path = tmp_path / "mini.onnx"
    onnx.save(_mini_kv_model(), str(path))
    good = compile_model(path, tmp_path / "good.so", "host", "none", max_length=70)
    assert good.metadata["kv_step"]["max_length"] == 70
    monkeypatch.setattr(generate, "step_errors", lambda module: {"logits at past 0, 3 tokens": 0.5})
    bad = compile_model(path, tmp_path / "bad.so", "host", "none")
    assert "kv_step" not in bad.metadata
    assert any("no in-place KV-cache step (logits at past 0, 3 tokens: 5.00e-01 from main's (relative to its "
               "largest value))" in n for n in bad.notes), bad.notes


@pytest.mark.parametrize("target", [pytest.param("cuda -arch=sm_90", marks=needs_nvcc), "opencl -device=mali"])
def test_half_cache_builds_for_gpu_targets(hf_model, tmp_path, target):
    """``--kv-cache fp16`` for a GPU: the mixed-dtype attention matmuls (float32 q or p, the
    float16 cache) are scheduled by the GPU rules and the artefact builds (nvcc for CUDA); not
    run here (no GPU; the step is checked against main only where it runs)."""
    result = compile_model(hf_model("llama", "legacy", True), tmp_path / "gpu16.so", target, "int4-g128",
                           kv_cache="fp16", host="llvm")
    info = result.metadata["kv_step"]
    assert info["cache_dtype"] == "float16" and info["fused_attention"] == 4
    assert "the KV-cache step was not run against main here (another machine's target)" in result.notes
    if target.startswith("cuda"):  # no GPU here: the session says so in one line (it was TVM's device mismatch)
        from qtvm import runtime
        from qtvm.cuda import device_arch

        if device_arch() is None:
            with pytest.raises(QtvmError, match="runs on an NVIDIA GPU \\(sm_90 or newer\\) but no CUDA device"):
                runtime.load(result.path).generate(np.array([[1, 2, 3]], np.int64), 2)


def test_step_tolerance_widens_only_for_a_half_cache():
    from qtvm.pipeline import step_tolerance

    def meta(acts, cache_dtype, model_dtype="float32"):
        return {"activations": acts, "inputs": [{"name": "past", "dtype": model_dtype}],
                "kv_step": {"caches": ["past"], "cache_dtype": cache_dtype}}
    assert step_tolerance(meta("fp32", "float32")) == 1e-3 and step_tolerance(meta("int8", "float32")) == 3e-2
    assert step_tolerance(meta("fp32", "float16")) == 1e-2 and step_tolerance(meta("int8", "float16")) == 6e-2
    assert step_tolerance(meta("fp32", "float16", "float16")) == 1e-3  # a float16 model's own cache


def test_half_cache_read_by_an_attention_the_rewrite_leaves(tmp_path):
    """A cache the attention rewrite does not take (the mini model reads its present twice)
    is widened back to float32 for the model's own ops; the step, checked against main at
    compile, is kept; a model with no cache at all only gets a note."""
    path = tmp_path / "mini.onnx"
    onnx.save(_mini_kv_model(), str(path))
    result = compile_model(path, tmp_path / "mini16.so", "host", "none", max_length=70, kv_cache="fp16")
    info = result.metadata["kv_step"]
    assert info["cache_dtype"] == "float16" and info["fused_attention"] == 0
    assert any(n.startswith("KV caches held in float16") for n in result.notes), result.notes
    from tests.conftest import mlp_model

    onnx.save(mlp_model(), str(tmp_path / "mlp.onnx"))
    _, meta, _, notes = build_module(tmp_path / "mlp.onnx", "host", "none", kv_cache="fp16")
    assert "kv_step" not in meta and "--kv-cache fp16 changes nothing (no in-place cache)" in notes


@pytest.mark.parametrize("kv_cache", ["model", "fp16"])
def test_grouped_attention_matmuls_are_scheduled_right(hf_dir, kv_cache):
    """The step's attention matmuls (q and p grouped by KV head: rows = heads per KV head x
    seq, here 4 x seq: whole register tiles, no padded copies) under the generic CPU rule
    equal TVM's default loops at several bindings of batch, seq and kv_length; a float16
    cache (widened as it is read) takes the same register-tile rule."""
    from qtvm.bench.e2e import export_model
    from qtvm.target import parse_target
    from schedules.verify import compare
    import re

    from schedules.x86_generic import fuse_generic_ops, generic_schedules

    cfg = {"hidden": 128, "layers": 1, "intermediate": 64, "vocab": 64, "heads": 8, "kv_heads": 2}
    path = hf_dir / "llama_rep4_kv.onnx"
    if not path.exists():
        export_model(cfg, path)
    target = parse_target("host")
    mod, meta, *_ = build_module(path, target, "none", max_length=256, kv_cache=kv_cache)
    assert meta["kv_step"]["fused_attention"] == 2
    assert meta["kv_step"]["cache_dtype"] == ("float16" if kv_cache == "fp16" else "float32")
    fused = fuse_generic_ops(mod, target)
    def attention(func):  # a reduction whose buffers span the cache length
        text = func.script()
        return "T.axis.remap" in text and '"SSSSR"' in text and "kv_blocks" in text

    step = fused[STEP_FUNC].script()  # (the last-logits step calls copies of them)
    pairs = [(gv.name_hint, fused[gv], sch) for gv, sch in generic_schedules(fused, target).items()
             if sch is not None and attention(fused[gv]) and re.search(rf"\b{gv.name_hint}\b", step)]
    assert len(pairs) == 2, [p[0] for p in pairs]
    # whole tiles (4 x seq rows; head dim 16 and 64 x kv_blocks columns): no padded copies of the cache
    assert not any("_pad" in sch.script() for _, _, sch in pairs)
    for name, func, sch in pairs:  # the matmul rule's register tile, reading the cache in its dtype
        assert 'scope="local"' in sch.script() and ("float16" in func.script()) == (kv_cache == "fp16"), name
    bindings = [{"batch": b, "seq": s, "kv_blocks": n} for b, s, n in [(1, 1, 1), (2, 3, 1), (1, 67, 2), (3, 64, 3)]]
    bad = [f"{name}: {m}" for name, func, scheduled in pairs for m in compare(func, scheduled, target, bindings)]
    assert not bad, bad
