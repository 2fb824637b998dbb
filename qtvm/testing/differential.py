"""Scheduled GPU function vs the same function unscheduled on the CPU, on random inputs.

    report = compare_on_opencl(scheduled, unscheduled, dims=(1, 3, 64, 67))
    assert report.worst <= 1e-5, report

Every symbolic dim of the parameters (and every scalar parameter) is bound to each value
of ``dims`` in turn; float inputs are uniform in [0.5, 1.5) (distinct per element, so a wrong
index shows, and positive, so norms and square roots are well conditioned and a
reduction order changes the result by rounding only), integer inputs small
non-negative values (valid indices for gathers); outputs start as NaN on both sides, so an element the
schedule never writes fails. The reference is the unscheduled PrimFunc built for LLVM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import tirx

from qtvm.testing import opencl


@dataclass
class Comparison:
    name: str
    errors: dict = field(default_factory=dict)  # dim value -> max relative error over outputs

    @property
    def worst(self) -> float:
        return max(self.errors.values(), default=0.0)


def random_args(func: tirx.PrimFunc, value: int, rng: np.random.Generator, n_outputs: int):
    """(arrays in parameter order, scalars by name): dims bound to ``value``; the last
    ``n_outputs`` arrays are outputs and start as NaN (or -1 for integers)."""
    buffers = [p for p in func.params if opencl._is_buffer(p)]
    arrays = []
    for pos, p in enumerate(buffers):
        shape = [value if isinstance(d, tirx.Var) else _static(d, value) for d in p.shape]
        dtype = str(p.dtype)
        output = pos >= len(buffers) - n_outputs
        if dtype.startswith("float"):
            a = np.full(shape, np.nan, dtype) if output else rng.uniform(0.5, 1.5, shape).astype(dtype)
        elif dtype == "bool":
            a = np.zeros(shape, bool) if output else rng.integers(0, 2, shape).astype(bool)
        else:
            a = np.full(shape, -1, dtype) if output else rng.integers(0, 8, shape).astype(dtype)
        arrays.append(a)
    scalars = {p.name: value for p in func.params if not opencl._is_buffer(p)}
    return arrays, scalars


class _Every(dict):
    """Binds every symbolic dim to one value."""

    def __init__(self, value: int):
        super().__init__()
        self.value = value

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> int:
        return self.value


def _static(dim, value: int) -> int:
    """A shape expression over symbolic dims, each bound to ``value``."""
    return opencl._evaluate(dim, _Every(value))


def _cpu_reference(func: tirx.PrimFunc):
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))["main"]


def compare_on_opencl(scheduled: tirx.PrimFunc, unscheduled: tirx.PrimFunc, n_outputs: int = 1,
                      dims=(1, 3, 64, 67), name: str = "", seed: int = 0, half_as_float: bool = False) -> Comparison:
    """Max relative error of the scheduled function (on PoCL) against the unscheduled one
    (LLVM), per binding of the symbolic dims."""
    program = opencl.build(scheduled, half_as_float=half_as_float)
    reference = _cpu_reference(unscheduled)
    symbolic = any(isinstance(d, tirx.Var) for p in scheduled.params if opencl._is_buffer(p) for d in p.shape) \
        or any(not opencl._is_buffer(p) for p in scheduled.params)
    out = Comparison(name)
    for value in dims if symbolic else dims[:1]:
        rng = np.random.default_rng(seed + value)
        arrays, scalars = random_args(unscheduled, value, rng, n_outputs)
        mine = [a.copy() for a in arrays]
        program.run(*mine, **scalars)
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        pending = iter(tensors)
        reference(*[next(pending) if opencl._is_buffer(p) else scalars[p.name] for p in unscheduled.params])
        worst = 0.0
        for got, want in zip(mine[len(mine) - n_outputs:], tensors[len(tensors) - n_outputs:]):
            want = want.numpy()
            if got.dtype.kind == "f":
                if np.isnan(got).any() and not np.isnan(want).any():
                    worst = float("inf")
                    continue
                scale = max(float(np.nanmax(np.abs(want))) if want.size else 0.0, 1e-30)
                worst = max(worst, float(np.nanmax(np.abs(got.astype(np.float64) - want), initial=0.0)) / scale)
            else:
                worst = max(worst, 0.0 if np.array_equal(got, want) else float("inf"))
        out.errors[value] = worst
    return out
