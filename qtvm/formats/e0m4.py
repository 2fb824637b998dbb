"""E0M4 FP4 weights (Transformer-Lite, Li et al. 2024), group-wise along K.

Per group a scale and bias map the weights into [1, 2) (exponent 0, so every
mapped value shares the exponent bits of 1.0); only the top 4 fraction bits
are kept, rounded by the next one: y1 = top 4 bits, y2 = the 5th bit,
code = min(y1 + y2, 15). Dequantization is two integer ops and a reinterpret:

    f32:  f = reinterpret_f32(0x3F800000 | code << 19)   (= 1 + code / 16)
    f16:  f = reinterpret_f16(0x3C00 | code << 6)        (the same value)
    w[k, n] = scale[g, n] * f + bias[g, n]

Storage, for a [K, N] weight with K padded to ``padded_k(K)``:
  qweight [K_pad / 8, N] int32: code j of a word at bits [4j, 4j + 4) (as int4).
  scales  [G, N] float32, bias [G, N] float32.

How zero maps exactly. When a group's range contains 0, the image of w = 0,
t = -bias / scale, has its fraction bits below the top 4 zeroed, i.e. it is
rounded onto a code: t = 1 + c0 / 16 with c0 = round(-min * 16 / scale). The
scale (max - min, as in the paper's mapping) is rounded to 19 significant
bits, so bias = -t * scale is exact in fp32 (5 + 19 <= 24 bits); w = 0 then
maps to v = t exactly, rounds to code c0 (y2 = 0) and decodes to
scale * t + bias = 0 in any precision. The grid shifts by at most half a step
for this. A group whose range excludes 0 has no zero to keep and maps
[min, max] onto [1, 2) unshifted. A constant group is stored as scale = 0,
bias = the constant: exact.

The mapping [min, max] -> [1, 2) gives 16 steps of (max - min) / 16 where RTN
INT4 has 15 of (max - min) / 15; the values in the top 1/32 of the range clip
to code 15 (the min(y1 + y2, 15)). That smaller step is where the paper's MAE
gain over INT4 comes from; numerically the representable set is still a
16-level uniform grid. :func:`mae` measures a format's mean absolute error;
on Gaussian weights at group 128 E0M4 measured 0.967x INT4's MAE with zero kept
exact (0.959x without the zero shift; the paper reports ~0.955x).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import tirx

from qtvm.errors import QtvmError
from qtvm.formats.base import ArrayLoader, GroupedAlongK, QuantFormat, QuantizedTensor, check_weight

VALID_GROUPS = (16, 32, 64, 128, 256)
PRESET_GROUPS = (32, 64, 128)
DECODES = ("fp32", "fp16")
VALUES_PER_WORD = 8
CODE_MAX = 15
F32_ONE, F32_SHIFT = 0x3F800000, 19  # 23 fraction bits - 4
F16_ONE, F16_SHIFT = 0x3C00, 6  # 10 fraction bits - 4
SCALE_BITS = 19  # significant bits kept in a zero-preserving scale (24 - 5)


@dataclass(frozen=True)
class E0M4Format(GroupedAlongK, QuantFormat):
    columns_independent = True  # scales and codes per (group, column)
    group_size: int | None = 128  # None: one group per column
    decode: str = "fp32"  # how the kernel turns a code into a float: "fp32" or "fp16"

    def __post_init__(self):
        if self.group_size is not None and self.group_size not in VALID_GROUPS:
            raise QtvmError(f"E0M4 format cannot use group size {self.group_size}",
                            f"valid group sizes: {', '.join(map(str, VALID_GROUPS))} or full column")
        if self.decode not in DECODES:
            raise QtvmError(f"E0M4 format has no '{self.decode}' decode", f"valid decodes: {', '.join(DECODES)}")

    # -- layout facts -------------------------------------------------------
    pack_unit = VALUES_PER_WORD  # 8 codes per int32

    @property
    def name(self) -> str:
        base = "e0m4-" + ("col" if self.group_size is None else f"g{self.group_size}")
        return base if self.decode == "fp32" else f"{base}-f16"




    def array_rows(self, k: int) -> dict[str, int]:
        g = self.num_groups(k)
        return {"qweight": self.padded_k(k) // VALUES_PER_WORD, "scales": g, "bias": g}

    def array_dtype(self, name: str) -> str:
        return "int32" if name == "qweight" else "float32"

    def describe(self) -> dict:
        return {"family": "e0m4", "bits": 4, "group_size": self.group_size or 0, "storage": "int32",
                "zeros": "float32-bias", "decode": self.decode, "values_per_block": VALUES_PER_WORD}

    def bits_per_weight_nominal(self) -> float:
        return 4 + 64.0 / (self.group_size or 4096)

    # -- packing ----------------------------------------------------------------
    @staticmethod
    def pack(codes: np.ndarray) -> np.ndarray:
        """[K_pad, N] codes in [0, 15] -> [K_pad / 8, N] int32."""
        kp, n = codes.shape
        if kp % VALUES_PER_WORD:
            raise QtvmError(f"cannot pack {kp} E0M4 rows", f"rows must be a multiple of {VALUES_PER_WORD}")
        c = codes.astype(np.uint64).reshape(kp // VALUES_PER_WORD, VALUES_PER_WORD, n)
        shifts = (4 * np.arange(VALUES_PER_WORD, dtype=np.uint64))[None, :, None]
        return np.ascontiguousarray((c << shifts).sum(axis=1).astype(np.uint32).view(np.int32))

    @staticmethod
    def unpack(words: np.ndarray) -> np.ndarray:
        """[K_pad / 8, N] int32 -> [K_pad, N] uint32 codes."""
        w = words.view(np.uint32)
        shifts = (4 * np.arange(VALUES_PER_WORD, dtype=np.uint32))[None, :, None]
        return ((w[:, None, :] >> shifts) & np.uint32(CODE_MAX)).reshape(-1, w.shape[1])

    @staticmethod
    def code_values(codes: np.ndarray, decode: str = "fp32") -> np.ndarray:
        """The float each code decodes to, by the kernel's bit recipe (numpy)."""
        c = np.asarray(codes).astype(np.uint32)
        if decode == "fp16":
            return ((c << F16_SHIFT) | F16_ONE).astype(np.uint16).view(np.float16)
        return ((c << F32_SHIFT) | F32_ONE).astype(np.uint32).view(np.float32)

    @staticmethod
    def encode(v: np.ndarray) -> np.ndarray:
        """Mapped values in [1, 2) -> codes: top 4 fraction bits + the 5th as rounding."""
        v32 = np.clip(np.asarray(v, np.float64), 1.0, 2.0).astype(np.float32)
        v32 = np.minimum(v32, np.nextafter(np.float32(2.0), np.float32(1.0)))
        bits = v32.view(np.uint32)
        y1 = (bits >> np.uint32(F32_SHIFT)) & np.uint32(CODE_MAX)
        y2 = (bits >> np.uint32(F32_SHIFT - 1)) & np.uint32(1)
        return np.minimum(y1 + y2, CODE_MAX).astype(np.uint32)

    # -- numpy side -----------------------------------------------------------
    def quantize(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        w = check_weight(w, name)
        k, n = w.shape
        kp, gs = self.padded_k(k), self.group_size_for(k)
        ng = kp // gs
        wp = np.zeros((kp, n), np.float64)
        wp[:k] = w
        grouped = wp.reshape(ng, gs, n)
        valid = (np.arange(kp) < k).reshape(ng, gs, 1)
        lo = np.where(valid, grouped, np.inf).min(axis=1)
        hi = np.where(valid, grouped, -np.inf).max(axis=1)
        empty = ~np.isfinite(lo)  # groups of padding only
        lo[empty], hi[empty] = 0.0, 0.0
        scale, bias = _group_params(lo, hi)
        fmax = float(np.finfo(np.float32).max)
        if np.abs(scale).max() > fmax or np.abs(bias).max() > fmax:
            raise QtvmError(f"{name} has a group range too wide for fp32 E0M4 scales (|w| up to {np.abs(w).max():.3g})",
                            "rescale the weight or use a smaller group")
        safe = np.where(scale == 0, 1.0, scale)
        v = np.where(scale[:, None, :] == 0, 1.0, (grouped - bias[:, None, :]) / safe[:, None, :])
        codes = self.encode(v).reshape(kp, n)
        return QuantizedTensor(self, k, n, {"qweight": self.pack(codes), "scales": scale.astype(np.float32),
                                            "bias": bias.astype(np.float32)})

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        gs = self.group_size_for(qt.k)
        f = self.code_values(self.unpack(qt.arrays["qweight"]), self.decode).astype(np.float64)
        scales = np.repeat(qt.arrays["scales"].astype(np.float64), gs, axis=0)
        bias = np.repeat(qt.arrays["bias"].astype(np.float64), gs, axis=0)
        return (scales * f + bias)[: qt.k].astype(np.float32)

    # -- TE side ----------------------------------------------------------------
    def te_decode_terms(self, load: ArrayLoader, k):
        """One term: the code's float (1 + code / 16) by bit assembly, no int->float convert."""
        shift = ((k % VALUES_PER_WORD) * 4).astype("int32")
        code = (load("qweight", k // VALUES_PER_WORD) >> shift) & CODE_MAX
        if self.decode == "fp16":
            half = ((code << F16_SHIFT) | F16_ONE).astype("uint16")
            return [tirx.reinterpret("float16", half).astype("float32")]
        return [tirx.reinterpret("float32", (code << F32_SHIFT) | F32_ONE)]

    def te_group_coefs(self, load: ArrayLoader, g):
        return [load("scales", g)], load("bias", g)

    def te_code_affine(self, load: ArrayLoader, g):
        """The decoded 1 + code/16 is affine in the 4-bit code, so integer dots apply:
        w = scale * (1 + c/16) + bias = (scale/16) * c + (scale + bias)."""
        scale = load("scales", g)
        return scale * (1.0 / (CODE_MAX + 1)), scale + load("bias", g)


def _round_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """Round non-negative float64s to nearest with ``bits`` significant bits."""
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * (1 << bits)) / (1 << bits), e)


def _group_params(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, bias) float64 per group: [lo, hi] -> [1, 2) (the top 1/32 clips to code 15).

    A range holding zero keeps zero on a code (see the module docstring): the
    image of zero, t = 1 + c0 / 16, is rounded to a code and the scale to 19
    significant bits, so bias = -t * scale is exact in fp32.
    """
    scale = hi - lo  # 16 steps of (hi - lo) / 16; a constant group gets scale 0
    bias = lo - scale  # w = lo -> v = 1
    sz = (lo <= 0) & (hi >= 0) & (scale > 0)
    s = _round_bits(scale[sz], SCALE_BITS)
    c0 = np.clip(np.round(-lo[sz] / s * 16.0), 0, CODE_MAX)
    t = 1.0 + c0 / 16.0
    scale[sz] = s
    bias[sz] = -t * s  # exact in fp32: a 5-bit t times a 19-bit s
    return scale, bias


def mae(w: np.ndarray, fmt: QuantFormat) -> float:
    """Mean absolute quantization error of ``fmt`` on ``w`` (float64 mean)."""
    w = check_weight(w)
    return float(np.mean(np.abs(fmt.quantize(w).dequantize().astype(np.float64) - w)))


def mae_ratio_vs_int4(w: np.ndarray, group_size: int = 128) -> float:
    """MAE(E0M4) / MAE(INT4 round-to-nearest) at the same group size (Transformer-Lite Table 2)."""
    from qtvm.formats.uniform import UniformFormat

    return mae(w, E0M4Format(group_size)) / mae(w, UniformFormat(4, group_size))


def _register():
    from qtvm.formats import register

    for g in PRESET_GROUPS:
        register(E0M4Format(g))
        register(E0M4Format(g, "fp16"))


_register()
