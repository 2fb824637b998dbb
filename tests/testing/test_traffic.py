"""Memory traffic of the analytic OpenCL decode schedules, counted from the lowered kernels
(``qtvm.testing.traffic``): the weight bytes each work-group fetches, summed over the
work-groups of one decode call (M = 1), are within 10% of the format's stored bits per
weight -- no packed word or coefficient is fetched twice. Shapes without tails (K and N
multiples of the kernels' tiles), so every guard is taken and the count is exact.

The activations are not in this count: every work-group reads all of x (K values), from
L2, not DRAM (x is K x 4 bytes, shared by all work-groups); and within a work-group the
group coefficients are re-read once per lane chunk of their group (L1 hits), which the
load-instruction count shows."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from qtvm.formats.mixed import SPARSE_ATTR
from qtvm.lut_gemv import lut_gemv_func
from qtvm.target import parse_target
from qtvm.testing.traffic import kernel_traffic
from schedules import facts, schedule_kernel

MALI, ADRENO = parse_target("opencl -device=mali"), parse_target("opencl -device=adreno")
K, N = 256, 64


def decode_kernels(qt, target):
    """(scheduled kernel, the arrays it reads) for each kernel of a decode call of ``qt``, as
    the pass builds them: the dense parts (LUT-GEMM for BCQ), then any CSR outliers."""
    from qtvm.formats.mixed import sparse_outlier_arrays, sparse_outlier_func

    f = facts(target)
    parts = qt.fmt.kernel_parts(qt, **f.parts_options)
    for _, part in parts.dense:
        if f.decode_kernel.get(str(part.fmt.describe().get("family"))) == "lut_gemv":
            func = lut_gemv_func(part.fmt, part.k, part.n, 1)
        else:
            func = ops.qmatmul_func(part.fmt, part.k, part.n, 1, **f.gemv_options(part.fmt, part.k))
        yield schedule_kernel(func, target), {name: a for name, a in zip(part.fmt.array_rows(part.k), ops.blocked_arrays(part, 1))}
    if parts.sparse is not None:
        func = sparse_outlier_func(parts.sparse, qt.k, qt.n)
        names = [p.name for p in func.params][1:-1]  # x, the CSR arrays, y
        yield schedule_kernel(func, target), dict(zip(names, sparse_outlier_arrays(parts.sparse)))


@pytest.mark.parametrize("preset,target", [("int4-g128", MALI), ("int3-g128", MALI), ("int2-g64", ADRENO),
                                           ("e0m4-g128", MALI), ("bcq3-g128", ADRENO), ("mixed-2-4-16", MALI)])
def test_weight_bytes_fetched_match_the_format(preset, target):
    qt = get_format(preset).quantize(np.random.default_rng(0).standard_normal((K, N)).astype(np.float32))
    fetched = loaded = 0
    for func, arrays in decode_kernels(qt, target):
        traffic = kernel_traffic(func, arrays, target, m=1)
        if SPARSE_ATTR not in func.attrs:  # dense kernels: no stored byte fetched by two work-groups
            assert all(traffic.fetched[name] <= a.nbytes for name, a in arrays.items()), traffic.fetched
        fetched += sum(traffic.fetched.values())
        loaded += sum(traffic.loaded.values())
    bits = 8 * fetched / (K * N)
    print(f"{preset}: {bits:.3f} bits/weight fetched, {8 * loaded / (K * N):.3f} loaded, "
          f"format {qt.bits_per_weight:.3f}")
    assert abs(bits - qt.bits_per_weight) <= 0.1 * qt.bits_per_weight
