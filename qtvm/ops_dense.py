"""TE compute of a matmul by a constant float32 weight (``--quant none``); it never schedules.

    w[k, j]   = wb[j // nb, k, j % nb]                       (stage BLOCK_W, a view)
    xk[i, k]  = x[i, k] if k < K else 0                      (stage BLOCK_XPAD, when K_pad != K)
    acc[i, j] = sum_{k < K_pad} xk[i, k] * w[k, j]           (stage BLOCK_ACC)
    y[i, j]   = acc[i, j]   for j < N                        (stage BLOCK_OUT)

The weight is stored as the packed kernels store theirs: column blocks of ``nb``
columns, ``wb[N / nb, K_pad, nb]`` (zero-padded), so a thread streams contiguous
memory per block and each row of a block is ``nb`` contiguous floats. K is padded to
a multiple of ``K_ALIGN`` (zero weights meet zero activations) so the reduction
splits into whole chunks whatever K is. One kernel serves every M (symbolic): a
GEMV is the same loop nest with one row tile. Left unscheduled it is a correct,
slow GEMM; ``schedules/x86_dense.py`` schedules it.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from qtvm.ops import BLOCK_ACC, BLOCK_OUT, FORMAT_ATTR, KERNEL_ATTR, block_columns, padded_reader

KERNEL_NAME = "dense"
BLOCK_W, BLOCK_XPAD = "w_view", "x_padk"
K_ALIGN = 16


def padded_k(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def dense_weight(w: np.ndarray, nb: int) -> np.ndarray:
    """[K, N] float32 -> [ceil(N / nb), K_pad, nb], zero rows and columns as padding."""
    k, n = w.shape
    padded = np.zeros((padded_k(k), n), np.float32)
    padded[:k] = w
    return block_columns(padded, nb)


def dense_func(k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], wb[ceil(n / nb), K_pad, nb], y[m, n]), kernel attribute ``"dense"``."""
    m = te.var("m", "int64")
    kp, nblk = padded_k(k), -(-n // nb)
    x = te.placeholder((m, k), "float32", name="x")
    wb = te.placeholder((nblk, kp, nb), "float32", name="wb")
    xk = x if kp == k else te.compute((m, kp), padded_reader(x, k, kp), name=BLOCK_XPAD)
    w = te.compute((kp, nblk * nb), lambda r, j: wb[j // nb, r, j % nb], name=BLOCK_W)
    r = te.reduce_axis((0, kp), name="k")
    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(xk[i, r] * w[r, j], axis=r), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, wb, y])
    desc = {"k": k, "n": n, "col_block": nb, "padded_k": kp, "values_per_block": 1}
    return func.with_attrs({KERNEL_ATTR: KERNEL_NAME, FORMAT_ATTR: desc})
