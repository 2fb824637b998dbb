"""What the graph pass needs to know of a target family's kernels (and nothing else).

The pass (``relay_passes/quantize_weights.py``) never imports a target module: it asks
``schedules.facts(target)`` for a :class:`KernelFacts` and builds the kernels those facts
name. A family fills them in from its own tables (``schedules/x86.py``, ``schedules/gpu.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from qtvm.errors import QtvmError

#: Format families (``describe()["family"]``) a target may build kernels for.
FORMAT_FAMILIES = ("uniform", "bcq", "e0m4", "mixed")


def _no_options(fmt, k: int) -> dict:
    return {}


@dataclass(frozen=True)
class ActRounding:
    """Symmetric int8 rounding of a matmul's activations: every ``block`` consecutive values
    of a row (K zero-padded to the format's padded K) share the scale max|x| / 127;
    ``max_rows``: only when the matmul has at most that many rows (the decode GEMV), else all."""

    block: int
    max_rows: int | None = None


@dataclass(frozen=True)
class KernelFacts:
    """family: the rule family's name ("x86", "gpu").
    col_block: columns per stored block, the ``nb`` of ``[ceil(N/nb), rows, nb]``.
    gemv_max_rows: M <= this runs the decode kernel, larger M the prefill kernel.
    row_tile: rows per tile of the int8-activation prefill kernel (0 where there is none).
    int8_activations: whether the target has int8-activation kernels at all.
    formats: format families whose kernels this target builds.
    activations: the ``--act`` modes this target builds kernels for.
    decode_kernel: format family -> compute of its decode kernel ("qmatmul" unless named).
    gemv_options(fmt, k): keyword arguments for ``qtvm.ops.qmatmul_func`` (e.g. the K chunk
        one GPU lane reduces before applying group coefficients).
    col_pad: N is padded with zero columns to a multiple of this (the pass slices y), so
        kernels walk whole column tiles without guards.
    f16_activations(fmt, k): whether the fp16-activation decode kernel exists for it.
    parts_options: keyword arguments for a composite format's ``kernel_parts`` (the GPU
        runs mixed-2-4-16's 2-bit part on its stored second-order scales).
    lut16_gemv(fmt, k): whether a decode matmul runs the 16-entry LUT kernel (x86 BCQ).
    lut16_a8_gemv(fmt, k): whether, with ``--act int8``, it runs the int16-table one instead.
    bcq_a8_gemv(fmt, k): whether, with ``--act int8``, it runs the int8 nibble-table kernel
        (``qtvm.bcq_a8_gemv``, AVX-512 VBMI + VNNI) instead of the int16 tables; both round x
        per weight group, so ``int8_rounding`` does not depend on which.
    f16_accumulate: fp16 ``--act`` mode -> the dtype its decode GEMV sums each lane's chunk in
        (CUDA's ``fp16`` sums chunks in fp16; OpenCL's ``fp16`` in fp32, ``fp16-acc16`` in fp16).
    routed_experts: whether a mixture of experts' routed matmul (``take(W[E], ids) @ x``) runs the
        packed ``qtvm.ops.qmatmul_experts_func`` (else its experts stay float).
    routed_int8: whether, with ``--act int8``, it runs the int8 GEMV by each row's expert
        (``qtvm.ops.qmatmul_a8_expert_func``) where the format has the int8 dot
        (``routed_int8_rounding``).
    f16_gemm: whether a matmul with fp16 activations (``f16_activations``) runs prefill on the
        fp16-operand GEMM (``qtvm.ops_gemm.qmatmul_gemm_f16_func``: CUDA tensor cores, fp32
        sums) instead of the exact fp32 one.
    """

    family: str
    col_block: int
    gemv_max_rows: int
    row_tile: int = 0
    int8_activations: bool = False
    formats: frozenset = frozenset(FORMAT_FAMILIES)
    activations: tuple = ("fp32",)
    decode_kernel: dict = field(default_factory=dict)
    gemv_options: Callable = _no_options
    col_pad: int = 1
    f16_activations: Callable = lambda fmt, k: False  # noqa: E731
    parts_options: dict = field(default_factory=dict)
    lut16_gemv: Callable = lambda fmt, k: False  # noqa: E731
    lut16_a8_gemv: Callable = lambda fmt, k: False  # noqa: E731
    bcq_a8_gemv: Callable = lambda fmt, k: False  # noqa: E731
    f16_accumulate: dict = field(default_factory=lambda: {"fp16": "float16"})
    f16_gemm: bool = False
    routed_experts: bool = False
    routed_int8: bool = False

    def int8_rounding(self, fmt, k: int) -> "ActRounding | None":
        """How ``--act int8`` rounds a matmul's activations on this target: the pass builds
        its kernels from this, ``qtvm check`` rebuilds the same rounding for its reference.
        None: the matmul keeps fp32 activations (no int8 kernel for the format or shape)."""
        from qtvm import ops

        if self.int8_activations and ops.supports_int8_activations(fmt, k):
            return ActRounding(ops.ACT_BLOCK)
        family = str(fmt.describe().get("family"))
        if self.decode_kernel.get(family, "qmatmul") != "lut_gemv" and (self.lut16_a8_gemv(fmt, k)
                                                                         or self.bcq_a8_gemv(fmt, k)):
            return ActRounding(fmt.group_size_for(k), max_rows=self.gemv_max_rows)  # BCQ's int16 / int8 tables
        return None

    def routed_int8_rounding(self, fmt, k: int) -> "ActRounding | None":
        """``int8_rounding`` of a routed matmul (every row count: each row is a GEMV by its own
        expert); None: it keeps fp32 activations."""
        from qtvm import ops

        if self.routed_int8 and self.int8_activations and ops.supports_int8_activations(fmt, k):
            return ActRounding(ops.ACT_BLOCK)
        return None

    def check_format(self, fmt, target_name: str) -> None:
        """A format family this target has no kernels for is named with the ones it has."""
        family = str(fmt.describe().get("family", "uniform"))
        if family not in self.formats:
            built = ", ".join(f for f in FORMAT_FAMILIES if f in self.formats)
            raise QtvmError(f"{fmt.name} ({family} family) has no kernels for target {target_name} yet",
                            f"formats built for {target_name}: {built}")

    def check_activations(self, activations: str, target_name: str) -> None:
        if activations not in self.activations and activations != "int8":  # int8 falls back, with a note
            raise QtvmError(f"--act {activations} has no kernels for target {target_name}",
                            f"use one of: {', '.join(self.activations)}")
