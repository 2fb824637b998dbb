"""Numerical repairs of legalized PrimFuncs, applied before any target rule.

TVM's max/min reductions start from the lowest/highest *finite* float, so the max of a
row that is all -inf (a fully masked attention row) comes out as -3.4e38, not -inf, and a
graph that tests ``ReduceMax(x) == -inf`` (ONNX's own Attention function does, to zero such
rows instead of returning NaN) takes the wrong branch. ONNX, numpy and onnxruntime start
from -inf/+inf. :func:`exact_reduction_identities` rewrites those initial values; it
changes nothing else (the max of any row holding a finite value is the same).
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx


def _rewrite_block(block):
    init = block.init
    if init is None or not isinstance(init, tirx.stmt.BufferStore) or not isinstance(block.body, tirx.stmt.BufferStore):
        return block
    value, update = init.value, block.body.value
    dtype = str(value.ty)
    if not isinstance(value, tirx.FloatImm) or not dtype.startswith(("float", "bfloat")):
        return block
    finfo = np.finfo(np.float32 if dtype == "bfloat16" else dtype)
    if isinstance(update, tirx.Max) and value.value <= float(finfo.min):
        new = tirx.const(-np.inf, dtype)
    elif isinstance(update, tirx.Min) and value.value >= float(finfo.max):
        new = tirx.const(np.inf, dtype)
    else:
        return block
    new_init = tirx.stmt.BufferStore(init.buffer, new, init.indices)
    return s_tir.stmt.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body, new_init,
                             block.alloc_buffers, block.match_buffers, block.annotations)


def exact_reduction_identities_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    return tvm_ffi.structural_map(func, (s_tir.stmt.SBlock, _rewrite_block))


def exact_reduction_identities(mod: tvm.IRModule) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` with float max/min reductions starting from -inf/+inf."""
    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            new = exact_reduction_identities_func(func)
            if not new.same_as(func):
                updates[gv] = new
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod[gv] = func
    return mod
