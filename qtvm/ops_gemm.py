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

``qmatmul_gemm_f16`` is the same GEMM with fp16 operands (``--act fp16``), the form
tensor cores take; it is a numerics option, never the default.
"""
from __future__ import annotations

import tvm
from tvm import te

from qtvm.formats.base import QuantFormat
from qtvm.ops import BLOCK_ACC, BLOCK_OUT, FORMAT_ATTR, KERNEL_ATTR, decode_term_count, padded_reader, weight_inputs

BLOCK_DEQUANT = "w_dequant"
BLOCK_XPAD = "x_padk"
BLOCK_XH_GEMM = "x_f16"
KERNEL_NAME = "qmatmul_gemm"
KERNEL_NAME_F16 = "qmatmul_gemm_f16"


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
    # rows past K: the weights there are finite (codes of zero), x is zero
    xk = x if kp == k else te.compute((m, kp), padded_reader(x, k, kp), name=BLOCK_XPAD)
    w = te.compute((kp, nblk * nb), lambda kk, j: _dequant(fmt, at_column, gs, kk, j), name=BLOCK_DEQUANT)
    r = te.reduce_axis((0, kp), name="k")
    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(xk[i, r] * w[r, j], axis=r), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    return _with_format(te.create_prim_func([x, *stored.values(), y]), KERNEL_NAME, fmt, k, n, nb, at_column)


def qmatmul_gemm_f16_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """``qmatmul_gemm_func``'s arguments and result with fp16 operands (a numerics option,
    ``--act fp16``): the shape tensor cores take.

        x_f16[i, k]    = fp16(x[i, k])  (0 past K)                     stage BLOCK_XH_GEMM
        w_f16[j, k]    = fp16(dequantized weight, computed in fp32)    stage BLOCK_DEQUANT
        acc[i, j]      = sum_k fp32(x_f16[i, k]) * fp32(w_f16[j, k])   fp32 sums of exact products
        y[i, j]        = acc[i, j]  for j < N

    So the activations and each weight are rounded to fp16 once; products (exact in fp32)
    and sums stay fp32. ``acc`` is the plain fp16-in, fp32-out einsum of two producer stages
    that TVM's tensor-core matmul rule recognises and pads (M is symbolic). The weight is laid
    out [N, K] (B transposed), as the tensor-core fragments read it. Every index is int64
    (M is): the rule's layout rewrites need one index type per buffer; the packed arrays are
    still addressed in int32.
    """
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    nblk = -(-n // nb)
    wide = lambda v: tvm.tirx.IntImm("int64", v)  # noqa: E731
    x = te.placeholder((m, k), "float32", name="x")
    stored, at_column = weight_inputs(fmt, k, n, nb)
    xk = padded_reader(x, k, kp)
    xh = te.compute((m, wide(kp)), lambda i, kk: xk(i, kk).astype("float16"), name=BLOCK_XH_GEMM)
    w = te.compute((wide(nblk * nb), wide(kp)), lambda j, kk: _dequant(
        fmt, at_column, gs, kk.astype("int32"), j.astype("int32")).astype("float16"), name=BLOCK_DEQUANT)
    r = te.reduce_axis((wide(0), wide(kp)), name="k")
    acc = te.compute((m, wide(nblk * nb)), lambda i, j: te.sum(
        xh[i, r].astype("float32") * w[j, r].astype("float32"), axis=r), name=BLOCK_ACC)
    y = te.compute((m, wide(n)), lambda i, j: acc[i, j], name=BLOCK_OUT)
    return _with_format(te.create_prim_func([x, *stored.values(), y]), KERNEL_NAME_F16, fmt, k, n, nb, at_column,
                        activations="fp16")


def _dequant(fmt: QuantFormat, at_column, gs: int, kk, j):
    """The fp32 weight at row ``kk`` of column ``j``: sum_t coef_t * decode_t + offset."""
    load = at_column(j)
    terms = fmt.te_decode_terms(load, kk)
    coefs, offset = fmt.te_group_coefs(load, kk // gs)
    total = offset
    for coef, term in zip(coefs, terms):
        total = total + coef * term
    return total


def _with_format(func, kernel: str, fmt: QuantFormat, k: int, n: int, nb: int, at_column, **extra):
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=fmt.padded_k(k), group=fmt.group_size_for(k),
                terms=decode_term_count(fmt, at_column), **extra)
    return func.with_attrs({KERNEL_ATTR: kernel, FORMAT_ATTR: desc})
