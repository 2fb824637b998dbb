"""Each OpenCL kernel family once under Oclgrind with data-race, uninitialized-value and
API checks (``qtvm.testing.oclgrind``), on Mali and Adreno launch shapes with tails (K not
a multiple of the group or of the lanes' chunks, N not a multiple of the column tile, M
past the decode threshold for the GEMM), local memory the devices' 32 KiB: decode GEMV
(fp32, and fp16 with its as_half2 decode, half spelled float), prefill GEMM, LUT-GEMM,
CSR outliers. Their outputs must also match the numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from qtvm.formats.mixed import sparse_outlier_arrays, sparse_outlier_func
from qtvm.lut_gemv import lut_gemv_func
from qtvm.ops_gemm import qmatmul_gemm_func
from qtvm.target import parse_target
from qtvm.testing import oclgrind, opencl
from schedules import facts
from tests.gpu import blocked, rel_err, scheduled

MALI, ADRENO = parse_target("opencl -device=mali"), parse_target("opencl -device=adreno")


def quantized(preset: str, k: int, n: int):
    return get_format(preset).quantize(np.random.default_rng(k).standard_normal((k, n)).astype(np.float32))


def case(func, qt, m: int, half_as_float: bool = False, arrays=None):
    x = np.random.default_rng(m).standard_normal((m, qt.k)).astype(np.float32)
    y = np.full((m, qt.n), np.nan, np.float32)
    return (opencl.build(func, half_as_float=half_as_float), [x, *(arrays or blocked(qt)), y])


@pytest.mark.skipif(not oclgrind.available(), reason="apt-get install oclgrind")
def test_kernel_families_are_race_free_under_oclgrind():
    """Small shapes (Oclgrind simulates every instruction): about 15 s in all."""
    gemv_q, f16_q, gemm_q, lut_q, mixed_q = (quantized("int4-g32", 600, 37), quantized("e0m4-g32", 300, 37),
                                             quantized("int4-g32", 40, 37), quantized("bcq2-g32", 40, 37),
                                             quantized("mixed-2-4-16", 300, 37))
    f = facts(MALI)
    gemv = ops.qmatmul_func(gemv_q.fmt, 600, 37, 1, **f.gemv_options(gemv_q.fmt, 600))  # 19 chunks over 16 lanes
    f16 = ops.qmatmul_f16_func(f16_q.fmt, 300, 37, 1, **f.gemv_options(f16_q.fmt, 300), accumulate="float32")
    csr = mixed_q.fmt.kernel_parts(mixed_q, **f.parts_options).sparse
    cases = {
        "decode GEMV (Mali)": (case(scheduled(gemv, MALI), gemv_q, 3), gemv_q),
        "decode GEMV fp16 (Adreno)": (case(scheduled(f16, ADRENO), f16_q, 1, half_as_float=True), f16_q),
        "prefill GEMM (Mali)": (case(scheduled(qmatmul_gemm_func(gemm_q.fmt, 40, 37, 1), MALI), gemm_q, 5), gemm_q),
        "LUT-GEMM (Adreno)": (case(scheduled(lut_gemv_func(lut_q.fmt, 40, 37, 1), ADRENO), lut_q, 2), lut_q),
        "CSR outliers (Mali)": (case(scheduled(sparse_outlier_func(csr, 300, 37), MALI), mixed_q, 3, True,
                                     sparse_outlier_arrays(csr)), None),
    }
    result = oclgrind.run([c for c, _ in cases.values()], local_mem_bytes=32 << 10)
    assert result.errors == [], "\n".join(result.errors)
    for (name, (_, qt)), arrays in zip(cases.items(), result.outputs):
        x, y = arrays[0], arrays[-1]
        if qt is None:  # the outliers alone: x @ S
            indptr, indices, values = csr
            want = np.zeros((x.shape[0], 37))
            for j in range(37):
                rows = indices[indptr[j]:indptr[j + 1]]
                want[:, j] = x[:, rows].astype(np.float64) @ values[indptr[j]:indptr[j + 1]].astype(np.float64)
        else:
            want = x.astype(np.float64) @ qt.dequantize()
        assert rel_err(y, want) < 1e-5, name


def test_a_race_is_reported():
    """The check can fail: a kernel whose work-items all write one local word unsynchronized."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def racy(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                with T.sblock("w"):
                    b[0] = a[tx]

    if not oclgrind.available():
        pytest.skip("apt-get install oclgrind")
    result = oclgrind.run([(opencl.build(racy), [np.arange(64, dtype=np.float32), np.zeros(64, np.float32)])])
    assert any("race" in line.lower() for line in result.errors), result.log
