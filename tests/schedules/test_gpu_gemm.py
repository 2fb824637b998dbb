"""GPU prefill GEMM rule: the scheduled TIR on PoCL against each format's numpy reference
(M not a multiple of the row tile, K not of the K tile or group, N not of the column tile),
and its CUDA through ptxas for sm_80 and sm_90 (no spills, shared memory within 48 KiB)."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm.formats import get_format
from qtvm.ops_gemm import qmatmul_gemm_func
from qtvm.target import parse_target
from schedules import facts, gpu, gpu_gemm
from tests.gpu import SM80, blocked, check_ptxas, needs_nvcc, needs_opencl, rel_err, run_on_pocl, scheduled

CASES = [("int4-g128", 300, 37), ("int3-g128", 1000, 70), ("int2-g64", 1000, 33), ("int8-g32", 200, 9),
         ("int4-g128-qz", 700, 37), ("e0m4-g128", 700, 37), ("bcq3-g128", 300, 40), ("int4-col", 100, 37)]


def gemm_func(preset: str, k: int, n: int, target=SM80):
    return scheduled(qmatmul_gemm_func(get_format(preset), k, n, facts(target).col_block), target)


@needs_opencl
@pytest.mark.parametrize("preset,k,n", CASES)
def test_gemm_matches_reference_on_opencl(preset, k, n):
    qt = get_format(preset).quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))
    func = gemm_func(preset, k, n)
    rng = np.random.default_rng(2)
    for m in (1, 5, 67):  # one kernel, symbolic M: rows padded to tiles of 32 inside the kernel only
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert rel_err(run_on_pocl(func, x, blocked(qt), n), x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_opencl
def test_gemm_scheduled_for_opencl_runs_on_opencl():
    """``--target opencl`` schedules with its own limits (16 KiB of local memory, 256 threads)."""
    target = parse_target("opencl")
    k, n = 1000, 70
    qt = get_format("int4-g128").quantize(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32))
    tiles = gpu_gemm.gemm_tiles(qmatmul_gemm_func(qt.fmt, k, n, 1).attrs["qtvm.format"], target)
    assert (tiles.bm + tiles.bn) * tiles.bk * 4 <= 16384
    x = np.random.default_rng(1).standard_normal((19, k)).astype(np.float32)
    got = run_on_pocl(gemm_func("int4-g128", k, n, target), x, blocked(qt), n)
    assert rel_err(got, x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_nvcc
def test_gemm_cuda_fits_without_spills():
    """Every format's GEMM for sm_80 and sm_90 (int3's K = 1000 has the same 64-deep K tile
    as K = 4096, so only int4 repeats at the 4096 x 11008 shape)."""
    # as the pass builds them: N padded with zero columns to the GPU's column tile
    funcs = {f"gemm_{p.replace('-', '_')}_{k}": gemm_func(p, k, -(-n // gpu.COL_PAD) * gpu.COL_PAD)
             for p, k, n in CASES}
    funcs["gemm_int4_g128_big"] = gemm_func("int4-g128", 4096, 11008)
    for report in check_ptxas(funcs).values():
        assert report["gemm_int4_g128_big_kernel"].shared_bytes == (32 + 64) * 64 * 4  # x and weight tiles


def test_k_tile_is_whole_packed_runs_dividing_padded_k():
    for preset, k in (("int3-g128", 1000), ("int4-col", 100), ("int8-g32", 200), ("int4-g128", 4096)):
        desc = qmatmul_gemm_func(get_format(preset), k, 8, 1).attrs["qtvm.format"]
        tiles = gpu_gemm.gemm_tiles(desc, SM80)
        assert int(desc["padded_k"]) % tiles.bk == 0 and tiles.bk % int(desc["values_per_block"]) == 0
    assert gpu_gemm.gemm_tiles(qmatmul_gemm_func(get_format("int4-g128"), 4096, 8, 1).attrs["qtvm.format"],
                               SM80).bk == 64
