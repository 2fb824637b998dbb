"""The GPU family: CUDA (NVIDIA) and OpenCL targets share these rules and facts.

Layout: one column per stored block (``col_block = 1``), so every stored array is
``[N, rows, 1]`` -- each column's packed K run is contiguous. A decode lane then reads
its K chunk of a column with vector loads and a warp reads one contiguous run.

Kernels (see the rule modules):
  gpu_gemv.py    decode GEMV: split-K over the lanes (cross-lane reduction: warp shuffles
                 on CUDA, shared memory past a warp), several columns per lane group
  gpu_gemm.py    prefill: shared-memory tiles of x and of the dequantized weights
                 (each weight dequantized once per tile), register tiles, fp32 FMA
  gpu_gemm_tc.py prefill with ``--act fp16`` on CUDA: fp16 operands on tensor cores
                 (TVM's wmma matmul rule over the dequantizing compute), fp32 sums
  gpu_sparse.py  the CSR outliers of mixed-2-4-16
  gpu_generic.py everything around the kernels (TVM's dlight GPU rules, checked on PoCL)

OpenCL uses the same rules with its own warp size (1: cross-thread reductions go
through local memory); a Mali/Adreno specialisation changes ``GpuParams`` and, where
needed, adds rules ahead of these ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm

from qtvm import ops

#: Bytes one decode lane loads per chunk of a column: one 128-bit load (or a multiple).
LOAD_BYTES = 16
#: Rows up to which the decode GEMV runs (one thread-block row per activation row, the
#: weights re-read per row); above, the prefill GEMM. CUDA, measured on an H100 (int4-g128,
#: docs/bench_gpu_h100.md): the GEMV took 86-175 us at M = 8-16 where the GEMM (no tensor
#: cores) took 223-400 us at any M up to 16. OpenCL: not measured on a phone GPU.
GEMV_MAX_ROWS = {"cuda": 16, "opencl": 4}
#: Stored columns are a multiple of this (zero columns appended by the pass): the GEMM's
#: column tile, a multiple of the GEMV block's columns, so neither kernel guards columns.
COL_PAD = 64


@dataclass(frozen=True)
class GpuParams:
    """Launch shape of the rules for one target. lanes: threads splitting K in the GEMV
    (a warp, or several whose sums meet in shared memory); warps: GEMV thread groups of
    ``lanes`` per block, each on its own columns; cols: columns per group; x_bytes: width of
    a lane's loads of its activations in the GEMV (0: value by value); chunk_values: the
    fewest K values in a lane's chunk, whole packed words (0: one 16-byte load a column,
    ``lane_chunk``)."""

    kind: str
    warp: int
    max_threads: int
    shared_bytes: int
    lanes: int = 32
    warps: int = 4
    cols: int = 4
    x_bytes: int = 0
    chunk_values: int = 0


def params(target: tvm.target.Target) -> GpuParams:
    """From the target's limits; a Mali/Adreno target from its row of ``schedules.opencl.DEVICES``."""
    if target.kind.name == "opencl":
        from schedules.opencl import device

        row = device(target)
        if row is not None:
            return row.gpu_params()
    attrs = target.attrs
    warp = int(attrs.get("thread_warp_size", 32))
    threads = int(attrs.get("max_num_threads", 256))
    shared = int(attrs.get("max_shared_memory_per_block", 16384))
    if target.kind.name != "cuda":
        return GpuParams(kind=target.kind.name, warp=warp, max_threads=threads, shared_bytes=shared,
                         warps=max(1, min(4, threads // 32)))
    # CUDA, measured on an H100 (docs/bench_gpu_h100.md): a lane's chunk of 16 values (int4:
    # two packed words), so a warp's loads of x are one contiguous run, not 32 lines 128 B
    # apart; 128 threads split K for 4 columns (sums meet in shared memory), so even N = 4096
    # launches 1024 blocks. int4-g128 at 11008 x 4096: 32.4 -> 17.3 us; 8192 x 28672: 74.0 -> 59.2.
    return GpuParams(kind="cuda", warp=warp, max_threads=threads, shared_bytes=shared, lanes=min(128, threads),
                     warps=1, cols=4, x_bytes=32, chunk_values=16)


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target, kernel: str) -> bool:
    return (target.kind.name in ("cuda", "opencl") and func.attrs is not None
            and str(func.attrs.get(ops.KERNEL_ATTR, "")) == kernel)


def loops_below(sch, block, loop) -> list:
    """The loops of ``block`` nested inside ``loop`` (unit loops are dropped by TVM, so
    counting from the innermost end could reach a thread-bound loop)."""
    loops = sch.get_loops(block)
    anchor = sch.get(loop)
    index = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(anchor))
    return loops[index + 1:]


def stored_bits(desc) -> int:
    """Bits one weight takes in the main packed array."""
    family = str(desc.get("family"))
    if family == "bcq":
        return int(desc["planes"])
    if family == "e0m4":
        return 4
    return int(desc["bits"])


def lane_chunk(fmt, k: int, min_values: int = 0) -> int:
    """K values one lane reduces before applying the group's coefficients: whole packed
    runs filling one 128-bit load (int4 32 values, int2 64, int8 16, bcq2 64), or one run
    where a run is longer than 12 bytes' worth of splitting allows (3-bit and bcq3: 32
    values in 12 bytes, three 32-bit loads), cut to a divisor of the group size. ``min_values`` (instead): the fewest whole runs holding that many values
    (16: int4 two words, int2 one, int8 four, int3 and bcq3 one 32-value run).
    Longer chunks would unroll into long straight-line code for little gain."""
    desc = fmt.describe()
    bits = stored_bits(desc)
    run = int(desc.get("values_per_block", 32 // bits if 32 % bits == 0 else 32))
    run_bytes = run * bits // 8
    want = run * (-(-min_values // run) if min_values else max(1, LOAD_BYTES // run_bytes))
    return math.gcd(fmt.group_size_for(k), want)


def target_chunk(target: tvm.target.Target, fmt, k: int) -> int:
    """The lane chunk the target's decode GEMVs use (``GpuParams.chunk_values``)."""
    return lane_chunk(fmt, k, min_values=params(target).chunk_values)


def facts(target: tvm.target.Target):
    from schedules.facts import KernelFacts

    # BCQ's decode GEMV: on an H100 the dequantizing GEMV ran 11-23x faster than the LUT-GEMM
    # one (bcq3-g128: 16 vs 373 us at 4096 x 4096, 134 vs 739 us at 8192 x 28672;
    # docs/bench_gpu_h100.md), so CUDA dequantizes; OpenCL (unmeasured on a phone) keeps LUT-GEMM.
    bcq = {} if target.kind.name == "cuda" else {"bcq": "lut_gemv"}
    from schedules.gpu_gemm_tc import tensor_cores

    return KernelFacts(family="gpu", col_block=1, gemv_max_rows=GEMV_MAX_ROWS[target.kind.name], row_tile=0,
                       int8_activations=False, activations=("fp32", "fp16"), f16_gemm=tensor_cores(target),
                       gemv_options=lambda fmt, k: {"chunk": target_chunk(target, fmt, k)}, col_pad=COL_PAD,
                       f16_activations=lambda fmt, k: f16_activations(fmt, k, target_chunk(target, fmt, k)),
                       decode_kernel=bcq, routed_experts=True,
                       parts_options={"second_order": True})


#: fp16 unpacks the fp16 GEMV uses. The 3-bit run intrinsic compiles clean on its own but
#: spilled 12-24 bytes inside the GEMV on sm_80 (72 registers under TVM's ptxas flags):
#: int3 keeps the exact fp32 kernel.
F16_UNPACKS = ("u2", "u4", "u8", "e0m4")


def f16_activations(fmt, k: int, chunk: int) -> bool:
    """The fp16 GEMV serves a format whose decode has an fp16 unpack intrinsic, with
    lane chunks (``chunk`` K values) of whole packed runs (one intrinsic call per run)."""
    from qtvm.intrin.cuda import RUNS
    from qtvm.ops import f16_unpack_kind

    kind = f16_unpack_kind(fmt)
    return kind in F16_UNPACKS and chunk % RUNS[kind][1] == 0


def rules() -> list:
    from schedules import gpu_gemm, gpu_gemm_tc, gpu_gemv, gpu_lut, gpu_sparse

    return [gpu_gemv.schedule_qmatmul_gpu, gpu_gemm.schedule_qmatmul_gemm_gpu, gpu_gemm_tc.schedule_qmatmul_gemm_tc,
            gpu_lut.schedule_lut_gemv_gpu, gpu_sparse.schedule_outliers_gpu]


def schedule_generic_ops(mod, target: tvm.target.Target):
    from schedules.gpu_generic import schedule_generic_ops as generic

    return generic(mod, target)


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """What ``tvm.compile`` runs after ``schedule_generic_ops``: TVM's GPU pipeline minus
    the legalize/fuse/dlight part already done (run again, its FuseTIR would drop the
    artefact's metadata function, which nothing calls)."""
    from tvm.relax.backend import gpu_generic
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline

    backend = cuda_pipeline if target.kind.name == "cuda" else gpu_generic
    passes = backend.dataflow_lower_passes(target) + backend.finalize_passes(target)

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
