"""Prefill (M above the GEMV threshold) rule for GPU targets: the ``qmatmul_gemm`` compute.

The compute dequantizes the weight as a stage of its own (``w_dequant[K_pad, N]``), so a
schedule can dequantize a tile once and reuse it for every row of the tile:

    grid  (ceil(N / BN), ceil(M / BM)), block (BN / TN, BM / TM) threads
    for each K tile of BK rows:
        xs[BM, BK]  = x tile                       shared memory (rows past M or K read as 0)
        ws[BK, BN]  = dequantize(packed tile)      shared memory, each weight once per block:
                                                   a thread decodes whole packed words of one
                                                   column (consecutive threads: consecutive words)
        sync
        R[TM, TN] += xs[rows, k] * ws[k, cols]     registers, fp32 FMA (exact fp32 accumulate)
    y[rows < M, cols < N] = R

BK is a multiple of the format's packed run (so a word never straddles tiles) that
divides the padded K and keeps both tiles inside the target's shared memory. Tensor
cores need fp16/bf16 (or tf32) operands, which round the activations: they belong to
an opt-in activation mode, not to this exact kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from qtvm import ops
from qtvm.ops_gemm import BLOCK_DEQUANT, BLOCK_XPAD, KERNEL_NAME
from schedules import gpu


@dataclass(frozen=True)
class GemmTiles:
    bm: int = 32
    bn: int = 64
    bk: int = 64
    tm: int = 4
    tn: int = 4
    run: int = 8

    @property
    def threads(self) -> tuple[int, int]:
        return self.bn // self.tn, self.bm // self.tm


def gemm_tiles(desc, target: tvm.target.Target, *, bm: int = 32, bn: int = 64, tm: int = 4, tn: int = 4,
               max_bk: int = 64) -> GemmTiles:
    p = gpu.params(target)
    kp = int(desc["padded_k"])
    run = int(desc.get("values_per_block", 1))
    run = run if kp % run == 0 else 1
    budget = p.shared_bytes // 4  # floats of shared memory
    candidates = [bk for bk in range(run, min(max_bk, kp) + 1, run)
                  if kp % bk == 0 and (bm + bn) * bk <= budget]
    bk = max(candidates) if candidates else run
    return GemmTiles(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, run=run)


def schedule_qmatmul_gemm_gpu(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs) -> s_tir.Schedule | None:
    if not gpu.applies(func, target, KERNEL_NAME):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    tiles = gemm_tiles(desc, target, **knobs)
    sch = s_tir.Schedule(func)
    apply_qmatmul_gemm_gpu(sch, desc, tiles)
    return sch


def apply_qmatmul_gemm_gpu(sch: s_tir.Schedule, desc, t: GemmTiles) -> None:
    acc, out, wdq = sch.get_sblock(ops.BLOCK_ACC), sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(BLOCK_DEQUANT)
    nx, ny = t.threads

    # Rows padded to whole tiles (M is symbolic; a GPU tile needs a constant extent): the
    # padded copy of x is never materialized, it is inlined into the shared-memory tile load.
    sch.pad_einsum(acc, [t.bm, 1, 1])
    if int(desc["padded_k"]) != int(desc["k"]):
        sch.compute_inline(sch.get_sblock(BLOCK_XPAD))
    (x_pad,) = [b for b in sch.get_producers(acc) if not sch.get(b).same_as(sch.get(wdq))]
    (unpad,) = sch.get_consumers(acc)
    sch.compute_inline(unpad)

    i, j, k = sch.get_loops(acc)
    io, ty, tm = sch.split(i, [None, t.bm // t.tm, t.tm])
    jo, tx, tn = sch.split(j, [None, t.bn // t.tn, t.tn])
    ko, ki = sch.split(k, [None, t.bk])
    sch.reorder(io, jo, ty, tx, ko, ki, tm, tn)
    sch.bind(jo, "blockIdx.x")
    sch.bind(io, "blockIdx.y")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(ki)  # left to nvcc, a short K tile's loop was kept and 16 bytes spilled on sm_80
    sch.unroll(tm)
    sch.unroll(tn)

    # x tile in shared memory, loaded by all threads of the block.
    xs = sch.cache_read(acc, 0, "shared")
    sch.compute_at(xs, ko)
    sch.compute_inline(x_pad)
    _cooperative(sch, xs, nx, ny)

    # Dequantized weight tile in shared memory: a thread decodes whole words of a column.
    sch.set_scope(wdq, 0, "shared")  # before compute_at: shared regions span the block's threads
    sch.compute_at(wdq, ko)
    w_k, w_j = sch.get_loops(wdq)[-2:]
    w_word, w_val = sch.split(w_k, [None, t.run])
    sch.reorder(w_j, w_word, w_val)
    sch.unroll(w_val)
    fused = sch.fuse(w_j, w_word)
    _, wy, wx = sch.split(fused, [None, ny, nx])
    sch.bind(wy, "threadIdx.y")
    sch.bind(wx, "threadIdx.x")

    # Register tile, stored to y (rows < M, columns < N).
    sch.reverse_compute_at(out, tx)
    for loop in sch.get_loops(out)[-2:]:
        sch.unroll(loop)  # registers are indexed by constants only (no local-memory array)
    sch.set_scope(acc, 0, "local")
    sch.decompose_reduction(acc, ko)


def _cooperative(sch: s_tir.Schedule, block, nx: int, ny: int) -> None:
    """All threads of the block load a tile: the tile's loops fused and dealt round-robin."""
    loops = sch.get_loops(block)[-2:]
    fused = sch.fuse(*loops)
    _, ly, lx = sch.split(fused, [None, ny, nx])
    sch.bind(ly, "threadIdx.y")
    sch.bind(lx, "threadIdx.x")
