"""MetaSchedule tuning seeded by the analytic schedule: database, replay, fallbacks.

Small shapes (K=256, N=128; K=1024, N=512 where a timing difference must be
real) and a handful of trials keep the file around a minute on 2 cores.  The
target is the host's, whatever ISA it has.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax

from qtvm.cli import build_parser
from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.pipeline import build_module
from qtvm.target import parse_target
from schedules import tune
from tests.conftest import TUNING_WORKER, matmul_model

pytestmark = TUNING_WORKER  # tests/conftest.py

PRESET = "int4-g128"
K, N = 256, 128




@pytest.fixture(scope="module")
def target():
    return parse_target("host")


@pytest.fixture(scope="module")
def small(tmp_path_factory, target):
    """(onnx path, weight, Relax module with one analytic int4-g128 kernel)."""
    model, w = matmul_model(K, N)
    path = tmp_path_factory.mktemp("model") / "mm.onnx"
    onnx.save(model, str(path))
    mod, _meta, _summary, _notes = build_module(path, target, PRESET)
    return path, w, mod


@pytest.fixture(scope="module")
def tuned(small, target, tmp_path_factory):
    """(database dir, TuneReport, stderr) of 4 trials on the small kernel."""
    _path, _w, mod = small
    db_dir = tmp_path_factory.mktemp("tune") / "db"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        report = tune.tune_kernels(mod, target, db_dir, 4, progress=True, seed=1)
    return db_dir, report, err.getvalue()


def _gemvs(mod):
    """The module's tunable GEMV kernels (the pipeline also emits GEMMs for larger M)."""
    return [(gv, f) for gv, f in tune.qtvm_kernels(mod) if str(f.attrs[tune.ops.KERNEL_ATTR]) == "qmatmul"]


def _kernel(mod):
    kernels = _gemvs(mod)
    assert len(kernels) == 1
    return kernels[0]


def _check_numerics(mod, target, w: np.ndarray) -> None:
    """The module's output, and its GEMV kernel called on its own with symbolic M,
    match x @ dequantize_reference(W) for M = 1 and 17."""
    fmt = get_format(PRESET)
    qt = fmt.quantize(w)
    w_hat = fmt.dequantize_reference(qt).astype(np.float64)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    _gv, gemv = _kernel(mod)
    kernel = tvm.compile(tvm.IRModule({"main": gemv.with_attr("global_symbol", "main")}), target=target)
    weights = [tvm.runtime.tensor(a) for a in tune.ops.blocked_arrays(qt, int(tune._desc(gemv)["col_block"]))]
    rng = np.random.default_rng(3)
    for m in (1, 17):
        x = rng.standard_normal((m, w.shape[0])).astype(np.float32)
        ref = x.astype(np.float64) @ w_hat
        tol = dict(rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        y = vm["main"](tvm.runtime.tensor(x)).numpy()
        assert y.shape == (m, w.shape[1])
        np.testing.assert_allclose(y, ref, **tol)
        y_kernel = tvm.runtime.tensor(np.zeros((m, w.shape[1]), np.float32))
        kernel["main"](tvm.runtime.tensor(x), *weights, y_kernel)
        np.testing.assert_allclose(y_kernel.numpy(), ref, **tol)


def _records(db_dir, kernel, target):
    _gv, func = kernel
    compute, why = tune.unscheduled_kernel(func, target)
    assert compute is not None, why
    db = tune.open_database(db_dir, create=False)
    wl_mod = tune.workload_of(compute)
    assert db.has_workload(wl_mod)
    return db, db.commit_workload(wl_mod), tune.KnobSpace.of(compute, target), compute


# ------------------------------------------------------------------------ flow


def test_tuning_writes_a_database_and_reports(tuned, small, target):
    db_dir, report, err = tuned
    assert all((db_dir / name).is_file() and (db_dir / name).stat().st_size > 0 for name in tune.DB_FILES)
    assert len(report.kernels) == 1
    row = report.kernels[0]
    assert (row.k, row.n, row.fmt) == (K, N, PRESET)
    assert row.analytic_s is not None and 0 < row.analytic_s < 1e-2
    assert row.tuned_s is not None and row.tuned_s > 0 and row.tuned_knobs
    assert row.use in ("tuned", "analytic")
    assert row.use == ("tuned" if row.tuned_s < row.analytic_s * (1 - tune.MARGIN) else "analytic")
    assert "trials" in err and row.name in err  # one progress line per measured batch
    assert row.name in report.table() and "analytic us" in report.table()

    db, wl, space, _ = _records(db_dir, _kernel(small[2]), target)
    records = db.get_top_k(wl, 1000)
    knobs = [tune.trace_knobs(r.trace) for r in records]
    assert all(set(k) == set(tune.KNOB_NAMES) for k in knobs)
    assert space.analytic in knobs  # the analytic schedule was measured the same way
    assert sum(k != space.analytic for k in knobs) >= 1  # and at least one tuned schedule
    assert all(r.run_secs and all(float(s) > 0 for s in r.run_secs) for r in records)


def test_design_space_starts_from_the_analytic_schedule(small, target):
    _gv, func = _kernel(small[2])
    compute, _ = tune.unscheduled_kernel(func, target)
    space = tune.KnobSpace.of(compute, target)
    assert space.analytic["tile_cols"] == int(tune._desc(compute)["col_block"])
    assert space.analytic["tile_cols"] in space.tile_cols and space.analytic["unroll"] in space.unroll
    assert abs(sum(space.tile_probs) - 1) < 1e-9 and abs(sum(space.unroll_probs) - 1) < 1e-9
    # The hand value is the most likely sample of each knob the analytic rule fixes.
    assert max(space.unroll_probs) == space.unroll_probs[space.unroll.index(space.analytic["unroll"])]
    spaces = space.design_spaces(tvm.s_tir.Schedule(tune.workload_of(compute)["main"]))
    assert len(spaces) == 4
    assert {(tune.trace_knobs(s.trace)["parallel"], tune.trace_knobs(s.trace)["local_partials"]) for s in spaces} \
        == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # Knobs read back from the trace and from the scheduled kernel agree.
    sch = space.schedule(compute, {**space.analytic, "tile_cols": space.tile_cols[0]})
    assert tune.kernel_knobs(sch.mod["main"]) == tune.trace_knobs(sch.trace)
    assert tune.kernel_knobs(sch.mod["main"])["tile_cols"] == space.tile_cols[0]


def test_mutator_changes_one_knob(small, target):
    _gv, func = _kernel(small[2])
    compute, _ = tune.unscheduled_kernel(func, target)
    space = tune.KnobSpace.of(compute, target)
    wl_main = tune.workload_of(compute)["main"]
    trace = space.schedule(wl_main, space.analytic).trace
    mutator = tune.MutateKnob()
    seen = set()
    for _ in range(20):  # through the FFI, as the search calls it (a fresh random state each call)
        mutated = mutator.apply(trace)
        knobs = tune.trace_knobs(mutated)
        changed = {k for k in tune.KNOB_NAMES if knobs[k] != space.analytic[k]}
        assert len(changed) == 1 and changed <= {"tile_cols", "unroll"}
        seen |= changed
        sch = tvm.s_tir.Schedule(wl_main)
        mutated.apply_to_schedule(sch, remove_postproc=True)
        assert tune.kernel_knobs(sch.mod["main"]) == knobs
    assert seen == {"tile_cols", "unroll"}


def test_apply_database_matches_reference(tuned, small, target):
    db_dir, report, _ = tuned
    _path, w, mod = small
    new, notes = tune.apply_database(mod, target, db_dir)
    assert len(notes) == 1 and _kernel(mod)[0].name_hint in notes[0]
    gv, func = _kernel(new)
    if report.kernels[0].use == "tuned":
        assert tune.kernel_knobs(func) == report.kernels[0].tuned_knobs
        assert "tuned schedule" in notes[0]
    else:
        assert tvm.ir.assert_structural_equal(func, _kernel(mod)[1]) is None
    assert func.attrs["global_symbol"] == gv.name_hint and tune.ops.KERNEL_ATTR in func.attrs
    _check_numerics(new, target, w)


def test_faster_record_is_replayed_on_the_symbolic_kernel(tuned, small, target, tmp_path):
    """A record that beats the analytic one is used: its M = 1 trace replays on symbolic M."""
    db_dir = tmp_path / "db"
    shutil.copytree(tuned[0], db_dir)
    _path, w, mod = small
    db, wl, space, _ = _records(db_dir, _kernel(mod), target)
    measured = [tune.trace_knobs(r.trace) for r in db.get_top_k(wl, 1000)]
    knobs = next(k for k in ({"tile_cols": t, "unroll": u, "local_partials": 0, "parallel": 0}
                             for t in space.tile_cols for u in reversed(space.unroll)) if k not in measured)
    tune.commit_record(db, wl, space.schedule(wl.mod["main"], knobs), [1e-9] * 3, target)
    new, notes = tune.apply_database(mod, target, db_dir)
    _gv, func = _kernel(new)
    assert tune.kernel_knobs(func) == knobs, notes
    assert any(str(d) == "m" for d in func.params[0].ty.shape)  # still symbolic in M
    _check_numerics(new, target, w)


def test_a_tuned_record_is_used_only_where_it_measured_faster(target, tmp_path):
    """A deliberately bad schedule and the analytic one, measured for real: apply_database
    follows the measurements and the margin. (The "bad" one is usually slower, but not on
    every CPU and not always while another test process shares the cores: both outcomes are
    checked exactly, whichever the measurement gave.)"""
    k, n = 1024, 512
    model, _w = matmul_model(k, n, seed=1)
    path = tmp_path / "mm.onnx"
    onnx.save(model, str(path))
    mod, *_ = build_module(path, target, PRESET)
    _gv, func = _kernel(mod)
    compute, _ = tune.unscheduled_kernel(func, target)
    space = tune.KnobSpace.of(compute, target)
    # unroll = 1: no constant shifts; the narrowest tile; partials not in registers.
    bad_space = dataclasses.replace(space, unroll=(1, *space.unroll), unroll_probs=(0.0, *space.unroll_probs))
    bad = {"tile_cols": space.tile_cols[0], "unroll": 1, "local_partials": 0, "parallel": 1}
    db_dir = tmp_path / "db"
    db = tune.open_database(db_dir, create=True)
    wl_mod = tune.workload_of(compute)
    wl = db.commit_workload(wl_mod)
    schs = [space.schedule(wl_mod["main"], space.analytic), bad_space.schedule(wl_mod["main"], bad)]
    runner = tune.make_runner()
    try:
        secs = tune.measure(schs, target, tune.make_builder(), runner, rounds=3)
    finally:
        tune.close_runner(runner)
    assert all(s is not None for s in secs)
    for sch, s in zip(schs, secs):
        tune.commit_record(db, wl, sch, s, target)
    del db
    new, notes = tune.apply_database(mod, target, db_dir)
    assert len(notes) == 1
    if min(secs[1]) < min(secs[0]) * (1 - tune.MARGIN):  # measured faster by the margin: used
        assert "tuned schedule" in notes[0] and tune.kernel_knobs(_kernel(new)[1]) == bad
    else:
        assert tvm.ir.assert_structural_equal(_kernel(new)[1], func) is None
        assert "not faster" in notes[0] and "analytic schedule" in notes[0]


def test_tuned_within_noise_margin_is_not_used(tuned, small, target, tmp_path):
    db_dir = tmp_path / "db"
    shutil.copytree(tuned[0], db_dir)
    _path, _w, mod = small
    db, wl, space, _ = _records(db_dir, _kernel(mod), target)
    # Replace every record by synthetic ones: analytic 10 us, tuned 9.9 us (1 %, inside MARGIN).
    fresh = tmp_path / "fresh"
    db2 = tune.open_database(fresh, create=True)
    wl2 = db2.commit_workload(wl.mod)
    tune.commit_record(db2, wl2, space.schedule(wl.mod["main"], space.analytic), [10e-6] * 3, target)
    other = {**space.analytic, "parallel": 0}
    tune.commit_record(db2, wl2, space.schedule(wl.mod["main"], other), [9.9e-6] * 3, target)
    new, notes = tune.apply_database(mod, target, fresh)
    assert tvm.ir.assert_structural_equal(_kernel(new)[1], _kernel(mod)[1]) is None
    assert "not faster" in notes[0]
    # A record for another target is ignored.
    other_target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})
    tune.commit_record(db2, wl2, space.schedule(wl.mod["main"], other), [1e-9] * 3, other_target)
    new, notes = tune.apply_database(mod, target, fresh)
    assert tvm.ir.assert_structural_equal(_kernel(new)[1], _kernel(mod)[1]) is None


# ------------------------------------------------------------------- fallbacks


def _assert_fallback(mod, target, db_dir, words: str):
    new, notes = tune.apply_database(mod, target, db_dir)
    assert len(notes) == 1 and notes[0].startswith("warning:") and words in notes[0], notes
    assert "\n" not in notes[0]
    assert tvm.ir.assert_structural_equal(_kernel(new)[1], _kernel(mod)[1]) is None


def test_missing_empty_and_corrupt_databases_fall_back(tuned, small, target, tmp_path):
    mod = small[2]
    _assert_fallback(mod, target, tmp_path / "nowhere", "does not exist")
    (tmp_path / "empty").mkdir()
    _assert_fallback(mod, target, tmp_path / "empty", "empty")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tuned[0], corrupt)
    (corrupt / "database_tuning_record.json").write_text('[0, [["SampleCategorical", oops\n')
    _assert_fallback(mod, target, corrupt, "unreadable")
    (corrupt / "database_tuning_record.json").write_text("")
    _assert_fallback(mod, target, corrupt, "empty")
    (corrupt / "database_workload.json").write_text("not json at all\n")
    _assert_fallback(mod, target, corrupt, "unreadable")


# ------------------------------------------------------------------------- CLI


def test_trials_must_be_positive(small, target, tmp_path):
    mod = small[2]
    for bad in (0, -3):
        with pytest.raises(QtvmError, match="trials"):
            tune.tune_kernels(mod, target, tmp_path / "db", bad)
    assert not (tmp_path / "db").exists()
    args = build_parser().parse_args(["tune", str(small[0]), "--trials", "0", "--db", str(tmp_path / "db2")])
    with pytest.raises(QtvmError, match="trials"):
        args.fn(args)


def test_fewer_trials_than_kernels(target, tmp_path):
    """Two kernels, one trial: one kernel gets it, the other keeps its analytic schedule."""
    from tests.conftest import mlp_model

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(k=256, hidden=128, n=64), str(path))
    mod, *_ = build_module(path, target, PRESET)
    assert len(_gemvs(mod)) == 2
    report = tune.tune_kernels(mod, target, tmp_path / "db", 1, progress=False, seed=0)
    assert len(report.kernels) == 2 and report.measured == 1
    assert all(row.analytic_s for row in report.kernels)
    assert sorted(row.tuned_schedules for row in report.kernels) == [0, 1]
    new, notes = tune.apply_database(mod, target, tmp_path / "db")
    assert len(notes) == 2
    untuned = next(row for row in report.kernels if row.tuned_schedules == 0)
    assert any(untuned.name in note and "no tuned record" in note for note in notes)


def test_a_module_whose_packed_kernels_have_no_tuning_space_says_so(target, tmp_path):
    """A mixture of experts' routed kernels are packed but not tunable: the error names them,
    not "quantize the model" (it is quantized)."""
    from tests.conftest import moe_model

    path = tmp_path / "moe.onnx"
    onnx.save(moe_model(), str(path))
    mod, *_ = build_module(path, target, "int4-g32")
    with pytest.raises(QtvmError, match="none of the module's packed kernels can be tuned .*qmatmul_experts"):
        tune.tune_kernels(mod, target, tmp_path / "db", 2, progress=False)


def test_a_ctrl_c_swallowed_inside_a_callback_still_stops_tuning(small, target, tmp_path, monkeypatch):
    """A Ctrl-C that lands in code which catches it (here the cost model's update; in CI a
    worker pool) must still stop the search at that batch, not let it run to the end and
    exit 0: the run raises KeyboardInterrupt naming the kept records."""
    import os
    import signal

    xgb = tune.ms.cost_model.XGBModel._cls  # the Python class behind the FFI object
    original = xgb.update
    calls = []

    def update(self, *args, **kwargs):
        calls.append(1)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        except KeyboardInterrupt:
            pass  # swallowed
        return original(self, *args, **kwargs)

    monkeypatch.setattr(xgb, "update", update)
    with pytest.raises(KeyboardInterrupt, match=r"record\(s\) kept .*rerun the same command to resume"):
        tune.tune_kernels(small[2], target, tmp_path / "db", 24, progress=False, seed=0)
    assert len(calls) == 1, calls  # stopped after the first batch, not after all three
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_tune_command_prints_per_kernel_table(small, tmp_path, capsys):
    db_dir = tmp_path / "db"
    args = build_parser().parse_args(["tune", str(small[0]), "--target", "host", "--trials", "2", "--db", str(db_dir),
                              "--quant", PRESET])
    assert args.fn(args) == 0
    out, err = capsys.readouterr()
    assert "analytic us" in out and "tuned us" in out and f"{K}x{N}" in out
    row = next(line for line in out.splitlines() if f"{K}x{N}" in line)
    assert " tuned " in row or " analytic " in row
    assert "[qtvm tune]" in err
    assert (db_dir / "database_tuning_record.json").stat().st_size > 0


def test_analytic_record_is_the_hand_schedule(small, target):
    """The design space at the analytic knobs compiles to the hand schedule's exact code,
    so the analytic record in the database times the schedule the pipeline ships."""
    from schedules import schedule_kernel

    _gv, func = _kernel(small[2])
    compute, _ = tune.unscheduled_kernel(func, target)
    space = tune.KnobSpace.of(compute, target)

    def asm(f):
        mod = tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
        return tvm.tirx.build(mod, target=target).inspect_source("asm")

    assert asm(space.schedule(compute, space.analytic).mod["main"]) == asm(schedule_kernel(compute, target))


def test_torn_last_record_is_repaired_before_tuning(tuned, small, target, tmp_path):
    """A run killed mid-append leaves a line without its newline: the next tuning run
    drops it (or completes it if whole) and keeps every earlier record."""
    db_dir = tmp_path / "db"
    shutil.copytree(tuned[0], db_dir)
    path = db_dir / "database_tuning_record.json"
    whole = path.read_text()
    lines = whole.splitlines()
    path.write_text(whole + lines[-1][: len(lines[-1]) // 2])  # half a record, no newline
    assert tune.repair_torn_tail(path) and path.read_text() == whole
    path.write_text(whole[:-1])  # a whole record missing only its newline
    assert tune.repair_torn_tail(path) and path.read_text() == whole
    assert not tune.repair_torn_tail(path)
    path.write_text(whole + lines[0][:10])
    db = tune.open_database(db_dir, create=True)
    assert len(db.get_all_tuning_records()) == len(lines)
