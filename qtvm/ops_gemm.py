"""TE compute of the prefill (M > 1) quantized matmul; it never schedules.

``qmatmul_gemm`` computes the same y[M, N] = x[M, K] @ W as ``qtvm.ops.qmatmul``
(same arguments: x, the column-blocked stored arrays of the format, y; same
symbolic M) but as dequantize-then-GEMM:

    w[k, j]   = sum_t coef_t[g(k), j] * decode_t(k, j) + offset[g(k), j]   (stage BLOCK_DEQUANT)
    xk[i, k]  = x[i, k] if k < K else 0        (stage BLOCK_XPAD, only when K_pad != K)
    acc[i, j] = sum_{k < K_pad} xk[i, k] * w[k, j]                          (stage BLOCK_ACC)
    y[i, j]   = acc[i, j]   for j < N                                       (stage BLOCK_OUT)

Why a second compute: in ``qmatmul`` the unpack is an expression inlined in
each partial's reduction, so a schedule can only re-run it for every row of x
(TVM's schedule primitives cache *buffers*, not sub-expressions). Here the
dequantized weight is its own stage: a schedule computes it tile by tile into
a small buffer and reuses every tile across all rows, and the GEMM reads fp32
weights, so its inner loop is a plain FMA micro-kernel with no group terms.
Left unscheduled (inlined) it is still a correct, slow GEMM.

The reduction runs over the format's padded K, so K splits into whole packed
runs and groups; the padding rows of W are finite (codes of zero) and meet
zeros of x, so they add nothing. ``acc`` spans the padded columns of the last
column block, so no vector loop needs a column tail; only ``y`` is cut to N.
``acc`` is a plain einsum of two buffers, so a schedule can pad M with
``pad_einsum``.
"""
from __future__ import annotations

import tvm
from tvm import te

from qtvm.formats.base import QuantFormat
from qtvm.ops import BLOCK_ACC, BLOCK_OUT, FORMAT_ATTR, KERNEL_ATTR, decode_term_count, padded_reader, weight_inputs

BLOCK_DEQUANT = "w_dequant"
BLOCK_XPAD = "x_padk"
KERNEL_NAME = "qmatmul_gemm"


def qmatmul_gemm_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], *blocked weight arrays, y[m, n]) with its format attached.

    Same arguments and attribute contract as :func:`qtvm.ops.qmatmul_func`;
    the kernel attribute is ``"qmatmul_gemm"``.
    """
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    nblk = -(-n // nb)
    x = te.placeholder((m, k), "float32", name="x")
    stored, at_column = weight_inputs(fmt, k, n, nb)

    def dequant(kk, j):
        load = at_column(j)
        terms = fmt.te_decode_terms(load, kk)
        coefs, offset = fmt.te_group_coefs(load, kk // gs)
        total = offset
        for coef, term in zip(coefs, terms):
            total = total + coef * term
        return total

    num_terms = decode_term_count(fmt, at_column)
    # rows past K: the weights there are finite (codes of zero), x is zero
    xk = x if kp == k else te.compute((m, kp), padded_reader(x, k, kp), name=BLOCK_XPAD)
    w = te.compute((kp, nblk * nb), dequant, name=BLOCK_DEQUANT)
    r = te.reduce_axis((0, kp), name="k")
    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(xk[i, r] * w[r, j], axis=r), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=num_terms)
    return func.with_attrs({KERNEL_ATTR: KERNEL_NAME, FORMAT_ATTR: desc})
