"""GPTQ (Frantar et al., ICLR 2023) for the uniform format, act-order tensors, packed zeros.

GPTQ quantizes the K rows of a [K, N] weight one at a time (our rows are GPTQ's
"columns": input features) and spreads each row's rounding error over the rows
not yet quantized, so that the layer output X W, not W itself, stays close:

    H    = 2 X^T X / S + lambda I,   lambda = percdamp * mean(diag(2 X^T X / S))
    U    = upper Cholesky factor of H^-1        (H^-1 = U^T U)
    for row k in processing order:
        q_k  = quant(w_k)                       (the group's scale/zero, see below)
        e_k  = (w_k - q_k) / U[k, k]
        w_j -= U[k, j] * e_k                    for every later row j
  with the updates to rows past the current block of ``block_size`` rows
  applied lazily, once per block (W[i2:] -= U[i1:i2, i2:]^T E): the same
  arithmetic, reordered so the big update is one matrix product.

Channels the calibration data never activates (diag(H) = 0) get H[k, k] = 1:
they are then decoupled from the others and quantized round-to-nearest
(GPTQ's reference implementation zeroes them instead; we keep the weights).
All Hessian math runs in float64.

Group parameters (GPTQ's ``static_groups=False``): a group's scale and zero are
fixed when the quantizer reaches the group's first row in processing order,
by the same min/max rule as round-to-nearest (``UniformFormat.quantize``),
from the group's weights as already updated by the errors of every row
quantized before it (including the pending lazy updates of the current block).

Act-order (``act_order=True``): rows are processed in order of decreasing
diag(H), and group j holds the rows at processing positions [j g, (j+1) g),
so a row's group is ``g_idx[k] = position(k) // g``. The stored tensor keeps
rows in their original order and carries ``g_idx`` [K] int32, as GPTQ
checkpoints do (``ActOrderFormat``); ``reorder_for_kernel`` permutes the rows
so the groups are contiguous again and returns the activation permutation:
``x @ W == x[:, perm] @ W_perm``, so the plain uniform kernel runs it.

Packed zeros (``QZerosFormat``, presets ``int4-g128-qz`` etc.): the integer zero
points are stored as b-bit codes packed in int32 words like GPTQ's ``qzeros``,
but packed along the group axis ([ceil(G / values_per_word) * words, N], the
same packing as ``qweight``) rather than along N, so every stored array keeps
the [rows, N] column-blocked layout the kernels stream. A GPTQ checkpoint's
qzeros (packed along N) converts by unpack + repack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qtvm.errors import QtvmError
from qtvm.formats import register
from qtvm.formats.base import ArrayLoader, QuantFormat, QuantizedTensor, check_weight
from qtvm.formats.uniform import SCALE_DTYPES, VALID_BITS, VALID_GROUPS, UniformFormat


# -- packed zeros ----------------------------------------------------------------
@dataclass(frozen=True)
class QZerosFormat(UniformFormat):
    """Uniform weights with zero points packed as b-bit codes (``qzeros`` int32)."""

    @property
    def name(self) -> str:
        return super().name + "-qz"

    def zero_rows(self, k: int) -> int:
        """int32 rows of ``qzeros``: groups padded to a whole run of words."""
        return -(-self.num_groups(k) // self.values_per_block) * self.words_per_block

    def array_rows(self, k: int) -> dict[str, int]:
        return {"qweight": self.word_rows(k), "scales": self.num_groups(k), "qzeros": self.zero_rows(k)}

    def array_dtype(self, name: str) -> str:
        return "int32" if name in ("qweight", "qzeros") else self.scale_dtype

    def describe(self) -> dict:
        return dict(super().describe(), zeros="packed")

    def bits_per_weight_nominal(self) -> float:
        g = self.group_size or 4096
        return self.bits + (8.0 * np.dtype(self.scale_dtype).itemsize + self.bits) / g

    def pack_zeros(self, zeros: np.ndarray) -> np.ndarray:
        """[G, N] integer-valued zero points -> [zero rows, N] int32."""
        g, n = zeros.shape
        codes = np.zeros((-(-g // self.values_per_block) * self.values_per_block, n), np.uint32)
        codes[:g] = zeros
        return self.pack(codes)

    def unpack_zeros(self, qzeros: np.ndarray, k: int) -> np.ndarray:
        g = self.num_groups(k)
        rows = qzeros.shape[0] // self.words_per_block * self.values_per_block
        return self.unpack(qzeros, rows)[:g].astype(np.float32)

    def from_float_zeros(self, qt: QuantizedTensor) -> QuantizedTensor:
        """A tensor with float ``zeros`` [G, N] -> the same tensor with packed ``qzeros``."""
        arrays = {name: a for name, a in qt.arrays.items() if name != "zeros"}
        arrays["qzeros"] = self.pack_zeros(qt.arrays["zeros"])
        order = ["qweight", "scales", "qzeros", *[a for a in arrays if a not in ("qweight", "scales", "qzeros")]]
        return QuantizedTensor(qt.fmt, qt.k, qt.n, {name: arrays[name] for name in order})

    def quantize(self, w: np.ndarray, name: str = "weight") -> QuantizedTensor:
        return self.from_float_zeros(super().quantize(w, name))

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        arrays = dict(qt.arrays, zeros=self.unpack_zeros(qt.arrays["qzeros"], qt.k))
        return super().dequantize_reference(QuantizedTensor(self, qt.k, qt.n, arrays))

    def te_group_coefs(self, load: ArrayLoader, g):
        s = load("scales", g).astype("float32")
        z = self._te_code(lambda row: load("qzeros", row), g).astype("float32")
        return [s], -z * s


def group_zeros(fmt: UniformFormat, arrays: dict, k: int) -> np.ndarray:
    """Float [G, N] zero points of a uniform tensor, packed or not."""
    if isinstance(fmt, QZerosFormat):
        return fmt.unpack_zeros(arrays["qzeros"], k)
    return arrays["zeros"]


# -- act-order tensors ---------------------------------------------------------------
_REORDER_HINT = "call qtvm.formats.gptq.reorder_for_kernel(qt) and feed x[:, perm] to the uniform kernel"


@dataclass(frozen=True)
class ActOrderFormat(QuantFormat):
    """A uniform tensor whose rows belong to groups through ``g_idx`` [K] int32.

    Stored arrays: those of ``base`` (rows in original order) plus ``g_idx``;
    w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].
    It has no kernel of its own: ``reorder_for_kernel`` gives the uniform one.
    """

    base: UniformFormat

    def __post_init__(self):
        if not isinstance(self.base, UniformFormat):
            raise QtvmError(f"act-order needs a uniform base format, not {type(self.base).__name__}")

    @property
    def name(self) -> str:
        return self.base.name + "-act"

    def quantize(self, w: np.ndarray) -> QuantizedTensor:
        raise QtvmError("act-order quantization needs calibration data",
                        "use qtvm.formats.gptq.gptq_quantize(w, calib_x, fmt, act_order=True)")

    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        base, k = self.base, qt.k
        codes = base.unpack(qt.arrays["qweight"], base.padded_k(k))[:k].astype(np.float64)
        g_idx = check_g_idx(qt.arrays["g_idx"], k, base.num_groups(k))
        scales = qt.arrays["scales"].astype(np.float64)[g_idx]
        zeros = group_zeros(base, qt.arrays, k).astype(np.float64)[g_idx]
        return ((codes - zeros) * scales).astype(np.float32)

    def describe(self) -> dict:
        return dict(self.base.describe(), act_order=True)

    def bits_per_weight_nominal(self) -> float:
        return self.base.bits_per_weight_nominal() + 32.0 / 4096  # g_idx: 32 bits a row, N = 4096

    def padded_k(self, k: int) -> int:
        return self.base.padded_k(k)

    def group_size_for(self, k: int) -> int:
        return self.base.group_size_for(k)

    def _no_kernel(self, *args):
        raise QtvmError(f"{self.name} tensors (rows grouped by g_idx) have no kernel", _REORDER_HINT)

    array_rows = array_dtype = te_decode_terms = te_group_coefs = _no_kernel


def check_g_idx(g_idx: np.ndarray, k: int, groups: int) -> np.ndarray:
    g_idx = np.asarray(g_idx)
    if g_idx.shape != (k,):
        raise QtvmError(f"g_idx has shape {g_idx.shape}; expected one group index per input row, ({k},)")
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise QtvmError(f"g_idx values span [{g_idx.min()}, {g_idx.max()}]; the tensor has {groups} groups")
    return g_idx.astype(np.int64)


def reorder_for_kernel(qt: QuantizedTensor) -> tuple[np.ndarray, QuantizedTensor]:
    """(perm, tensor in the base uniform format) with ``x @ W == x[:, perm] @ W_perm``.

    ``perm`` sorts rows by group (stably), so group j occupies rows [j g, (j+1) g)
    as the uniform layout requires; padding rows get their group's zero point
    (weight 0). Works for any g_idx whose groups hold g rows each (the last may
    hold fewer), which is what GPTQ's act-order produces.
    """
    if not isinstance(qt.fmt, ActOrderFormat):
        raise QtvmError(f"a {qt.fmt.name} tensor has no g_idx to reorder", "it runs on its kernel as it is")
    base, k, n = qt.fmt.base, qt.k, qt.n
    gs, groups, kp = base.group_size_for(k), base.num_groups(k), base.padded_k(k)
    g_idx = check_g_idx(qt.arrays["g_idx"], k, groups)
    counts = np.bincount(g_idx, minlength=groups)
    expected = np.clip(k - gs * np.arange(groups), 0, gs)
    if not np.array_equal(counts, expected):
        raise QtvmError("g_idx groups do not hold group_size rows each, so no row permutation makes them "
                        "contiguous", f"rows per group: {counts.tolist()[:8]}..., expected {gs}")
    perm = np.argsort(g_idx, kind="stable")
    codes = base.unpack(qt.arrays["qweight"], kp)[:k][perm]
    permuted = np.repeat(group_zeros(base, qt.arrays, k), gs, axis=0).astype(np.uint32)
    permuted[:k] = codes
    arrays = {name: a for name, a in qt.arrays.items() if name != "g_idx"}
    arrays["qweight"] = base.pack(permuted)
    return perm.astype(np.int64), QuantizedTensor(base, k, n, arrays)


# -- calibration Hessian ---------------------------------------------------------------
def calibration_hessian(calib_x, k: int, what: str = "weight") -> np.ndarray:
    """H = 2 X^T X / S in float64 from calibration activations X [S, K] (no damping)."""
    x = np.asarray(calib_x)
    if x.ndim != 2:
        raise QtvmError(f"calibration data for {what} has shape {x.shape}",
                        f"pass a 2-D [samples, {k}] array of the layer's input activations")
    if x.shape[1] != k:
        raise QtvmError(f"calibration data has width {x.shape[1]} but {what} has {k} input rows (K = {k})",
                        f"pass activations of shape [samples, {k}]")
    if x.shape[0] == 0:
        raise QtvmError(f"calibration data for {what} has no samples")
    if not np.all(np.isfinite(x)):
        raise QtvmError(f"calibration data for {what} contains NaN/Inf values")
    x = x.astype(np.float64)
    return 2.0 * (x.T @ x) / x.shape[0]


def damped_inverse_factor(h: np.ndarray, percdamp: float) -> np.ndarray:
    """Upper U with U^T U = (H + percdamp * mean(diag H) * I)^-1; dead channels get H[k, k] = 1."""
    h = h.copy()
    diag = np.diag(h).copy()
    dead = diag == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += percdamp * float(np.mean(np.diag(h)))
    # With J the row reversal, J H J = L L^T gives H^-1 = (J L^-1 J)^T (J L^-1 J), and
    # J L^-1 J is upper triangular with a positive diagonal: the Cholesky factor of
    # H^-1, from one factorization and one triangular inverse (no explicit H^-1).
    try:
        lower = np.linalg.cholesky(h[::-1, ::-1])
        return np.ascontiguousarray(np.linalg.inv(lower)[::-1, ::-1])
    except np.linalg.LinAlgError:
        raise QtvmError("the damped calibration Hessian is not positive definite",
                        f"increase percdamp (now {percdamp})") from None


# -- GPTQ ----------------------------------------------------------------------------
def gptq_quantize(w: np.ndarray, calib_x: np.ndarray, fmt: UniformFormat, *, block_size: int = 128,
                  percdamp: float = 0.01, act_order: bool = False, name: str = "weight") -> QuantizedTensor:
    """GPTQ-quantize ``w`` [K, N] for ``fmt`` using calibration inputs ``calib_x`` [S, K].

    Returns a tensor of ``fmt`` itself (runs on the uniform kernel unchanged), or
    with ``act_order`` an ``ActOrderFormat`` tensor carrying ``g_idx``.
    """
    if not isinstance(fmt, UniformFormat):
        raise QtvmError(f"GPTQ quantizes to uniform formats, not {fmt.name}", "pick e.g. int4-g128")
    if int(block_size) != block_size or block_size < 1:
        raise QtvmError(f"GPTQ block_size must be a positive integer, not {block_size}")
    if not (math.isfinite(percdamp) and percdamp >= 0):
        raise QtvmError(f"GPTQ percdamp must be a finite number >= 0, not {percdamp}")
    w = check_weight(w, name)
    k, n = w.shape
    h = calibration_hessian(calib_x, k, name)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    u = damped_inverse_factor(h[np.ix_(order, order)], percdamp)
    codes, scales, zeros = _gptq_rows(w.astype(np.float64)[order], u, fmt, int(block_size))

    gs = fmt.group_size_for(k)
    stored = np.repeat(zeros, gs, axis=0).astype(np.uint32)  # padding rows: zero point, weight 0
    stored[:k][order] = codes
    arrays = {"qweight": fmt.pack(stored), "scales": scales.astype(fmt.array_dtype("scales")),
              "zeros": zeros.astype(fmt.array_dtype("zeros"))}  # the group rule's values: exact in its dtype
    if act_order:
        g_idx = np.empty(k, np.int32)
        g_idx[order] = np.arange(k) // gs
        arrays["g_idx"] = g_idx
    qt = QuantizedTensor(fmt, k, n, arrays)
    if isinstance(fmt, QZerosFormat):
        qt = fmt.from_float_zeros(qt)
    return QuantizedTensor(ActOrderFormat(fmt), k, n, qt.arrays) if act_order else qt


def _group_params(fmt: UniformFormat, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest scale and zero [N] of one group's current rows (the RTN rule)."""
    one = UniformFormat.quantize(fmt, rows.astype(np.float32))  # rows <= one group: group 0 is theirs
    return one.arrays["scales"][0], one.arrays["zeros"][0]


def _gptq_rows(w: np.ndarray, u: np.ndarray, fmt: UniformFormat, block: int):
    """Codes [K, N] (processing order), scales and zeros [G, N] float32."""
    k, n = w.shape
    gs, qmax = fmt.group_size_for(k), float(fmt.qmax)
    scales = np.ones((fmt.num_groups(k), n), np.float32)
    zeros = np.zeros((fmt.num_groups(k), n), np.float32)
    codes = np.zeros((k, n), np.uint32)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, u1, err = w[i1:i2].copy(), u[i1:i2, i1:i2], np.zeros((i2 - i1, n))
        for i in range(i2 - i1):
            row = i1 + i
            if row % gs == 0:
                end = min(row + gs, k)
                current = w1[i:end - i1]
                if end > i2:  # rows past the block still owe this block's lazy update
                    later = w[i2:end] - u[i1:row, i2:end].T @ err[:i]
                    current = np.concatenate([current, later])
                s, z = _group_params(fmt, current)
                scales[row // gs], zeros[row // gs] = s, z
                s64, z64 = s.astype(np.float64), z.astype(np.float64)
            q = np.clip(np.round(w1[i] / s64) + z64, 0, qmax)
            codes[row] = q
            err[i] = (w1[i] - (q - z64) * s64) / u1[i, i]
            w1[i:] -= np.outer(u1[i, i:], err[i])
        w[i2:] -= u[i1:i2, i2:].T @ err
    return codes, scales, zeros


for _bits in VALID_BITS:
    for _g in (*VALID_GROUPS, None):
        for _scales in SCALE_DTYPES:
            register(QZerosFormat(_bits, _g, _scales))
