"""What the MetaSchedule knob spaces (``tune.KnobSpace``, ``tune_a8.A8KnobSpace``,
``tune_lut.LutKnobSpace``) share: a knob choice that changes the loop nest or the
TensorIntrin cannot be a trace decision, so each such choice is a design space of its own."""
from __future__ import annotations

import tvm
from tvm import s_tir


class DesignSpaces:
    """Mixin over a space's ``apply(sch, knobs=None, **structural)``."""

    def _spaces(self, sch: s_tir.Schedule, choices: list[dict]) -> list[s_tir.Schedule]:
        """One copy of ``sch`` per structural choice, its other knobs sampled."""
        spaces = []
        for choice in choices:
            copy = sch.copy()
            self.apply(copy, **choice)
            spaces.append(copy)
        return spaces

    def schedule(self, func: tvm.tirx.PrimFunc, knobs: dict) -> s_tir.Schedule:
        """``func`` scheduled at the given knob values."""
        sch = s_tir.Schedule(func)
        self.apply(sch, knobs)
        return sch
