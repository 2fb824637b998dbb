"""The OpenCL family (``schedules/opencl.py``): devices from the target, their facts in the
rules, and the kernels the family shares with the GPU rules -- prefill GEMM, LUT-GEMM for
BCQ, mixed-2-4-16's parts and CSR outliers -- run on PoCL with each device's launch shape
against the numpy reference of their format (M = 1, 3, 5 and 67; K not a multiple of the
group; N not a multiple of the column tile)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.formats.mixed import mixed_matmul_reference, sparse_outlier_arrays, sparse_outlier_func
from qtvm.lut_gemv import lut_gemv_func
from qtvm.ops_gemm import qmatmul_gemm_func
from qtvm.target import parse_target
from schedules import facts, gpu, gpu_gemm, opencl
from tests.gpu import blocked, needs_opencl, rel_err, run_on_pocl, scheduled

MALI, ADRENO = parse_target("opencl -device=mali"), parse_target("opencl -device=adreno")


def test_device_comes_from_the_target():
    assert opencl.device(MALI).name == "mali" and opencl.device(ADRENO).name == "adreno"
    assert opencl.device(parse_target("opencl -device=mali -model=bifrost")).subgroup == 8
    assert opencl.device(parse_target("opencl")) is None and opencl.device(parse_target("cuda -arch=sm_80")) is None
    # TVM's own GPU rules (dlight) and target keys see a GPU with the device's limits
    assert {"opencl", "gpu", "mali"} <= set(MALI.keys) and {"opencl", "gpu", "adreno"} <= set(ADRENO.keys)
    assert int(ADRENO.attrs["max_threads_per_block"]) == 1024
    assert int(MALI.attrs["max_shared_memory_per_block"]) == 32 << 10
    with pytest.raises(QtvmError, match="unknown OpenCL device 'mail'.*-device=mali"):
        parse_target("opencl -device=mail")


def test_rules_read_the_device_row():
    p = gpu.params(MALI)
    assert (p.lanes, p.warps, p.cols, p.shared_bytes, p.max_threads) == (16, 4, 4, 32 << 10, 512)
    assert gpu.params(ADRENO).lanes == 64
    f = facts(ADRENO)
    assert f.family == "opencl" and f.activations == ("fp32", "fp16", "fp16-acc16")
    assert f.f16_accumulate == {"fp16": "float32", "fp16-acc16": "float16"}
    assert f.f16_activations(get_format("int3-g128"), 4096)  # every uniform width has an OpenCL decode
    assert not f.f16_activations(get_format("bcq3-g128"), 4096)
    tiles = gpu_gemm.gemm_tiles({"padded_k": 4096, "values_per_block": 8}, MALI)
    assert (tiles.bm + tiles.bn) * tiles.bk * 4 <= 32 << 10 and max(tiles.threads) <= 512


def quantized(preset: str, k: int, n: int):
    return get_format(preset).quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))


@needs_opencl
@pytest.mark.parametrize("target,preset,k,n", [(MALI, "int4-g128", 300, 70), (ADRENO, "int3-g128", 1000, 37),
                                               (MALI, "e0m4-g128", 300, 37), (ADRENO, "int2-g64", 200, 65)],
                         ids=["mali-int4", "adreno-int3", "mali-e0m4", "adreno-int2"])
def test_prefill_gemm_on_opencl(target, preset, k, n):
    """Prefill (M above the decode threshold): gpu_gemm's tiles in the device's local memory."""
    qt = quantized(preset, k, n)
    func = scheduled(qmatmul_gemm_func(qt.fmt, k, n, 1), target)
    rng = np.random.default_rng(2)
    for m in (5, 67):
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert rel_err(run_on_pocl(func, x, blocked(qt), n), x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_opencl
@pytest.mark.parametrize("target,preset,k,n", [(ADRENO, "bcq3-g128", 300, 40), (MALI, "bcq2-g64", 200, 37)],
                         ids=["adreno-bcq3", "mali-bcq2"])
def test_lut_gemv_on_opencl(target, preset, k, n):
    """BCQ decode: LUT-GEMM with its tables in the device's local memory."""
    qt = quantized(preset, k, n)
    func = scheduled(lut_gemv_func(qt.fmt, k, n, 1), target)
    rng = np.random.default_rng(3)
    for m in (1, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert rel_err(run_on_pocl(func, x, blocked(qt), n), x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_opencl
def test_mixed_matmul_on_opencl():
    """mixed-2-4-16 on Mali: the 4-bit part, the 2-bit part on its stored 4-bit scale codes,
    then the CSR outliers, each the kernel the pass dispatches to for M."""
    k, n = 300, 70
    qt = quantized("mixed-2-4-16", k, n)
    f = facts(MALI)
    parts = qt.fmt.kernel_parts(qt, **f.parts_options)
    rng = np.random.default_rng(1)
    for m in (1, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.zeros((m, n))
        for rows, part in parts.dense:
            func = ops.qmatmul_func(part.fmt, part.k, n, 1, **f.gemv_options(part.fmt, part.k)) \
                if m <= f.gemv_max_rows else qmatmul_gemm_func(part.fmt, part.k, n, 1)
            y += run_on_pocl(scheduled(func, MALI), x[:, rows], blocked(part), n, half_as_float=True)  # fp16 minima
        outliers = scheduled(sparse_outlier_func(parts.sparse, k, n), MALI)
        y += run_on_pocl(outliers, x, sparse_outlier_arrays(parts.sparse), n, half_as_float=True)
        assert rel_err(y, mixed_matmul_reference(x, qt)) < 1e-5


def test_family_is_picked_by_kind():
    from schedules import family

    assert family(MALI) is opencl and family(tvm.target.Target("opencl")) is opencl
