"""TE compute definitions of quantized matmuls; they never schedule.

``qmatmul`` computes y[M, N] = x[M, K] @ W for a symbolic M with W stored
column-blocked: every stored [rows, N] array of the format becomes
[ceil(N / nb), rows, nb] (``block_columns``), so a kernel that walks one block
of nb columns reads contiguous memory. Affine formats (w = scale * decode +
offset per group) use the grouped formula

    y[m, n] = sum_g scale[g, n] * P[m, g, n] + offset[g, n] * X[m, g]
    P[m, g, n] = sum_{k in g} x[m, k] * decode(k, n),   X[m, g] = sum_{k in g} x[m, k]

so the inner loop is unpack + one FMA and the group terms cost 1/g of it.
A format may decode a weight into several terms (BCQ: one per binary plane):
w = sum_t coef_t * decode_t + offset, one partial stage per term.
No float copy of W exists at any point.

The format contract (see ``qtvm.formats.base.QuantFormat``):
  array_rows(k) -> {name: rows}      stored [rows, N] arrays, kernel order
  array_dtype(name) -> str
  padded_k(k), group_size_for(k)
  te_decode_terms(load, k) -> [float32 PrimExpr]   load(name, row) at this column
  te_group_coefs(load, g) -> ([coef per term], offset)
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from qtvm.formats.base import QuantFormat, QuantizedTensor

# Block names are part of the contract between compute and schedule rules.
BLOCK_XSUM, BLOCK_ACC, BLOCK_OUT = "xsum", "acc", "y"


def partial_block(term: int) -> str:
    return f"partial_{term}"
KERNEL_ATTR = "qtvm.kernel"
FORMAT_ATTR = "qtvm.format"


def block_columns(a: np.ndarray, nb: int) -> np.ndarray:
    """[rows, N] -> [ceil(N / nb), rows, nb], zero-padded columns."""
    rows, n = a.shape
    nblk = -(-n // nb)
    padded = np.zeros((rows, nblk * nb), a.dtype)
    padded[:, :n] = a
    return np.ascontiguousarray(padded.reshape(rows, nblk, nb).transpose(1, 0, 2))


def blocked_arrays(qt: QuantizedTensor, nb: int) -> list[np.ndarray]:
    """The kernel's weight arguments, in order."""
    return [block_columns(qt.arrays[name], nb) for name in qt.fmt.array_rows(qt.k)]


def qmatmul_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], *blocked weight arrays, y[m, n]) with its format attached."""
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ngroups, nblk = kp // gs, -(-n // nb)
    x = te.placeholder((m, k), "float32", name="x")
    stored = {name: te.placeholder((nblk, rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}

    def at_column(j):
        return lambda name, row: stored[name][j // nb, row, j % nb]

    def xk(i, kk):
        # Rows past K are padding: their weights are zero, but x has no such rows.
        return x[i, kk] if kp == k else tirx.if_then_else(kk < k, x[i, tirx.min(kk, k - 1)], tirx.const(0.0, "float32"))

    num_terms = len(fmt.te_decode_terms(at_column(tirx.const(0, "int32")), tirx.const(0, "int32")))
    def partial(t):
        r = te.reduce_axis((0, gs), name="kk")
        return te.compute(
            (m, ngroups, nblk * nb),
            lambda i, g, j: te.sum(xk(i, g * gs + r) * fmt.te_decode_terms(at_column(j), g * gs + r)[t], axis=r),
            name=partial_block(t))

    partials = [partial(t) for t in range(num_terms)]
    r2 = te.reduce_axis((0, gs), name="kx")
    xsum = te.compute((m, ngroups), lambda i, g: te.sum(xk(i, g * gs + r2), axis=r2), name=BLOCK_XSUM)

    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        coefs, offset = fmt.te_group_coefs(at_column(j), rg)
        total = offset * xsum[i, rg]
        for coef, part in zip(coefs, partials):
            total = total + coef * part[i, rg, j]
        return total

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    desc = dict(fmt.describe(), k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=num_terms)
    return func.with_attrs({KERNEL_ATTR: "qmatmul", FORMAT_ATTR: desc})
