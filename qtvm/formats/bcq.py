"""Binary-coding quantization (BCQ) with a bias, group-wise along K (LUT-GEMM).

A weight is a sum of ``q`` binary planes plus a per-group offset:

    w[k, n] ~= sum_{t < q} alpha[g, t, n] * b_t[k, n] + bias[g, n],   b_t in {-1, +1},  g = k // group

(Park et al., "LUT-GEMM", 2022/2024; the bias is their eq. 5 extension that
makes uniform quantization a special case, see :func:`from_uniform`).

Storage, for a [K, N] weight with K padded to ``padded_k(K)`` (a multiple of
32 and of the group):
  bits  [K_pad / 32 * q, N] int32: the planes interleaved per 32-row chunk.
        Word row ``(k // 32) * q + t`` holds plane t of rows 32*(k//32) ..
        +31; bit ``k % 32`` of it is 1 where b_t[k, n] = +1 and 0 where it is
        -1. All q words one chunk needs are adjacent, so a kernel walking K
        streams one contiguous run per column block.
  alpha [G * q, N] float32: row ``g * q + t`` is plane t's scale in group g.
  bias  [G, N] float32.
Rows past K (padding) are stored with bit 0 and contribute nothing: the kernel
multiplies them by zero activations.

The quantizer is the alternating multi-bit method (Xu et al. 2018, as used by
LUT-GEMM): a greedy start (bias = group mean, then each plane is the sign of
the residual scaled by its mean magnitude), refined by alternating (a) the
least-squares [alpha; bias] for fixed planes and (b) the best plane bits for
fixed scales (exhaustive over the 2^q sign patterns). Both steps are optimal
for what they hold fixed, so the per-group squared error never increases; the
best iterate (measured on the fp32-stored coefficients) is kept, so the result
is never worse than the greedy start.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import tirx

from qtvm.errors import QtvmError
from qtvm.formats.base import ArrayLoader, GroupedAlongK, QuantFormat, QuantizedTensor, check_weight

VALID_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
VALID_GROUPS = (16, 32, 64, 128, 256)
PRESET_BITS = (2, 3, 4)
PRESET_GROUPS = (32, 64, 128)
WORD_BITS = 32


@dataclass(frozen=True)
class BCQFormat(GroupedAlongK, QuantFormat):
    columns_independent = True  # scales and codes per (group, column)
    bits: int = 3  # q, the number of binary planes
    group_size: int | None = 128  # None: one group per column
    iters: int = 5  # alternating refinement rounds (0: greedy only)

    def __post_init__(self):
        if self.bits not in VALID_BITS:
            raise QtvmError(f"BCQ format cannot use {self.bits} binary planes",
                            f"valid plane counts (bits): {', '.join(map(str, VALID_BITS))}")
        if self.group_size is not None and self.group_size not in VALID_GROUPS:
            raise QtvmError(f"BCQ format cannot use group size {self.group_size}",
                            f"valid group sizes: {', '.join(map(str, VALID_GROUPS))} or full column")
        if not isinstance(self.iters, int) or self.iters < 0:
            raise QtvmError(f"BCQ refinement iterations must be a non-negative int, got {self.iters!r}")

    # -- layout facts -------------------------------------------------------
    pack_unit = WORD_BITS  # one int32 of sign bits per plane

    @property
    def name(self) -> str:
        return f"bcq{self.bits}-" + ("col" if self.group_size is None else f"g{self.group_size}")




    def array_rows(self, k: int) -> dict[str, int]:
        g = self.num_groups(k)
        return {"bits": self.padded_k(k) // WORD_BITS * self.bits, "alpha": g * self.bits, "bias": g}

    def array_dtype(self, name: str) -> str:
        return "int32" if name == "bits" else "float32"

    def describe(self) -> dict:
        return {"family": "bcq", "bits": self.bits, "planes": self.bits, "group_size": self.group_size or 0,
                "storage": "int32", "plane_layout": "interleaved-per-32-rows", "zeros": "float32-bias",
                "values_per_block": WORD_BITS}

    def bits_per_weight_nominal(self) -> float:
        g = self.group_size or 4096
        return self.bits + 32.0 * (self.bits + 1) / g

    # -- packing ----------------------------------------------------------------
    def pack(self, planes: np.ndarray) -> np.ndarray:
        """[q, K_pad, N] bools (True = +1) -> [K_pad / 32 * q, N] int32 words."""
        q, kp, n = planes.shape
        if q != self.bits or kp % WORD_BITS:
            raise QtvmError(f"cannot pack planes of shape {planes.shape} as {self.name}",
                            f"expected ({self.bits}, a multiple of {WORD_BITS}, N)")
        b = planes.astype(np.uint64).reshape(q, kp // WORD_BITS, WORD_BITS, n)
        shifts = np.arange(WORD_BITS, dtype=np.uint64)[None, None, :, None]
        words = (b << shifts).sum(axis=2)  # [q, chunks, N]
        words = words.transpose(1, 0, 2).reshape(kp // WORD_BITS * q, n)
        return np.ascontiguousarray(words.astype(np.uint32).view(np.int32))

    def unpack(self, words: np.ndarray, kp: int) -> np.ndarray:
        """[K_pad / 32 * q, N] int32 -> [q, K_pad, N] bools (True = +1)."""
        n = words.shape[1]
        w = words.view(np.uint32).reshape(kp // WORD_BITS, self.bits, n).transpose(1, 0, 2)
        shifts = np.arange(WORD_BITS, dtype=np.uint32)[None, None, :, None]
        bits = (w[:, :, None, :] >> shifts) & np.uint32(1)
        return bits.reshape(self.bits, kp, n).astype(bool)

    # -- numpy side -----------------------------------------------------------
    def quantize(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        return self._quantize(w, name, self.iters)

    def quantize_greedy(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        """The greedy start alone (no alternating refinement): the baseline."""
        return self._quantize(w, name, 0)

    def _quantize(self, w: np.ndarray, name: str, iters: int) -> QuantizedTensor:
        w = check_weight(w, name)
        k, n = w.shape
        kp, gs = self.padded_k(k), self.group_size_for(k)
        ng, q = kp // gs, self.bits
        wp = np.zeros((kp, n), np.float64)
        wp[:k] = w
        valid = (np.arange(kp) < k).reshape(ng, gs)
        planes = np.zeros((q, kp, n), bool)
        alpha = np.zeros((ng, q, n), np.float32)
        bias = np.zeros((ng, n), np.float32)
        for g in range(ng):
            rows = slice(g * gs, (g + 1) * gs)
            vals = wp[rows].T[:, valid[g]]  # [N, rows of K in this group]
            if vals.shape[1] == 0:
                continue  # a group of padding only: alpha = bias = 0
            b, a, z = _fit_group(vals, q, iters)  # b [q, N, R]
            planes[:, rows][:, valid[g]] = b.transpose(0, 2, 1)  # padding rows keep bit 0
            alpha[g] = a.T
            bias[g] = z
        return QuantizedTensor(self, k, n, {"bits": self.pack(planes),
                                            "alpha": alpha.reshape(ng * q, n), "bias": bias})

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        kp, gs = self.padded_k(qt.k), self.group_size_for(qt.k)
        ng, q = kp // gs, self.bits
        planes = self.unpack(qt.arrays["bits"], kp)  # [q, kp, N]
        alpha = qt.arrays["alpha"].astype(np.float64).reshape(ng, q, -1)
        w = np.repeat(qt.arrays["bias"].astype(np.float64), gs, axis=0)
        for t in range(q):  # summed in float64, rounded to fp32 once
            a = np.repeat(alpha[:, t], gs, axis=0)
            w += np.where(planes[t], a, -a)
        return w[: qt.k].astype(np.float32)

    # -- TE side ----------------------------------------------------------------
    def te_decode_terms(self, load: ArrayLoader, k):
        """q terms: plane t's bit of row ``k`` as -1.0 / +1.0, built as float bits.

        The bit is shifted down to bit 0, then up into the sign position (clearing the rest),
        and XORed with the bits of -1.0: set -> 0x3F800000 (+1.0), clear -> 0xBF800000 (-1.0);
        three integer ops, no int->float conversion. (Shifting left by ``31 - k % 32`` instead
        is a descending ramp when vectorized, whose uint32 stride TVM cannot build.)
        """
        shift = (k % WORD_BITS).astype("uint32")
        to_sign = tirx.const(WORD_BITS - 1, "uint32")
        minus_one = tirx.const(0xBF800000, "uint32")
        terms = []
        for t in range(self.bits):
            word = load("bits", (k // WORD_BITS) * self.bits + t).astype("uint32")
            terms.append(tirx.reinterpret("float32", ((word >> shift) << to_sign) ^ minus_one))
        return terms

    def te_group_coefs(self, load: ArrayLoader, g):
        return [load("alpha", g * self.bits + t) for t in range(self.bits)], load("bias", g)


def _sign_patterns(q: int) -> np.ndarray:
    """[2^q, q] all +-1 patterns; pattern p has +1 where bit t of p is set."""
    p = np.arange(1 << q)[:, None]
    return np.where((p >> np.arange(q)[None, :]) & 1, 1.0, -1.0)


def _sq_err(vals, b, a, z):
    """Per-column squared error of the fp32-stored coefficients. b [q, N, R]."""
    a32 = a.astype(np.float32).astype(np.float64)
    rec = np.repeat(z.astype(np.float32).astype(np.float64)[:, None], vals.shape[1], axis=1)
    for t in range(len(b)):
        rec += a32[:, t, None] * b[t]
    return ((vals - rec) ** 2).sum(axis=1)


def _fit_group(vals: np.ndarray, q: int, iters: int):
    """vals [N, R] float64 -> (bits [q, N, R] bool, alpha [N, q], bias [N])."""
    ncol, r = vals.shape
    # Greedy start: bias = mean, then sign of the residual and its mean magnitude.
    z = vals.mean(axis=1)
    res = vals - z[:, None]
    b = np.empty((q, ncol, r))
    a = np.empty((ncol, q))
    for t in range(q):
        b[t] = np.where(res >= 0, 1.0, -1.0)
        a[:, t] = np.abs(res).mean(axis=1)
        res -= a[:, t, None] * b[t]
    best_b, best_a, best_z = b.copy(), a.copy(), z.copy()
    best_err = _sq_err(vals, b, a, z)
    patterns = _sign_patterns(q)  # [P, q]
    design = np.ones((ncol, q + 1, r))
    for _ in range(iters):
        # (a) least squares for [alpha; bias] given the planes; pinv copes with
        # collinear planes (e.g. a constant group), giving the min-norm answer.
        design[:, :q] = b.transpose(1, 0, 2)
        gram = design @ design.transpose(0, 2, 1)
        rhs = (design @ vals[:, :, None])[:, :, 0]
        theta = (np.linalg.pinv(gram) @ rhs[:, :, None])[:, :, 0]
        a, z = theta[:, :q], theta[:, q]
        best_err = _keep_best(vals, b, a, z, best_b, best_a, best_z, best_err)
        # (b) the nearest of the 2^q levels for every weight, given alpha and
        # bias: count the sorted levels' midpoints below each weight.
        levels = z[:, None] + a @ patterns.T  # [N, P]
        order = np.argsort(levels, axis=1)
        srt = np.take_along_axis(levels, order, axis=1)
        mids = 0.5 * (srt[:, 1:] + srt[:, :-1])
        rank = np.zeros((ncol, r), np.intp)
        for m in range(mids.shape[1]):
            rank += vals > mids[:, m, None]
        chosen = np.take_along_axis(order, rank, axis=1)  # [N, R] pattern index
        b = patterns.T[:, chosen]  # [q, N, R]
        best_err = _keep_best(vals, b, a, z, best_b, best_a, best_z, best_err)
    return best_b > 0, best_a, best_z


def _keep_best(vals, b, a, z, best_b, best_a, best_z, best_err):
    err = _sq_err(vals, b, a, z)
    better = err < best_err
    best_b[:, better], best_a[better], best_z[better] = b[:, better], a[better], z[better]
    return np.where(better, err, best_err)


def from_uniform(qt: QuantizedTensor) -> QuantizedTensor:
    """Exact re-encoding of a uniform b-bit tensor as BCQ with q = b planes.

    With code c = sum_{i=1..q} 2^(i-1) (b_i + 1) / 2 (b_i = 2 * bit_{i-1}(c) - 1),
        w = s (c - z) = sum_i 2^(i-2) s b_i + s ((2^q - 1) / 2 - z),
    so alpha_i = 2^(i-2) s (exact in fp32: a power-of-two multiple of s) and
    bias = s ((2^q - 1) / 2 - z), which fp32 stores exactly only when
    s * ((2^q - 1)/2 - z) fits in 24 significant bits; otherwise it is rounded
    once (half an ulp of the bias), the only inexact step.
    """
    from qtvm.formats.uniform import UniformFormat

    ufmt = qt.fmt
    if not isinstance(ufmt, UniformFormat):
        raise QtvmError(f"from_uniform needs a uniform (intB-gG) tensor, got format '{ufmt.name}'")
    q = ufmt.bits
    fmt = BCQFormat(q, ufmt.group_size)
    kp_u, kp = ufmt.padded_k(qt.k), fmt.padded_k(qt.k)
    ng_u, ng = ufmt.num_groups(qt.k), fmt.num_groups(qt.k)
    codes = np.zeros((kp, qt.n), np.uint32)
    codes[:kp_u] = ufmt.unpack(qt.arrays["qweight"], kp_u)
    codes[qt.k:] = 0  # padding rows: any bits do (the kernel's activations there are 0)
    planes = ((codes[None] >> np.arange(q, dtype=np.uint32)[:, None, None]) & 1).astype(bool)
    s = np.zeros((ng, qt.n), np.float64)
    zero = np.zeros((ng, qt.n), np.float64)
    s[:ng_u], zero[:ng_u] = qt.arrays["scales"], qt.arrays["zeros"]  # extra padding groups: w = 0
    alpha = (s[:, None, :] * np.ldexp(1.0, np.arange(q) - 1)[None, :, None]).astype(np.float32)
    bias = (s * ((2.0 ** q - 1.0) / 2.0 - zero)).astype(np.float32)
    return QuantizedTensor(fmt, qt.k, qt.n, {"bits": fmt.pack(planes), "alpha": alpha.reshape(ng * q, qt.n),
                                             "bias": bias})


def _register():
    from qtvm.formats import register

    for q in PRESET_BITS:
        for g in PRESET_GROUPS:
            register(BCQFormat(q, g))


_register()
