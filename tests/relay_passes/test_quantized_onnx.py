"""Markers -> packed kernels through quantize_weights' emitter, then out of main's signature."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from qtvm.frontend.onnx import import_onnx
from qtvm.frontend.quantized import lower_quantized
from relay_passes.quantized_onnx import lower_prequantized
from tests.quantized_models import OPSETS, blocked_dq_layer, model_of

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})


def test_markers_become_kernels_and_leave_the_signature():
    layers = [blocked_dq_layer("mm", "x", "a", 64, 64, 32, signed=True, seed=0),  # MatMul weight [K, N]
              blocked_dq_layer("gemm", "x", "b", 64, 64, 32, signed=False, gemm=True, seed=1)]  # Gemm transB [N, K]
    model = model_of(layers, [("x", ["batch", 64])], [("a", ["batch", 64]), ("b", ["batch", 64])], opsets=OPSETS[:1])
    lowered = lower_quantized(model)
    mod = import_onnx(lowered.model)
    assert [p.name for p in mod["main"].params] == ["x", *lowered.weights]
    mod, report, prequantized = lower_prequantized(mod, lowered.weights, None, TARGET, "fp32")
    assert prequantized == 2 and report.float_matmuls == 0
    assert [p.name for p in mod["main"].params] == ["x"]
    assert int(mod["main"].attrs["num_input"]) == 1
    kernels = sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert kernels == ["qmatmul_gemm_int4_g32_qz_64x64", "qmatmul_int4_g32_qz_64x64"]  # one pair, shared by both layers
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    x = np.random.default_rng(0).standard_normal((5, 64))
    a, b = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x.astype(np.float32))))
    for got, (_, _, w) in zip((a, b), layers):
        assert np.abs(got - x @ w).max() <= 2e-6 * np.abs(x @ w).max()
