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


_REGISTERED: list = []


def register_exact_reducers() -> None:
    """Teach TVM's schedule analysis max from -inf and min from +inf (once per process).

    rfactor and cross-thread reductions recognise a reduction by its combiner *and* its
    identity, from a fixed list whose max starts at the lowest finite float; a rewritten
    block would not be recognised (x86: the lanes' rfactor of a max fails and the function
    stays unscheduled; GPU: dlight's cross-thread reductions fail to lower). Registered,
    the partial results start from -inf and a cross-thread max pads idle lanes with -inf.
    The getters are Python functions kept alive for the life of the process (one extra
    reference each): TVM's registry is a C++ static destroyed after the interpreter, and
    releasing a Python function then would crash the process at exit."""
    if _REGISTERED:
        return
    import ctypes

    def identity(infinity: float):
        def get(values):
            dtype = str(values[0].ty)
            if dtype.startswith(("float", "bfloat")):
                return [tirx.const(infinity, dtype)]
            return [tirx.max_value(dtype) if infinity > 0 else tirx.min_value(dtype)]
        return get

    register = tvm.get_global_func("s_tir.schedule.RegisterReducer")
    for combine, infinity in ((tirx.Max, -np.inf), (tirx.Min, np.inf)):
        getters = (tvm_ffi.convert(lambda x, y, combine=combine: [combine(x[0], y[0])]),
                   tvm_ffi.convert(identity(infinity)))
        for getter in getters:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(getter))
        register(1, *getters)
        _REGISTERED.append(getters)


def exact_reduction_identities_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    register_exact_reducers()
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
