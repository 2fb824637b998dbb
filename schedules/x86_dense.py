"""Schedule rule for matmuls by constant float32 weights (``qtvm.ops_dense``) on LLVM CPUs.

TVM's default loops for ``x @ W`` are one scalar multiply-add per weight and row; this
is the register-tiled GEMM of ``schedules/x86_gemm.py`` without its dequantization stage
(the weight is read straight from its column blocks):

    (parallel) over column slices of n_r columns (inside one column block)
      C[M_pad, n_r] = 0
      for each K chunk of kc rows:                 (the [kc, n_r] weight slice stays in L1)
        for each tile of m_r rows:                 (x rows padded to m_r)
          R[m_r, n_r] = sum_{k in chunk} x[rows, k] * wb[block, k, cols]   registers, FMA
          C[rows, :] += R
      y[:M, slice] = C

Tiles are x86_gemm's (``gemm_tiles``: m_r x n_r accumulators in three quarters of the
vector registers, the chunk within half of L1); small weights run on one core
(``PARALLEL_MIN_WEIGHTS``). One schedule serves every M: at M = 1
the row tile is mostly padding, but a GEMV is bound by streaming the weight, which
happens once either way. Returns None for any other kernel and for non-LLVM targets.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import ops
from qtvm.ops_dense import BLOCK_W, BLOCK_XPAD, KERNEL_NAME
from schedules.x86_gemm import gemm_tiles, register_tiles, store_slices

__all__ = ["schedule_dense_x86", "MIN_WEIGHTS", "PARALLEL_MIN_WEIGHTS"]

#: Weights (K x N) from which a matmul is worth this kernel. Smaller ones stay with the
#: generic matmul rule (schedules/x86_generic.py), which fuses their epilogue and has no
#: padded copies: at hidden 64 that was 1.1-1.35x less CPU time per forward pass, while
#: at hidden 256-384 (K x N >= 64K) this kernel took 1.2-1.7x less (benchmarks/float_models.py).
MIN_WEIGHTS = 1 << 15

#: Weights (K x N) from which the column slices run in parallel. A parallel launch costs a
#: few microseconds, and many when the cores are shared (a worker descheduled by another
#: process stalls the whole region: at hidden 64 a parallel kernel measured 7x slower
#: than a serial one on a loaded 2-core machine); below ~1 MB of weights one core finishes
#: the matmul in tens of microseconds.
PARALLEL_MIN_WEIGHTS = 1 << 18


def schedule_dense_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if (target.kind.name != "llvm" or func.attrs is None or ops.KERNEL_ATTR not in func.attrs
            or str(func.attrs[ops.KERNEL_ATTR]) != KERNEL_NAME):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    tiles = gemm_tiles(desc, target)
    nb = int(desc["col_block"])
    sch = s_tir.Schedule(func)
    acc = sch.get_sblock(ops.BLOCK_ACC)
    (out,) = sch.get_consumers(acc)

    # Rows padded to a multiple of m_r; the padded copy of x absorbs the zero-past-K stage.
    sch.pad_einsum(acc, [tiles.rows, 1, 1])
    if int(desc["padded_k"]) != int(desc["k"]):
        sch.compute_inline(sch.get_sblock(BLOCK_XPAD))
    sch.compute_inline(sch.get_sblock(BLOCK_W))  # read the column blocks directly
    (x_pad,) = sch.get_producers(acc)
    (unpad,) = sch.get_consumers(acc)
    sch.compute_inline(unpad)

    parallel = int(desc["k"]) * int(desc["n"]) >= PARALLEL_MIN_WEIGHTS
    store_slices(sch, acc, out, x_pad, register_tiles(sch, acc, tiles, nb, parallel), parallel)
    return sch
