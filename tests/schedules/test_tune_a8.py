"""Tuning the int8-activation kernels: their design space, tuning into a database with the
cold-weight runner, and the tuned model against the int8-rounded reference."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from qtvm import ops
from qtvm.formats import get_format
from qtvm.pipeline import build_module
from qtvm.target import parse_target
from schedules import schedule_kernel, tune, tune_a8, tune_runner
from tests.conftest import TUNING_WORKER, matmul_model
from tests.kernels import NB, int8_rounded_reference, rel_err, run_a8

pytestmark = TUNING_WORKER  # tests/conftest.py

PRESET, K, N = "int4-g128", 300, 200  # K not a multiple of the group, N of the column block


@pytest.fixture(scope="module")
def target():
    return parse_target("host")


@pytest.fixture(scope="module")
def model(tmp_path_factory, target):
    model, w = matmul_model(K, N)
    path = tmp_path_factory.mktemp("model") / "mm.onnx"
    onnx.save(model, str(path))
    mod, _meta, _summary, _notes = build_module(path, target, PRESET, "int8")
    return path, w, mod


def _a8_kernels(mod):
    return {str(f.attrs[ops.KERNEL_ATTR]): (gv, f) for gv, f in tune.qtvm_kernels(mod)
            if str(f.attrs[ops.KERNEL_ATTR]) in tune_a8.KINDS}


def test_space_has_a_design_space_per_streams_prefetch_and_fold(model, target):
    kernels = _a8_kernels(model[2])
    assert set(kernels) == set(tune_a8.KINDS)
    for kind, (_gv, func) in kernels.items():
        compute, why = tune.unscheduled_kernel(func, target)
        assert compute is not None, why
        space = tune.space_of(compute, target)
        assert isinstance(space, tune_a8.A8KnobSpace)
        assert (0, 0) in space.prefetch and len(space.prefetch) >= 8
        assert space.streams == ((1,) if kind == "qmatmul_a8_gemm" else (1, 2))  # 4 column blocks
        assert space.folds == (1,)  # 3 groups of 128: no fold divides them
        spaces = space.design_spaces(tvm.s_tir.Schedule(tune.workload_of(compute)["main"]))
        assert len(spaces) == len(space.streams) * len(space.prefetch) * len(space.folds)


@pytest.mark.parametrize("mcpu, preset, k, folds, analytic", [
    ("znver4", "int4-g64", 1000, (1, 2, 4), 2),  # 16 groups; Zen 4's measured fold
    ("znver4", "int4-g128", 4096, (1, 2), 1),  # Zen 4 folds groups of 64 only
    ("rocketlake", "int4-g128", 4096, (1, 2), 2),  # the Intel Xeon VM's measured fold
    ("rocketlake", "int4-g64", 4096, (1, 2, 4), 1),  # ... of groups of 128 only
    ("znver5", "int4-g64", 1000, (1, 2, 4), 1),  # 16-column passes: no fold
    ("haswell", "int4-g128", 4096, (1, 2), 1),  # at most 256 rows a fold
    ("haswell", "int3-g128", 300, (1,), 1),  # 3 groups
])
def test_fold_candidates_divide_the_groups_and_the_analytic_point_is_the_hand_schedule(mcpu, preset, k, folds,
                                                                                          analytic):
    """The analytic point compiles to the hand schedule's machine code, fold included."""
    target = parse_target(f"llvm -mcpu={mcpu}")
    compute = ops.qmatmul_a8_func(get_format(preset), k, 256, NB)
    space = tune_a8.A8KnobSpace.of(compute, target)
    assert space.folds == folds and space.analytic["fold_groups"] == analytic

    def asm(func):
        return tvm.compile(tvm.IRModule({"main": func}), target=target).mod.inspect_source("asm")

    assert asm(space.schedule(compute, space.analytic).mod["main"]) == asm(schedule_kernel(compute, target))


@pytest.mark.parametrize("preset, k, knobs", [
    (PRESET, K, {"streams": 2, "tile_cols": 32, "prefetch_bytes": 0, "prefetch_locality": 0, "unroll": 256,
                 "fold_groups": 1}),
    (PRESET, K, {"streams": 1, "tile_cols": 16, "prefetch_bytes": 2048, "prefetch_locality": 3, "unroll": 0,
                 "fold_groups": 1}),
    ("int4-g32", K, {"streams": 2, "tile_cols": 128, "prefetch_bytes": 0, "prefetch_locality": 0, "unroll": 256,
                     "fold_groups": 2}),  # 10 groups of 32
    ("int3-g64", 1000, {"streams": 1, "tile_cols": 64, "prefetch_bytes": 2048, "prefetch_locality": 3,
                        "unroll": 0, "fold_groups": 4}),  # 16 groups of 64, the last one padded
])
def test_gemv_space_points_compute_the_rounded_product(preset, k, knobs, target):
    fmt = get_format(preset)
    compute = ops.qmatmul_a8_func(fmt, k, 256, NB)  # 4 column blocks
    space = tune_a8.A8KnobSpace.of(compute, target)
    assert knobs["fold_groups"] in space.folds
    func = space.schedule(compute, knobs).mod["main"]
    assert tune.kernel_knobs(func) == knobs
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    rng = np.random.default_rng(1)
    qt = fmt.quantize(rng.standard_normal((k, 256)).astype(np.float32))
    for m in (1, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got, _ = run_a8(target, fmt, qt, x, lib=lib)
        assert rel_err(got, int8_rounded_reference(x, fmt, qt)) < 1e-5


def test_prefill_space_point_computes_the_rounded_product(target):
    fmt = get_format("int3-g64")
    compute = ops.qmatmul_a8_gemm_func(fmt, K, N, NB, 4)
    space = tune_a8.A8KnobSpace.of(compute, target)
    knobs = {"streams": 1, "tile_cols": 0, "prefetch_bytes": 4096, "prefetch_locality": 3, "unroll": 256}
    lib = tvm.compile(tvm.IRModule({"main": space.schedule(compute, knobs).mod["main"]}), target=target)
    rng = np.random.default_rng(2)
    qt = fmt.quantize(rng.standard_normal((K, N)).astype(np.float32))
    for m in (1, 5, 67):
        x = rng.standard_normal((m, K)).astype(np.float32)
        got, _ = run_a8(target, fmt, qt, x, row_tile=4, lib=lib)
        assert rel_err(got, int8_rounded_reference(x, fmt, qt)) < 1e-5


def tune_with_a_small_rotation(mod, target, db_dir, trials: int, seed: int, progress: bool = False):
    """``tune.tune_kernels`` with the cold runner's logic at a test's cost (a small rotation)."""
    make = tune.make_runner
    tune.make_runner = lambda: tune_runner.ColdRunner(rounds=2, calls_per_round=8, min_total_bytes=8 << 20,
                                                      l3_bytes=1 << 20)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return tune.tune_kernels(mod, target, db_dir, trials, progress=progress, seed=seed)
    finally:
        tune.make_runner = make


@pytest.fixture(scope="module")
def tuned(model, target, tmp_path_factory):
    """6 trials with a small rotation."""
    db_dir = tmp_path_factory.mktemp("tune") / "db"
    return db_dir, tune_with_a_small_rotation(model[2], target, db_dir, 6, seed=3, progress=True)


def test_tuning_records_the_knobs_and_the_machine(tuned, model, target):
    db_dir, report = tuned
    rows = {r.name: r for r in report.kernels}
    assert len(rows) == 2
    for row in rows.values():
        assert row.analytic_s and row.analytic_knobs["streams"] == 1
    record = tune_runner.read_machine(db_dir)
    assert record["runner"] == "cold-weights" and record["cpu_model"] and "family" in record["cpu_id"]
    assert any("cold-weights" in note for note in report.notes)
    db = tune.open_database(db_dir, create=False)
    for _kind, (_gv, func) in _a8_kernels(model[2]).items():
        compute, _ = tune.unscheduled_kernel(func, target)
        knobs = [tune.trace_knobs(r.trace) for r in db.get_top_k(db.commit_workload(tune.workload_of(compute)), 100)]
        assert knobs and all(set(k) == set(tune_a8.KNOB_NAMES) for k in knobs)


def test_tuned_model_computes_the_rounded_product(tuned, model, target):
    db_dir, _ = tuned
    _path, w, mod = model
    new, notes = tune.apply_database(mod, target, db_dir)
    assert len(notes) == 2, notes  # one per int8 kernel: tuned, or why not
    fmt = get_format(PRESET)
    qt = fmt.quantize(w)
    vm = relax.VirtualMachine(tvm.compile(new, target=target), tvm.cpu())
    rng = np.random.default_rng(4)
    for m in (1, 3, 64, 67):  # the GEMV (M <= 2) and the prefill kernel with tail rows
        x = rng.standard_normal((m, K)).astype(np.float32)
        y = vm["main"](tvm.runtime.tensor(x)).numpy()
        assert rel_err(y, int8_rounded_reference(x, fmt, qt)) < 1e-5


def test_a_database_of_another_cpu_is_refused(tmp_path):
    from qtvm.errors import QtvmError

    db_dir = tmp_path / "db"
    db_dir.mkdir()
    rec = tune_runner.record_machine(db_dir)
    assert tune_runner.record_machine(db_dir) == rec  # same machine: accepted
    other = dict(rec, cpu_model="Some Other CPU")
    (db_dir / tune_runner.MACHINE_FILE).write_text(__import__("json").dumps(other))
    with pytest.raises(QtvmError, match="Some Other CPU"):
        tune_runner.record_machine(db_dir)
    assert tune_runner.machine_note(db_dir).startswith("warning:")


def test_cold_runner_rotates_more_than_the_cache(target, monkeypatch):
    fmt = get_format(PRESET)
    func = ops.qmatmul_a8_func(fmt, K, N, NB)
    from schedules import compile_kernel

    lib = compile_kernel(tune.specialize_rows(func, 1), target)
    runner = tune_runner.ColdRunner(rounds=3, calls_per_round=4, min_total_bytes=1 << 20, l3_bytes=1 << 18)
    info = tvm.s_tir.meta_schedule.arg_info.ArgInfo.from_prim_func(tune.specialize_rows(func, 1))
    from qtvm import hugepages

    made = []  # the copies are made where huge pages are asked for, as a loaded artefact's weights are

    class Recording(hugepages.NewMemoryOnHugePages):
        def finish(self):
            made.append(len(runner._copies))
            return super().finish()

    monkeypatch.setattr(hugepages, "NewMemoryOnHugePages", Recording)
    secs = runner.time_function(lib["main"], info)
    assert made == [1]  # one block, which made the copies
    assert len(secs) == 3 and all(s > 0 for s in secs)
    (copies,) = runner._copies.values()
    per_copy = sum(t.numpy().nbytes for t in copies[0])
    assert len(copies) * per_copy >= max(4 * (1 << 18), 1 << 20)
    assert copies[1][3].numpy().ctypes.data != copies[0][3].numpy().ctypes.data
    # A large L3 (480 MiB on one Xeon VM) over a small kernel: the copies stop at MAX_COPIES (100k of them,
    # made and touched, took 5 minutes a candidate)
    monkeypatch.setattr(tune_runner, "MAX_COPIES", 7)
    big = tune_runner.ColdRunner(rounds=1, calls_per_round=2, l3_bytes=480 << 20)
    assert len(big.time_function(lib["main"], info)) == 1
    assert [len(c) for c in big._copies.values()] == [7]
