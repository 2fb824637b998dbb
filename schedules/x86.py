"""Schedule rule for quantized matmuls on LLVM CPU targets (AVX2 / AVX-512).

Parallel over column blocks; per block and row: for each group, the unpacked
codes of ``lanes`` columns are FMA'd into a register accumulator (K unrolled
over one packed word so every shift is a constant), then the group's scale and
offset fold the partial into the output accumulator.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import ops


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> bool:
    return target.kind.name == "llvm" and func.attrs is not None and ops.KERNEL_ATTR in func.attrs


def col_block(target: tvm.target.Target) -> int:
    """Columns per contiguous weight block: 4 ymm or 2 zmm accumulators' worth."""
    return 64


def schedule_qmatmul_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if not applies(func, target):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    nb = int(desc["col_block"])
    unroll = _unpack_unroll(desc)
    sch = s_tir.Schedule(func)
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    parts = [sch.get_sblock(ops.partial_block(t)) for t in range(int(desc["terms"]))]

    i, j = sch.get_loops(out)
    jo, ji = sch.split(j, [None, nb])
    sch.reorder(jo, i, ji)
    sch.parallel(jo)
    sch.compute_at(acc, i)
    sch.set_scope(acc, 0, "local")
    if int(desc["padded_k"]) == int(desc["group"]):
        sch.add_unit_loop(acc)  # one group: compute_at dropped the unit group loop
    acc_j, acc_g = sch.get_loops(acc)[-2:]
    sch.reorder(acc_g, acc_j)
    for part in parts:
        sch.compute_at(part, acc_g)
        sch.set_scope(part, 0, "local")
        part_j, part_k = sch.get_loops(part)[-2:]
        ko, ki = sch.split(part_k, [None, unroll])
        sch.reorder(ko, ki, part_j)
        sch.unroll(ki)
        sch.vectorize(part_j)
        sch.decompose_reduction(part, ko)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(acc, acc_g)
    sch.vectorize(sch.get_loops(out)[-1])
    return sch


def _unpack_unroll(desc) -> int:
    """Unroll K over one run of packed words so shifts become constants."""
    values = int(desc.get("values_per_block", 8))
    group = int(desc["group"])
    return values if group % values == 0 else 1
