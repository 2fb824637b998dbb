"""Schedule rules, one module per target family; the family is picked by ``target.kind``.

A family module provides ``facts(target) -> KernelFacts`` (what the graph pass needs:
column block, row tile, GEMV/prefill threshold, which kernels exist), ``rules()`` (each
``rule(func, target) -> Schedule | None``; None means "not mine", the first that accepts
a kernel wins) and ``schedule_generic_ops(mod, target)`` for the ops around the kernels.
Rules read the format description the compute attached to the PrimFunc. Adding a target
family is adding its modules and one line in ``FAMILIES``.
"""
from __future__ import annotations

import importlib

import tvm

from qtvm.errors import QtvmError
from schedules.facts import KernelFacts

FAMILIES = {"llvm": "schedules.x86", "cuda": "schedules.gpu", "opencl": "schedules.opencl"}


def family(target: tvm.target.Target):
    """The rule module of ``target``'s family."""
    kind = target.kind.name
    if kind not in FAMILIES:
        raise QtvmError(f"no qtvm schedules for target kind '{kind}'", f"use one of: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[kind])


def facts(target: tvm.target.Target) -> KernelFacts:
    return family(target).facts(target)


def schedule_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    for rule in family(target).rules():
        sch = rule(func, target)
        if sch is not None:
            return sch.mod["main"]
    kind = func.attrs.get("qtvm.kernel", "?") if func.attrs is not None else "?"
    raise QtvmError(f"no qtvm schedule for the '{kind}' kernel on target kind '{target.kind.name}'",
                    "report it: the target's facts promised this kernel")


def compile_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """One kernel on its own, scheduled by its rule and compiled (benchmarks and tests)."""
    return compile_func(schedule_kernel(func, target), target)


def compile_func(func: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """A PrimFunc (scheduled or not) compiled on its own as ``main``, through the TIR pipeline
    the family's artefacts get (``tir_pipeline``), so what runs is what ships."""
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target,
                       tir_pipeline=tir_pipeline(target))


def tir_pipeline(target: tvm.target.Target) -> str:
    """The name of the TIR pipeline ``tvm.compile`` runs for ``target``: the family's own
    (``tir_pipeline(target)`` in its module, e.g. x86's chunk claiming), else TVM's default."""
    own = getattr(family(target), "tir_pipeline", None)
    return own(target) if own is not None else "default"


def schedule_generic_ops(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The family's schedules for the ops around the packed kernels."""
    return family(target).schedule_generic_ops(mod, target)


def column_block(target: tvm.target.Target) -> int:
    """Weight column-block width the target's rules stream."""
    return facts(target).col_block
