"""Tuning BCQ's LUT GEMVs: their design space (prefetch distance, unroll), tuning into a
database with the cold-weight runner, and the tuned model against the reference."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from qtvm import bcq_a8_gemv, lut_gemv, ops
from qtvm.formats import get_format
from qtvm.pipeline import build_module
from qtvm.target import parse_target
from schedules import tune, tune_lut
from schedules.x86_bcq import prefer_bcq_a8
from schedules.x86_lut import lut16_a8_isa
from tests.conftest import TUNING_WORKER, matmul_model
from tests.kernels import NB, rel_err, run_blocked
from tests.schedules.test_tune_a8 import tune_with_a_small_rotation

pytestmark = TUNING_WORKER  # tests/conftest.py

PRESET, K, N = "bcq3-g128", 384, 200  # N not a multiple of the column block


@pytest.fixture(scope="module")
def target():
    return parse_target("host")


def _model(tmp_path_factory, target, activations):
    model, w = matmul_model(K, N)
    path = tmp_path_factory.mktemp("model") / "mm.onnx"
    onnx.save(model, str(path))
    mod, _meta, _summary, _notes = build_module(path, target, PRESET, activations)
    return w, mod


def _lut_kernels(mod):
    return [(gv, f) for gv, f in tune.qtvm_kernels(mod) if str(f.attrs[ops.KERNEL_ATTR]) in tune_lut.KINDS]


def _isa_target(kind):
    """A target with the kernel's ISA (compiled only): AVX-512BW, or VBMI + VNNI for the nibble tables."""
    return parse_target("llvm -mcpu=icelake-server" if kind == bcq_a8_gemv.KERNEL else "llvm -mcpu=skylake-avx512")


@pytest.mark.parametrize("kind", tune_lut.KINDS)
def test_space_has_a_design_space_per_prefetch_distance(kind):
    target = _isa_target(kind)  # compiled only
    fmt = get_format(PRESET)
    compute = tune_lut.compute_of(kind, fmt, {"k": K, "n": 256, "col_block": NB})
    space = tune.space_of(compute, target)
    assert isinstance(space, tune_lut.LutKnobSpace)
    assert 0 in space.prefetch and space.analytic == {
        "prefetch_bytes": 4096 if kind in tune_lut.A8_KINDS else 6144, "unroll": 0}
    spaces = space.design_spaces(tvm.s_tir.Schedule(tune.workload_of(compute)["main"]))
    assert len(spaces) == len(space.prefetch)
    assert [tune.kernel_knobs(s.mod["main"])["prefetch_bytes"] for s in spaces] == list(space.prefetch)


@pytest.mark.parametrize("kind", tune_lut.KINDS)
@pytest.mark.parametrize("knobs", [{"prefetch_bytes": 0, "unroll": 256}, {"prefetch_bytes": 2048, "unroll": 0}])
def test_space_points_compute_the_product(kind, knobs):
    """Every point of the space is the same product (run where this CPU has the ISA: AVX2 for
    the fp32 tables, AVX-512BW for the int16 ones)."""
    a8 = kind in tune_lut.A8_KINDS
    host = parse_target("host")
    runs_here = prefer_bcq_a8(get_format(PRESET), K, host) if kind == bcq_a8_gemv.KERNEL else lut16_a8_isa(host)
    if a8 and not runs_here:
        target = _isa_target(kind)  # compiled, not run
    else:
        target = host if a8 else parse_target("llvm -mcpu=haswell")
    fmt = get_format(PRESET)
    compute = tune_lut.compute_of(kind, fmt, {"k": K, "n": N, "col_block": NB})
    func = tune_lut.LutKnobSpace.of(compute, target).schedule(compute, knobs).mod["main"]
    assert tune.kernel_knobs(func) == knobs
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    if target is not host and a8:
        return
    rng = np.random.default_rng(1)
    qt = fmt.quantize(rng.standard_normal((K, N)).astype(np.float32))
    for m in (1, 3):
        x = rng.standard_normal((m, K)).astype(np.float32)
        ref = lut_gemv.reference_a8(x, qt) if a8 else x.astype(np.float64) @ qt.dequantize().astype(np.float64)
        assert rel_err(run_blocked(lib, x, qt), ref) < 1e-5


def test_tuning_and_applying_the_database(target, tmp_path_factory):
    """4 trials with a small rotation: records carry the LUT knobs, the database's variants
    replay in a fresh registry, and the tuned model computes the same product."""
    activations = "int8" if lut16_a8_isa(target) else "fp32"
    w, mod = _model(tmp_path_factory, target, activations)
    kernels = _lut_kernels(mod)
    assert len(kernels) == 1
    db_dir = tmp_path_factory.mktemp("tune") / "db"
    (row,) = tune_with_a_small_rotation(mod, target, db_dir, 4, seed=5).kernels
    assert row.analytic_s and row.analytic_knobs["unroll"] == 0
    db = tune.open_database(db_dir, create=False)
    compute, why = tune.unscheduled_kernel(kernels[0][1], target)
    assert compute is not None, why
    knobs = [tune.trace_knobs(r.trace) for r in db.get_top_k(db.commit_workload(tune.workload_of(compute)), 100)]
    assert len(knobs) >= 2 and all(set(k) == set(tune_lut.KNOB_NAMES) for k in knobs)
    new, notes = tune.apply_database(mod, target, db_dir)
    assert len(notes) == 1, notes
    fmt = get_format(PRESET)
    qt = fmt.quantize(w)
    vm = relax.VirtualMachine(tvm.compile(new, target=target), tvm.cpu())
    rng = np.random.default_rng(4)
    for m in (1, 2):  # decode-sized: the LUT GEMV
        x = rng.standard_normal((m, K)).astype(np.float32)
        y = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = lut_gemv.reference_a8(x, qt) if activations == "int8" else x.astype(np.float64) @ qt.dequantize()
        assert rel_err(y, ref) < 1e-5
