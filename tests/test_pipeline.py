"""The bundled model, compiled once, against onnxruntime on the dequantized weights."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtvm.formats import get_format
from qtvm.reference import dequantized_model


@pytest.fixture(scope="module")
def sessions(tiny_llama_path):
    model = onnx.load(str(tiny_llama_path))
    deq = dequantized_model(model, get_format("int4-g128"))
    return (ort.InferenceSession(deq.SerializeToString(), providers=["CPUExecutionProvider"]),
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]))


# M = batch * seq rows: 1 and 2 take the GEMV branch, the others the GEMM (prefill) branch.
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 1), (1, 5), (1, 33), (2, 5), (2, 33)])
def test_one_artefact_matches_ort_dequantized(tiny_llama_int4, sessions, batch, seq):
    from qtvm import runtime

    module = runtime.load(tiny_llama_int4[0])
    ids = np.random.default_rng(batch * 100 + seq).integers(0, 512, (batch, seq)).astype(np.int64)
    got = module.run({"input_ids": ids})["logits"]
    want = sessions[0].run(None, {"input_ids": ids})[0]
    assert got.shape == (batch, seq, 512)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
    # The quantization error itself is real (not a float model in disguise) but bounded.
    float_out = sessions[1].run(None, {"input_ids": ids})[0]
    rel_float = np.abs(got - float_out).max() / np.abs(float_out).max()
    assert 1e-3 < rel_float < 1.0


def test_compile_summary(tiny_llama_int4):
    meta = tiny_llama_int4[1].metadata
    assert meta["quantized_matmuls"] == 15
    assert meta["float_weight_bytes"] / meta["packed_bytes"] > 6.5  # int4 + fp32 scale/zero per 128
    assert meta["inputs"] == [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}]
    assert any("4 MatMul/Gemm whose weight is not a constant" in n for n in tiny_llama_int4[1].notes)


def test_artefact_smaller_than_float_weights(tiny_llama_int4):
    path, result = tiny_llama_int4
    assert path.stat().st_size < result.metadata["float_weight_bytes"] / 2


def test_failed_export_leaves_nothing(mlp_path, tmp_path, monkeypatch):
    import tvm

    from qtvm import pipeline

    def broken_export(self, path, *a, **k):
        open(path, "wb").write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tvm.runtime.Executable, "export_library", broken_export)
    with pytest.raises(RuntimeError):
        pipeline.compile_model(mlp_path, tmp_path / "out.so", "llvm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx"]


def test_float_build_matches_onnxruntime(mlp_path, tmp_path):
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    out = compile_model(mlp_path, tmp_path / "f.so", "llvm", "none").path
    x = np.random.default_rng(1).standard_normal((4, 100)).astype(np.float32)
    got = runtime.load(out).run({"x": x})
    want = ort.InferenceSession(str(mlp_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)


FAMILY_PRESETS = ["int3-g128", "int2-g64", "int8-g128", "int4-col", "int4-g128-qz", "int4-g128-f16", "mixed-2-4-16"]


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_every_family_compiles_the_bundled_model(tiny_llama_path, tmp_path, preset):
    """One artefact per preset; matches ORT on the same format's dequantized weights.

    mixed-2-4-16 also covers two layers sharing a shape but not their outlier layout.
    """
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    result = compile_model(tiny_llama_path, tmp_path / "m.so", "host", preset)
    module = runtime.load(result.path)
    ids = np.random.default_rng(7).integers(0, 512, (2, 9)).astype(np.int64)
    got = module.run({"input_ids": ids})["logits"]
    deq = dequantized_model(onnx.load(str(tiny_llama_path)), get_format(preset))
    want = ort.InferenceSession(deq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
    assert result.metadata["quantized_matmuls"] == 15


@pytest.mark.parametrize("preset", ["e0m4-g128", "int3-g64", "mixed-2-4-16"])
def test_int8_activations_end_to_end(tiny_llama_path, tmp_path, preset):
    """--act int8 through the pass: E0M4 via its code-affine form; int3 re-laid in byte
    planes (K = 704 is not a multiple of its 64-row groups); mixed's 4-bit part too,
    while its 2-bit part (16-row groups, finer than the 32-value activation blocks) keeps
    fp32 activations and says so."""
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    result = compile_model(tiny_llama_path, tmp_path / "m.so", "host", preset, "int8")
    fallbacks = [note for note in result.notes if "int8 activations not available" in note]
    if preset == "mixed-2-4-16":
        assert len(fallbacks) == 1 and "int2-g16" in fallbacks[0] and "int4" not in fallbacks[0]
    else:
        assert not fallbacks, result.notes
    ids = np.random.default_rng(3).integers(0, 512, (1, 7)).astype(np.int64)
    got = runtime.load(result.path).run({"input_ids": ids})["logits"]
    deq = dequantized_model(onnx.load(str(tiny_llama_path)), get_format(preset))
    want = ort.InferenceSession(deq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < rel < 0.05  # int8 rounding of activations is visible, and bounded
