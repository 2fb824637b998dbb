"""BCQ decode GEMV on int8 activations by int8 nibble tables (``--act int8``, AVX-512 VBMI + VNNI).

x is rounded to int8 per weight group (``qtvm.lut_gemv.round_x_per_group``, the int16-table
kernel's rounding, so ``KernelFacts.int8_rounding`` is the same for both) and each xq is split
into nibbles, xq = 16 xh + xl (xl = xq & 15 in [0, 15], xh = xq >> 4 in [-8, 7]). Per 32-row
block b and each 4 rows (a quad), two 16-entry tables of signed sums

    lo[p] = sum_{j < 4} (bit j of p ? +xl : -xl)   in [-60, 60]
    hi[p] = sum_{j < 4} (bit j of p ? +xh : -xh)   in [-32, 32]

fit int8, so one ``vpermb`` (64 byte entries: 4 quads' tables) looks up 64 nibbles, 16
columns x 4 quads; the two nibble halves' lookups of a part add bytewise (lo sums in
[-120, 120], hi in [-64, 64]: still int8) and one ``vpdpbusd`` with u8 ones (lo) or sixteens
(hi) adds each column's 4 summed bytes into its int32 lane: sum_{k} xq_k s_k = sum lo + 16 sum
hi, exact. Byte q of a column's stored word holds quads 2q (low nibble) and 2q + 1 (high
nibble), so the format's own bits are read as stored (no relayout): the low nibbles index the
tables of quads 0, 2, 4, 6 (``(w & 0x0F0F0F0F) | 0x30201000``, one ``vpternlogd``, puts quad
position q in bits 4-5) and the shifted high nibbles those of quads 1, 3, 5, 7. Per block,
plane and 16 columns: 4 lookups, 2 byte adds, 2 dots, 3 index ops (the int16 tables: 4
``vpermw``, 4 index ops, 3 shifts, 4 adds).
Then per group, in fp32:

    y[i, n] += amax[i, g] / 127 * (sum_t alpha[g, t, n] D_t + bias[g, n] S),   S = sum_{k in g} xq_k

(exactly x_hat @ W up to fp32 rounding: D and S are exact int32).

An earlier design of this kernel, per 64 bits one mask register (``kmovq``), a zero-masked
byte move of x and ``vpdpbusd`` with ones, measured no faster than the int16 tables on
Emerald Rapids: about 2.2 core cycles per mask in a microbenchmark (the mask path, not the
dot, limits it), where this table form takes about 0.7 per 64 weight bits.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te, tirx

from qtvm.errors import QtvmError
from qtvm.formats.base import QuantFormat, QuantizedTensor
from qtvm.ops import BLOCK_XSUM

KERNEL = "bcq_a8_gemv"
BLOCK_LUT, BLOCK_PARTIAL = "nibble_tables", "bcq_partial"
HALVES, PARTS, QUADS, ENTRIES = 2, 2, 4, 16  # nibble of a byte, (xl, xh), quads per half, table entries
WORD_BITS = 32


def supports(fmt: QuantFormat, k: int) -> bool:
    """What the int16-table kernel supports (so the rounding is the same where either runs)."""
    from qtvm.lut_gemv import supports_lut16_a8

    return supports_lut16_a8(fmt, k)


def quad_of(half, pos):
    """The quad (4 rows of a 32-row block) that nibble ``half`` of byte ``pos`` of a word holds."""
    return pos * 2 + half


def bcq_a8_gemv_func(fmt: QuantFormat, k: int, n: int, nb: int) -> tvm.tirx.PrimFunc:
    """PrimFunc(x[m, k], bits, alpha, bias (column-blocked, as stored), y[m, n]): y = x_hat @ W,
    x rounded to int8 per weight group. Same arguments as ``lut16_a8_gemv_func``; the kernel
    attribute is ``bcq_a8_gemv``."""
    from qtvm.lut_gemv import _inputs, a8_group_scale, bcq_output_func, round_x_per_group

    desc = fmt.describe()
    if desc.get("family") != "bcq" or not supports(fmt, k):
        raise QtvmError(f"the int8 nibble-table BCQ GEMV needs a BCQ format with groups of whole 32-row blocks of "
                        f"at most 512 rows, got '{fmt.name}' at K={k}", "use a bcqQ-gG preset, or --act fp32")
    q, kp, gs = int(desc["planes"]), fmt.padded_k(k), fmt.group_size_for(k)
    m, x, xk, stored = _inputs(fmt, k, n, nb)
    ngroups, nblk, blocks, bpg = kp // gs, -(-n // nb), kp // WORD_BITS, gs // WORD_BITS
    bits = stored["bits"]
    amax, xq = round_x_per_group(m, xk, kp, gs)

    rj = te.reduce_axis((0, 4), name="j")

    def table(i, b, h, part, pos, p):
        v = xq[i, b * WORD_BITS + quad_of(h, pos) * 4 + rj]
        v = tirx.Select(part == 0, tirx.bitwise_and(v, tirx.const(15, "int8")),
                        tirx.shift_right(v, tirx.const(4, "int8")))  # xl, or xh (arithmetic shift)
        return te.sum(tirx.Select(((p.astype("int32") >> rj.var.astype("int32")) & 1) == 1, v, -v), axis=rj)

    lut = te.compute((m, blocks, HALVES, PARTS, QUADS, ENTRIES), table, name=BLOCK_LUT)
    # D[i, g, t, j] = sum_{k in g} xq_k s_k: per block, nibble half h, part and byte pos, the
    # table entry its nibble selects (a one-hot sum over the 16 entries, so every index is
    # affine and the x86 rule can replace the nest by vpermb + vpdpbusd), xh's times 16.
    rb, rh, rpart, rpos, rp = (te.reduce_axis((0, bpg), name="b"), te.reduce_axis((0, HALVES), name="h"),
                               te.reduce_axis((0, PARTS), name="part"), te.reduce_axis((0, QUADS), name="pos"),
                               te.reduce_axis((0, ENTRIES), name="p"))

    def dot(i, g, t, j):
        word = bits[j // nb, (g * bpg + rb) * q + t, j % nb]
        nibble = tirx.bitwise_and(tirx.shift_right(word, (rpos * 8 + rh * 4).astype("int32")), 15)
        entry = lut[i, g * bpg + rb, rh, rpart, rpos, rp].astype("int32") * (rpart * 15 + 1).astype("int32")
        return te.sum(tirx.Select(nibble == rp.var.astype("int32"), entry, tirx.const(0, "int32")),
                      axis=[rb, rh, rpart, rpos, rp])

    partial = te.compute((m, ngroups, q, nblk * nb), dot, name=BLOCK_PARTIAL)
    rs = te.reduce_axis((0, gs), name="s")
    qsum = te.compute((m, ngroups), lambda i, g: te.sum(xq[i, g * gs + rs].astype("int32"), axis=rs),
                      name=BLOCK_XSUM)
    info = dict(desc, k=k, n=n, col_block=nb, padded_k=kp, group=gs, terms=q, mu=4, activations="int8")
    return bcq_output_func(x, stored, m, n, nb, ngroups, q, lambda i, g, t, j: partial[i, g, t, j].astype("float32"),
                           lambda i, g: qsum[i, g].astype("float32"), KERNEL, info, group_scale=a8_group_scale(amax))


def reference(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """The nibble-table algorithm in numpy (int64 sums, float64 fold), for checking it
    against the dequantized reference: y[M, N]."""
    from qtvm.lut_gemv import round_x_per_group_np

    fmt = qt.fmt
    q, kp, gs = int(fmt.describe()["planes"]), fmt.padded_k(qt.k), fmt.group_size_for(qt.k)
    xq, amax = round_x_per_group_np(x, kp, gs)
    xl, xh = xq & 15, xq >> 4
    words = qt.arrays["bits"].view(np.uint32).astype(np.int64).reshape(kp // 32, q, qt.n)
    d = np.zeros((x.shape[0], kp // gs, q, qt.n), np.int64)
    pattern = np.where((np.arange(16)[:, None] >> np.arange(4)[None, :]) & 1, 1, -1)  # [16, 4]
    for b in range(kp // 32):
        for quad in range(8):
            rows = slice(32 * b + 4 * quad, 32 * b + 4 * quad + 4)
            lo, hi = xl[:, rows] @ pattern.T, xh[:, rows] @ pattern.T  # [M, 16] tables
            nib = (words[b] >> (4 * quad)) & 15  # [q, N]: quad 2 pos + h sits at bit 8 pos + 4 h
            d[:, b * 32 // gs] += lo[:, nib] + 16 * hi[:, nib]
    s = xq.reshape(x.shape[0], -1, gs).sum(-1)  # [M, G]
    alpha = qt.arrays["alpha"].astype(np.float64).reshape(kp // gs, q, qt.n)
    y = np.einsum("mgtn,gtn->mgn", d.astype(np.float64), alpha) + s[:, :, None] * qt.arrays["bias"].astype(np.float64)
    return (y * (amax[:, :, None].astype(np.float64) / 127)).sum(1)
