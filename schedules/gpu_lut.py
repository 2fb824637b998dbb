"""LUT-GEMM rule for GPU targets (Park et al.): the ``lut_gemv`` compute of BCQ weights.

Per thread block (a tile of ``threads * cols`` columns, one activation row):

    for each K slice of t_h rows (a whole number of groups):
        tables[t_h / 8][256] = every +-sum of 8 activations         shared memory, built by all
                                                                    threads of the block, once
        sync
        per thread, for its ``cols`` columns (l in the paper), per group and plane:
            P = sum over the group's chunks of tables[c][byte(column, plane, c)]
            acc += alpha * P + bias * X_g                            (X_g: table entry 255)

so a packed byte of binary weights is one shared-memory read instead of 8 multiply-adds,
and each table (8 activations' 256 sums) serves every column of the block. Knobs (the
paper's): ``t_h`` rows of K per table slice (default one group), ``cols`` columns per
thread and ``threads`` per block (the tile width t_w = threads * cols). Larger t_w
amortizes the tables over more columns; t_h sizes shared memory (t_h / 8 KiB).
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import lut_gemv, ops
from schedules import gpu

THREADS, COLS = 128, 2


def schedule_lut_gemv_gpu(func: tvm.tirx.PrimFunc, target: tvm.target.Target, *, t_h: int | None = None,
                          threads: int = THREADS, cols: int = COLS) -> s_tir.Schedule | None:
    if not gpu.applies(func, target, lut_gemv.KERNEL):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    group, kp = int(desc["group"]), int(desc["padded_k"])
    t_h = t_h or group
    p = gpu.params(target)
    if t_h % group or kp % t_h or (t_h // lut_gemv.MU) * lut_gemv.TABLE * 4 > p.shared_bytes:
        return None  # slices of whole groups that divide K, tables within shared memory
    sch = s_tir.Schedule(func)
    apply_lut_gemv_gpu(sch, desc, t_h=t_h, threads=min(threads, p.max_threads), cols=cols)
    return sch


def apply_lut_gemv_gpu(sch: s_tir.Schedule, desc, *, t_h: int, threads: int, cols: int) -> None:
    group = int(desc["group"])
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    lut, part = sch.get_sblock(lut_gemv.BLOCK_LUT), sch.get_sblock(lut_gemv.BLOCK_PARTIAL)
    xsum = sch.get_sblock(ops.BLOCK_XSUM)

    i, j, g = sch.get_loops(acc)
    jb, jt, jc = sch.split(j, [None, threads, cols])
    slices, g_in = sch.split(g, [None, t_h // group])
    sch.reorder(i, jb, jt, slices, g_in, jc)
    sch.bind(i, "blockIdx.y")
    sch.bind(jb, "blockIdx.x")
    sch.bind(jt, "threadIdx.x")
    sch.unroll(jc)

    # Per column and group: table reads summed per plane, and the group's x sum.
    sch.compute_at(part, g_in)
    sch.set_scope(part, 0, "local")
    sch.compute_at(xsum, g_in)
    sch.set_scope(xsum, 0, "local")
    for block in (part, xsum):  # the block's own loops (plane, column, chunk; unit ones dropped)
        for loop in gpu.loops_below(sch, block, g_in):
            sch.unroll(loop)

    # The slice's tables, in shared memory, built once by all threads of the block.
    sch.set_scope(lut, 0, "shared")  # before compute_at: the region spans the block's threads
    sch.compute_at(lut, slices)
    l_c, l_p, l_j = sch.get_loops(lut)[-3:]
    fused = sch.fuse(l_c, l_p)
    _, l_t = sch.split(fused, [None, threads])
    sch.bind(l_t, "threadIdx.x")
    sch.unroll(l_j)
    sch.decompose_reduction(lut, l_j)

    sch.set_scope(acc, 0, "local")
    sch.reverse_compute_at(out, jt)
    for loop in gpu.loops_below(sch, out, jt):  # a thread's columns (none when cols = 1)
        sch.unroll(loop)
    sch.decompose_reduction(acc, slices)
    for block in (part, xsum):
        sch.decompose_reduction(block, sch.get_loops(block)[-1])

