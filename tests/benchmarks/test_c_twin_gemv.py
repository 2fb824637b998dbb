"""benchmarks/c_twin_gemv.py: the twin reads the arrays the int8 GEMV reads, laid out as the
kernel lays them out on this host (or says why it cannot), and it builds and runs."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import c_twin_gemv as twin


class _Copy:
    def __init__(self, *arrays):
        import tvm

        self._weights = [tvm.runtime.tensor(a) for a in arrays]


def _gemv(k=1000, n=200):
    from qtvm.bench.gemv import QtvmGemv

    gemv = QtvmGemv(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "int4-g128", "int8")
    gemv.set_input(np.ones(k, np.float32))
    return gemv


def test_twin_reads_the_kernels_layout_or_refuses_by_name():
    from qtvm.target import parse_target
    from schedules import column_block

    gemv = _gemv()
    if column_block(parse_target("host")) != 64:
        with pytest.raises(ValueError, match="64 columns"):
            twin.twin_layout(gemv)
        return
    addresses, n_blocks, rows, groups = twin.twin_layout(gemv)
    assert (n_blocks, rows, groups) == (4, 1024 // 8, 8)  # N 200 -> 4 blocks of 64; K 1000 -> 1024 padded
    assert len(set(addresses)) == 3 and all(a % 64 == 0 for a in addresses)


def test_twin_refuses_a_layout_it_does_not_read():
    w = np.zeros((2, 16, 64), np.int32)
    with pytest.raises(ValueError, match="no longer matches"):
        twin.twin_layout(_Copy(w, np.zeros((2, 3, 64), np.float32), np.zeros((2, 3, 64), np.float32)))
    with pytest.raises(ValueError, match="64 columns"):
        twin.twin_layout(_Copy(np.zeros((2, 16, 32), np.int32), np.zeros((2, 1, 32), np.float32),
                               np.zeros((2, 1, 32), np.float32)))


def test_twin_builds_and_streams_a_copy():
    import subprocess

    from qtvm.hostinfo import host_cpu_flags

    if "avx512_vnni" not in host_cpu_flags():
        with pytest.raises(subprocess.CalledProcessError):  # its intrinsics need AVX-512 VNNI: gcc refuses
            twin.build_twin()
        return
    gemv = _gemv(4096, 128)
    addresses, n_blocks, rows, groups = twin.twin_layout(gemv)
    lib = twin.build_twin()
    x8 = np.ones(4096, np.int8)
    one, two = (lib.twin_gemv(*addresses, n_blocks, rows, groups, 6144, x8.ctypes.data, t) for t in (1, 2))
    assert np.isfinite(one) and one != 0.0
    assert np.isclose(one, two, rtol=1e-5)  # two threads walk the same blocks, summed in another order
