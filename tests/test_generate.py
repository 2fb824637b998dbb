"""Greedy generation over the in-place KV cache (qtvm.generate) against onnxruntime running
the exported model with its presents fed back, token for token; the maximum length; the
fallback for artefacts without the step."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model  # the compiler's TVM first
from tests.frontend.transformers_exports import export_with_position_ids


def ort_greedy(model: onnx.ModelProto, prompt: np.ndarray, new: int, mask: np.ndarray | None = None) -> np.ndarray:
    """onnxruntime's greedy decoding of ``model`` (a KV export): prompt first (past 0), then
    one token at a time with the presents fed back."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    batch = prompt.shape[0]
    caches = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    state = {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32) for i in caches}
    mask = np.ones(prompt.shape, np.int64) if mask is None else mask.astype(np.int64)
    ids, out = prompt, [prompt]
    for step in range(new):
        logits, *presents = sess.run(None, {"input_ids": ids, "attention_mask": mask, **state})
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        out.append(token)
        state = {i.name: p for i, p in zip(caches, presents)}
        ids, mask = token, np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_greedy_matches_onnxruntime(hf_model, hf_compiled, exporter):
    """70 new tokens (the cache crosses a 64-token step, so its rows are moved once): the
    same tokens as onnxruntime, at batch 1 and for a left-padded batch of 2."""
    from qtvm import runtime

    module = runtime.load(hf_compiled("llama", exporter, "none", kv=True).path)
    assert module.session().mode.startswith("in-place")
    model = onnx.load(str(hf_model("llama", exporter, kv=True)))
    prompt = np.array([[3, 141, 59, 26, 53]], np.int64)
    got = module.generate(prompt, 70)
    assert got.shape == (1, 75)
    np.testing.assert_array_equal(got, ort_greedy(model, prompt, 70))
    prompt2 = np.array([[7, 7, 9, 1, 250, 3], [0, 0, 42, 17, 99, 5]], np.int64)
    mask2 = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int64)
    np.testing.assert_array_equal(module.generate(prompt2, 66, attention_mask=mask2),
                                  ort_greedy(model, prompt2, 66, mask2))


def test_greedy_int4_matches_onnxruntime_on_dequantized_weights(hf_model, hf_compiled):
    from qtvm import runtime
    from qtvm.formats import get_format
    from qtvm.reference import dequantized_model

    module = runtime.load(hf_compiled("gpt2", "legacy", "int4-g128", kv=True).path)
    model = dequantized_model(onnx.load(str(hf_model("gpt2", "legacy", kv=True))), get_format("int4-g128"))
    prompt = np.array([[11, 200, 3, 99]], np.int64)
    np.testing.assert_array_equal(module.generate(prompt, 66), ort_greedy(model, prompt, 66))


def test_past_the_maximum_length(hf_compiled):
    """A feed past the maximum length is refused before anything is written: the session's
    length and cache are as they were, and it goes on as if the refused feed never
    happened (its next logits equal a session that never saw it). generate() refuses
    up front."""
    from qtvm import runtime
    from qtvm.generate import ConcatSession

    module = runtime.load(hf_compiled("llama", "legacy", "none", kv=True).path)
    limit = module.metadata["kv_step"]["max_length"]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, (1, limit - 3)).astype(np.int64)
    s = module.session()
    s.feed(prompt)
    before = {name: s.cache(name) for name in module.metadata["kv_step"]["caches"]}
    with pytest.raises(QtvmError, match=f"past the maximum length: the cache holds {limit - 3} tokens and 4 more "
                                        f"would make {limit + 1} > {limit}"):
        s.feed(np.ones((1, 4), np.int64))
    assert s.length == limit - 3
    for name, cache in before.items():
        np.testing.assert_array_equal(s.cache(name), cache)
    tail = np.array([[5, 6, 7]], np.int64)
    reference = ConcatSession(module)
    reference.feed(prompt)
    np.testing.assert_allclose(s.feed(tail), reference.feed(tail), rtol=1e-4, atol=1e-5)
    assert s.length == limit
    with pytest.raises(QtvmError, match="past the maximum length"):
        s.feed(np.ones((1, 1), np.int64))
    with pytest.raises(QtvmError, match=f"{limit - 3} prompt tokens \\+ 5 new need a cache of {limit + 1} > {limit}"):
        module.generate(prompt, 5)


@pytest.mark.parametrize("family,exporter,kv_cache", [("llama", "legacy", "fp16"), ("qwen3", "dynamo", "model")])
def test_device_buffers_session_matches_the_host_session(hf_compiled, family, exporter, kv_cache):
    """The session's GPU branch (caches, mask and ids in device tensors, the mask uploaded per
    feed, rows re-laid through host memory) run with the CPU standing in as the device: the
    same logits and caches as the host session, bit for bit, over a left-padded batch of 2
    whose cache crosses two 64-token layouts, the last-position step included. (On a GPU the
    branch is run by benchmarks/gpu_device_check.py's kv part.)"""
    import tvm

    from qtvm import runtime

    path = hf_compiled(family, exporter, "int4-g128", kv=True, kv_cache=kv_cache).path
    host, device = runtime.load(path), runtime.load(path)
    device._device = tvm.cpu(0)  # a "device" the session copies to and from
    a, b = host.session(2), device.session(2)
    assert a._device is None and b._device is not None and not b._flat
    rng = np.random.default_rng(3)
    mask = np.ones((2, 60), np.int64)
    mask[1, :5] = 0
    for n, last in ((60, True), (1, False), (7, False), (1, True), (70, False), (1, False)):
        ids = rng.integers(0, 256, (2, n)).astype(np.int64)
        m = mask if n == 60 else None
        np.testing.assert_array_equal(b.feed(ids, m, last=last), a.feed(ids, m, last=last))
    assert a.length == b.length == 140 and b._layout == 192
    np.testing.assert_array_equal(b.mask(), a.mask())
    for name in host.metadata["kv_step"]["caches"]:
        np.testing.assert_array_equal(b.cache(name), a.cache(name))
    value = host.metadata["kv_step"]["caches"][1]  # [batch, heads, L, dim]
    heads, dim = b._rows[value][:2]
    padding = b._buffers[value].numpy()[:2 * heads * 192 * dim].reshape(2, heads, 192, dim)[:, :, 140:]
    assert not padding.any()  # the rows' padding zeroed, as on the host


def test_session_errors_and_fallback(hf_compiled, tiny_llama_int4):
    """Batch beyond the compiled plan, wrong ids, a model without a cache; the fallback
    (presents fed back through main) gives the same tokens as the in-place step."""
    from qtvm import runtime
    from qtvm.generate import ConcatSession, generate

    module = runtime.load(hf_compiled("llama", "dynamo", "none", kv=True).path)
    with pytest.raises(QtvmError, match="batch 3 is outside this artefact's KV-cache step \\(batch 1 .. 2\\)"):
        module.session(3)
    with pytest.raises(QtvmError, match="ids have shape \\[2, 3\\], expected \\[1, n >= 1\\]"):
        module.session().feed(np.zeros((2, 3), np.int64))
    prompt = np.array([[1, 2, 3]], np.int64)
    np.testing.assert_array_equal(generate(module, prompt, 20, session_obj=ConcatSession(module)),
                                  module.generate(prompt, 20))
    plain = runtime.load(tiny_llama_int4[0])
    with pytest.raises(QtvmError, match="not a KV-cache export"):
        plain.generate(prompt, 3)


def test_cli_generate(hf_compiled, tmp_path):
    """qtvm generate prints the new tokens (the same as Module.generate); past the maximum
    length it is one line and exit 2."""
    import subprocess
    import sys

    from qtvm import runtime

    art = hf_compiled("llama", "legacy", "none", kv=True).path

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "qtvm.cli", "generate", str(art), *args], capture_output=True,
                              text=True, timeout=300)

    proc = cli("--prompt", "3,141,59", "-n", "12")
    assert proc.returncode == 0, proc.stderr
    want = runtime.load(art).generate(np.array([[3, 141, 59]], np.int64), 12)[0, 3:]
    assert proc.stdout.split() == [str(t) for t in want]
    assert "12 tokens after 3 prompt tokens" in proc.stderr and "in-place cache" in proc.stderr
    np.save(tmp_path / "ids.npy", np.arange(2040, dtype=np.int64) % 256)
    proc = cli("--prompt-file", str(tmp_path / "ids.npy"), "-n", "20")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "past the maximum length: 2040 prompt tokens + 20 new need a cache of 2059 > 2048" in proc.stderr
    proc = cli("--prompt", "1,x")
    assert proc.returncode == 2 and "is not comma-separated token ids" in proc.stderr


def test_fallback_stops_at_the_models_position_limit(hf_model, hf_compiled):
    """GPT-Neo with a cache (its causal masks sliced from a [256, 256] table: past + seq <=
    256): the fallback session (presents fed back) takes that limit as its maximum length, as
    the in-place step does, so a generation past it is refused before any work, naming the
    tables, not a --max-length the model could not use; within it, onnxruntime's tokens from
    both sessions (GPT-Neo's keys are cast to float32, a no-op the step sees through)."""
    from qtvm import runtime
    from qtvm.generate import ConcatSession, generate

    result = hf_compiled("gpt_neo", "legacy", "none", kv=True)
    assert result.metadata["dim_limits"] == {"past + seq": 256}
    module = runtime.load(result.path)
    step, fallback = module.session(), ConcatSession(module)
    assert step.mode.startswith("in-place") and fallback.max_length == step.max_length == 256
    prompt = np.array([[3, 141, 59, 26]], np.int64)
    for s in (step, fallback):
        with pytest.raises(QtvmError, match="4 prompt tokens \\+ 254 new need a cache of 257 > 256; generate fewer "
                                            "tokens \\(the model's position tables hold 256\\)"):
            generate(module, prompt, 254, session_obj=s)
    want = ort_greedy(onnx.load(str(hf_model("gpt_neo", "legacy", kv=True))), prompt, 12)
    np.testing.assert_array_equal(generate(module, prompt, 12, session_obj=step), want)
    np.testing.assert_array_equal(generate(module, prompt, 12, session_obj=fallback), want)


def test_max_length_past_the_models_position_tables_is_refused(hf_model, tmp_path):
    """MPT's ALiBi bias holds past + seq <= 256: an in-place cache of 512 would read its clipped
    last column for every position past 256 (tokens, no error), so --max-length 512 is refused
    with the limit named, and nothing is written; the default is the limit."""
    path = hf_model("mpt", "legacy", kv=True)
    with pytest.raises(QtvmError, match="--max-length 512 is past what this model's position tables hold "
                                        "\\(past \\+ seq <= 256\\); use --max-length 256 or less"):
        compile_model(path, tmp_path / "long.so", "host", "none", max_batch=1, max_length=512)
    assert list(tmp_path.iterdir()) == []
    result = compile_model(path, tmp_path / "m.so", "host", "none", max_batch=1)
    assert result.metadata["kv_step"]["max_length"] == 256


def test_position_ids_input_as_optimum_exports_it(hf_dir, tmp_path):
    """optimum's layout (input_ids, attention_mask, position_ids, caches): the in-place step
    keeps position_ids as an input and the sessions fill it as transformers' generate does
    (a left-padded row's first token at position 0): a left-padded prompt of 2 and two more
    tokens give onnxruntime's logits with those positions, with the step and with the fallback
    (the tiny model's greedy tokens do not move with its positions; its logits do)."""
    from qtvm import runtime
    from qtvm.generate import ConcatSession

    path = export_with_position_ids("llama", hf_dir)
    result = compile_model(path, tmp_path / "m.so", "host", "none", max_batch=2)
    assert result.metadata["kv_step"]["positions"] == "position_ids"
    module = runtime.load(result.path)
    prompt = np.array([[7, 7, 9, 1, 250, 3], [0, 0, 42, 17, 99, 5]], np.int64)
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int64)
    feeds = [(prompt, mask), (np.array([[11], [12]]), np.ones((2, 1), np.int64)),
             (np.array([[13], [14]]), np.ones((2, 1), np.int64))]
    want = _ort_logits(path, feeds, transformers_positions=True)
    wrong = _ort_logits(path, feeds, transformers_positions=False)
    scale = max(float(np.abs(w).max()) for w in want)
    for session in (module.session(2), ConcatSession(module, 2)):
        for (ids, m), w in zip(feeds, want):
            assert np.abs(session.feed(ids, m) - w).max() < 1e-4 * scale, session.mode
    # positions restarted at 0: 0.6% of the largest logit on the tiny model, 60x the tolerance
    assert max(np.abs(b - w).max() for b, w in zip(wrong, want)) > 1e-3 * scale


def _ort_logits(path, feeds, transformers_positions: bool) -> list:
    """onnxruntime's logits of each feed (ids, mask of the new tokens) in turn, the presents fed
    back, position_ids as transformers' generate makes them or restarted at 0 on every call."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    caches = [i for i in sess.get_inputs() if i.name.startswith("past_key_values")]
    state = {i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32) for i in caches}
    full, out = np.zeros((2, 0), np.int64), []
    for ids, m in feeds:
        full = np.concatenate([full, m], axis=1)
        if transformers_positions:
            positions = full.cumsum(-1) - 1
            positions[full == 0] = 1
            positions = positions[:, -ids.shape[1]:]
        else:
            positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64)
        logits, *presents = sess.run(None, {"input_ids": ids.astype(np.int64), "attention_mask": full,
                                            "position_ids": positions, **state})
        state = {i.name: p for i, p in zip(caches, presents)}
        out.append(logits)
    return out
