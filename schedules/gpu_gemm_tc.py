"""Prefill rule on CUDA tensor cores: the ``qmatmul_gemm_f16`` compute (``--act fp16``).

The compute is a plain fp16-in, fp32-out einsum ``acc[i, j] = sum_k x_f16[i, k] * w_f16[j, k]``
whose two producers are the activation cast and the weight dequantization. TVM's
tensor-core matmul rule (dlight's ``MatmulTensorization``) schedules exactly that form:

    grid   (ceil(M / 128), N / 128)           M padded to the tile inside the kernel only
    block  16 warps, each 32 x 32 outputs (2 x 2 wmma 16x16x16 fp32 accumulators)
    for each K tile of 64, two-stage software pipeline (next tile's loads in registers):
        xs[128, 64] = fp16(x tile)             shared memory
        ws[128, 64] = fp16(dequantize(packed)) shared memory: the producers are inlined into
                                               the copy, so each weight is dequantized once per
                                               block and only packed words come from HBM
        wmma fragments of xs and ws, mma_sync
    accumulators -> shared memory -> y (columns < N)

Measured on an H200 (docs/bench_gpu_h100.md): 4.0-5.4x the exact fp32 GEMM at M = 256, still
4.4-6.3x slower than cuBLAS' fp16 matmul. A schedule of our own with smaller tiles (32-128 x 32-128,
4-8 warps, with and without the pipeline) won at M <= 128 (52 vs 99 us at 32 x 4096 x 4096)
and lost at prefill sizes (M >= 256), so it was not kept. The exact fp32 GEMM
(``schedules/gpu_gemm.py``) stays the default; fp16 operands are the user's choice. Where the
tensor-core rule declines (a target without fp16 tensor cores), TVM's generic GPU matmul rule
schedules the same compute without them.
"""
from __future__ import annotations

import importlib
import inspect
import sys

import tvm
from tvm import s_tir

from schedules import gpu

#: wmma's fp16 fragments need sm_70 or later.
MIN_SM = 70


def tensor_cores(target: tvm.target.Target) -> bool:
    """Whether ``target`` is CUDA with fp16 tensor cores (an ``-arch`` of sm_70 or later)."""
    from qtvm.cuda import sm_number

    return target.kind.name == "cuda" and sm_number(str(target.attrs.get("arch", ""))) >= MIN_SM


def schedule_qmatmul_gemm_tc(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if target.kind.name != "cuda" or not gpu.applies(func, target, "qmatmul_gemm_f16"):
        return None  # OpenCL (no tensor cores in TVM's OpenCL codegen) keeps the exact GEMM
    from tvm.s_tir.dlight.gpu.matmul import Matmul, MatmulTensorization

    import_tvm_cuda_intrinsics()
    sch = MatmulTensorization().apply(func, target, False) if tensor_cores(target) else None
    return sch if sch is not None else Matmul().apply(func, target, False)


TVM_CUDA_INTRINSICS = "tvm.s_tir.tensor_intrin.cuda"


def import_tvm_cuda_intrinsics() -> None:
    """Import TVM's CUDA tensor intrinsics (the wmma ones dlight's rule tensorizes with) with
    ``inspect.stack`` made shallow. Each of the package's ~500 ``@T.prim_func`` calls
    ``inspect.stack()``, which reads the source line of every frame and scans ``sys.modules``
    once per frame: 38 s in a fresh process, 4-8 minutes in a process that has imported torch
    and onnxruntime (a test worker, a notebook). TVM's parser reads the frames themselves and
    the source line of the third (0.27: ``resolve_closure_vars``, ``is_defined_in_class``), so
    the shallow stack fills in those and leaves the others' source empty: 4 s, the same intrinsics."""
    if TVM_CUDA_INTRINSICS in sys.modules:
        return
    full = inspect.stack
    inspect.stack = shallow_stack
    try:
        importlib.import_module(TVM_CUDA_INTRINSICS)
    finally:
        inspect.stack = full


#: Frames of a shallow stack whose source line is read (TVM's parser reads frame 2's).
SHALLOW_SOURCE_FRAMES = 3


def shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` with the filename, line and source only for the innermost
    ``SHALLOW_SOURCE_FRAMES`` frames (the others: their code's filename and line, no source)."""
    frame, out = sys._getframe(1), []
    while frame is not None:
        if len(out) < SHALLOW_SOURCE_FRAMES:
            info = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        else:
            out.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                         None, None))
        frame = frame.f_back
    return out
