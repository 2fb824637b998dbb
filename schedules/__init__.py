"""Schedule rules, one per target family; the first rule that accepts a kernel wins.

A rule is ``rule(func, target) -> Schedule | None``; None means "not mine".
Rules read the format description the compute attached to the PrimFunc.
"""
from __future__ import annotations

import tvm

from qtvm.errors import QtvmError
from schedules import x86, x86_dense, x86_gemm, x86_lut

RULES = [
    x86.schedule_qmatmul_x86,
    x86.schedule_qmatmul_a8_x86,
    x86.schedule_qmatmul_a8_gemm_x86,
    x86.schedule_quantize_activations_x86,
    x86.schedule_sparse_outliers_x86,
    x86_gemm.schedule_qmatmul_gemm_x86,
    x86_lut.schedule_lut_gemv_x86,
    x86_dense.schedule_dense_x86,
    x86_lut.schedule_lut16_gemv_x86,
]


def schedule_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    for rule in RULES:
        sch = rule(func, target)
        if sch is not None:
            return sch.mod["main"]
    raise QtvmError(f"no qtvm schedule for target kind '{target.kind.name}' yet", "use an llvm target")


def compile_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """One kernel on its own, scheduled by its rule and compiled (benchmarks and tests)."""
    return tvm.compile(tvm.IRModule({"main": schedule_kernel(func, target)}), target=target)


def column_block(target: tvm.target.Target) -> int:
    """Weight column-block width the target's rule streams."""
    return x86.col_block(target)
