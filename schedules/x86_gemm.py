"""Prefill (M > 1) schedule rule for quantized matmuls on LLVM CPU targets.

The GEMV rule (``schedules/x86.py``) unpacks every weight once per row of x,
so M rows cost M GEMVs. This rule schedules the dequantize-then-GEMM compute
of ``qtvm.ops_gemm.qmatmul_gemm_func`` so each weight is unpacked and
dequantized once per call and reused by every row:

    parallel over column slices of n_r columns (inside one stored column block)
      C[M_pad, n_r] = 0                                   per-thread slice of y
      for each K chunk of kc rows:
        W[kc, n_r] = dequantize(packed tile)              fp32, L1-sized, once
        for each tile of m_r rows:                        (x rows padded to m_r)
          R[m_r, n_r] = sum_{k in chunk} x[rows, k] * W[k, :]   registers, FMA
          C[rows, :] += R
      y[:M, slice] = C  (rows < M, columns < N)

The micro-kernel keeps m_r x (n_r / lanes) vector accumulators in registers
(AVX2: 3 x 4 ymm, AVX-512: 4 x 4 zmm); each k step loads n_r / lanes weight
vectors and broadcasts m_r activations. kc is the largest multiple of the
format's packed run (8 values for int4, 32 for int3) that divides the padded
K and keeps the fp32 tile within half of L1.

Tails: M is padded to a multiple of m_r by ``pad_einsum`` (zero rows of x; at
most m_r - 1 wasted rows, which is why m_r is kept small); K runs over the
format's padded K, with x zero past K (so padding rows never matter); N runs
over the padded last column block and only columns < N are stored.

Each column slice streams all of x once (x is re-read N / n_r times per call;
at M = 128, K = 4096 that is 2 MiB from L2/L3 per slice, well under the FMA
rate's needs). There is no blocking over M, so for very large M x comes from
DRAM; the dequantization would be repeated per M block if one were added.

Use (same weights, same argument order as the GEMV kernel, so a caller can
dispatch by M at run time between the two PrimFuncs):

    func = qtvm.ops_gemm.qmatmul_gemm_func(fmt, k, n, nb)   # nb = schedules.column_block(target)
    sch = schedule_qmatmul_gemm_x86(func, target)           # target with mcpu spelled out
    prim = sch.mod["main"]                                  # (x[m, k], *blocked arrays, y[m, n])

The target needs its ``mcpu`` spelled out (``resolve_host_target`` for the
host): TVM builds a target without one for baseline x86-64 while
``cpu_facts`` would describe the host. Measured on this project's machines
(``benchmarks/prefill.py``, int4-g128, K = N = 4096): GEMM is faster than the
GEMV rule from M = 3, 2.5x faster at M = 128.

Tile sizes come from ``schedules.target_facts.cpu_facts``; the format from
the PrimFunc's ``qtvm.format`` attribute. This rule only takes PrimFuncs whose
``qtvm.kernel`` attribute is ``"qmatmul_gemm"``; it returns None otherwise
(including the GEMV compute ``"qmatmul"``, whose unpack is inlined in its
reduction and cannot be cached) and for non-LLVM targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from qtvm import ops
from qtvm.ops_gemm import BLOCK_DEQUANT, BLOCK_XPAD, KERNEL_NAME
from schedules import claim_chunks
from schedules.target_facts import cpu_facts, table_facts

__all__ = ["GemmTiles", "applies", "gemm_tiles", "register_tiles", "schedule_qmatmul_gemm_x86", "store_slices"]

#: Most weight vectors per micro-kernel row (n_r = this many vectors of lanes).
MAX_COL_VECTORS = 4
#: Most rows per micro-kernel: rows past M are padding, so small m_r wastes little.
MAX_ROWS = 4


@dataclass(frozen=True)
class GemmTiles:
    """rows (m_r) x cols (n_r) register tile, depth (kc) rows of K per dequantized tile,
    unroll: K rows unrolled in the dequantization (one packed run, constant shifts)."""

    rows: int
    cols: int
    depth: int
    unroll: int


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> bool:
    return (target.kind.name == "llvm" and func.attrs is not None and ops.KERNEL_ATTR in func.attrs
            and str(func.attrs[ops.KERNEL_ATTR]) == KERNEL_NAME)


def gemm_tiles(desc, target: tvm.target.Target) -> GemmTiles:
    """Register/cache tiles for this format on this target."""
    try:
        facts = cpu_facts(target)
    except ValueError:  # an mcpu the table does not know, or not x86: assume 128-bit vectors
        facts = table_facts("x86-64")
    lanes, nb = facts.f32_lanes, int(desc["col_block"])
    kp, run = int(desc["padded_k"]), int(desc.get("values_per_block", 1))
    if nb % lanes:
        cols = nb  # odd column blocks: one slice, whatever LLVM makes of it
    else:
        vectors = MAX_COL_VECTORS
        while nb % (vectors * lanes):
            vectors //= 2
        cols = vectors * lanes
    vectors = max(1, cols // lanes)
    # Three quarters of the register file hold accumulators; the rest take the
    # weight vectors (or fold them into FMA memory operands) and a broadcast.
    rows = max(1, min(MAX_ROWS, (3 * facts.vector_registers // 4) // vectors))
    if kp % run:
        run = 1
    budget = max(run, facts.l1d_bytes // 2 // (4 * cols))  # the fp32 tile fills half of L1
    depth = max(d for d in range(run, min(kp, budget) + 1, run) if kp % d == 0)
    return GemmTiles(rows=rows, cols=cols, depth=depth, unroll=run)


def register_tiles(sch: s_tir.Schedule, acc, tiles: GemmTiles, nb: int, parallel: bool = True):
    """The loop nest both GEMM rules share: K in chunks of kc (the register tile R is the
    rfactor of one chunk), (parallel) column slices of n_r columns inside a column block,
    and the micro-kernel R[m_r, n_r] in registers (k outermost, rows unrolled, columns
    vectorised). Returns what ``store_slices`` takes: (slice loop, chunk loop, register
    block, its k loop); R's init is split off there, after the caller's own stages."""
    _, _, k = sch.get_loops(acc)
    ko, _ = sch.split(k, [None, tiles.depth])
    reg = sch.rfactor(ko, 0)
    i, j, ko = sch.get_loops(acc)
    io, ii = sch.split(i, [None, tiles.rows])
    jo, jm, ji = sch.split(j, [None, nb // tiles.cols, tiles.cols])
    sch.reorder(jo, jm, ko, io, ii, ji)
    slice_loop = sch.fuse(jo, jm)
    if parallel:
        sch.parallel(slice_loop)  # before any decompose_reduction
    sch.compute_at(reg, io)
    sch.set_scope(reg, 0, "local")
    r_rows, r_cols, r_k = sch.get_loops(reg)[-3:]
    sch.reorder(r_k, r_rows, r_cols)
    sch.unroll(r_rows)
    sch.vectorize(r_cols)
    sch.unroll(ii)
    sch.vectorize(ji)
    return slice_loop, ko, reg, r_k


def store_slices(sch: s_tir.Schedule, acc, out, x_pad, tiled, parallel: bool = True) -> None:
    """C, a slice's accumulator over all rows, stored to y (rows < M, columns < N); the
    padded copy of x built by (parallel) rows. ``tiled``: ``register_tiles``' result."""
    slice_loop, ko, reg, r_k = tiled
    c_store = sch.cache_write(acc, 0, "global")
    sch.reverse_compute_at(c_store, slice_loop)
    sch.reverse_compute_inline(out)
    sch.decompose_reduction(reg, r_k)
    c_init = sch.decompose_reduction(acc, ko)
    sch.vectorize(sch.get_loops(c_init)[-1])
    rows_loop, _ = sch.get_loops(x_pad)
    if parallel:
        sch.parallel(rows_loop)
        claim_chunks.mark(sch, slice_loop)


def schedule_qmatmul_gemm_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if not applies(func, target):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    tiles = gemm_tiles(desc, target)
    nb = int(desc["col_block"])
    sch = s_tir.Schedule(func)
    acc, wdq = sch.get_sblock(ops.BLOCK_ACC), sch.get_sblock(BLOCK_DEQUANT)
    (out,) = sch.get_consumers(acc)

    # Rows: pad M to a multiple of m_r (zero rows of x). The padded copy of x
    # absorbs the compute's zero-past-K stage, if it has one.
    sch.pad_einsum(acc, [tiles.rows, 1, 1])
    if int(desc["padded_k"]) != int(desc["k"]):
        sch.compute_inline(sch.get_sblock(BLOCK_XPAD))
    (x_pad,) = [b for b in sch.get_producers(acc) if not sch.get(b).same_as(sch.get(wdq))]
    (unpad,) = sch.get_consumers(acc)  # acc_pad -> acc copy
    sch.compute_inline(unpad)

    tiled = register_tiles(sch, acc, tiles, nb)
    ko = tiled[1]

    # Dequantized tile W[kc, n_r], once per (slice, chunk), unrolled over one packed run.
    sch.compute_at(wdq, ko)
    w_k, w_j = sch.get_loops(wdq)[-2:]
    _, w_run = sch.split(w_k, [None, tiles.unroll])
    sch.unroll(w_run)
    sch.vectorize(w_j)

    store_slices(sch, acc, out, x_pad, tiled)
    return sch
