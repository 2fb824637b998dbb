"""The CSR outlier term of mixed-2-4-16 on GPU targets, and the whole mixed matmul
(two dense parts on gathered activations + outliers) against the format's reference."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from qtvm.ops_gemm import qmatmul_gemm_func
from qtvm.formats.mixed import mixed_matmul_reference, sparse_outlier_arrays, sparse_outlier_func
from schedules import facts, gpu_sparse
from tests.gpu import SM80, blocked, check_ptxas, needs_nvcc, needs_opencl, rel_err, run_on_pocl, scheduled

K, N = 300, 70


@pytest.fixture(scope="module")
def mixed():
    fmt = get_format("mixed-2-4-16")
    return fmt.quantize(np.random.default_rng(0).standard_normal((K, N)).astype(np.float32))


def outlier_kernel(csr):
    return gpu_sparse.schedule_outliers_gpu(sparse_outlier_func(csr, K, N), SM80).mod["main"]


@needs_opencl
def test_mixed_matmul_on_opencl(mixed):
    """y = x[:, idx4] @ W4 + x[:, idx2] @ W2 + x @ S, each part a GPU kernel; the 2-bit
    part's scales are decoded from their stored 4-bit codes inside its kernel."""
    gpu = facts(SM80)
    parts = mixed.fmt.kernel_parts(mixed, **gpu.parts_options)
    assert len(parts.dense) == 2 and parts.sparse is not None and len(parts.sparse[2]) > 0
    assert parts.dense[1][1].fmt.name == "int2-g16-so4x16"
    rng = np.random.default_rng(1)
    for m in (1, 3, 67):
        x = rng.standard_normal((m, K)).astype(np.float32)
        y = np.zeros((m, N))
        for rows, part in parts.dense:  # the kernel the pass dispatches to for this M
            if m <= gpu.gemv_max_rows:
                func = ops.qmatmul_func(part.fmt, part.k, N, 1, **gpu.gemv_options(part.fmt, part.k))
            else:
                func = qmatmul_gemm_func(part.fmt, part.k, N, 1)
            y += run_on_pocl(scheduled(func), x[:, rows], blocked(part), N, half_as_float=True)  # fp16 minima
        y += run_on_pocl(outlier_kernel(parts.sparse), x, sparse_outlier_arrays(parts.sparse), N,
                         half_as_float=True)  # fp16 values widened to fp32 either way: exact
        assert rel_err(y, mixed_matmul_reference(x, mixed)) < 1e-5


def test_rule_takes_only_outlier_functions(mixed):
    import tvm

    csr = mixed.fmt.outliers(mixed)
    assert gpu_sparse.schedule_outliers_gpu(sparse_outlier_func(csr, K, N), tvm.target.Target("llvm")) is None
    assert gpu_sparse.schedule_outliers_gpu(ops.qmatmul_func(get_format("int4-g128"), K, N, 1), SM80) is None


@needs_nvcc
def test_outliers_cuda_fits(mixed):
    check_ptxas({"outliers": outlier_kernel(mixed.fmt.outliers(mixed))})  # sm_80 and sm_90
