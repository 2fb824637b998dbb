"""The prefill GEMM rule (schedules/x86_gemm.py) on qtvm.ops_gemm's compute.

Numerics against the format's numpy reference (``quantize(W).dequantize()``)
on awkward shapes: M tails (1, 17 rows), K not a multiple of the group (1000),
N not a multiple of the vector width or of the column block (37). Built for
znver3 (AVX2; run only where the host can) and for the host's own CPU.
Structure: every weight tile is dequantized once per call (no loop over rows
above it), and the micro-kernel accumulates in registers.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from tvm import te

from qtvm import ops
from qtvm.formats import get_format
from qtvm.ops_gemm import BLOCK_DEQUANT, KERNEL_NAME, qmatmul_gemm_func
from schedules.target_facts import cpu_facts, host_supports, resolve_host_target
from schedules.x86_gemm import gemm_tiles, schedule_qmatmul_gemm_x86
from tests.kernels import NB, run_blocked

TARGETS = {
    "znver3": tvm.target.Target({"kind": "llvm", "mcpu": "znver3"}),
    "host": resolve_host_target({"kind": "llvm"}),
}
# Executed only for targets this host can run (the host target always; AVX2 on any AVX2 CPU):
# the others are not generated, rather than generated and skipped.
RUNNABLE = [name for name, target in TARGETS.items() if host_supports(cpu_facts(target))]
FORMATS = ["int4-g128", "int4-g32", "int3-g128", "int4-col"]
SHAPES = [(128, 37), (128, 256), (1000, 37), (1000, 256)]
MS = (1, 17, 128)
RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def build(fmt_name: str, k: int, n: int, target_name: str):
    target = TARGETS[target_name]
    func = qmatmul_gemm_func(get_format(fmt_name), k, n, NB)
    sch = schedule_qmatmul_gemm_x86(func, target)
    assert sch is not None
    return tvm.compile(sch.mod, target=target)


def run(lib, qt, x: np.ndarray) -> np.ndarray:
    return run_blocked(lib, x, qt)


def check(fmt_name: str, k: int, n: int, target_name: str, ms=MS, seed: int = 0):
    lib = build(fmt_name, k, n, target_name)
    rng = np.random.default_rng(seed)
    qt = get_format(fmt_name).quantize(rng.standard_normal((k, n)).astype(np.float32))
    d = qt.dequantize().astype(np.float64)
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = run(lib, qt, x)
        ref = x.astype(np.float64) @ d
        assert y.shape == (m, n) and np.all(np.isfinite(y)), (fmt_name, k, n, m)
        # Relative to the size of the sum (|x| @ |w|), element by element, and as a whole.
        bound = RTOL * (np.abs(x).astype(np.float64) @ np.abs(d))
        worst = float(np.max(np.abs(y - ref) / bound))
        assert worst < 1.0, (fmt_name, k, n, m, worst * RTOL)
        assert np.linalg.norm(y - ref) < RTOL * np.linalg.norm(ref), (fmt_name, k, n, m)


@pytest.mark.parametrize("target_name", RUNNABLE)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_gemm_matches_reference(target_name, fmt_name, k, n):
    check(fmt_name, k, n, target_name, seed=k + n)


def test_host_target_is_always_run():
    assert "host" in RUNNABLE


def test_multi_term_format_reads_only_the_attributes():
    """BCQ (three sign planes + bias): the rule never looks at the format's name."""
    check("bcq3-g128", 1000, 37, "host", ms=(1, 17))


def test_exact_on_constant_and_zero_weights():
    w = np.zeros((256, 40), np.float32)
    w[:128, :20] = 0.3
    w[128:, 20:] = -1.7
    qt = get_format("int4-g128").quantize(w)
    np.testing.assert_array_equal(qt.dequantize(), w)
    x = np.random.default_rng(0).standard_normal((17, 256)).astype(np.float32)
    y = run(build("int4-g128", 256, 40, "host"), qt, x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


# -- structure ------------------------------------------------------------------
def _mentions(expr, name: str) -> bool:
    return any(v.name == name for v in tvm.tirx.analysis.undefined_vars(expr))


@pytest.mark.parametrize("target_name", ["znver3", "host"])
def test_each_weight_tile_is_dequantized_once_and_kept_in_registers(target_name):
    target = TARGETS[target_name]
    func = qmatmul_gemm_func(get_format("int4-g128"), 1000, 256, NB)
    tiles = gemm_tiles(func.attrs[ops.FORMAT_ATTR], target)
    sch = schedule_qmatmul_gemm_x86(func, target)
    dequant = sch.get_sblock(BLOCK_DEQUANT)
    loops = [sch.get(lp) for lp in sch.get_loops(dequant)]
    assert loops[0].kind == tvm.tirx.ForKind.PARALLEL  # over column slices
    assert not any(_mentions(lp.extent, "m") for lp in loops)  # no loop over rows of x above it
    assert loops[-1].kind == tvm.tirx.ForKind.VECTORIZED and int(loops[-1].extent) == tiles.cols
    # Its consumer, the micro-kernel: k, then m_r unrolled rows, then n_r vectorised columns,
    # accumulating into a local (register) tile.
    (kernel,) = sch.get_consumers(dequant)
    k_loop, rows, cols = [sch.get(lp) for lp in sch.get_loops(kernel)[-3:]]
    assert int(k_loop.extent) == tiles.depth and k_loop.kind == tvm.tirx.ForKind.SERIAL
    assert rows.kind == tvm.tirx.ForKind.UNROLLED and int(rows.extent) == tiles.rows
    assert cols.kind == tvm.tirx.ForKind.VECTORIZED and int(cols.extent) == tiles.cols
    assert sch.get(kernel).writes[0].source.scope() == "local"


def test_tiles_follow_the_target():
    desc = qmatmul_gemm_func(get_format("int4-g128"), 4096, 4096, NB).attrs[ops.FORMAT_ATTR]
    avx2 = gemm_tiles(desc, TARGETS["znver3"])  # 16 ymm, 32 KiB L1d
    assert (avx2.rows, avx2.cols, avx2.depth, avx2.unroll) == (3, 32, 128, 8)
    avx512 = gemm_tiles(desc, tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"}))
    assert (avx512.rows, avx512.cols, avx512.depth) == (4, 64, 64)
    int3 = gemm_tiles(qmatmul_gemm_func(get_format("int3-g128"), 1000, 37, NB).attrs[ops.FORMAT_ATTR],
                      TARGETS["znver3"])
    assert int3.unroll == 32 and int3.depth % 32 == 0
    col = gemm_tiles(qmatmul_gemm_func(get_format("int4-col"), 1000, 37, NB).attrs[ops.FORMAT_ATTR],
                     TARGETS["znver3"])
    assert 1000 % col.depth == 0 and col.depth % 8 == 0  # divides the padded K exactly


def test_avx512_build_uses_zmm():
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    func = qmatmul_gemm_func(get_format("int4-g128"), 256, 128, NB)
    asm = tvm.compile(schedule_qmatmul_gemm_x86(func, target).mod, target=target).mod.inspect_source("asm")
    assert "vfmadd231ps\t%zmm" in asm or "zmm" in asm


# -- not mine ---------------------------------------------------------------------
def test_declines_other_kernels_and_targets():
    fmt = get_format("int4-g128")
    gemm = qmatmul_gemm_func(fmt, 128, 64, NB)
    assert gemm.attrs[ops.KERNEL_ATTR] == KERNEL_NAME
    assert schedule_qmatmul_gemm_x86(gemm, tvm.target.Target({"kind": "c"})) is None
    # The GEMV compute inlines the unpack into its reduction: not this rule's.
    assert schedule_qmatmul_gemm_x86(ops.qmatmul_func(fmt, 128, 64, NB), TARGETS["znver3"]) is None
    a = te.placeholder((4, 4), "float32", name="a")
    plain = te.create_prim_func([a, te.compute((4, 4), lambda i, j: a[i, j] * 2.0, name="b")])
    assert schedule_qmatmul_gemm_x86(plain, TARGETS["znver3"]) is None


def test_compute_keeps_the_qmatmul_contract():
    """Same arguments (x, blocked arrays in format order, y) and format attributes as qmatmul."""
    fmt = get_format("int3-g128")
    gemv, gemm = ops.qmatmul_func(fmt, 1000, 37, NB), qmatmul_gemm_func(fmt, 1000, 37, NB)
    assert [p.name for p in gemm.params] == [p.name for p in gemv.params]
    signature = lambda f: [(str(p.dtype), [str(d) for d in p.shape]) for p in f.params]  # noqa: E731
    assert signature(gemm) == signature(gemv)
    assert dict(gemm.attrs[ops.FORMAT_ATTR]) == dict(gemv.attrs[ops.FORMAT_ATTR])
