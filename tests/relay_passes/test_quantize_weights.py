"""The Relax pass: constant-weight matmuls become packed kernels, others stay float."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

from qtvm.formats import get_format
from qtvm.frontend.onnx import import_onnx
from qtvm.reference import dequantized_model
from relay_passes.quantize_weights import quantize_weights
from tests.conftest import mlp_model

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})


@pytest.mark.parametrize("preset", ["int4-g32", "int4-col", "int3-g64", "int8-g128"])
def test_rewrites_gemm_transb_and_matmul(preset):
    model = mlp_model()
    mod, report = quantize_weights(import_onnx(model), get_format(preset), TARGET)
    assert [(layer.k, layer.n) for layer in report.layers] == [(100, 70), (70, 37)]
    assert report.float_matmuls == 1  # x @ x^T
    kernels = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {name.split("_" + preset.replace("-", "_"))[0] for name in kernels if "qmatmul" in name} == \
        {"qmatmul", "qmatmul_gemm"}  # decode GEMV and prefill GEMM, chosen at run time by M
    ex = tvm.compile(mod, target=TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows in (1, 2, 17):  # both sides of the GEMV/GEMM dispatch
        x = np.random.default_rng(rows).standard_normal((rows, 100)).astype(np.float32)
        y, gram = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
        ref = session.run(None, {"x": x})
        assert np.abs(y - ref[0]).max() / np.abs(ref[0]).max() < 1e-5
        np.testing.assert_allclose(gram, ref[1], rtol=1e-5, atol=1e-4)


def test_same_shape_shares_one_kernel():
    model = mlp_model(k=64, hidden=64, n=64)
    mod, report = quantize_weights(import_onnx(model), get_format("int4-g32"), TARGET)
    assert len(report.layers) == 2
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sorted(kernels) == ["qmatmul_gemm_int4_g32_64x64", "qmatmul_int4_g32_64x64"]


@pytest.mark.parametrize("preset", ["bcq3-g32", "bcq2-g64"])
def test_bcq_gemv_runs_the_lut16_kernel(preset):
    """BCQ decode matmuls take the 16-entry LUT kernel (schedules.x86_lut.prefer_lut16);
    prefill keeps the dequantize-once GEMM; both sides match onnxruntime's dequantized model."""
    model = mlp_model()
    mod, _ = quantize_weights(import_onnx(model), get_format(preset), TARGET)
    kinds = {str(f.attrs["qtvm.kernel"]) for _, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "qtvm.kernel" in f.attrs}
    assert kinds == {"lut16_gemv", "qmatmul_gemm"}
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows in (1, 2, 3, 67):
        x = np.random.default_rng(rows).standard_normal((rows, 100)).astype(np.float32)
        y, _ = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
        ref = session.run(None, {"x": x})[0]
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
