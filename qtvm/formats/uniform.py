"""Uniform asymmetric b-bit weights, group-wise along K (GPTQ / QIGen layout).

Storage, for a [K, N] weight with K padded to ``padded_k(K)``:
  qweight [K_pad * b / 32, N] int32: values packed along K; for b in {2, 4, 8}
          value j of a word sits at bits [b*j, b*j + b); for b = 3, 32 values
          fill 3 consecutive words as one 96-bit little-endian field, so values
          10 and 21 straddle word boundaries (QIGen's 3-bit layout).
  scales  [G, N] float32, zeros [G, N] float32 (integer-valued zero points);
          float16 both in the ``-f16`` presets (``scale_dtype``): GPTQ's, AWQ's and
          llama.cpp's scale width, 4.25 instead of 4.5 bits a weight at b = 4, g = 128, and
          the bytes a memory-bound GEMV streams are its time.
  w[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import tirx

from qtvm.errors import QtvmError
from qtvm.formats.base import ArrayLoader, GroupedAlongK, QuantFormat, QuantizedTensor, check_weight

VALID_BITS = (2, 3, 4, 8)
VALID_GROUPS = (16, 32, 64, 128, 256)  # the presets; a model's own blocks may be any multiple of GROUP_UNIT
GROUP_UNIT = 16  # every group is whole int32 words at 2/4/8 bits (and MatMulNBits' smallest block)
SCALE_DTYPES = {"float32": "", "float16": "-f16"}  # stored scale/zero dtype -> preset suffix


@dataclass(frozen=True)
class UniformFormat(GroupedAlongK, QuantFormat):
    columns_independent = True  # scales and codes per (group, column)
    bits: int = 4
    group_size: int | None = 128  # None: one group per column ("-col")
    scale_dtype: str = "float32"  # of the stored scales and zeros (SCALE_DTYPES)

    def __post_init__(self):
        if self.bits not in VALID_BITS:
            raise QtvmError(f"uniform format cannot pack {self.bits}-bit values",
                            f"valid bits: {', '.join(map(str, VALID_BITS))}")
        g = self.group_size
        if g is not None and (not isinstance(g, int) or g <= 0 or g % GROUP_UNIT):
            raise QtvmError(f"uniform format cannot use group size {g}",
                            f"valid group sizes: multiples of {GROUP_UNIT} (presets: "
                            f"{', '.join(map(str, VALID_GROUPS))}) or full column")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QtvmError(f"uniform format cannot store scales as {self.scale_dtype}",
                            f"valid: {', '.join(SCALE_DTYPES)}")

    # -- layout facts -------------------------------------------------------
    @property
    def name(self) -> str:
        return f"int{self.bits}-" + ("col" if self.group_size is None else f"g{self.group_size}") + \
            SCALE_DTYPES[self.scale_dtype]

    @property
    def values_per_block(self) -> int:
        """Values in one indivisible run of words (3 words for 3-bit)."""
        return 32 if self.bits == 3 else 32 // self.bits

    @property
    def pack_unit(self) -> int:
        return self.values_per_block

    @property
    def words_per_block(self) -> int:
        return 3 if self.bits == 3 else 1

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1




    def word_rows(self, k: int) -> int:
        return self.padded_k(k) // self.values_per_block * self.words_per_block

    def array_rows(self, k: int) -> dict[str, int]:
        """Rows of each stored [rows, N] array, in kernel argument order."""
        g = self.num_groups(k)
        return {"qweight": self.word_rows(k), "scales": g, "zeros": g}

    def describe(self) -> dict:
        return {"family": "uniform", "bits": self.bits, "group_size": self.group_size or 0,
                "storage": "int32", "zeros": self.scale_dtype, "values_per_block": self.values_per_block,
                **({} if self.scale_dtype == "float32" else {"scales": self.scale_dtype})}

    def bits_per_weight_nominal(self) -> float:
        g = self.group_size or 4096
        return self.bits + 2.0 * np.dtype(self.scale_dtype).itemsize * 8 / g

    # -- numpy side -----------------------------------------------------------
    def quantize(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        """Round-to-nearest; the range always covers 0 so zeros stay exact."""
        w = check_weight(w, name)
        k, n = w.shape
        kp, gs = self.padded_k(k), self.group_size_for(k)
        wp = np.zeros((kp, n), np.float32)
        wp[:k] = w
        grouped = wp.reshape(kp // gs, gs, n)
        lo, hi = grouped.min(axis=1), grouped.max(axis=1)
        wmin, wmax = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
        # float64: wmax - wmin of float32 values near +-3.4e38 overflows float32.
        scales = ((wmax.astype(np.float64) - wmin) / self.qmax).astype(np.float32)
        scales[scales == 0] = 1.0  # an all-zero group: any scale reproduces it
        # A constant group c != 0: scale |c| gives code 1 (zero 0) or code 0 (zero 1),
        # so it dequantizes to exactly c (|c| / qmax * qmax need not round back to |c|).
        const = (lo == hi) & (lo != 0)
        scales[const] = np.abs(lo[const])
        scales = self._stored_scales(scales, name)
        zeros = np.clip(np.round(-wmin / scales), 0, self.qmax).astype(np.float32)
        codes = np.clip(np.round(grouped / scales[:, None, :]) + zeros[:, None, :], 0, self.qmax)
        codes = codes.reshape(kp, n).astype(np.uint32)
        return QuantizedTensor(self, k, n, {"qweight": self.pack(codes), "scales": scales.astype(self.scale_dtype),
                                            "zeros": zeros.astype(self.scale_dtype)})

    def _stored_scales(self, scales: np.ndarray, name: str) -> np.ndarray:
        """The float32 scales as stored (rounded to ``scale_dtype``), so the codes are
        chosen against the scale the kernel will read. A scale the dtype cannot hold
        (beyond float16's 65504, or rounding to 0) is refused by name."""
        if self.scale_dtype == "float32":
            return scales
        with np.errstate(over="ignore", under="ignore"):
            stored = scales.astype(self.scale_dtype)
        bad = ~np.isfinite(stored) | (stored == 0)
        if bad.any():
            g, j = (int(i) for i in np.argwhere(bad)[0])
            raise QtvmError(f"'{name}' needs a scale of {float(scales[g, j]):.3g} (group {g}, column {j}), "
                            f"beyond {self.scale_dtype}'s range",
                            f"use the float32-scale preset {UniformFormat(self.bits, self.group_size).name}")
        return stored.astype(np.float32)

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """[K_pad, N] codes -> [word rows, N] int32. Field by field into 32-bit words, so the
        temporaries are word-sized (a large layer's codes widened to 64 bits at once took 16x
        its packed size)."""
        kp, n = codes.shape
        if self.bits != 3:
            vpw = self.values_per_block
            fields = codes.reshape(kp // vpw, vpw, n)
            words = np.zeros((kp // vpw, n), np.uint32)
            for j in range(vpw):
                words |= fields[:, j].astype(np.uint32) << np.uint32(self.bits * j)
            return words.view(np.int32)
        blocks = codes.reshape(kp // 32, 32, n)
        words = np.zeros((kp // 32, 3, n), np.uint32)
        for j in range(32):
            word, shift = divmod(3 * j, 32)
            value = blocks[:, j].astype(np.uint32)
            words[:, word] |= value << np.uint32(shift)  # bits past 32 fall off
            if shift > 29:  # the value's high bits continue in the next word
                words[:, word + 1] |= value >> np.uint32(32 - shift)
        return words.reshape(kp // 32 * 3, n).view(np.int32)

    def unpack(self, words: np.ndarray, kp: int) -> np.ndarray:
        """[word rows, N] int32 -> [K_pad, N] codes (uint32)."""
        w = words.view(np.uint32).astype(np.uint64)
        n = w.shape[1]
        if self.bits != 3:
            vpw = self.values_per_block
            shifts = (self.bits * np.arange(vpw, dtype=np.uint64))[None, :, None]
            return ((w[:, None, :] >> shifts) & np.uint64(self.qmax)).reshape(kp, n).astype(np.uint32)
        bits96 = w.reshape(kp // 32, 3, n)
        field = bits96[:, 0] | (bits96[:, 1] << np.uint64(32))  # low 64 bits
        out = np.empty((kp // 32, 32, n), np.uint64)
        for j in range(32):
            off = 3 * j
            if off + 3 <= 64:
                out[:, j] = (field >> np.uint64(off)) & np.uint64(7)
            elif off >= 64:
                out[:, j] = (bits96[:, 2] >> np.uint64(off - 64)) & np.uint64(7)
            else:  # value 21 straddles the 64-bit boundary
                out[:, j] = ((field >> np.uint64(off)) | (bits96[:, 2] << np.uint64(64 - off))) & np.uint64(7)
        return out.reshape(kp, n).astype(np.uint32)

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        kp, gs = self.padded_k(qt.k), self.group_size_for(qt.k)
        codes = self.unpack(qt.arrays["qweight"], kp).astype(np.float64)
        scales = np.repeat(qt.arrays["scales"].astype(np.float64), gs, axis=0)
        zeros = np.repeat(qt.arrays["zeros"].astype(np.float64), gs, axis=0)
        return ((codes - zeros) * scales)[: qt.k].astype(np.float32)

    # -- TE side ----------------------------------------------------------------
    def array_dtype(self, name: str) -> str:
        return "int32" if name == "qweight" else self.scale_dtype

    def te_decode_terms(self, load: ArrayLoader, k):
        """One term: the integer code of weight row ``k`` as float32."""
        return [self._te_code(lambda row: load("qweight", row), k).astype("float32")]

    def te_group_coefs(self, load: ArrayLoader, g):
        s = load("scales", g).astype("float32")
        return [s], -load("zeros", g).astype("float32") * s

    def te_code_affine(self, load: ArrayLoader, g):
        coefs, offset = self.te_group_coefs(load, g)
        return coefs[0], offset

    def _te_code(self, word, k):
        mask = tirx.const(self.qmax, "int32")
        if self.bits != 3:
            vpw = self.values_per_block
            shift = ((k % vpw) * self.bits).astype("int32")
            return (word(k // vpw) >> shift) & mask
        base, j = (k // 32) * 3, k % 32
        off = (j * 3).astype("int32")
        word_index = off // 32
        shift = off % 32
        # Branch-free: logical shifts (uint32), and the next word's shift is
        # >= 3 (so it contributes nothing) unless the value straddles words
        # (values 10 and 21). Every shift amount stays in [0, 31] for all j.
        lo = word(base + word_index).astype("uint32")
        hi = word(base + tirx.min(word_index + 1, 2)).astype("uint32")
        code = ((lo >> shift.astype("uint32")) | (hi << tirx.min(32 - shift, 31).astype("uint32")))
        return (code & tirx.const(7, "uint32")).astype("int32")

