"""Shared by the kernel tests: compile a scheduled kernel, run it on column-blocked weights."""
from __future__ import annotations

import numpy as np
import tvm

from qtvm import ops
from schedules import compile_kernel

NB = 64  # column block of the x86 rules
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})  # runs on every supported x86 host


def compile_scheduled(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """The PrimFunc scheduled by the first matching rule, compiled."""
    return compile_kernel(func, target)


def run_blocked(lib, x: np.ndarray, qt, nb: int = NB) -> np.ndarray:
    """lib(x, *blocked weights of qt, y) -> y; y starts as NaN so unwritten outputs fail checks."""
    out = tvm.runtime.tensor(np.full((x.shape[0], qt.n), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(x, np.float32)),
                *[tvm.runtime.tensor(a) for a in ops.blocked_arrays(qt, nb)], out)
    return out.numpy()


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
