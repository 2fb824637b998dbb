"""MetaSchedule design space of the x86 LUT GEMVs (BCQ decode: ``lut16_gemv`` with fp32
tables, ``lut16_a8_gemv`` with int16 tables and ``bcq_a8_gemv`` with int8 nibble tables under
``--act int8``), with their knobs:

  prefetch_bytes  how far ahead each lookup prefetches the bit stream (0: none); it names
                  the TensorIntrin variant, so each value is a design space of its own
  unroll          each group's lookups unrolled (pragma_auto_unroll_max_step 256) or
                  loops (0): a ``sample_categorical`` decision

The analytic point is the target's facts (``schedules.x86_lut.lut_prefetch_bytes``: a
measured row of ``schedules.target_facts``, else the distances measured on Zen 5) with
loops. The kernels stream packed bits at a few instructions per byte, so where the line
is fetched from matters as much as on the int8 GEMV: timed by the same cold-weight
runner (``schedules.tune_runner.ColdRunner``), at M = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from qtvm import bcq_a8_gemv, lut_gemv, ops
from schedules.knob_space import DesignSpaces

KINDS = (lut_gemv.KERNEL16, lut_gemv.KERNEL16_A8, bcq_a8_gemv.KERNEL)
A8_KINDS = (lut_gemv.KERNEL16_A8, bcq_a8_gemv.KERNEL)  # int8 activations: the int16 tables' prefetch facts
# (the nibble tables' own where a row measured them: ``lut_prefetch_bytes(..., nibble=True)``)
KNOB_NAMES = ("prefetch_bytes", "unroll")
PREFETCH_BYTES = (0, 2048, 4096, 6144, 8192, 12288)
UNROLL = (0, 256)


def compute_of(kind: str, fmt, desc: dict) -> tvm.tirx.PrimFunc:
    """The unscheduled kernel of ``kind`` for the format description a kernel carries."""
    make = {lut_gemv.KERNEL16_A8: lut_gemv.lut16_a8_gemv_func,
            bcq_a8_gemv.KERNEL: bcq_a8_gemv.bcq_a8_gemv_func}.get(kind, lut_gemv.lut16_gemv_func)
    return make(fmt, int(desc["k"]), int(desc["n"]), int(desc["col_block"]))


@dataclass(frozen=True)
class LutKnobSpace(DesignSpaces):
    """The knobs of one LUT GEMV on one target (the interface of ``schedules.tune.KnobSpace``:
    ``analytic``, ``apply``, ``design_spaces``, ``schedule``)."""

    kind: str
    target: tvm.target.Target
    prefetch: tuple[int, ...]
    analytic: dict

    @staticmethod
    def of(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> "LutKnobSpace":
        from schedules.x86_lut import lut_prefetch_bytes

        kind = str(func.attrs[ops.KERNEL_ATTR])
        default = lut_prefetch_bytes(target, a8=kind in A8_KINDS, nibble=kind == bcq_a8_gemv.KERNEL)
        prefetch = tuple(sorted(set(PREFETCH_BYTES) | {default}))
        return LutKnobSpace(kind, target, prefetch, {"prefetch_bytes": default, "unroll": 0})

    def apply(self, sch: s_tir.Schedule, knobs: dict | None = None, *, prefetch: int | None = None) -> None:
        """Schedule ``sch`` (the unscheduled kernel) with a sampled unroll, or ``knobs``' values."""
        from schedules.tune import KNOB_PREFIX
        from schedules.tune_a8 import _probs
        from schedules.x86_bcq import apply_bcq_a8_x86
        from schedules.x86_lut import apply_lut16_x86

        knobs = knobs or {}
        if knobs:
            prefetch = int(knobs["prefetch_bytes"])
            if knobs["unroll"] not in UNROLL:
                raise ValueError(f"unroll={knobs['unroll']} is not one of {UNROLL}")
        prefetch = self.analytic["prefetch_bytes"] if prefetch is None else int(prefetch)
        decision = None if not knobs else UNROLL.index(knobs["unroll"])
        unroll = sch.sample_categorical(list(UNROLL), _probs(list(UNROLL), 0), decision=decision)
        out = sch.get_sblock(ops.BLOCK_OUT)
        sch.annotate(out, KNOB_PREFIX + "prefetch_bytes", prefetch)
        sch.annotate(out, KNOB_PREFIX + "unroll", unroll)
        apply = apply_bcq_a8_x86 if self.kind == bcq_a8_gemv.KERNEL else apply_lut16_x86
        apply(sch, self.target, prefetch_bytes=prefetch, unroll=unroll)

    def design_spaces(self, sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        """The ScheduleFn: one design space per prefetch distance."""
        return self._spaces(sch, [{"prefetch": p} for p in self.prefetch])
