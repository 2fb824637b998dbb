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
from qtvm.ops import BLOCK_ACC, BLOCK_OUT, BLOCK_XSUM, FORMAT_ATTR, KERNEL_ATTR, padded_reader, weight_inputs

KERNEL = "lut_gemv"
MU = 8  # activations per table
TABLE = 1 << MU
BLOCK_LUT, BLOCK_PARTIAL = "lut", "lut_partial"


def _inputs(fmt: QuantFormat, k: int, n: int, nb: int):
    """``qmatmul_func``'s arguments for a symbolic M: (m, x, x read with zeros past K, the
    column-blocked BCQ arrays by name)."""
    m = te.var("m", "int64")
    x = te.placeholder((m, k), "float32", name="x")
    return m, x, padded_reader(x, k, fmt.padded_k(k)), weight_inputs(fmt, k, n, nb)[0]


def bcq_output_func(x, stored: dict, m, n: int, nb: int, ngroups: int, q: int, plane, xsum, kernel: str, info: dict,
                    group_scale=None) -> tvm.tirx.PrimFunc:
    """The BCQ table kernels' common tail: per group, sum_t alpha_t * plane(i, g, t, j) plus
    bias * xsum(i, g) (times ``group_scale(i, g)`` where the activations were rounded per
    group), summed over groups into ``BLOCK_ACC`` and cut to n columns in ``BLOCK_OUT``.
    One definition, so every table kernel folds its planes in the same float order."""
    alpha, bias = stored["alpha"], stored["bias"]
    rg = te.reduce_axis((0, ngroups), name="g")

    def group_term(i, j):
        total = bias[j // nb, rg, j % nb] * xsum(i, rg)
        for t in range(q):
            total = total + alpha[j // nb, rg * q + t, j % nb] * plane(i, rg, t, j)
        return total if group_scale is None else group_scale(i, rg) * total

    acc = te.compute((m, -(-n // nb) * nb), lambda i, j: te.sum(group_term(i, j), axis=rg), name=BLOCK_ACC)
    y = te.compute((m, n), lambda i, j: acc[i, j], name=BLOCK_OUT)
    func = te.create_prim_func([x, *stored.values(), y])
    return func.with_attrs({KERNEL_ATTR: kernel, FORMAT_ATTR: info})


def lut_gemv_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], bits, alpha, bias (column-blocked), y[m, n]) for a BCQ format."""
    desc = fmt.describe()
    if desc.get("family") != "bcq":
        raise QtvmError(f"the LUT GEMV kernel needs a BCQ format, got '{fmt.name}'", "use a bcqQ-gG preset")
    q = int(desc["planes"])
    words_per_chunk = 32 // MU  # bytes (tables) per packed word
    kp, gs = fmt.padded_k(k), fmt.group_size_for(k)
    if gs % MU:
        raise QtvmError(f"LUT GEMV needs groups of a multiple of {MU} rows, got {gs}")
    ngroups, nblk, nchunks, cpg = kp // gs, -(-n // nb), kp // MU, gs // MU
    m, x, xk, stored = _inputs(fmt, k, n, nb)
    bits = stored["bits"]

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
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=MU)
    return bcq_output_func(x, stored, m, n, nb, ngroups, q, lambda i, g, t, j: partial[i, g, t, j],
                           lambda i, g: xsum[i, g], KERNEL, info)


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
    q, kp, gs = int(desc["planes"]), fmt.padded_k(k), fmt.group_size_for(k)
    m, x, xk, stored = _inputs(fmt, k, n, nb)
    ngroups, nblk, blocks, bpg = kp // gs, -(-n // nb), kp // 32, gs // 32
    bits = stored["bits"]

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
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=MU16)
    return bcq_output_func(x, stored, m, n, nb, ngroups, q, lambda i, g, t, j: partial[i, g, t, j],
                           lambda i, g: xsum[i, g], KERNEL16, info)


# -- int8 activations, 16-bit tables (``--act int8``: a user option, it rounds x) ------------
KERNEL16_A8 = "lut16_a8_gemv"
PAIRS = 4  # one 32-entry int16 table register holds chunk c (entries 0-15) and chunk c + 4 (16-31)
A8_MAX_GROUP = 512  # 16-bit partials: per lane g/8 lookups of |entry| <= 4 * 127, so g <= 516


def supports_lut16_a8(fmt: QuantFormat, k: int) -> bool:
    """Whole 32-row blocks per group, and groups short enough for 16-bit partials."""
    return supports_lut16(fmt, k) and fmt.group_size_for(k) <= A8_MAX_GROUP


def round_x_per_group(m, xk, kp: int, gs: int):
    """The int8 rounding of x per weight group (stages "amax" and "xq", the names the x86
    rules schedule): amax[i, g] = max |x| over group g, xq = round(x * 127 / amax) (int8),
    so x_hat = xq * amax / 127. ``round_x_per_group_np`` is its numpy twin; the BCQ int8 kernels
    (the int16 tables here, ``qtvm.bcq_a8_gemv``'s nibble tables) share it."""
    ra = te.reduce_axis((0, gs), name="ra")
    amax = te.compute((m, kp // gs), lambda i, g: te.max(tirx.abs(xk(i, g * gs + ra)), axis=ra), name="amax")

    def quant(i, kk):
        a = amax[i, kk // gs]
        inv = tirx.if_then_else(a > 0, 127.0 / tirx.max(a, tirx.const(1e-30, "float32")), tirx.const(0.0, "float32"))
        return tirx.max(tirx.min(tirx.round(xk(i, kk) * inv), 127.0), -127.0).astype("int8")

    return amax, te.compute((m, kp), quant, name="xq")


def a8_group_scale(amax):
    """x_hat's scale per (row, group) for ``bcq_output_func``: amax / 127."""
    return lambda i, g: amax[i, g] * tirx.const(1.0 / 127.0, "float32")


def lut16_a8_gemv_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """The 16-entry LUT GEMV on int8-rounded activations (one scale per weight group, as
    MatMulNBits' accuracy level 4 rounds x per block): per row and group,

        xd[i, g] = max |x| / 127,  xq = round(x / xd)  (int8)
        lut[i, b, h, s, p] = sum_{j < 4} (bit j of p ? +xq : -xq)[i, 32 b + 4 (h + 4 s) + j]  (int16)
        P[i, g, t, n, s] = sum_{b in g, h < 4} lut[i, b, h, s, nibble_{h + 4 s}(word_t(b, n))]  (int16, exact)
        y[i, n] = sum_g xd[i, g] (sum_t alpha[g, t, n] (P[.., 0] + P[.., 1]) + bias[g, n] sum_{k in g} xq[i, k])

    A table pair (h, .) is 32 int16, one zmm, so the x86 rule looks up 16 columns' chunk h
    (low half-words) and chunk h + 4 (high half-words) with one ``vpermw``, into the 32
    int16 partials (column, half) of one register, which stay 16-bit within a group
    (``A8_MAX_GROUP``). So y = x_hat @ W exactly, x_hat the rounded activations. Same
    arguments as ``lut16_gemv_func``."""
    desc = fmt.describe()
    if not supports_lut16_a8(fmt, k):
        raise QtvmError(f"the int8-activation LUT GEMV needs a BCQ format with groups of whole 32-row blocks "
                        f"of at most {A8_MAX_GROUP} rows, got '{fmt.name}' at K={k}",
                        "use a bcqQ-gG preset with G a multiple of 32 up to 512, or --act fp32")
    q, kp, gs = int(desc["planes"]), fmt.padded_k(k), fmt.group_size_for(k)
    m, x, xk, stored = _inputs(fmt, k, n, nb)
    ngroups, nblk, blocks, bpg = kp // gs, -(-n // nb), kp // 32, gs // 32
    bits = stored["bits"]

    amax, xq = round_x_per_group(m, xk, kp, gs)
    rj = te.reduce_axis((0, MU16), name="j")

    def table(i, b, h, s, p):
        v = xq[i, b * 32 + (h + PAIRS * s) * MU16 + rj].astype("int16")
        return te.sum(tirx.Select(((p.astype("int32") >> rj.var.astype("int32")) & 1) == 1, v, -v), axis=rj)

    lut = te.compute((m, blocks, PAIRS, 2, TABLE16), table, name=BLOCK_LUT)
    # Partials per column and half (s = 0: chunks 0-3, s = 1: chunks 4-7) in int16, as the
    # kernel keeps them: exact, since |sum| <= (g / 8) * 4 * 127 < 2^15 (A8_MAX_GROUP).
    rb, rh, rp = (te.reduce_axis((0, bpg), name="b"), te.reduce_axis((0, PAIRS), name="h"),
                  te.reduce_axis((0, TABLE16), name="p"))
    partial = te.compute(
        (m, ngroups, q, nblk * nb, 2),
        lambda i, g, t, j, s: te.sum(
            tirx.Select(((bits[j // nb, (g * bpg + rb) * q + t, j % nb] >> ((rh + PAIRS * s) * MU16).astype("int32"))
                         & (TABLE16 - 1)) == rp.var.astype("int32"),
                        lut[i, g * bpg + rb, rh, s, rp], tirx.const(0, "int16")),
            axis=[rb, rh, rp]),
        name=BLOCK_PARTIAL)
    xb, xh, xs_ = (te.reduce_axis((0, bpg), name="xb"), te.reduce_axis((0, PAIRS), name="xh"),
                   te.reduce_axis((0, 2), name="xs"))
    qsum = te.compute((m, ngroups), lambda i, g: te.sum(
        lut[i, g * bpg + xb, xh, xs_, TABLE16 - 1].astype("int32"), axis=[xb, xh, xs_]), name=BLOCK_XSUM)
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=MU16, activations="int8")
    return bcq_output_func(
        x, stored, m, n, nb, ngroups, q,
        lambda i, g, t, j: (partial[i, g, t, j, 0].astype("int32") + partial[i, g, t, j, 1].astype("int32")
                            ).astype("float32"),
        lambda i, g: qsum[i, g].astype("float32"), KERNEL16_A8, info, group_scale=a8_group_scale(amax))


def round_x_per_group_np(x: np.ndarray, kp: int, gs: int) -> tuple[np.ndarray, np.ndarray]:
    """``round_x_per_group`` in numpy: x [M, K] zero-padded to ``kp`` -> (xq [M, kp] int64,
    amax [M, kp // gs] float32), so x_hat = xq * amax / 127 (fp32 arithmetic, as the kernels)."""
    xp = np.zeros((x.shape[0], kp), np.float32)
    xp[:, : x.shape[1]] = x
    groups = xp.reshape(x.shape[0], -1, gs)
    amax = np.abs(groups).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    xq = np.clip(np.round(groups * inv), -127, 127).astype(np.int64)
    return xq.reshape(x.shape[0], kp), amax[..., 0]


def reference_a8(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """What ``lut16_a8_gemv_func`` computes, in numpy (float64): x rounded to int8 per
    weight group (scale max|x| / 127), times the dequantized weight."""
    kp, gs = qt.fmt.padded_k(qt.k), qt.fmt.group_size_for(qt.k)
    xq, amax = round_x_per_group_np(x, kp, gs)
    x_hat = xq.astype(np.float64) * np.repeat(amax.astype(np.float64) / 127, gs, axis=1)
    return x_hat[:, : qt.k] @ qt.dequantize().astype(np.float64)
