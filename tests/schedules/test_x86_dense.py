"""The float-weight GEMM rule (schedules/x86_dense.py) on qtvm.ops_dense's compute.

Scheduled and unscheduled kernels against numpy on awkward shapes: M = 1, 3, 64, 67
(row tiles with tails), K not a multiple of the 16-row alignment (100, 1000), N not a
multiple of the vector width or of the column block (37, 100). Outputs start as NaN.
Built for znver3 (AVX2; run only where the host can) and for the host's own CPU.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from tvm import te

from qtvm import ops
from qtvm.ops_dense import KERNEL_NAME, dense_func, dense_weight, padded_k
from schedules.target_facts import cpu_facts, host_supports, resolve_host_target
from schedules.x86_dense import schedule_dense_x86
from tests.kernels import NB

TARGETS = {
    "znver3": tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}),
    "host": resolve_host_target({"kind": "llvm"}),
}
RUNNABLE = [name for name, target in TARGETS.items() if host_supports(cpu_facts(target))]
SHAPES = [(64, 64), (100, 37), (1000, 100), (256, 704), (600, 500)]  # the last one parallel
MS = (1, 3, 64, 67)


@functools.lru_cache(maxsize=None)
def build(k: int, n: int, target_name: str, scheduled: bool = True):
    func = dense_func(k, n, NB)
    target = TARGETS[target_name]
    if scheduled:
        func = schedule_dense_x86(func, target).mod["main"]
    return tvm.compile(tvm.IRModule({"main": func}), target=target)


def run(lib, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = tvm.runtime.tensor(np.full((x.shape[0], w.shape[1]), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(dense_weight(w, NB)), out)
    return out.numpy()


@pytest.mark.parametrize("target_name", RUNNABLE)
@pytest.mark.parametrize("k,n", SHAPES)
def test_dense_matches_numpy_and_the_unscheduled_kernel(target_name, k, n):
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    for m in MS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64)
        got = run(build(k, n, target_name), x, w)
        plain = run(build(k, n, target_name, scheduled=False), x, w)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() / scale <= 1e-5, (m, k, n)
        assert np.abs(got - plain).max() / scale <= 1e-5, (m, k, n)


def test_host_target_is_always_run():
    assert "host" in RUNNABLE


def test_weight_layout_is_column_blocked_and_zero_padded():
    w = np.arange(100 * 37, dtype=np.float32).reshape(100, 37)
    wb = dense_weight(w, NB)
    assert wb.shape == (1, padded_k(100), NB) and padded_k(100) == 112
    np.testing.assert_array_equal(wb[0, :100, :37], w)
    assert not wb[0, 100:].any() and not wb[0, :, 37:].any()


def test_avx512_build_uses_zmm_fmas():
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    asm = tvm.compile(schedule_dense_x86(dense_func(256, 128, NB), target).mod, target=target).mod.inspect_source("asm")
    assert "vfmadd" in asm and "zmm" in asm


def test_declines_other_kernels_and_targets():
    func = dense_func(64, 64, NB)
    assert func.attrs[ops.KERNEL_ATTR] == KERNEL_NAME
    assert schedule_dense_x86(func, tvm.target.Target({"kind": "c"})) is None
    a = te.placeholder((4, 4), "float32", name="a")
    plain = te.create_prim_func([a, te.compute((4, 4), lambda i, j: a[i, j] * 2.0, name="b")])
    assert schedule_dense_x86(plain, TARGETS["znver3"]) is None


def test_small_weights_run_on_one_core():
    from schedules.x86_dense import PARALLEL_MIN_WEIGHTS

    small = schedule_dense_x86(dense_func(64, 64, NB), TARGETS["znver3"]).mod.script()
    big = schedule_dense_x86(dense_func(512, 512, NB), TARGETS["znver3"]).mod.script()
    assert 512 * 512 >= PARALLEL_MIN_WEIGHTS > 64 * 64
    assert "T.parallel" not in small and "T.parallel" in big
