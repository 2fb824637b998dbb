"""Mixed 2/4/16-bit precision inside one weight matrix (preset ``mixed-2-4-16``).

After Li et al., "Fast and Efficient 2-bit LLM Inference on GPU: 2/4/16-bit in a
Weight Matrix with Asynchronous Dequantization" (arXiv 2311.16442): the most
sensitive input channels get 4 bits, the rest 2 bits with second-order
quantized scales, and a few fp16 sparse outliers fix the worst 2-bit weights.

Units and precision choice
--------------------------
The K rows (input channels) of a [K, N] weight are cut into units of ``g1``
consecutive rows (the last one may be partial). Each unit gets a sensitivity

    S_u = sum_{k in u} ||W[k, :]||_2^2 / ([H^-1]_kk)^2            (with calibration X)
    H   = 2 X^T X / S + percdamp * mean(diag(2 X^T X / S)) * I

the OBS/GPTQ saliency of eq. 9 summed over the unit's rows (channels that X never
activates get H_kk = 1 before damping, as in GPTQ). Without calibration data
the ranking falls back to S_u = sum_{k in u} ||W[k, :]||^2 (documented
approximation: it assumes H proportional to the identity).
The ``n4`` most sensitive units are stored in 4 bits, where ``n4`` is
``frac_4bit * units`` rounded to a whole number of 4-bit groups (g4 / g1 units),
so the 4-bit part is made of full groups; the other units are 2-bit.
Each part keeps its units in ascending row order (a partial unit is the last
unit, so its padding falls at the end of its part).

Storage (every 2-D array is [rows, N], N contiguous; "memory-aligned": a 2-bit
unit of 16 rows is exactly one int32 word per column, a 4-bit group of 128 rows
is 16 words, no word mixes parts or units, and each part starts on a word)
  units4          [n4]              int32    units stored in 4 bits (ascending)
  q4              [K4p / 8, N]      int32    4-bit codes of rows idx4, UniformFormat packing
  scales4, mins4  [K4p / g4, N]     float16  w = q * scale + min   (asymmetric, min-offset)
  q2              [n2 * g1 / 16, N] int32    2-bit codes of rows idx2, one group per unit
  qscales2        [..., N]          int32    b_s-bit codes of the 2-bit scales, packed along units
  sscale2, smin2  [ceil(n2 / g2), N] float16 second order: scale = smin2 + code * sscale2
  outlier_indptr  [N + 1]           int32    CSR over output columns n of S ([0] if no outliers)
  outlier_indices [nnz]             int16 (int32 if K > 32767)   input row k
  outlier_values  [nnz]             float16
2-bit weights are symmetric mid-rise, w = (q - 1.5) * scale, q in {0..3}, so no
zero point is stored; each group's scale minimizes the group's squared error
over a few clipping ratios of max|w| / 1.5 before it is second-order quantized,
and the codes are then chosen for the quantized scale.

Outliers: round(outlier_frac * K * N) weights (at most 0.5 %) are picked from
the 2-bit rows only, largest 2-bit quantization error first; they are set to
zero, the 2-bit part is quantized again without them, and S keeps their
residual w - dequant (fp16), so W = W4 (rows idx4) + W2 (rows idx2) + S.

Bits per weight (eq. 10)
------------------------
With r = frac_4bit, 4-bit groups of g4 rows with fp16 scale + min, 2-bit groups
of g1 rows with b_s-bit scales and an fp16 scale-of-scales + min per g2 scales,
outliers at density p stored as fp16 value + 16-bit index:

    b = r (4 + 32 / g4) + (1 - r) (2 + b_s / g1 + 32 / (g1 g2)) + 32 p
      = 0.25 * 4.25 + 0.75 * (2 + 0.25 + 0.125)       = 2.84375   (p = 0)
      + 32 * 0.002                                     = 2.90775   (p = 0.2 %)

The stored bytes add what the formula leaves out, which vanishes at large K, N:
padding of a partial unit / 4-bit group, the units4 list (32 n4 / (K N)), the
CSR row pointer (32 (N + 1) / (K N) = 32 / K per weight: +0.0078 at K = 4096),
and int32 indices when K > 32767. At K = N = 4096 the stored count is 2.8439
without outliers and 2.9156 with 0.2 % (see tests/formats/test_mixed.py).

Kernels
-------
``y = x[:, idx4] @ W4 + x[:, idx2] @ W2 + x @ S``: ``mixed_parts`` turns the
compact form into two ``UniformFormat`` tensors for ``qtvm.ops.qmatmul_func``
(4-bit: zeros = -min / scale; 2-bit: scales = the second-order scales
dequantized to float32 at pack time, zeros = 1.5) plus the CSR arrays, and
``sparse_outlier_func`` is the TE compute of the sparse term. Bits per weight
are always counted on the compact form (``QuantizedTensor.nbytes``), not on
the kernel's float32 scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import tvm
from tvm import te, tirx

from qtvm.errors import QtvmError
from qtvm.formats import register
from qtvm.formats.base import KernelParts, QuantFormat, QuantizedTensor, add_csr, check_weight
from qtvm.formats.gptq import calibration_hessian, damped_inverse_factor
from qtvm.formats.uniform import VALID_BITS, VALID_GROUPS, UniformFormat

MAX_OUTLIER_FRAC = 0.005
FP16_MAX = 65504.0
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6)  # 2-bit scale search: scale = ratio * max|w| / 1.5
SPARSE_ATTR = "qtvm.sparse"
SPARSE_KERNEL = "sparse_outliers"  # its qtvm.kernel: scheduled by schedules.x86.schedule_sparse_outliers_x86
_KERNEL_HINT = ("use qtvm.formats.mixed.mixed_parts(qt) (two uniform kernels) and "
                "sparse_outlier_func for the outliers")


@dataclass(frozen=True)
class MixedFormat(QuantFormat):
    frac_4bit: float = 0.25
    g1: int = 16            # rows per unit = rows per 2-bit group
    g2: int = 16            # 2-bit scales per second-order group
    scale_bits: int = 4     # bits of a quantized 2-bit scale
    outlier_frac: float = 0.002
    g4: int = 128           # rows per 4-bit group
    percdamp: float = 0.01  # Hessian damping for the sensitivity

    def __post_init__(self):
        if not (isinstance(self.frac_4bit, (int, float)) and 0.0 <= self.frac_4bit <= 1.0):
            raise QtvmError(f"mixed format: frac_4bit must be in [0, 1], not {self.frac_4bit}")
        for what in ("g1", "g4"):
            if getattr(self, what) not in VALID_GROUPS:
                raise QtvmError(f"mixed format: {what} = {getattr(self, what)} is not a kernel group size",
                                f"valid: {', '.join(map(str, VALID_GROUPS))}")
        if not (isinstance(self.g2, int) and 1 <= self.g2 <= 4096):
            raise QtvmError(f"mixed format: g2 must be an integer in [1, 4096], not {self.g2}")
        if self.scale_bits not in VALID_BITS:
            raise QtvmError(f"mixed format: cannot pack {self.scale_bits}-bit scales",
                            f"valid scale_bits: {', '.join(map(str, VALID_BITS))}")
        if not (isinstance(self.outlier_frac, (int, float)) and 0.0 <= self.outlier_frac <= MAX_OUTLIER_FRAC):
            raise QtvmError(f"mixed format: outlier_frac must be in [0, {MAX_OUTLIER_FRAC}] "
                            f"(at most 0.5 % of weights), not {self.outlier_frac}")
        if not (math.isfinite(self.percdamp) and self.percdamp >= 0):
            raise QtvmError(f"mixed format: percdamp must be >= 0, not {self.percdamp}")

    # -- facts -------------------------------------------------------------------
    @property
    def name(self) -> str:
        if self == MixedFormat():
            return "mixed-2-4-16"
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return "mixed-2-4-16(" + ",".join(changed) + ")"

    def describe(self) -> dict:
        return {"family": "mixed", "bits": self.bits_per_weight_nominal(), "frac_4bit": self.frac_4bit,
                "g1": self.g1, "g2": self.g2, "g4": self.g4, "scale_bits": self.scale_bits,
                "outlier_frac": self.outlier_frac, "storage": "int32+fp16+csr"}

    def eq10_bits(self, with_outliers: bool = True) -> float:
        """Asymptotic bits per weight (module docstring, eq. 10)."""
        r = self.frac_4bit
        b = r * (4 + 32 / self.g4) + (1 - r) * (2 + self.scale_bits / self.g1 + 32 / (self.g1 * self.g2))
        return b + (32 * self.outlier_frac if with_outliers else 0.0)

    def bits_per_weight_nominal(self) -> float:
        return self.eq10_bits()

    @property
    def four(self) -> UniformFormat:
        return UniformFormat(4, self.g4)

    @property
    def two(self) -> UniformFormat:
        return UniformFormat(2, self.g1)

    def units(self, k: int) -> int:
        return -(-k // self.g1)

    def units_4bit(self, k: int) -> int:
        """4-bit units: frac_4bit of all, rounded to whole 4-bit groups."""
        align = max(1, self.g4 // self.g1)
        return min(self.units(k), int(math.floor(self.frac_4bit * self.units(k) / align + 0.5)) * align)

    def rows_of(self, units: np.ndarray, k: int) -> np.ndarray:
        """Input rows of the given units, in order (a partial last unit is cut at K)."""
        rows = (np.asarray(units, np.int64)[:, None] * self.g1 + np.arange(self.g1)).ravel()
        return rows[rows < k]

    # -- quantize ----------------------------------------------------------------
    def sensitivity(self, w: np.ndarray, calib_x=None, name: str = "weight") -> np.ndarray:
        """S_u per unit (module docstring)."""
        w64 = w.astype(np.float64)
        per_row = (w64 * w64).sum(axis=1)
        if calib_x is not None:
            u = damped_inverse_factor(calibration_hessian(calib_x, w.shape[0], name), self.percdamp)
            hinv_diag = (u * u).sum(axis=0)  # diag(U^T U) = diag(H^-1)
            per_row = per_row / hinv_diag ** 2
        padded = np.zeros(self.units(w.shape[0]) * self.g1)
        padded[: w.shape[0]] = per_row
        return padded.reshape(-1, self.g1).sum(axis=1)

    def quantize(self, w: np.ndarray, calib_x=None, name: str = "weight") -> QuantizedTensor:
        w = check_weight(w, name)
        if np.abs(w).max() > FP16_MAX:
            raise QtvmError(f"{name} has |w| up to {np.abs(w).max():.3g}; {self.name} stores fp16 scales",
                            f"weights must stay within +-{FP16_MAX:g}")
        k, n = w.shape
        sens = self.sensitivity(w, calib_x, name)
        n4 = self.units_4bit(k)
        ranked = np.argsort(-sens, kind="stable")
        units4 = np.sort(ranked[:n4]).astype(np.int32)
        units2 = np.sort(ranked[n4:])
        idx4, idx2 = self.rows_of(units4, k), self.rows_of(units2, k)

        arrays = {"units4": units4}
        arrays.update(self._quantize_4bit(w[idx4]))
        w2 = w[idx2]
        n_out = min(int(round(self.outlier_frac * k * n)), w2.size)
        part2 = self._quantize_2bit(w2, pack=n_out == 0)
        if n_out:
            err = np.abs(w2 - part2.pop("deq"))
            sel = np.argpartition(err.ravel(), err.size - n_out)[err.size - n_out:]
            rows, cols = np.unravel_index(sel, w2.shape)
            masked = w2.copy()
            masked[rows, cols] = 0.0
            part2 = self._quantize_2bit(masked)
            residual = (w2[rows, cols] - part2["deq"][rows, cols]).astype(np.float16)
            rows = idx2[rows]
        else:
            rows = cols = np.zeros(0, np.int64)
            residual = np.zeros(0, np.float16)
        part2.pop("deq")
        arrays.update(part2)
        order = np.lexsort((rows, cols))
        # An outlier-free tensor stores an empty row pointer (``outliers`` expands it).
        indptr = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=n))]) if n_out else np.zeros(0)
        arrays["outlier_indptr"] = indptr.astype(np.int32)
        arrays["outlier_indices"] = rows[order].astype(np.int16 if k <= np.iinfo(np.int16).max else np.int32)
        arrays["outlier_values"] = residual[order]
        return QuantizedTensor(self, k, n, arrays)

    def _quantize_4bit(self, w4: np.ndarray) -> dict:
        k4, n = w4.shape
        kp = self.four.padded_k(k4)
        if k4 == 0:
            return {"q4": np.zeros((0, n), np.int32), "scales4": np.zeros((0, n), np.float16),
                    "mins4": np.zeros((0, n), np.float16)}
        grouped = np.pad(w4, ((0, kp - k4), (0, 0)), mode="edge").reshape(kp // self.g4, self.g4, n)
        lo, hi = grouped.min(axis=1), grouped.max(axis=1)
        s16 = ((hi.astype(np.float64) - lo) / 15).astype(np.float16)
        s16[s16 == 0] = 1.0  # (near-)constant group: every code is 0, w = min
        m16 = lo.astype(np.float16)
        s, m = s16.astype(np.float32)[:, None, :], m16.astype(np.float32)[:, None, :]
        codes = np.clip(np.round((grouped - m) / s), 0, 15).reshape(kp, n).astype(np.uint32)
        codes[k4:] = 0
        return {"q4": self.four.pack(codes), "scales4": s16, "mins4": m16}

    def _quantize_2bit(self, w2: np.ndarray, pack: bool = True) -> dict:
        """2-bit codes, second-order scales, and the dequantized part ("deq", not stored)."""
        k2, n = w2.shape
        units = self.units(k2)
        kp = units * self.g1
        grouped = np.pad(w2, ((0, kp - k2), (0, 0)), mode="edge").reshape(units, self.g1, n)
        amax = np.abs(grouped).max(axis=1)
        best, best_err = amax / 1.5, np.full(amax.shape, np.inf, np.float32)
        for ratio in CLIP_RATIOS:
            s = (amax * np.float32(ratio / 1.5)).astype(np.float32)
            diff = _mid_rise(grouped, s)
            diff *= s[:, None, :]
            np.subtract(grouped, diff, out=diff)
            diff *= diff
            err = diff.sum(axis=1)
            better = err < best_err
            best, best_err = np.where(better, s, best), np.where(better, err, best_err)

        levels = (1 << self.scale_bits) - 1
        so_groups = -(-units // self.g2)
        sp = np.pad(best, ((0, so_groups * self.g2 - units), (0, 0)), mode="edge").reshape(so_groups, self.g2, n)
        smin, smax = sp.min(axis=1), sp.max(axis=1)
        ss16 = ((smax.astype(np.float64) - smin) / levels).astype(np.float16)
        sm16 = smin.astype(np.float16)
        ss, sm = ss16.astype(np.float32)[:, None, :], sm16.astype(np.float32)[:, None, :]
        qs = np.clip(np.round((sp - sm) / np.where(ss > 0, ss, 1.0)), 0, levels)
        qs = qs.reshape(so_groups * self.g2, n).astype(np.uint32)
        scales = self.second_order_scales(qs, ss16, sm16, units)
        centered = _mid_rise(grouped, scales)  # q - 1.5
        deq = (centered * scales[:, None, :]).reshape(kp, n)[:k2]
        if not pack:
            return {"deq": deq}
        codes = (centered + np.float32(1.5)).reshape(kp, n).astype(np.uint32)
        codes[k2:] = 0
        fmt_s = UniformFormat(self.scale_bits, None)
        qs_padded = np.zeros((fmt_s.padded_k(qs.shape[0]), n), np.uint32)
        qs_padded[: qs.shape[0]] = qs
        return {"q2": self.two.pack(codes), "qscales2": fmt_s.pack(qs_padded),
                "sscale2": ss16, "smin2": sm16, "deq": deq}

    def second_order_scales(self, qs: np.ndarray, ss16: np.ndarray, sm16: np.ndarray, units: int) -> np.ndarray:
        """float32 [units, N] 2-bit scales = smin2 + code * sscale2 of their second-order group."""
        ss = np.repeat(ss16.astype(np.float32), self.g2, axis=0)[:units]
        sm = np.repeat(sm16.astype(np.float32), self.g2, axis=0)[:units]
        return sm + qs[:units].astype(np.float32) * ss

    # -- dequantize ----------------------------------------------------------------
    def unpack_parts(self, qt: QuantizedTensor):
        """(rows of the 4-bit part, 2-bit units, rows of the 2-bit part), in part order."""
        k = qt.k
        units4 = qt.arrays["units4"].astype(np.int64)
        units2 = np.setdiff1d(np.arange(self.units(k)), units4)
        idx4, idx2 = self.rows_of(units4, k), self.rows_of(units2, k)
        return idx4, units2, idx2

    def parts_float(self, qt: QuantizedTensor):
        """(idx4, w4 [K4, N] float64, idx2, w2 [K2, N] float64, scales2 float32 [units2, N])."""
        a, n = qt.arrays, qt.n
        idx4, units2, idx2 = self.unpack_parts(qt)
        k4, k2 = len(idx4), len(idx2)
        w4 = np.zeros((0, n))
        if k4:
            kp4 = self.four.padded_k(k4)
            codes4 = self.four.unpack(a["q4"], kp4)[:k4].astype(np.float64)
            s = np.repeat(a["scales4"].astype(np.float64), self.g4, axis=0)[:k4]
            m = np.repeat(a["mins4"].astype(np.float64), self.g4, axis=0)[:k4]
            w4 = codes4 * s + m
        fmt_s = UniformFormat(self.scale_bits, None)
        rows_s = a["qscales2"].shape[0] // fmt_s.words_per_block * fmt_s.values_per_block
        qs = fmt_s.unpack(a["qscales2"], rows_s)
        scales2 = self.second_order_scales(qs, a["sscale2"], a["smin2"], len(units2))
        codes2 = self.two.unpack(a["q2"], len(units2) * self.g1)[:k2].astype(np.float64)
        w2 = (codes2 - 1.5) * np.repeat(scales2.astype(np.float64), self.g1, axis=0)[:k2]
        return idx4, w4, idx2, w2, scales2

    def outliers(self, qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR of S over output columns: (indptr [N + 1] int32, indices, values fp16)."""
        a = qt.arrays
        indptr = a["outlier_indptr"] if len(a["outlier_indptr"]) else np.zeros(qt.n + 1, np.int32)
        return indptr, a["outlier_indices"], a["outlier_values"]

    def kernel_parts(self, qt: QuantizedTensor, second_order: bool = False, **_) -> KernelParts:
        """Two uniform kernels on gathered activations plus the CSR outliers; with
        ``second_order`` the 2-bit part keeps its 4-bit scale codes (``SecondOrder2Bit``)
        and its kernel dequantizes them as it loads each group's weights."""
        idx4, part4, idx2, part2, csr = mixed_parts(qt, second_order=second_order)
        dense = [(idx.astype(np.int64), part) for idx, part in ((idx4, part4), (idx2, part2)) if part is not None]
        return KernelParts(dense, csr if len(csr[2]) else None)

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        idx4, w4, idx2, w2, _ = self.parts_float(qt)
        w = np.zeros((qt.k, qt.n), np.float64)
        w[idx4], w[idx2] = w4, w2
        return add_csr(w, self.outliers(qt)).astype(np.float32)

    # -- the compute contract: no single kernel ------------------------------------
    def padded_k(self, k: int) -> int:
        return self.units(k) * self.g1

    def group_size_for(self, k: int) -> int:
        return self.g1

    def _no_kernel(self, *args):
        raise QtvmError(f"{self.name} has no single qmatmul kernel", _KERNEL_HINT)

    array_rows = array_dtype = te_decode_terms = te_group_coefs = _no_kernel


def _mid_rise(grouped: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q - 1.5 for w = (q - 1.5) * s, q in {0..3}; zero-scale groups give q = 2 (w = 0.5 * 0)."""
    s = scales[:, None, :]
    t = grouped / np.where(s > 0, s, np.float32(1.0))
    t += np.float32(1.5)
    np.round(t, out=t)
    np.clip(t, 0, 3, out=t)
    t -= np.float32(1.5)
    return t


# -- kernels' view ----------------------------------------------------------------------
def mixed_parts(qt: QuantizedTensor, second_order: bool = False):
    """(idx4, 4-bit UniformFormat tensor | None, idx2, 2-bit tensor | None, csr).

    ``x @ W == x[:, idx4] @ W4 + x[:, idx2] @ W2 + x @ S``; each part runs on
    ``qtvm.ops.qmatmul_func`` unchanged. The 2-bit part's scales are the
    second-order scales dequantized to float32 here, at pack time, or with
    ``second_order`` left as stored (4-bit codes + fp16 scale/min per ``g2`` groups,
    ``SecondOrder2Bit``), for kernels that dequantize them while the weights load:
    0.25 + 2/g2 bits per weight instead of 2 for fp32 scales per 16 weights.
    """
    fmt = qt.fmt
    if not isinstance(fmt, MixedFormat):
        raise QtvmError(f"mixed_parts takes a mixed-2-4-16 tensor, not {fmt.name}")
    a = qt.arrays
    idx4, _, idx2, _, scales2 = fmt.parts_float(qt)
    part4 = part2 = None
    if len(idx4):
        s4 = a["scales4"].astype(np.float32)
        part4 = QuantizedTensor(fmt.four, len(idx4), qt.n, {
            "qweight": a["q4"], "scales": s4, "zeros": (-a["mins4"].astype(np.float32) / s4).astype(np.float32)})
    if len(idx2) and second_order:
        part2 = QuantizedTensor(SecondOrder2Bit(fmt.g1, fmt.g2, fmt.scale_bits), len(idx2), qt.n, {
            "qweight": a["q2"], "qscales": a["qscales2"], "sscale": a["sscale2"], "smin": a["smin2"]})
    elif len(idx2):
        part2 = QuantizedTensor(fmt.two, len(idx2), qt.n, {
            "qweight": a["q2"], "scales": scales2, "zeros": np.full_like(scales2, 1.5)})
    return idx4, part4, idx2, part2, fmt.outliers(qt)


@dataclass(frozen=True)
class SecondOrder2Bit(UniformFormat):
    """The 2-bit part of a mixed tensor as stored: w = (q - 1.5) * s, the group scale
    s = smin[g // g2] + code[g] * sscale[g // g2] decoded in the kernel (from the
    ``scale_bits``-bit codes packed along groups, fp16 scale-of-scales and minimum).
    Only a kernel view: quantizing is ``MixedFormat``'s."""

    columns_independent = False  # never quantizes on its own
    g2: int = 16
    scale_bits: int = 4

    def __init__(self, g1: int, g2: int, scale_bits: int):
        UniformFormat.__init__(self, 2, g1)
        object.__setattr__(self, "g2", g2)
        object.__setattr__(self, "scale_bits", scale_bits)

    @property
    def name(self) -> str:
        return f"int2-g{self.group_size}-so{self.scale_bits}x{self.g2}"

    def _scale_format(self) -> UniformFormat:
        return UniformFormat(self.scale_bits, None)

    def array_rows(self, k: int) -> dict[str, int]:
        groups = self.num_groups(k)
        fmt_s = self._scale_format()
        so_groups = -(-groups // self.g2)  # codes are stored for whole second-order groups
        return {"qweight": self.word_rows(k), "qscales": fmt_s.word_rows(so_groups * self.g2),
                "sscale": so_groups, "smin": so_groups}

    def array_dtype(self, name: str) -> str:
        return {"qweight": "int32", "qscales": "int32"}.get(name, "float16")

    def describe(self) -> dict:
        return dict(super().describe(), zeros="mid-rise", scales=f"second-order-{self.scale_bits}bit-g{self.g2}")

    def group_scale(self, load, g):
        code = self._scale_format()._te_code(lambda row: load("qscales", row), g).astype("float32")
        so = g // self.g2
        return load("smin", so).astype("float32") + code * load("sscale", so).astype("float32")

    def te_group_coefs(self, load, g):
        s = self.group_scale(load, g)
        return [s], s * -1.5

    def quantize(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        raise QtvmError(f"{self.name} is the kernel view of mixed-2-4-16's 2-bit part", "quantize with mixed-2-4-16")

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        groups = self.num_groups(qt.k)
        fmt_s = self._scale_format()
        rows = qt.arrays["qscales"].shape[0] // fmt_s.words_per_block * fmt_s.values_per_block
        codes = fmt_s.unpack(qt.arrays["qscales"], rows)[:groups]
        ss = np.repeat(qt.arrays["sscale"].astype(np.float32), self.g2, axis=0)[:groups]
        sm = np.repeat(qt.arrays["smin"].astype(np.float32), self.g2, axis=0)[:groups]
        scales = sm + codes.astype(np.float32) * ss
        kp = self.padded_k(qt.k)
        w = (self.unpack(qt.arrays["qweight"], kp).astype(np.float64) - 1.5) * np.repeat(scales, self.group_size, axis=0)
        return w[: qt.k].astype(np.float32)


def mixed_matmul_reference(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """float64 y = x[:, idx4] @ W4 + x[:, idx2] @ W2 + x @ S, as the kernels compute it."""
    fmt = qt.fmt
    if not isinstance(fmt, MixedFormat):
        raise QtvmError(f"mixed_matmul_reference takes a mixed-2-4-16 tensor, not {fmt.name}")
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] != qt.k:
        raise QtvmError(f"activations of shape {x.shape} do not match a weight with K = {qt.k}")
    idx4, w4, idx2, w2, _ = fmt.parts_float(qt)
    y = x[:, idx4] @ w4 + x[:, idx2] @ w2
    indptr, indices, values = fmt.outliers(qt)
    if len(values):
        prod = x[:, indices.astype(np.int64)] * values.astype(np.float64)
        nonempty = indptr[1:] > indptr[:-1]
        y[:, nonempty] += np.add.reduceat(prod, indptr[:-1][nonempty], axis=1)
    return y


def sparse_outlier_arrays(csr) -> list[np.ndarray]:
    """CSR arrays in ``sparse_outlier_func`` argument order (empty ones padded to one entry)."""
    indptr, indices, values = csr
    if len(values) == 0:
        indices, values = np.zeros(1, indices.dtype), np.zeros(1, np.float16)
    return [np.ascontiguousarray(indptr, np.int32), np.ascontiguousarray(indices), np.ascontiguousarray(values)]


def sparse_outlier_func(csr, k: int, n: int) -> tvm.tirx.PrimFunc:
    """TE compute of y[m, n] = sum_j values[j] * x[m, indices[j]], j in indptr[n] .. indptr[n+1].

    PrimFunc(x[m, k], indptr[n + 1], indices[nnz], values[nnz] fp16, y[m, n]) for a
    symbolic m. The variable-length column is a reduction over the longest
    column with a guard (pointers clamped, so no read leaves the arrays).
    """
    indptr_np, indices_np, _ = csr
    nnz = max(1, len(csr[2]))
    longest = max(1, int(np.diff(indptr_np).max(initial=0)))
    m = te.var("m", "int64")
    x = te.placeholder((m, k), "float32", name="x")
    indptr = te.placeholder((n + 1,), "int32", name="indptr")
    indices = te.placeholder((nnz,), str(np.dtype(indices_np.dtype)), name="indices")
    values = te.placeholder((nnz,), "float16", name="values")
    r = te.reduce_axis((0, longest), name="r")

    def body(i, j):
        start = indptr[j]
        pos = tirx.min(start + r, nnz - 1)
        term = values[pos].astype("float32") * x[i, indices[pos].astype("int64")]
        return te.sum(tirx.if_then_else(r < indptr[j + 1] - start, term, tirx.const(0.0, "float32")), axis=r)

    y = te.compute((m, n), body, name="outliers")
    func = te.create_prim_func([x, indptr, indices, values, y])
    from qtvm.ops import FORMAT_ATTR, KERNEL_ATTR

    facts = {"k": k, "n": n, "nnz": nnz, "longest_column": longest}
    return func.with_attrs({SPARSE_ATTR: facts, KERNEL_ATTR: SPARSE_KERNEL, FORMAT_ATTR: facts})


register(MixedFormat())
