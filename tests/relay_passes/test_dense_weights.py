"""--quant none: constant-weight matmuls become the scheduled dense kernel; others stay."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import tvm

from qtvm.frontend.onnx import import_onnx
from qtvm.target import parse_target
from relay_passes.dense_weights import dense_weights
from tests.conftest import mlp_model


def _calls(mod, prefix):
    return [gv.name_hint for gv, f in mod.functions_items() if gv.name_hint.startswith(prefix)]


def test_constant_weights_rewritten_computed_ones_kept():
    mod, n = dense_weights(import_onnx(mlp_model()), parse_target("host"), min_weights=0)
    assert n == 2  # fc1 (Gemm transB=1, through permute_dims) and fc2; not x @ x^T
    assert sorted(_calls(mod, "dense_")) == ["dense_100x70", "dense_70x37"]
    text = mod["main"].script()
    assert text.count("R.matmul") == 1  # the gram matrix


def test_other_targets_keep_plain_matmuls():
    mod = import_onnx(mlp_model())
    same, n = dense_weights(mod, tvm.target.Target({"kind": "c"}))
    assert n == 0 and same is mod


def test_small_weights_left_to_the_generic_rule():
    from schedules.x86_dense import MIN_WEIGHTS

    mod, n = dense_weights(import_onnx(mlp_model(k=100, hidden=70, n=37)), parse_target("host"))
    assert 100 * 70 < MIN_WEIGHTS and n == 0


def test_float_model_matches_onnxruntime(tmp_path):
    """Through the pipeline: K x N = 400 x 200 and 200 x 170, above the size threshold."""
    import onnx

    from qtvm import runtime
    from qtvm.pipeline import compile_model

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(k=400, hidden=200, n=170), str(path))
    result = compile_model(path, tmp_path / "f.so", "host", "none")
    assert result.metadata["dense_matmuls"] == 2
    module = runtime.load(result.path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 64, 67):
        x = np.random.default_rng(batch).standard_normal((batch, 400)).astype(np.float32)
        got = module.run({"x": x})
        want = session.run(None, {"x": x})
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["gram"], want[1], rtol=1e-5, atol=1e-3)
