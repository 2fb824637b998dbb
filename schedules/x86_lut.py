"""Schedule rule for the LUT GEMV (``qtvm.lut_gemv``) on LLVM CPU targets.

The tables (256 floats per 8 activations) are built once per row of x, at the
root, parallel over chunks and vectorised over the 256 entries. The matmul
part is parallel over column blocks; per block and row, for each group, each
packed word (plane t, column j) is loaded once and its 4 bytes index 4
consecutive tables, accumulating into partial[t, j] (the byte loop unrolled so
the shifts are constants; 8 columns unrolled for instruction-level
parallelism); then the group's alphas and bias fold the partials into the
output accumulator. The reads stay scalar: TVM lowers a vectorised load with
a data-dependent index lane by lane (vpextrq/vinsertps), which measured ~1.8x
slower than scalar reads here.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import lut_gemv, ops
from schedules.x86 import tile_columns_then_groups


READ_UNROLL = 8  # columns whose table reads are unrolled together


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> bool:
    return (target.kind.name == "llvm" and func.attrs is not None
            and str(func.attrs.get(ops.KERNEL_ATTR, "")) == lut_gemv.KERNEL)


def schedule_lut_gemv_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if not applies(func, target):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    nb = int(desc["col_block"])
    chunks_per_word = 32 // int(desc["mu"])
    sch = s_tir.Schedule(func)

    # Tables: root, parallel over chunks, the 256 entries as vector lanes.
    lut = sch.get_sblock(lut_gemv.BLOCK_LUT)
    _, c, p, j = sch.get_loops(lut)
    sch.reorder(c, j, p)
    sch.parallel(c)
    sch.vectorize(p)
    sch.decompose_reduction(lut, j)

    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    part = sch.get_sblock(lut_gemv.BLOCK_PARTIAL)
    acc_g, acc_j = tile_columns_then_groups(sch, desc, nb)
    sch.compute_at(part, acc_g)
    sch.set_scope(part, 0, "local")
    loops = sch.get_loops(part)
    pj, pc = loops[-2:]
    planes = [loops[-3]] if int(desc["planes"]) > 1 else []  # compute_at drops a unit plane loop
    cpg = int(desc["group"]) // int(desc["mu"])
    unroll = chunks_per_word if cpg % chunks_per_word == 0 else 1
    co, ci = sch.split(pc, [None, unroll])
    pjo, pji = sch.split(pj, [None, READ_UNROLL])
    sch.reorder(co, *planes, pjo, pji, ci)  # one word load feeds its 4 table reads
    sch.unroll(pji)
    sch.unroll(ci)
    sch.decompose_reduction(part, co)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(acc, acc_g)
    sch.vectorize(sch.get_loops(out)[-1])
    return sch
