"""GPU decode GEMV rule: the scheduled TIR on PoCL against each format's numpy reference,
and its CUDA through ptxas for sm_80 and sm_90 (no spills)."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from schedules import facts, gpu, gpu_gemv
from tests.gpu import SM80, blocked, check_ptxas, needs_nvcc, needs_opencl, rel_err, run_on_pocl, scheduled

# One case per format family; K not a multiple of the group (or of 32 lanes' chunks),
# N not a multiple of the columns a block covers.
CASES = [("int4-g128", 300, 37), ("int3-g128", 1000, 70), ("int2-g64", 1000, 33), ("int8-g32", 200, 9),
         ("int4-g128-qz", 700, 37), ("e0m4-g128", 700, 37), ("bcq3-g128", 300, 40), ("int4-col", 100, 37),
         ("int2-g16", 576, 37),  # 36 chunks over 32 lanes: a tail iteration
         ("int4-g128-f16", 300, 37), ("int4-g64-f16-qz", 300, 37),  # float16 scales (and zeros)
         ("int4-g128", 1024, 37), ("e0m4-g128", 2048, 70)]  # no K padding: x read in 32-byte vectors


def gemv_func(preset: str, k: int, n: int, target=SM80):
    fmt = get_format(preset)
    return scheduled(ops.qmatmul_func(fmt, k, n, facts(target).col_block, **facts(target).gemv_options(fmt, k)), target)


def gemv(preset: str, k: int, n: int, target=SM80):
    qt = get_format(preset).quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))
    return qt, gemv_func(preset, k, n, target)


@needs_opencl
@pytest.mark.parametrize("preset,k,n", CASES)
def test_gemv_matches_reference_on_opencl(preset, k, n):
    qt, func = gemv(preset, k, n)
    rng = np.random.default_rng(1)
    for m in (1, 3, 16):  # one kernel, symbolic M (CUDA runs it up to M = 16)
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = run_on_pocl(func, x, blocked(qt), n, half_as_float="-f16" in preset)  # PoCL: no cl_khr_fp16
        assert rel_err(got, x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_nvcc
def test_gemv_cuda_fits_without_spills():
    """The 4096 x 11008 decode shape of every family, plus the awkward test shapes."""
    # as the pass builds them: N padded with zero columns to the GPU's column tile
    funcs = {f"gemv_{p.replace('-', '_')}_{k}": gemv_func(p, k, -(-n // gpu.COL_PAD) * gpu.COL_PAD)
             for p, k, n in CASES}
    for preset in ("int4-g128", "int3-g128", "e0m4-g128-f16"):
        funcs[f"gemv_{preset.replace('-', '_')}_big"] = gemv_func(preset, 4096, 11008)
    for report in check_ptxas(funcs).values():  # sm_80 and sm_90
        assert report["gemv_int4_g128_big_kernel"].registers <= 128  # 4 warps a block, several blocks an SM


def test_gemv_source_streams_coalesced_words():
    """CUDA: a lane's chunk is 16 values (int4: two packed words a column), so a warp's
    weight loads of a column and its x loads are each one contiguous run; 128 threads split K
    and their sums meet through warp shuffles, then shared memory (docs/bench_gpu_h100.md:
    the layout of 32-value chunks, lanes 128 B of x apart, 32 lanes a column, ran 1.2-1.9x slower)."""
    from qtvm.testing.ptxas import cuda_source

    source = cuda_source(gemv_func("int4-g128", 4096, 11008), SM80)
    assert "__launch_bounds__(128)" in source
    assert "*(int2*)(qweight_local_ptr" in source  # a lane's two words of a column: one 8-byte load
    assert "((int64_t)((int)threadIdx.x)) * (int64_t)16)))" in source  # x: 16 floats a lane, lanes adjacent
    assert "__shfl_down_sync" in source and "__shared__" in source


def test_cuda_source_loads_each_lanes_activations_in_32_byte_vectors():
    """Read where used, a warp's x loads (lanes a chunk, 128 bytes, apart) kept L1 busy: on an
    H100 the vector loads made the int4-g128 GEMV 3.4x faster at 8192 x 28672."""
    from qtvm.testing.ptxas import cuda_source

    assert "*(ulonglong4*)(x_local_ptr" in cuda_source(gemv_func("int4-g128", 4096, 11008), SM80)
    padded = cuda_source(gemv_func("int4-g128", 300, 64), SM80)  # K padded: value by value, guarded
    assert "ulonglong4" not in padded and "float4" not in padded


def test_lane_chunks():
    """Whole packed runs filling 16 bytes (one 12-byte run for 3-bit), cut to divide the group;
    on CUDA the fewest whole runs holding 16 values."""
    chunk = lambda preset, k=4096: gpu.lane_chunk(get_format(preset), k)  # noqa: E731
    assert [chunk(p) for p in ("int4-g128", "int2-g64", "int8-g128", "int3-g128", "e0m4-g128", "bcq3-g128",
                               "bcq2-g64", "int2-g16", "int3-g32")] == [32, 64, 16, 32, 32, 32, 64, 16, 32]
    assert chunk("int4-col", 100) == 8  # K padded to 104: one word
    cuda = lambda preset, k=4096: gpu.target_chunk(SM80, get_format(preset), k)  # noqa: E731
    assert [cuda(p) for p in ("int4-g128", "int2-g64", "int8-g128", "int3-g128", "e0m4-g128", "bcq3-g128",
                              "bcq2-g64", "int2-g16", "int3-g32")] == [16, 16, 16, 32, 16, 32, 32, 16, 32]


def test_rule_declines_what_it_was_not_shown_right_on():
    fmt = get_format("int4-g128")
    blocked64 = ops.qmatmul_func(fmt, 256, 64, 64)  # the x86 layout
    assert gpu_gemv.schedule_qmatmul_gpu(blocked64, SM80) is None
    import tvm

    assert gpu_gemv.schedule_qmatmul_gpu(ops.qmatmul_func(fmt, 256, 64, 1), tvm.target.Target("llvm")) is None


# -- fp16 activations (``--act fp16``): the decode TensorIntrins inside the GEMV -----------------
F16_CASES = [("int4-g128", 300, 37), ("int2-g16", 576, 37), ("int8-g32", 200, 9), ("e0m4-g128", 700, 37)]


def gemv_f16_func(preset: str, k: int, n: int, target=SM80):
    fmt = get_format(preset)
    return scheduled(ops.qmatmul_f16_func(fmt, k, n, 1, **facts(target).gemv_options(fmt, k)), target)


@needs_opencl
@pytest.mark.parametrize("preset,k,n", F16_CASES)
def test_fp16_gemv_indexing_on_opencl(preset, k, n):
    """The OpenCL schedule of the same compute (plain decode, no intrinsic), with half spelled
    float: checks indexing, guards and the cross-lane sum, not fp16 rounding."""
    from qtvm.target import parse_target

    qt = get_format(preset).quantize(np.random.default_rng(k).standard_normal((k, n)).astype(np.float32))
    func = gemv_f16_func(preset, k, n, parse_target("opencl"))
    x = np.random.default_rng(3).standard_normal((3, k)).astype(np.float32)
    got = run_on_pocl(func, x, blocked(qt), n, half_as_float=True)
    assert rel_err(got, x.astype(np.float64) @ qt.dequantize()) < 1e-5


@needs_nvcc
def test_fp16_gemv_cuda_uses_the_unpack_intrinsics():
    from qtvm.testing.ptxas import cuda_source

    pad = lambda n: -(-n // gpu.COL_PAD) * gpu.COL_PAD  # noqa: E731
    funcs = {f"f16_{p.replace('-', '_')}": gemv_f16_func(p, k, pad(n)) for p, k, n in F16_CASES}
    funcs["f16_int4_big"] = gemv_f16_func("int4-g128", 11008, 4096)
    for preset in ("int4-g128", "int2-g64", "int8-g32"):  # 128 lanes on K spilled here (sm_80, sm_90)
        funcs[f"f16_{preset.replace('-', '_')}_4096"] = gemv_f16_func(preset, 4096, 11008)
    check_ptxas(funcs)  # sm_80 and sm_90
    source = cuda_source(funcs["f16_int4_big"], SM80)
    assert "qtvm_unpack_u4_f16x8(" in source and "lop3.b32" in source
    assert "__byte_perm" in cuda_source(funcs["f16_int8_g32"], SM80)


def emulate_f16_gemv(x: np.ndarray, qt, chunk: int) -> np.ndarray:
    """What the CUDA fp16 kernel computes (uniform formats): x rounded to fp16, each chunk's
    dot summed in fp16 (one rounding per multiply-add, as HFMA), fp32 across chunks."""
    fmt = qt.fmt
    kp, gs = fmt.padded_k(qt.k), fmt.group_size_for(qt.k)
    codes = fmt.unpack(qt.arrays["qweight"], kp).astype(np.float32)  # [kp, n], exact in fp16
    xh = np.zeros((x.shape[0], kp), np.float32)
    xh[:, :qt.k] = x.astype(np.float16)
    chunks = kp // chunk
    part = np.zeros((x.shape[0], chunks, qt.n), np.float16)
    xc, wc = xh.reshape(-1, chunks, chunk), codes.reshape(chunks, chunk, qt.n)
    for r in range(chunk):
        part = (part.astype(np.float32) + xc[:, :, r, None] * wc[None, :, r, :]).astype(np.float16)
    group = np.arange(chunks) * chunk // gs
    scales, zeros = qt.arrays["scales"][group].astype(np.float64), qt.arrays["zeros"][group].astype(np.float64)
    xsum = xc.sum(axis=2, dtype=np.float64)
    return np.einsum("mcn,cn->mn", part.astype(np.float64), scales) - np.einsum("mc,cn->mn", xsum, zeros * scales)


def test_fp16_activation_error_is_measured():
    """The numerics of ``--act fp16`` (emulated: no GPU here), int4-g128, K = 4096, N = 512,
    against the exact product with the same weights: the activation rounding (2^-11) and
    the fp16 sums of 32 values dominate; reported in the README."""
    k, n = 4096, 512
    rng = np.random.default_rng(0)
    qt = get_format("int4-g128").quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.02)
    x = rng.standard_normal((2, k)).astype(np.float32)
    exact = x.astype(np.float64) @ qt.dequantize().astype(np.float64)
    err = rel_err(emulate_f16_gemv(x, qt, gpu.lane_chunk(qt.fmt, k)), exact)
    assert 1e-5 < err < 5e-3, err  # fp16-sized, and not exact (the emulation rounds)


@needs_opencl
@pytest.mark.parametrize("preset,k,n", [("int4-g128", 300, 37), ("int3-g128", 1000, 70), ("bcq3-g128", 300, 40),
                                        ("e0m4-g128", 700, 37), ("int4-g64-f16-qz", 300, 37)])
def test_routed_experts_gemv_matches_reference_on_opencl(preset, k, n):
    """A mixture of experts' routed matmul on the same layout (a block row per activation row,
    so each row's blocks read its own expert): row i by expert ids[i] mod E, negative ids too."""
    fmt, experts = get_format(preset), 3
    rng = np.random.default_rng(k + n)
    tensors = [fmt.quantize(rng.standard_normal((k, n)).astype(np.float32)) for _ in range(experts)]
    func = scheduled(ops.qmatmul_experts_func(fmt, k, n, 1, experts, **facts(SM80).gemv_options(fmt, k)))
    arrays = ops.expert_arrays(tensors, 1)
    for m in (1, 7):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ids = rng.integers(-experts, experts, m).astype(np.int64)
        want = np.stack([x[i].astype(np.float64) @ tensors[ids[i]].dequantize() for i in range(m)])
        got = run_on_pocl(func, x, [ids, *arrays], n, half_as_float="-f16" in preset)
        assert rel_err(got, want) < 1e-5, m


@needs_nvcc
def test_routed_experts_gemv_cuda_fits_without_spills():
    fmt = get_format("int4-g128")
    func = scheduled(ops.qmatmul_experts_func(fmt, 2048, 1408, 1, 8, **facts(SM80).gemv_options(fmt, 2048)))
    for report in check_ptxas({"experts_int4_g128": func}).values():
        assert report["experts_int4_g128_kernel"].registers <= 128
