"""Decode GEMV rule for OpenCL targets (Mali, Adreno, any other): the ``qmatmul`` and
``qmatmul_f16`` computes, scheduled as ``gpu_gemv`` lays out its split-K GEMV:

    work-group  (lanes, subgroups)        lanes = the device's subgroup (Mali Valhall 16,
                                          Bifrost 8, Adreno 64): one subgroup splits the K
                                          run of ``cols`` columns, so its loads of a column are
                                          one contiguous run of lanes x 16 bytes
    per lane and chunk of K:
        weights   one 128-bit load (``vload4`` of int) per column's chunk
        x         the chunk's activations in registers, ``vload4`` of float (fp32 path) or
                  ``convert_half8(vload8(x))``: 8 activations rounded to a half8 (fp16 path)
        decode    fp32: shift, mask, convert;  fp16: per packed run one ``qtvm.intrin.opencl``
                  TensorIntrin (as_half2 magic exponents, E0M4's exponent OR), two values an op
        dot       fp32 FMA; fp16: exact fp16 x fp16 products summed in fp32 (``--act fp16``)
                  or in fp16 within the chunk (``--act fp16-acc16``)
    then the group coefficients, and the lanes' sums meet through local memory.

Each weight byte is loaded once: the kernel's weight traffic is the format's bits per
weight (``tests/testing/test_traffic.py`` counts it from the lowered kernel).
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from schedules import gpu, gpu_gemv


def schedule_qmatmul_opencl(func: tvm.tirx.PrimFunc, target: tvm.target.Target, *, lanes: int | None = None,
                            warps: int | None = None, cols: int | None = None) -> s_tir.Schedule | None:
    """The analytic schedule for the device of ``target`` (``schedules.opencl.DEVICES``);
    the keyword knobs override its launch shape (for tuning)."""
    desc = gpu_gemv.gemv_format(func, target) if target.kind.name == "opencl" else None
    if desc is None:
        return None
    p = gpu.params(target)
    sch = s_tir.Schedule(func)
    gpu_gemv.apply_qmatmul_gpu(sch, desc, lanes=lanes or p.lanes, warps=warps or p.warps, cols=cols or p.cols,
                               **gemv_extras(desc, target))
    return sch


def gemv_extras(desc, target: tvm.target.Target) -> dict:
    """What OpenCL adds to ``gpu_gemv.apply_qmatmul_gpu``: its fp16 unpack intrinsics and
    activation loads of the device's load width (also used by ``gpu_tune``'s design space)."""
    from qtvm.intrin import opencl as intrinsics
    from schedules.opencl import device

    row = device(target)
    vector_bytes = row.vector_bytes if row is not None else gpu.LOAD_BYTES
    f16 = str(desc.get("activations", "fp32")) == "fp16"
    return {"intrinsics": intrinsics, "x_vector": vector_bytes // (2 if f16 else 4)}
