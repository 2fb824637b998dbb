"""LUT-GEMM compute for BCQ weights (Park et al., LUT-GEMM): no dequantization.

For binary weights b in {-1, +1}, a dot product with mu = 8 activations has
only 256 possible values. Per row i of x and per chunk c of 8 rows of K:

    lut[i, c, p] = sum_{j < 8} (bit j of p ? +x[i, 8c + j] : -x[i, 8c + j])

Then a plane's partial dot product over one group is a sum of table reads
indexed by 8 consecutive bits of the plane (one byte of a packed word):

    P[i, g, t, n] = sum_{c in g} lut[i, c, byte_t(c, n)]
    y[i, n] = sum_g sum_t alpha[g, t, n] * P[i, g, t, n] + bias[g, n] * X[i, g]

with X[i, g] = sum_{c in g} lut[i, c, 255] (all bits set: the plain sum of x).
The tables are computed once per (row of x, chunk) and shared by every column;
rows past K read zero activations, so padded bits never matter. The tables
take 128 bytes per activation (M * K_pad * 128 B: 512 KiB per row at K = 4096),
so this kernel is for decode-sized M; larger M belongs to the dequant qmatmul.

The PrimFunc takes the same arguments as ``qtvm.ops.qmatmul_func`` (x, the
column-blocked BCQ arrays, y), for a symbolic M; schedule rules find it by the
``qtvm.kernel`` attribute "lut_gemv" and read the block names below.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from qtvm.errors import QtvmError
from qtvm.formats.base import QuantFormat, QuantizedTensor
from qtvm.ops import BLOCK_ACC, BLOCK_OUT, BLOCK_XSUM, FORMAT_ATTR, KERNEL_ATTR

KERNEL = "lut_gemv"
MU = 8  # activations per table
TABLE = 1 << MU
BLOCK_LUT, BLOCK_PARTIAL = "lut", "lut_partial"


def lut_gemv_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], bits, alpha, bias (column-blocked), y[m, n]) for a BCQ format."""
    desc = fmt.describe()
    if desc.get("family") != "bcq":
        raise QtvmError(f"the LUT GEMV kernel needs a BCQ format, got '{fmt.name}'", "use a bcqQ-gG preset")
    q = int(desc["planes"])
    words_per_chunk = 32 // MU  # bytes (tables) per packed word
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    if gs % MU:
        raise QtvmError(f"LUT GEMV needs groups of a multiple of {MU} rows, got {gs}")
    ngroups, nblk, nchunks, cpg = kp // gs, -(-n // nb), kp // MU, gs // MU
    x = te.placeholder((m, k), "float32", name="x")
    stored = {name: te.placeholder((nblk, rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}
    bits, alpha, bias = stored["bits"], stored["alpha"], stored["bias"]

    def xk(i, kk):
        if kp == k:
            return x[i, kk]
        return tirx.if_then_else(kk < k, x[i, tirx.min(kk, k - 1)], tirx.const(0.0, "float32"))

    rj = te.reduce_axis((0, MU), name="j")

    def table(i, c, p):
        v = xk(i, c * MU + rj)
        return te.sum(tirx.Select(((p.astype("int32") >> rj.var.astype("int32")) & 1) == 1, v, -v), axis=rj)

    lut = te.compute((m, nchunks, TABLE), table, name=BLOCK_LUT)

    def byte(j, t, c):
        word = bits[j // nb, (c // words_per_chunk) * q + t, j % nb]
        return (word >> ((c % words_per_chunk) * MU).astype("int32")) & (TABLE - 1)

    rc = te.reduce_axis((0, cpg), name="c")
    partial = te.compute(
        (m, ngroups, q, nblk * nb),
        lambda i, g, t, j: te.sum(lut[i, g * cpg + rc, byte(j, t, g * cpg + rc)], axis=rc),
        name=BLOCK_PARTIAL)
    rx = te.reduce_axis((0, cpg), name="cx")
    xsum = te.compute((m, ngroups), lambda i, g: te.sum(lut[i, g * cpg + rx, TABLE - 1], axis=rx),
                      name=BLOCK_XSUM)
    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        total = bias[j // nb, rg, j % nb] * xsum[i, rg]
        for t in range(q):
            total = total + alpha[j // nb, rg * q + t, j % nb] * partial[i, rg, t, j]
        return total

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=MU)
    return func.with_attrs({KERNEL_ATTR: KERNEL, FORMAT_ATTR: info})


def reference(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """The table algorithm in numpy (float64), for checking: y[M, N] = x @ W."""
    fmt = qt.fmt
    if fmt.describe().get("family") != "bcq":
        raise QtvmError(f"the LUT GEMV reference needs a BCQ tensor, got '{fmt.name}'")
    q, kp, gs = int(fmt.describe()["planes"]), fmt.padded_k(qt.k), fmt.group_size_for(qt.k)
    ng, nchunks = kp // gs, kp // MU
    xp = np.zeros((x.shape[0], kp), np.float64)
    xp[:, : qt.k] = x
    patterns = np.where((np.arange(TABLE)[:, None] >> np.arange(MU)[None, :]) & 1, 1.0, -1.0)  # [256, 8]
    lut = np.einsum("mcj,pj->mcp", xp.reshape(-1, nchunks, MU), patterns)  # [M, chunks, 256]
    words = qt.arrays["bits"].view(np.uint32).reshape(kp // 32, q, qt.n)
    shifts = (MU * np.arange(32 // MU, dtype=np.uint32))[None, :, None, None]
    idx = ((words[:, None] >> shifts) & np.uint32(TABLE - 1)).reshape(nchunks, q, qt.n)  # byte per chunk
    reads = lut[:, np.arange(nchunks)[:, None, None], idx]  # [M, chunks, q, N]
    partial = reads.reshape(x.shape[0], ng, gs // MU, q, qt.n).sum(axis=2)  # [M, G, q, N]
    xsum = lut[:, :, TABLE - 1].reshape(x.shape[0], ng, gs // MU).sum(axis=2)  # [M, G]
    alpha = qt.arrays["alpha"].astype(np.float64).reshape(ng, q, qt.n)
    bias = qt.arrays["bias"].astype(np.float64)
    return np.einsum("mgtn,gtn->mn", partial, alpha) + xsum @ bias


# -- 16-entry tables: one vector register per table (vpermps) ----------------------------
KERNEL16 = "lut16_gemv"
MU16, TABLE16, CHUNKS = 4, 16, 8  # activations per table, entries, tables per 32-row block


def supports_lut16(fmt: QuantFormat, k: int) -> bool:
    """The 16-entry kernel walks whole 32-row blocks per group."""
    return fmt.describe().get("family") == "bcq" and fmt.group_size_for(k) % 32 == 0


def lut16_gemv_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """LUT GEMV with tables of 16 (T-MAC's size): per 32-row block b and chunk c of 4 rows

        lut[i, b, c, p] = sum_{j < 4} (bit j of p ? +x : -x)[i, 32 b + 4 c + j]

    and plane t's partial over a group reads, for each block, the 8 nibbles of its word:
    P[i, g, t, n] = sum_{b in g, c < 8} lut[i, b, c, (word_t(b, n) >> 4 c) & 15]. A table is
    16 floats, one zmm: the x86 rule looks up 16 columns at once (``vpermps``), exactly.
    Same arguments as ``qmatmul_func``; the kernel attribute is ``lut16_gemv``."""
    desc = fmt.describe()
    if not supports_lut16(fmt, k):
        raise QtvmError(f"the 16-entry LUT GEMV needs a BCQ format with groups of whole 32-row blocks, "
                        f"got '{fmt.name}'", "use a bcqQ-gG preset with G a multiple of 32")
    q = int(desc["planes"])
    m = te.var("m", "int64")
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    ngroups, nblk, blocks, bpg = kp // gs, -(-n // nb), kp // 32, gs // 32
    x = te.placeholder((m, k), "float32", name="x")
    stored = {name: te.placeholder((nblk, rows, nb), fmt.array_dtype(name), name=name)
              for name, rows in fmt.array_rows(k).items()}
    bits, alpha, bias = stored["bits"], stored["alpha"], stored["bias"]

    def xk(i, kk):
        if kp == k:
            return x[i, kk]
        return tirx.if_then_else(kk < k, x[i, tirx.min(kk, k - 1)], tirx.const(0.0, "float32"))

    rj = te.reduce_axis((0, MU16), name="j")
    lut = te.compute(
        (m, blocks, CHUNKS, TABLE16),
        lambda i, b, c, p: te.sum(tirx.Select(((p.astype("int32") >> rj.var.astype("int32")) & 1) == 1,
                                              xk(i, b * 32 + c * MU16 + rj), -xk(i, b * 32 + c * MU16 + rj)),
                                  axis=rj),
        name=BLOCK_LUT)
    # The lookup as a one-hot sum over the 16 entries: the same value as reading entry
    # `nibble`, with every index affine (a data-dependent index cannot be matched to a
    # TensorIntrin); the x86 rule replaces the (columns, chunks, entries) nest by vpermps.
    rb, rc, rp = (te.reduce_axis((0, bpg), name="b"), te.reduce_axis((0, CHUNKS), name="c"),
                  te.reduce_axis((0, TABLE16), name="p"))
    partial = te.compute(
        (m, ngroups, q, nblk * nb),
        lambda i, g, t, j: te.sum(
            tirx.Select(((bits[j // nb, (g * bpg + rb) * q + t, j % nb] >> (rc * MU16).astype("int32"))
                         & (TABLE16 - 1)) == rp.var.astype("int32"),
                        lut[i, g * bpg + rb, rc, rp], tirx.const(0.0, "float32")),
            axis=[rb, rc, rp]),
        name=BLOCK_PARTIAL)
    xb, xc = te.reduce_axis((0, bpg), name="xb"), te.reduce_axis((0, CHUNKS), name="xc")
    xsum = te.compute((m, ngroups), lambda i, g: te.sum(lut[i, g * bpg + xb, xc, TABLE16 - 1], axis=[xb, xc]),
                      name=BLOCK_XSUM)
    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        total = bias[j // nb, rg, j % nb] * xsum[i, rg]
        for t in range(q):
            total = total + alpha[j // nb, rg * q + t, j % nb] * partial[i, rg, t, j]
        return total

    acc = te.compute((m, nblk * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=MU16)
    return func.with_attrs({KERNEL_ATTR: KERNEL16, FORMAT_ATTR: info})
