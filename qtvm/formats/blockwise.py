"""Weights quantized elsewhere (quantized ONNX models, GPTQ checkpoints) -> uniform tensors.

A ``BlockQuantized`` is a 2-D weight as another tool stored it: unsigned integer
codes and, per group of consecutive elements along one axis, a scale and a zero point,

    w[r, c] = (codes[r, c] - zeros[group]) * scales[group]

kept in the orientation of the tensor it came from. ``for_matmul`` repacks it into
qtvm's uniform format for ``x @ W`` (K = the reduction axis): codes packed along K
in int32 words, scales/zeros [G, N] float32 (``qtvm.formats.uniform``), a format
built for the tensor's own bits and group size (``UniformFormat(4, 32)`` or
``UniformFormat(4, 48)``, preset or not). Only integer codes are moved; no float
copy of the weight is ever made. Act-order tensors (``g_idx``) are permuted so
their groups are contiguous (``qtvm.formats.gptq.reorder_for_kernel``) and carry
the activation permutation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtvm.errors import QtvmError
from qtvm.formats.base import QuantizedTensor
from qtvm.formats.gptq import ActOrderFormat, QZerosFormat, reorder_for_kernel
from qtvm.formats.uniform import GROUP_UNIT, VALID_BITS, UniformFormat


@dataclass(frozen=True)
class PackedCodes:
    """Codes [K, N] as MatMulNBits stores them: per column, its K codes packed low bits first
    into bytes ([N, bytes] uint8; K padded to whole blocks). Kept packed until the kernel's
    layout is made, so a model's weights are never all held a byte a code at once (twice
    their packed size at 4 bits); at 2, 4 and 8 bits they are never unpacked (``words``)."""

    columns: np.ndarray  # [N, bytes] uint8
    bits: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.k, self.columns.shape[0]

    def unpack(self) -> np.ndarray:
        """[K, N] codes."""
        return np.ascontiguousarray(unpack_low_first(self.columns, self.bits)[:, :self.k].T)

    def words(self, kp: int) -> np.ndarray | None:
        """The uniform format's words [kp * bits / 32, N] int32 (32 / bits codes a word, low
        bits first along K: ``UniformFormat.pack``) straight from the bytes: four bytes of a
        column are one little-endian word of it. None at 3 bits, or where the bytes hold
        fewer than ``kp`` codes."""
        nbytes = kp * self.bits // 8
        if 32 % self.bits or kp * self.bits % 32 or self.columns.shape[1] < nbytes:
            return None
        return np.ascontiguousarray(self.columns[:, :nbytes].view("<u4").T).view(np.int32)


def unpack_low_first(packed: np.ndarray, bits: int) -> np.ndarray:
    """[rows, bytes] uint8 -> [rows, bytes * 8 / bits] codes, lowest bits first."""
    per = 8 // bits
    shifts = (bits * np.arange(per, dtype=np.uint8))[None, None, :]
    codes = (packed[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(packed.shape[0], -1)


@dataclass
class BlockQuantized:
    """Codes [rows, cols] with groups running along ``axis`` (None: one group for the whole tensor).

    ``scales``/``zeros`` have the grouped axis reduced: [G, cols] when axis = 0,
    [rows, G] when axis = 1, [1, 1] when axis is None. ``group_size`` None means one
    group spans the whole axis (per-channel). ``g_idx`` [len(axis)] gives each
    row's group when groups are not consecutive (GPTQ act-order).
    """

    origin: str  # e.g. "MatMulNBits 'fc2'": named in notes and errors
    bits: int
    codes: np.ndarray | PackedCodes  # unsigned, < 2**bits
    scales: np.ndarray  # float32
    zeros: np.ndarray  # float32, in code units (integer-valued or not)
    axis: int | None
    group_size: int | None
    g_idx: np.ndarray | None = None

    def __post_init__(self):
        if self.bits not in VALID_BITS:
            raise QtvmError(f"{self.origin} has {self.bits}-bit weights; qtvm's kernels take "
                            f"{', '.join(map(str, VALID_BITS))} bits", "re-quantize it to one of those")
        g = self.group_size
        if g is not None and (g <= 0 or g % GROUP_UNIT):
            raise QtvmError(f"{self.origin} has block size {g}; qtvm's kernels take blocks that are "
                            f"multiples of {GROUP_UNIT}", "re-quantize with block_size 16, 32, 64, 128 or 256")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def code_array(self) -> np.ndarray:
        return self.codes.unpack() if isinstance(self.codes, PackedCodes) else self.codes

    @property
    def format(self) -> UniformFormat:
        """The uniform format the kernels run it in, a small one that holds the stored values
        exactly (the same products): float16 scales and zeros (``-f16``, 4.25 bits a weight at
        4 bits, groups of 128) where float16 holds them all (a GPTQ checkpoint's, an fp16
        model's: zero points that are codes always fit), else zero points that are codes
        (0 .. 2^bits - 1, as MatMulNBits and QDQ store them) packed as codes (``-qz``: 4.28
        bits) beside float32 scales, else float32 scales and zeros (4.5 bits). -f16 before
        -f16-qz: on Zen 4 the packed zeros' unpack cost more than their bytes saved (int4-g128
        at 4096 x 11008, 1 thread: 1020 us -f16, 1026 -f16-qz, 1124 -qz, 1142 float32)."""
        z = np.asarray(self.zeros, np.float64)
        if _float16_exact(self.scales, self.zeros):
            return UniformFormat(self.bits, self.group_size, "float16")
        if np.all((z == np.round(z)) & (z >= 0) & (z <= (1 << self.bits) - 1)):
            return QZerosFormat(self.bits, self.group_size)
        return UniformFormat(self.bits, self.group_size)

    def why_not(self, transposed: bool) -> str | None:
        """None when ``x @ W`` (``x @ W^T`` if ``transposed``) fits the uniform format, else why not."""
        k_axis = 1 if transposed else 0
        if self.axis is None or self.axis == k_axis:
            return None
        return (f"its {'blocks' if self.group_size else 'per-channel scales'} run along the output axis, "
                "so the scale changes with every row of K (qtvm's formats group along K)")

    def for_matmul(self, transposed: bool = False) -> tuple[QuantizedTensor, np.ndarray | None]:
        """(uniform tensor of W [K, N], activation permutation or None): ``x @ W == x[..., perm] @ W_kernel``."""
        reason = self.why_not(transposed)
        if reason is not None:
            raise QtvmError(f"{self.origin} cannot run on qtvm's kernels: {reason}")
        scales, zeros = (self.scales.T, self.zeros.T) if transposed else (self.scales, self.zeros)
        k, n = self.shape[::-1] if transposed else self.shape
        if self.axis is None:
            scales, zeros = np.broadcast_to(scales, (1, n)), np.broadcast_to(zeros, (1, n))
        fmt = self.format
        kp, gs, groups = fmt.padded_k(k), fmt.group_size_for(k), fmt.num_groups(k)
        if scales.shape[0] > groups or scales.shape[1] != n or zeros.shape != scales.shape:
            raise QtvmError(f"{self.origin} has scales {list(scales.shape)} and zero points {list(zeros.shape)} "
                            f"for a [{k}, {n}] weight with groups of {gs}", "check the quantized model")
        # Groups past the stored ones cover only padding rows (3-bit runs of 32 with groups of 16).
        s = np.ones((groups, n), np.float32)
        z = np.zeros((groups, n), np.float32)
        s[:scales.shape[0]], z[:zeros.shape[0]] = scales, zeros
        zero_codes = np.clip(np.round(z), 0, fmt.qmax).astype(np.uint8)  # bits <= 8
        padding = zero_codes[np.arange(k, kp) // gs]  # padding rows: their group's zero code (weight ~0, x is 0 there)
        words = self.codes.words(kp) if isinstance(self.codes, PackedCodes) and not transposed else None
        if words is None:
            codes = self.code_array()
            full = np.empty((kp, n), np.uint8)
            full[:k] = codes.T if transposed else codes
            full[k:] = padding
            words = fmt.pack(full)
        elif kp > k:  # the stored padding codes may be anything: the words holding them are re-packed
            first = k // fmt.values_per_block
            tail = fmt.unpack(words[first:], kp - first * fmt.values_per_block)
            tail[k - first * fmt.values_per_block:] = padding
            words[first:] = fmt.pack(tail)
        arrays = {"qweight": words, "scales": s.astype(fmt.array_dtype("scales")),
                  "zeros": z.astype(fmt.array_dtype("zeros"))}
        if isinstance(fmt, QZerosFormat):  # zero points packed as codes
            arrays = fmt.from_float_zeros(QuantizedTensor(fmt, k, n, arrays)).arrays
        if self.g_idx is None or np.array_equal(self.g_idx, np.arange(k) // gs):
            return QuantizedTensor(fmt, k, n, arrays), None
        try:
            perm, qt = reorder_for_kernel(QuantizedTensor(ActOrderFormat(fmt), k, n, dict(arrays, g_idx=self.g_idx)))
        except QtvmError as e:
            raise QtvmError(f"{self.origin}: {e.problem}", e.fix) from None
        return qt, perm

    def dequantize_reference(self) -> np.ndarray:
        """float64 [rows, cols], straight from the stored codes (tests and checks only)."""
        codes = self.code_array().astype(np.float64)
        if self.axis is None:
            return (codes - float(self.zeros.reshape(-1)[0])) * float(self.scales.reshape(-1)[0])
        c = np.moveaxis(codes, self.axis, 0)
        s, z = np.moveaxis(self.scales, self.axis, 0), np.moveaxis(self.zeros, self.axis, 0)
        length = c.shape[0]
        if self.g_idx is not None:
            g = np.asarray(self.g_idx, np.int64)
        else:
            g = np.arange(length) // (self.group_size or length)
        w = (c - z[g].astype(np.float64)) * s[g].astype(np.float64)
        return np.moveaxis(w, 0, self.axis)


def _float16_exact(*arrays: np.ndarray) -> bool:
    """Every value of ``arrays`` finite and exactly a float16."""
    for a in arrays:
        a = np.asarray(a, np.float32)
        with np.errstate(over="ignore"):
            if not (np.isfinite(a).all() and np.array_equal(a.astype(np.float16).astype(np.float32), a)):
                return False
    return True
