"""LUT-GEMM on GPU targets: tables of 256 sums per 8 activations in shared memory, one
table read per packed byte. PoCL against the BCQ reference, ptxas for sm_80 / sm_90,
the paper's knobs (t_h rows of K per table slice, columns per thread)."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import lut_gemv, ops
from qtvm.formats import get_format
from schedules import facts, gpu, gpu_lut
from tests.gpu import SM80, blocked, check_ptxas, needs_nvcc, needs_opencl, rel_err, run_on_pocl

CASES = [("bcq3-g128", 300, 37), ("bcq2-g64", 1000, 70), ("bcq4-g32", 200, 300)]


def lut_func(preset: str, k: int, n: int, **knobs):
    sch = gpu_lut.schedule_lut_gemv_gpu(lut_gemv.lut_gemv_func(get_format(preset), k, n, 1), SM80, **knobs)
    return sch.mod["main"]


@needs_opencl
@pytest.mark.parametrize("preset,k,n", CASES)
def test_lut_gemv_matches_reference_on_opencl(preset, k, n):
    qt = get_format(preset).quantize(np.random.default_rng(k).standard_normal((k, n)).astype(np.float32))
    func = lut_func(preset, k, n)
    for m in (1, 3):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        assert rel_err(run_on_pocl(func, x, blocked(qt), n), x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_opencl
def test_knobs_t_h_and_columns_per_thread():
    k, n = 512, 70
    qt = get_format("bcq3-g64").quantize(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32))
    x = np.random.default_rng(1).standard_normal((2, k)).astype(np.float32)
    want = x.astype(np.float64) @ qt.dequantize()
    for knobs in ({"t_h": 128, "cols": 1, "threads": 64}, {"t_h": 256, "cols": 4, "threads": 32}):
        assert rel_err(run_on_pocl(lut_func("bcq3-g64", k, n, **knobs), x, blocked(qt), n), want) < 1e-5


def test_rule_declines_slices_it_cannot_make():
    func = lut_gemv.lut_gemv_func(get_format("bcq3-g128"), 384, 64, 1)
    assert gpu_lut.schedule_lut_gemv_gpu(func, SM80, t_h=64) is None  # not whole groups
    assert gpu_lut.schedule_lut_gemv_gpu(func, SM80, t_h=256) is None  # does not divide K
    assert gpu_lut.schedule_lut_gemv_gpu(ops.qmatmul_func(get_format("bcq3-g128"), 384, 64, 1), SM80) is None


def test_gpu_facts_pick_the_bcq_decode_kernel_per_target():
    """CUDA dequantizes (measured faster on an H100); OpenCL keeps LUT-GEMM."""
    from qtvm.target import parse_target

    assert facts(SM80).decode_kernel == {}
    assert facts(parse_target("opencl -device=mali")).decode_kernel == {"bcq": "lut_gemv"}


@needs_nvcc
def test_lut_cuda_fits_without_spills():
    pad = lambda n: -(-n // gpu.COL_PAD) * gpu.COL_PAD  # noqa: E731
    funcs = {f"lut_{p.replace('-', '_')}": lut_func(p, k, pad(n)) for p, k, n in CASES}
    funcs["lut_bcq3_big"] = lut_func("bcq3-g128", 4096, 11008)
    for report in check_ptxas(funcs).values():  # sm_80 and sm_90
        assert report["lut_bcq3_big_kernel"].shared_bytes == 128 // 8 * 256 * 4  # one group's 16 tables
