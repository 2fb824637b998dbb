"""GPU rule for the CSR outlier term of mixed-2-4-16 (``qtvm.formats.mixed.sparse_outlier_func``).

y[m, n] = sum over column n's outliers of value * x[m, row]: one thread per output
(threads along columns, a block row per activation row), each walking its column's
outliers (at most ``longest_column``, guarded by the column's own count). Outliers are
0.2% of the weights, so this is a small gather next to the dense parts.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm.formats.mixed import SPARSE_ATTR

THREADS = 128


def schedule_outliers_gpu(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if target.kind.name not in ("cuda", "opencl") or func.attrs is None or SPARSE_ATTR not in func.attrs:
        return None
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("outliers")
    i, j, r = sch.get_loops(block)
    jo, ji = sch.split(j, [None, THREADS])
    sch.reorder(i, jo, ji, r)
    sch.bind(i, "blockIdx.y")
    sch.bind(jo, "blockIdx.x")
    sch.bind(ji, "threadIdx.x")
    sch.decompose_reduction(block, r)
    return sch
