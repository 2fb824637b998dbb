"""The last-position step (relay_passes.last_logits): its logits equal the step's last row
(a prompt of 1, 5, 66 tokens, batch 1 and 2, left padding, fp32 and int8 activations),
generation takes the same tokens, and the cases it declines or the compile drops."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from qtvm.pipeline import compile_model
from relay_passes.last_logits import LAST_FUNC, add_last_logits
from tests.relay_passes.test_kv_cache import _mini_kv_model


def _last_matches_full(module, batch: int, lengths, tol: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    vocab = module.outputs[0]["shape"][-1]
    full, last = module.session(batch), module.session(batch)
    for n in lengths:
        ids = rng.integers(0, vocab, (batch, n)).astype(np.int64)
        mask = np.ones((batch, n), np.int64)
        if batch > 1 and full.length == 0:
            mask[1, :2] = 0  # a left-padded second row
        want = full.feed(ids, mask)[:, -1:]
        got = last.feed(ids, mask, last=True)
        assert got.shape == (batch, 1, vocab)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= tol, f"{n} tokens at batch {batch}: relative error {err:.2e}"


@pytest.mark.parametrize("family,exporter", [("llama", "legacy"), ("llama", "dynamo"), ("gemma2", "dynamo")])
def test_transformers_export_last_logits(hf_compiled, family, exporter):
    """Gemma 2: its logits end in a softcap (scalar constants) after a tied LM head."""
    from qtvm import runtime

    result = hf_compiled(family, exporter, "int4-g128", kv=True)
    assert result.metadata["kv_step"]["last_function"] == LAST_FUNC
    module = runtime.load(result.path)
    for batch in (1, 2):
        _last_matches_full(module, batch, (5, 66, 1, 3), tol=1e-5, seed=batch)
    prompt = np.random.default_rng(7).integers(0, module.outputs[0]["shape"][-1], (2, 9)).astype(np.int64)
    want = [prompt]
    s = module.session(2)
    logits = s.feed(prompt)
    for _ in range(6):  # greedy over the full logits, as generate did before
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        want.append(token)
        logits = s.feed(token)
    np.testing.assert_array_equal(module.generate(prompt, 6), np.concatenate(want, axis=1))


def test_mini_model_int8_and_fp32(tmp_path):
    from qtvm import runtime

    path = tmp_path / "mini.onnx"
    onnx.save(_mini_kv_model(), str(path))
    for act in ("fp32", "int8"):
        result = compile_model(path, tmp_path / f"mini_{act}.so", "host", "none", act, max_length=140, max_batch=2)
        assert result.metadata["kv_step"]["last_function"] == LAST_FUNC
        module = runtime.load(result.path)
        _last_matches_full(module, 2, (1, 70, 2), tol=1e-6)


def test_declines_logits_that_mix_positions():
    """Logits normalized over the sequence (a softmax along it) are no row-wise chain: no
    second function, and why; nor logits without a sequence axis to take the last of."""
    bb = relax.BlockBuilder()
    seq = tvm.tirx.Var("seq", "int64")
    x = relax.Var("x", relax.TensorType([1, seq, 8], "float32"))
    with bb.function("step", [x]):
        with bb.dataflow():
            mixed = bb.emit(relax.op.nn.softmax(x, axis=1))
            out = bb.emit_output(relax.op.multiply(mixed, relax.const(np.float32(2.0))))
        bb.emit_func_output(out)
    mod = bb.get()
    same, why = add_last_logits(mod, "step", "seq")
    assert LAST_FUNC not in [gv.name_hint for gv in same.get_global_vars()]
    assert "row-wise" in why

    bb = relax.BlockBuilder()
    with bb.function("step", [x]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, relax.ShapeExpr([seq, 8])))
            out = bb.emit_output(relax.op.matmul(flat, relax.const(np.ones((8, 4), np.float32))))
        bb.emit_func_output(out)
    _, why = add_last_logits(bb.get(), "step", "seq")
    assert "[batch, seq, vocab]" in why  # the runtime takes the last position on axis 1


def test_last_step_that_disagrees_is_dropped(tmp_path, monkeypatch):
    """The compile runs the last-position step against the step; one that disagrees is not
    shipped (feed(last=True) then slices the full logits) and the note says why."""
    from qtvm import generate, runtime

    path = tmp_path / "mini.onnx"
    onnx.save(_mini_kv_model(), str(path))
    monkeypatch.setattr(generate, "check_last", lambda module, tol: "logits differ (simulated)")
    result = compile_model(path, tmp_path / "bad.so", "host", "none", max_length=70)
    assert result.metadata["kv_step"]["last_function"] is None
    assert any("every position (logits differ (simulated))" in n for n in result.notes), result.notes
    module = runtime.load(result.path)
    assert module.session(1)._step_last is None
    _last_matches_full(module, 1, (4, 1), tol=0)


def test_builds_for_a_gpu_target(tmp_path):
    """A CUDA build carries the last-position step too (compiled here; run where a GPU is)."""
    path = tmp_path / "mini.onnx"
    onnx.save(_mini_kv_model(), str(path))
    result = compile_model(path, tmp_path / "mini_cuda.so", '{"kind": "cuda", "arch": "sm_80"}', "none")
    assert result.metadata["kv_step"]["last_function"] == LAST_FUNC


def test_scalar_constants_keep_the_chain_row_wise():
    """Gemma 2's final softcap (logits / 30, tanh, * 30) has scalar constants: a row-wise
    chain (it once declined, taking a scalar for a matrix), and the last row matches."""
    bb = relax.BlockBuilder()
    seq = tvm.tirx.Var("seq", "int64")
    x = relax.Var("x", relax.TensorType([2, seq, 8], "float32"))
    rng = np.random.default_rng(0)
    with bb.function("step", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((8, 5)).astype(np.float32))))
            y = bb.emit(relax.op.divide(y, relax.const(np.float32(30.0))))
            y = bb.emit(relax.op.tanh(y))
            out = bb.emit_output(relax.op.multiply(y, relax.const(np.float32(30.0))))
        bb.emit_func_output(out)
    mod, why = add_last_logits(bb.get(), "step", "seq")
    assert why is None
    exe = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    data = rng.standard_normal((2, 6, 8)).astype(np.float32)
    full = vm["step"](tvm.runtime.tensor(data)).numpy()
    last = vm[LAST_FUNC](tvm.runtime.tensor(data)).numpy()
    assert last.shape == (2, 1, 5)
    np.testing.assert_allclose(last, full[:, -1:], rtol=1e-6, atol=1e-6)
