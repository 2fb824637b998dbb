"""What every weight format provides, and the container for packed weights.

A format owns packing, a numpy reference dequantizer and the TE expression of
one weight; it never schedules. The matmul compute (``qtvm.ops``) combines the
format's expressions with a storage layout that the target rule chooses.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from qtvm.errors import QtvmError


def bits_per_weight(stored_bytes: int, k: int, n: int) -> float:
    """Counted from the stored bytes (padding, scales, zeros included)."""
    return 8.0 * stored_bytes / (k * n)


@dataclass(frozen=True)
class QuantizedTensor:
    """Packed weights of one [K, N] matrix (K = input features, N = outputs).

    ``arrays`` holds every stored array, in the order the kernel takes them;
    column-major arrays have N as their last axis.
    """

    fmt: "QuantFormat"
    k: int
    n: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def bits_per_weight(self) -> float:
        return bits_per_weight(self.nbytes, self.k, self.n)

    def dequantize(self) -> np.ndarray:
        return self.fmt.dequantize_reference(self)


# load(array name, row) -> the stored element at the kernel's current column.
ArrayLoader = Callable[[str, object], object]


class QuantFormat(ABC):
    """A weight format: bits, grouping and storage, validated at construction."""

    #: quantize([W1 | W2]) == [quantize(W1) | quantize(W2)] column for column, so the compiler
    #: may combine matmuls that share an input (``relay_passes.combine_matmuls``); a format
    #: whose choices span columns (mixed precision ranks whole rows) leaves it False.
    columns_independent: bool = False

    @property
    @abstractmethod
    def name(self) -> str:
        """The preset name, e.g. ``int4-g128``."""

    @abstractmethod
    def quantize(self, w: np.ndarray) -> QuantizedTensor:
        """Quantize a float [K, N] weight (K = reduction axis)."""

    @abstractmethod
    def dequantize_reference(self, qt: QuantizedTensor) -> np.ndarray:
        """The float32 [K, N] matrix the kernel must multiply by."""

    @abstractmethod
    def describe(self) -> dict:
        """Format facts attached to the PrimFunc for schedule rules."""

    def bits_per_weight_nominal(self) -> float:
        """Bits per weight at a large K, for listings; reports count stored bytes."""
        return float(self.describe()["bits"])

    # -- the compute contract (qtvm.ops) -------------------------------------
    @abstractmethod
    def padded_k(self, k: int) -> int:
        """K rounded up to what the packing and grouping need."""

    @abstractmethod
    def group_size_for(self, k: int) -> int:
        """Rows of K sharing one set of group coefficients."""

    @abstractmethod
    def array_rows(self, k: int) -> dict[str, int]:
        """Stored [rows, N] arrays in kernel argument order."""

    @abstractmethod
    def array_dtype(self, name: str) -> str:
        """TVM dtype of a stored array."""

    @abstractmethod
    def te_decode_terms(self, load: ArrayLoader, k) -> list:
        """float32 PrimExprs whose coefficient-weighted sum (+ offset) is w[k, n]."""

    @abstractmethod
    def te_group_coefs(self, load: ArrayLoader, g) -> tuple[list, object]:
        """([coefficient per term], offset) of group ``g`` at the current column."""

    def te_code_affine(self, load: ArrayLoader, g):
        """(coef, offset) with w = coef * code + offset for the raw unsigned integer
        code stored in ``qweight``, or None when the weight is not affine in such a
        code. Integer-dot kernels (int8 activations) need it; they read the codes
        in byte-plane order (``qtvm.ops.a8_arrays`` re-lays them at compile time)."""
        return None

    def kernel_parts(self, qt: QuantizedTensor, **options) -> "KernelParts":
        """How the compiler runs this tensor: by default one kernel on all rows.

        Composite formats (mixed precision) split W into row subsets, each a
        tensor of a simpler format, plus an optional sparse correction. ``options``
        come from the target's facts (``KernelFacts.parts_options``); formats ignore
        the ones they do not know.
        """
        return KernelParts([(None, qt)], None)


class GroupedAlongK:
    """K padding and grouping for formats that pack K in indivisible runs.

    A format mixing this in defines ``group_size`` (None: one group per
    column) and ``pack_unit`` (values in one run of packed words); K is padded
    to a multiple of both, so padded rows are whole words and whole groups.
    """

    group_size: int | None
    pack_unit: int

    def padded_k(self, k: int) -> int:
        unit = self.pack_unit if self.group_size is None else math.lcm(self.pack_unit, self.group_size)
        return -(-k // unit) * unit

    def group_size_for(self, k: int) -> int:
        return self.padded_k(k) if self.group_size is None else self.group_size

    def num_groups(self, k: int) -> int:
        return self.padded_k(k) // self.group_size_for(k)


@dataclass(frozen=True)
class KernelParts:
    """x @ W == sum_i x[:, rows_i] @ W_i  (+ x @ S for a CSR (indptr, indices, values) S)."""

    dense: list  # [(row indices into K or None for all rows, QuantizedTensor)]
    sparse: tuple | None


def add_csr(w: np.ndarray, csr) -> np.ndarray:
    """``w`` [K, N] += S, S given as ``KernelParts.sparse`` stores it: indptr over the N
    columns, each entry's row in K, its value. Returns ``w``."""
    indptr, indices, values = csr
    cols = np.repeat(np.arange(w.shape[1]), np.diff(indptr))
    np.add.at(w, (np.asarray(indices, np.int64), cols), np.asarray(values, w.dtype))
    return w


def check_weight(w: np.ndarray, what: str = "weight") -> np.ndarray:
    """Reject what no quantizer can represent, naming the tensor."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise QtvmError(f"{what} has shape {w.shape}; quantizers take a 2-D [K, N] matrix")
    if w.size == 0:
        raise QtvmError(f"{what} is empty (shape {w.shape})")
    if not np.all(np.isfinite(w)):
        bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
        raise QtvmError(f"{what} contains {bad} NaN/Inf values", "clean the checkpoint before quantizing")
    return w.astype(np.float32, copy=False)
