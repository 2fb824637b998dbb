"""MetaSchedule tuning of qtvm kernels, seeded by the analytic (hand) schedule.

The design space is the x86 rule itself (``schedules.x86.apply_qmatmul_x86``) with
its knobs sampled, not MetaSchedule's generic rules (which found schedules 2x
slower than the hand schedule, see ENVIRONMENT.md).  Knobs of one ``qmatmul``:

  tile_cols       columns of one register tile (a multiple of the target's fp32
                  lanes dividing the weight column block; col_block = the hand
                  schedule): the K loops run inside each tile
  unroll          K values per unrolled step (one run of packed words = the hand
                  schedule; multiples keep every shift constant)
  local_partials  group partial sums in "local" scope (hand: yes)
  parallel        parallel over column blocks (hand: yes)

``tile_cols`` and ``unroll`` are ``sample_categorical`` decisions whose
probabilities come from the analytic model (``schedules.model.candidate_plans``:
the register tiles it ranks best get the most weight, the hand schedule's value
the largest share); ``local_partials`` x ``parallel`` are four design spaces (a
structural choice cannot be a trace decision).  A small mutator re-samples one
categorical decision.  Each knob value is also written as an annotation
``qtvm.knob.<name>`` on the output block, so a scheduled kernel says what it is.

The int8-activation kernels (``qmatmul_a8`` GEMV, ``qmatmul_a8_gemm`` prefill) have
their own space, ``schedules.tune_a8.A8KnobSpace`` (streams, column tile, prefetch
distance and level, unroll, groups per fold), and so have BCQ's LUT GEMVs (``schedules.tune_lut``: prefetch
distance, unroll); ``space_of`` picks by the kernel's ``qtvm.kernel``.

Measurement: MetaSchedule measures static shapes, so each kernel is tuned as a
copy specialised to M = 1 (decode; int8 prefill: ``tune_a8.PREFILL_ROWS``); the
winning trace is replayed on the symbolic-M kernel.  Candidates are built in this
process (``InProcessBuilder``) and timed by ``schedules.tune_runner.ColdRunner``,
which rotates the arguments over more than 4x the L3, so a GEMV is ranked by how it
streams its weights from DRAM (MetaSchedule's ``LocalRunner`` reuses one set of
arguments: cache-hot, ``make_hot_runner``).  The database directory records the
machine it was measured on (``qtvm_machine.json``: CPU model and id, ISA, L3, runner);
tuning another CPU into it is refused.

Database: MetaSchedule's JSON database in ``work_dir`` (``database_workload.json``,
``database_tuning_record.json``), keyed on the structural hash of the M = 1
kernel (its format description is part of it).  Before tuning, the analytic
schedule (the design space at the hand schedule's knobs, which compiles to the
hand schedule's exact machine code) is measured by the same
builder and runner and committed as an ordinary record; after tuning the analytic
and best tuned schedules are measured once more, back to back.  ``apply_database``
uses a tuned schedule only when its latency beats the analytic one's by more than
``MARGIN``: tuned is never slower than untuned.  A schedule's latency is the best
of all its timings in the database (each timing is a mean over >= 20 ms of calls):
other processes on a shared machine only ever add time, and the analytic schedule,
timed before and after the search, gets at least as many chances as any other.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tvm
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm_ffi import structural_equal
from tvm.s_tir import meta_schedule as ms

from qtvm import ops
from qtvm.errors import QtvmError
from schedules import tir_pipeline, tune_a8, tune_lut, x86
from schedules.knob_space import DesignSpaces
from schedules.tune_runner import machine_note, record_machine

KNOB_PREFIX = "qtvm.knob."
KNOB_NAMES = ("tile_cols", "unroll", "local_partials", "parallel")
MARGIN = 0.03  # tuned must beat analytic by 3 % (measurement noise on 2 shared cores)
DB_FILES = ("database_workload.json", "database_tuning_record.json")
MODEL_ATTR = "model"  # target attribute holding the device a record was measured on
# kernels with a design space (int8: tune_a8; BCQ's LUT GEMVs: tune_lut)
TUNABLE_KINDS = ("qmatmul", "qmatmul_a8", "qmatmul_a8_gemm", "lut16_gemv", "lut16_a8_gemv", "bcq_a8_gemv")
_PROGRESS_PREFIX = "qtvm tune"


# ------------------------------------------------------------------------- report


@dataclass
class KernelTuning:
    """One tuned kernel: where it is, what the analytic and tuned schedules measured."""

    name: str  # global symbol(s) in the module, comma-separated if shared
    k: int
    n: int
    fmt: str
    analytic_s: float | None = None  # latency of the analytic schedule at M = 1 (best timing)
    tuned_s: float | None = None  # best tuned schedule, same measurement
    tuned_knobs: dict | None = None
    analytic_knobs: dict | None = None
    tuned_schedules: int = 0  # distinct tuned knob settings measured (all sessions in the database)
    use: str = "analytic"  # what apply_database will choose

    @property
    def speedup(self) -> float | None:
        if self.analytic_s and self.tuned_s:
            return self.analytic_s / self.tuned_s
        return None


@dataclass
class TuneReport:
    kernels: list[KernelTuning] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    work_dir: Path | None = None
    device: str = ""  # what the measurements ran on (also in every record's target)
    trials: int = 0  # asked for
    measured: int = 0  # tuned candidates measured (fewer when the design space is exhausted)
    history: list = field(default_factory=list)  # (trials done, {kernel: best latency so far}) per batch
    seconds: float = 0.0

    def table(self) -> str:
        head = (f"{'kernel':<34}{'KxN':>12}  {'format':<10}{'analytic us':>12}{'tuned us':>10}{'speedup':>8}  "
                f"{'use':<9}tuned knobs")
        lines = [head]
        for k in self.kernels:
            a = f"{k.analytic_s * 1e6:.1f}" if k.analytic_s else "-"
            t = f"{k.tuned_s * 1e6:.1f}" if k.tuned_s else "-"
            s = f"{k.speedup:.2f}x" if k.speedup else "-"
            knobs = " ".join(f"{n}={v}" for n, v in (k.tuned_knobs or {}).items()) or "-"
            lines.append(f"{k.name[:33]:<34}{f'{k.k}x{k.n}':>12}  {k.fmt:<10}{a:>12}{t:>10}{s:>8}  "
                         f"{k.use:<9}{knobs}")
        return "\n".join(lines)


# ------------------------------------------------------------------ kernel facts


def _desc(func) -> dict:
    return {str(k): v for k, v in func.attrs[ops.FORMAT_ATTR].items()}


def _kind(func) -> str:
    return str(func.attrs[ops.KERNEL_ATTR])


def qtvm_kernels(mod: tvm.IRModule) -> list[tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]]:
    """Every PrimFunc of ``mod`` carrying the ``qtvm.kernel`` attribute (never by name)."""
    out = []
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and ops.KERNEL_ATTR in func.attrs:
            out.append((gv, func))
    return sorted(out, key=lambda item: item[0].name_hint)


def _format_of(desc: dict):
    """The registered format whose description the kernel carries (None if not registered)."""
    from qtvm.formats import PRESETS

    for fmt in PRESETS.values():
        facts = fmt.describe()
        if all(key in desc and str(desc[key]) == str(value) for key, value in facts.items()):
            return fmt
    return None


def unscheduled_kernel(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tuple[tvm.tirx.PrimFunc | None, str]:
    """(the compute ``func`` was scheduled from, "") or (None, why not).

    The pipeline stores scheduled kernels; the compute is rebuilt from the format
    description the kernel carries and checked: scheduling it with the analytic
    rule must give back exactly ``func``, so a kernel is never swapped for
    another computation.
    """
    from schedules import schedule_kernel

    kind = _kind(func)
    if kind not in TUNABLE_KINDS:
        return None, f"kernel kind '{kind}' has no tuning space yet"
    desc = _desc(func)
    fmt = _format_of(desc)
    if fmt is None:
        return None, "its format is not a registered preset"
    if kind in tune_a8.KINDS:
        compute = tune_a8.compute_of(kind, fmt, desc)
    elif kind in tune_lut.KINDS:
        compute = tune_lut.compute_of(kind, fmt, desc)
    else:
        compute = ops.qmatmul_func(fmt, int(desc["k"]), int(desc["n"]), int(desc["col_block"]))
    try:
        analytic = schedule_kernel(compute, target)
    except Exception as e:  # noqa: BLE001 - any failure means "not ours"
        return None, f"the analytic rule does not schedule it ({type(e).__name__})"
    if not structural_equal(analytic.with_attrs(dict(func.attrs)), func):
        return None, "it is not the analytic schedule of qtvm.ops.qmatmul_func for its format"
    return compute, ""


def specialize_rows(func: tvm.tirx.PrimFunc, rows: int = 1) -> tvm.tirx.PrimFunc:
    """``func`` with its symbolic row count M bound to ``rows`` (static shapes to measure)."""
    for param in func.params:
        shape = list(param.ty.shape)
        if any(isinstance(d, tvm.tirx.Var) for d in shape):
            static = [tvm.tirx.IntImm(d.ty, rows) if isinstance(d, tvm.tirx.Var) else d for d in shape]
            buf = tvm.tirx.decl_buffer(static, param.ty.dtype, name=param.name)
            func = func.specialize({param: buf})
            break
    for param in func.params:
        if any(not isinstance(d, tvm.tirx.IntImm) for d in param.ty.shape):
            raise QtvmError(f"cannot make kernel shapes static (parameter '{param.name}')")
    return func


def workload_of(compute: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The database key: the M = 1 compute (prefill kernels: M = tune_a8.PREFILL_ROWS) as
    MetaSchedule normalises a task's module."""
    kind = _kind(compute)
    return tvm.IRModule({"main": specialize_rows(compute, tune_a8.rows_of(kind) if kind in tune_a8.KINDS else 1)})


def space_of(compute: tvm.tirx.PrimFunc, target: tvm.target.Target):
    """The design space of a kernel: ``KnobSpace`` (fp32 qmatmul), ``tune_a8.A8KnobSpace`` or
    ``tune_lut.LutKnobSpace``."""
    if _kind(compute) in tune_a8.KINDS:
        return tune_a8.A8KnobSpace.of(compute, target)
    if _kind(compute) in tune_lut.KINDS:
        return tune_lut.LutKnobSpace.of(compute, target)
    return KnobSpace.of(compute, target)


# ------------------------------------------------------------------- design space


def _lanes(target: tvm.target.Target) -> int:
    from schedules.target_facts import cpu_facts

    try:
        return int(cpu_facts(target).f32_lanes)
    except ValueError:
        return 4


def _plans(desc: dict, target: tvm.target.Target) -> list:
    """The analytic model's GEMV plans, best first (empty if the model does not apply)."""
    from schedules.model import candidate_plans
    from schedules.target_facts import cpu_facts

    try:
        group = int(desc.get("group_size", 0)) or None
        return candidate_plans(cpu_facts(target), int(desc["bits"]), group, int(desc["k"]), int(desc["n"]))
    except (ValueError, KeyError):
        return []


def _weights(cands: list[int], hand: int, preferred: list[int]) -> list[float]:
    """Probabilities: a floor for every value, the hand value 40 %, model ranks 1/r of 50 %."""
    w = {c: 0.1 / len(cands) for c in cands}
    w[hand] += 0.4
    for rank, value in enumerate(preferred):
        if value in w:
            w[value] += 0.5 / (rank + 1)
    total = sum(w.values())
    return [w[c] / total for c in cands]


@dataclass(frozen=True)
class KnobSpace(DesignSpaces):
    """The sampled knobs of one qmatmul kernel on one target."""

    desc: dict
    tile_cols: tuple[int, ...]
    tile_probs: tuple[float, ...]
    unroll: tuple[int, ...]
    unroll_probs: tuple[float, ...]
    analytic: dict  # the hand schedule's knob values

    @staticmethod
    def of(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> "KnobSpace":
        desc = _desc(func)
        nb, group = int(desc["col_block"]), int(desc["group"])
        vpb = int(desc.get("values_per_block", 8))
        lanes = _lanes(target)
        tiles = [c for c in range(lanes, nb + 1, lanes) if nb % c == 0] or [nb]
        if nb not in tiles:
            tiles.append(nb)
        hand_unroll = x86._unpack_unroll(desc)
        if group % vpb == 0:
            unrolls = [vpb << i for i in range(5) if group % (vpb << i) == 0]
        else:
            unrolls = [u for u in (1, 2, 4, 8, 16) if group % u == 0]
        if hand_unroll not in unrolls:
            unrolls.insert(0, hand_unroll)
        plans = _plans(desc, target)
        tile_pref = [p.n_block for p in plans]
        unroll_pref = [math.lcm(p.m_u, vpb) if group % vpb == 0 else p.m_u for p in plans]
        analytic = {"tile_cols": nb, "unroll": hand_unroll, "local_partials": 1, "parallel": 1}
        return KnobSpace(desc, tuple(tiles), tuple(_weights(tiles, nb, tile_pref)),
                         tuple(unrolls), tuple(_weights(unrolls, hand_unroll, unroll_pref)), analytic)

    def apply(self, sch: s_tir.Schedule, knobs: dict | None = None, *, local_partials: bool = True,
              parallel: bool = True) -> None:
        """Schedule ``sch`` with sampled knobs (or ``knobs``' values as the decisions)."""
        knobs = knobs or {}
        if knobs:
            local_partials, parallel = bool(knobs["local_partials"]), bool(knobs["parallel"])

        def sample(name, cands, probs):
            value = knobs.get(name)
            if value is not None and value not in cands:
                raise ValueError(f"{name}={value} is not one of {cands}")
            decision = None if value is None else cands.index(value)
            return sch.sample_categorical(list(cands), list(probs), decision=decision)

        tile = sample("tile_cols", self.tile_cols, self.tile_probs)
        unroll = sample("unroll", self.unroll, self.unroll_probs)
        out = sch.get_sblock(ops.BLOCK_OUT)
        for name, value in (("tile_cols", tile), ("unroll", unroll), ("local_partials", int(local_partials)),
                            ("parallel", int(parallel))):
            sch.annotate(out, KNOB_PREFIX + name, value)
        x86.apply_qmatmul_x86(sch, self.desc, tile_cols=tile, unroll=unroll, local_partials=local_partials,
                              parallel=parallel)

    def design_spaces(self, sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        """The ScheduleFn: one design space per (parallel, local_partials)."""
        return self._spaces(sch, [{"local_partials": local, "parallel": parallel}
                                  for parallel in (True, False) for local in (True, False)])


def trace_knobs(trace) -> dict:
    """The knob values a trace of this design space chose (read from its annotations)."""
    sampled, knobs = {}, {}
    for inst in trace.insts:
        kind = inst.kind.name
        if kind == "SampleCategorical":
            decision = trace.decisions[inst] if inst in trace.decisions else None
            if decision is not None:
                sampled[inst.outputs[0]] = int(inst.attrs[0][int(decision)])
        elif kind == "Annotate" and str(inst.attrs[0]).startswith(KNOB_PREFIX):
            value = inst.inputs[1]
            value = sampled.get(value) if isinstance(value, tvm.tirx.Var) else int(value)
            knobs[str(inst.attrs[0])[len(KNOB_PREFIX):]] = value
    if set(knobs) - set(KNOB_NAMES):  # another design space's knobs (tune_a8)
        return knobs
    return {name: knobs.get(name) for name in KNOB_NAMES} if knobs else {}


def kernel_knobs(func: tvm.tirx.PrimFunc) -> dict:
    """Knob annotations of a scheduled kernel ({} for the hand schedule)."""
    sch = s_tir.Schedule(func)
    block = sch.get(sch.get_sblock(ops.BLOCK_OUT))
    return {str(k)[len(KNOB_PREFIX):]: int(v) for k, v in block.annotations.items()
            if str(k).startswith(KNOB_PREFIX)}


@derived_object
class MutateKnob(ms.mutator.PyMutator):
    """Re-sample one categorical knob decision (MetaSchedule's mutators only touch
    tile sizes, unroll annotations, parallel extents and compute locations)."""

    def __init__(self) -> None:
        self._calls = 0

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, trace, rand_state):
        self._calls += 1
        rng = random.Random(hash((int(rand_state), self._calls)))
        choices = [inst for inst in trace.insts
                   if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        if not choices:
            return None
        inst = rng.choice(choices)
        old = int(trace.decisions[inst])
        new = rng.choice([d for d in range(len(inst.attrs[0])) if d != old])
        return trace.with_decision(inst, new, True)

    def clone(self):
        return MutateKnob()


def space_generator(space: KnobSpace) -> ms.space_generator.ScheduleFn:
    return ms.space_generator.ScheduleFn(
        space.design_spaces,
        sch_rules=[],
        postprocs=[ms.postproc.DisallowDynamicLoop()],
        mutator_probs={MutateKnob(): 1.0},
    )


# -------------------------------------------------------------------- measurement


def _evaluator() -> ms.runner.EvaluatorConfig:
    return ms.runner.EvaluatorConfig(number=3, repeat=5, min_repeat_ms=20, enable_cpu_cache_flush=False)


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds candidates in this process.

    MetaSchedule's LocalBuilder starts fresh worker processes for every batch,
    and its build function imports ``tvm.s_tir.tensor_intrin`` (about 30 s on
    these machines) each time, longer than its own timeout.  Our candidates come
    from a fixed, verified design space, so process isolation buys nothing.
    """

    def __init__(self, toolchain=None, shared: bool = False) -> None:
        """``shared``: link a shared library (an RPC server loads it as is; ``toolchain``
        links it for the device), instead of the object tarball the local runner links."""
        super().__init__()
        self.toolchain, self.shared = toolchain, shared

    def build(self, build_inputs):
        from tvm.support.tar import tar

        results = []
        for item in build_inputs:
            try:
                # through the TIR pipeline artefacts get (x86: chunk claiming)
                rt_mod = tvm.tirx.build(item.mod, target=item.target, pipeline=tir_pipeline(item.target))
                folder = Path(tempfile.mkdtemp(prefix="qtvm-tune-build-"))
                if self.shared:
                    path = folder / "kernel.so"
                    rt_mod.export_library(str(path), fcompile=self.toolchain.fcompile() if self.toolchain else None)
                else:
                    path = folder / f"kernel.{tar.output_format}"
                    rt_mod.export_library(str(path), fcompile=tar)
                results.append(ms.builder.BuilderResult(str(path), None))
            except Exception as e:  # noqa: BLE001 - a failed candidate is a result, not a crash
                results.append(ms.builder.BuilderResult(None, f"{type(e).__name__}: {e}"[:2000]))
        return results


def make_builder(toolchain=None, shared: bool = False) -> InProcessBuilder:
    return InProcessBuilder(toolchain, shared)


def make_runner():
    """The one runner configuration both analytic and tuned schedules are timed with: the
    kernels stream weights, so their weights are rotated over more than the L3 (cold)."""
    from schedules.tune_runner import ColdRunner

    return ColdRunner()


def make_hot_runner() -> ms.runner.LocalRunner:
    """MetaSchedule's local runner (same arguments every call: weights cache-hot)."""
    return ms.runner.LocalRunner(timeout_sec=60.0, evaluator_config=_evaluator())


def make_rpc_runner(tracker, workers: int, log=None, known=None):
    """The same evaluator as the local runner, on the tracker's servers (schedules.rpc)."""
    from schedules.rpc import TrackerRunner

    return TrackerRunner(tracker, _evaluator(), workers, log=log, known=known)


def measure(schedules: list[s_tir.Schedule], target, builder, runner, rounds: int = 1) -> list[list[float] | None]:
    """Build each schedule once and time it ``rounds`` times, interleaved; run_secs or None."""
    inputs = [ms.builder.BuilderInput(sch.mod, target) for sch in schedules]
    built = builder.build(inputs)
    results: list[list[float] | None] = [[] if b.error_msg is None else None for b in built]
    try:
        for _ in range(rounds):
            todo = [(i, b) for i, b in enumerate(built) if results[i] is not None]
            futures = runner.run([ms.runner.RunnerInput(b.artifact_path, _device_type(target),
                                                        ms.arg_info.ArgInfo.from_prim_func(schedules[i].mod["main"]))
                                  for i, b in todo])
            for (i, _), fut in zip(todo, futures):
                res = fut.result()
                if res.error_msg is not None or not res.run_secs:
                    results[i] = None
                else:
                    results[i].extend(float(s) for s in res.run_secs)
    finally:
        for b in built:
            if b.artifact_path:
                shutil.rmtree(Path(b.artifact_path).parent, ignore_errors=True)
    return results


def commit_record(db, workload, sch: s_tir.Schedule, run_secs: list[float], target) -> None:
    db.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, workload, run_secs=run_secs, target=target,
        args_info=ms.arg_info.ArgInfo.from_prim_func(sch.mod["main"])))


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """One stderr line per measured batch; on a terminal a progress bar instead
    (``qtvm.progress``: none under ``qtvm -q``). ``history`` keeps (trials done, best
    latency so far) after each batch: the convergence curve."""

    def __init__(self, names: list[str], total: int, enabled: bool, done: int = 0,
                 interrupt: "_InterruptFlag | None" = None) -> None:
        from qtvm import progress

        self.names, self.total, self.enabled, self.interrupt = names, total, enabled, interrupt
        self.done, self.best = done, {}
        self.history: list[tuple[int, dict]] = []
        self.start = time.perf_counter()
        self.bar = progress.bar(total, "qtvm tune", unit="trial") if enabled and progress.bars_enabled() else None
        if self.bar is not None:
            self.bar.update(done)

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        if self.interrupt is not None and self.interrupt.seen:
            # A Ctrl-C that landed in code which swallowed it (a worker pool, the cost
            # model's update): stop at this batch, its records are already committed.
            raise KeyboardInterrupt
        secs = [min(r.run_secs) for r in runner_results if r.error_msg is None and r.run_secs]
        self.done += len(measure_candidates)
        name = self.names[task_id]
        if secs:
            self.best[name] = min(self.best.get(name, math.inf), min(float(s) for s in secs))
        self.history.append((self.done, dict(self.best)))
        if self.bar is not None:
            best = self.best.get(name)
            self.bar.update(len(measure_candidates))
            self.bar.set_postfix_str(f"{name}: best {best * 1e6:.1f} us" if best is not None else name)
        elif self.enabled:
            best = self.best.get(name)
            best_txt = f"{best * 1e6:.1f} us" if best is not None else "none ok"
            failed = len(measure_candidates) - len(secs)
            print(f"[{_PROGRESS_PREFIX}] {self.done}/{self.total} trials  {name}: +{len(measure_candidates)}"
                  f"{f' ({failed} failed)' if failed else ''}, best {best_txt}  "
                  f"({time.perf_counter() - self.start:.0f} s)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- database


def _device_type(target) -> str:
    return "cpu" if target.kind.name == "llvm" else target.kind.name


def _target_key(target) -> str:
    """Records match a target by everything but ``model``: the device they were measured on."""
    return json.dumps({str(k): str(v) for k, v in target.export().items() if str(k) != MODEL_ATTR}, sort_keys=True)


def measured_on(target) -> str:
    """The device a record was measured on ("" for records from before this was kept)."""
    return str(target.attrs.get(MODEL_ATTR, "") or "") if target is not None else ""


def with_device(target, device: str):
    """``target`` whose ``model`` names the device it is measured on (kept in every record)."""
    spec = dict(target.export())
    spec[MODEL_ATTR] = device
    return tvm.target.Target(spec)


def local_device() -> str:
    """This machine's CPU, as /proc/cpuinfo names it."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"local: {name} ({_cores()} CPUs)"


def repair_torn_tail(path: Path) -> bool:
    """A run killed while appending a record (SIGKILL, power loss) can leave a last line
    without its newline: complete it if it parses, else drop it (atomically).  True if
    the file changed.  Every earlier record is a whole line and is kept."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not data or data.endswith(b"\n"):
        return False
    head, _, last = data.rpartition(b"\n")
    try:
        json.loads(last)
        fixed = data + b"\n"
    except ValueError:
        fixed = head + b"\n" if head else b""
    tmp = path.with_name(f".{path.name}.repair")
    tmp.write_bytes(fixed)
    os.replace(tmp, path)
    return True


def open_database(db_dir: Path, *, create: bool):
    if create:
        db_dir.mkdir(parents=True, exist_ok=True)
        for name in DB_FILES:  # only a writer repairs; apply_database reads what is there
            if repair_torn_tail(db_dir / name):
                print(f"[{_PROGRESS_PREFIX}] {db_dir / name}: completed or dropped a torn last line (a killed run)",
                      file=sys.stderr, flush=True)
    paths = [db_dir / name for name in DB_FILES]
    if paths[1].is_file():  # the records' traces name TensorIntrin variants: register them first
        from qtvm.intrin import x86, x86_bcq, x86_lut

        text = paths[1].read_text()
        x86.register_variants(text)
        x86_lut.register_variants(text)
        x86_bcq.register_variants(text)
    return ms.database.JSONDatabase(str(paths[0]), str(paths[1]), allow_missing=create,
                                    module_equality="structural")


@dataclass
class _Decision:
    analytic_s: float | None
    tuned_s: float | None
    tuned_knobs: dict | None
    record: object | None  # the tuned TuningRecord to replay
    analytic_knobs: dict
    tuned_schedules: int

    @property
    def use_tuned(self) -> bool:
        return (self.record is not None and self.analytic_s is not None and self.tuned_s is not None
                and self.tuned_s < self.analytic_s * (1.0 - MARGIN))


def _decide(db, workload, space: KnobSpace, target) -> _Decision:
    """Pool each knob setting's timings; compare their best (see module doc)."""
    records = db.get_top_k(workload, 1 << 20)
    key = _target_key(target)
    pooled: dict[tuple, list[float]] = {}
    best_record: dict[tuple, tuple[float, object]] = {}
    for rec in records:
        if rec.run_secs is None or rec.target is None or _target_key(rec.target) != key:
            continue
        knobs = trace_knobs(rec.trace)
        if not knobs or any(v is None for v in knobs.values()):
            continue
        secs = [float(s) for s in rec.run_secs]
        ident = tuple(sorted(knobs.items()))
        pooled.setdefault(ident, []).extend(secs)
        mean = sum(secs) / len(secs)
        if ident not in best_record or mean < best_record[ident][0]:
            best_record[ident] = (mean, rec)
    analytic_id = tuple(sorted(space.analytic.items()))
    latency = {ident: min(v) for ident, v in pooled.items()}
    analytic_s = latency.pop(analytic_id, None)
    if not latency:
        return _Decision(analytic_s, None, None, None, space.analytic, 0)
    tuned_id = min(latency, key=latency.get)
    return _Decision(analytic_s, latency[tuned_id], dict(tuned_id), best_record[tuned_id][1], space.analytic,
                     len(latency))


def _replay(record, compute: tvm.tirx.PrimFunc, original: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """The tuned M = 1 trace replayed on the symbolic-M compute, attributes kept, built once."""
    sch = s_tir.Schedule(compute)
    record.trace.apply_to_schedule(sch, remove_postproc=True)
    func = sch.mod["main"].with_attrs(dict(original.attrs))
    expected = trace_knobs(record.trace)
    if kernel_knobs(func) != expected:
        raise ValueError(f"replayed kernel knobs {kernel_knobs(func)} != record {expected}")
    from schedules import compile_func

    compile_func(func, target)  # built once, as it will ship
    return func


# ------------------------------------------------------------------------ public


_LOG = logging.getLogger("qtvm.tune")


def _log_from_tvm(level: int, filename: str, lineno: int, msg: str) -> None:
    if level >= 0:  # < 0 asks a notebook to clear its output
        _LOG.log(level, "[%s:%d] %s", os.path.basename(filename), lineno, msg)


def _tune_context(mod, target, space, strategy, name: str, rand_state: int) -> ms.TuneContext:
    """``ms.TuneContext(...)`` without its first-use ``import tvm.s_tir.tensor_intrin``,
    which parses TVM's built-in CUDA/ROCm/Arm intrinsics for about 30 s; qtvm's
    design spaces tensorize only with qtvm's own intrinsics (registered by qtvm.intrin.x86).
    Same FFI constructor and initialisation as the class."""
    try:
        ctx = ms.TuneContext.__new__(ms.TuneContext)
        ctx.__init_handle_by_constructor__(ms._ffi_api.TuneContext, mod, target, space, strategy, name,
                                           _cores(), rand_state, _log_from_tvm)
        ms._ffi_api.TuneContextInitialize(ctx)
    except (AttributeError, TypeError):  # another TVM: the public (slow) constructor
        ctx = ms.TuneContext(mod, target=target, space_generator=space, search_strategy=strategy,
                             task_name=name, rand_state=rand_state, num_threads=_cores(), logger=_LOG)
    return ctx.clone()


def _check_target(target, remote: bool = False) -> tvm.target.Target:
    """A target this machine can measure (``remote``: any target the RPC servers measure)."""
    from qtvm.target import parse_target
    from schedules.target_facts import cpu_facts, host_supports

    target = parse_target(target) if isinstance(target, str) else target
    if remote:
        if target.kind.name not in ("llvm", "opencl", "cuda"):
            raise QtvmError(f"cannot tune for target kind '{target.kind.name}'", "use an llvm, opencl or cuda target")
        return target
    if target.kind.name != "llvm":
        raise QtvmError(f"cannot tune for target kind '{target.kind.name}' on this machine",
                        "measure on the device: --rpc HOST:PORT --device-key KEY")
    try:
        facts = cpu_facts(target)
    except ValueError as e:
        raise QtvmError(f"cannot tune for {target} on this machine: {e}",
                        "measure on the device: --rpc HOST:PORT --device-key KEY") from None
    if not host_supports(facts):
        raise QtvmError(f"this machine cannot run code for {target} ({facts.isa})",
                        "tune on a machine with that ISA (or through --rpc), or choose a target this host runs")
    return target


def _machine_line(rec: dict) -> str:
    return f"measured on '{rec.get('cpu_model')}' [{rec.get('cpu_id')}] ({rec.get('runner')} runner)"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_tuning_deps() -> None:
    """MetaSchedule imports these lazily, deep inside its search and worker pools."""
    for module, why in (("xgboost", "the XGBoost cost model"), ("psutil", "MetaSchedule's worker pools")):
        if importlib.util.find_spec(module) is None:
            raise QtvmError(f"tuning needs the '{module}' package ({why})", f"pip install {module}")
    try:
        ffi = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return
    if ffi.startswith("0.1.15"):  # tvm.ir.save_json segfaults: the JSON database would kill the process
        raise QtvmError(f"apache-tvm-ffi {ffi} crashes MetaSchedule's database", "pip install apache-tvm-ffi==0.1.14.post1")


def _check_trials(trials) -> int:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise QtvmError(f"--trials must be a positive number of measured schedules, got {trials!r}",
                        "use e.g. --trials 32")
    return trials


@dataclass
class _Task:
    names: list[str]
    compute: tvm.tirx.PrimFunc
    workload_mod: tvm.IRModule
    space: KnobSpace
    desc: dict


def _collect(mod: tvm.IRModule, target, notes: list[str]) -> list[_Task]:
    tasks: list[_Task] = []
    for gv, func in qtvm_kernels(mod):
        compute, why = unscheduled_kernel(func, target)
        if compute is None:
            notes.append(f"{gv.name_hint}: not tuned, {why}; analytic schedule kept")
            continue
        wl = workload_of(compute)
        same = next((t for t in tasks if structural_equal(t.workload_mod, wl)), None)
        if same is not None:
            same.names.append(gv.name_hint)
            continue
        tasks.append(_Task([gv.name_hint], compute, wl, space_of(compute, target), _desc(compute)))
    return tasks


def _kernel_row(task: _Task, decision: _Decision | None) -> KernelTuning:
    desc = task.desc
    fmt = _format_of(desc)
    row = KernelTuning(",".join(task.names), int(desc["k"]), int(desc["n"]), fmt.name if fmt else "?")
    if decision is not None:
        row.analytic_s, row.tuned_s, row.tuned_knobs = decision.analytic_s, decision.tuned_s, decision.tuned_knobs
        row.analytic_knobs, row.tuned_schedules = decision.analytic_knobs, decision.tuned_schedules
        row.use = "tuned" if decision.use_tuned else "analytic"
    return row


def tune_kernels(mod: tvm.IRModule, target, work_dir: Path, trials: int, *, progress: bool = True,
                 seed: int | None = None, rpc=None, cross_cc: str | None = None) -> TuneReport:
    """Tune every tunable ``qtvm.kernel`` PrimFunc of ``mod`` for ``trials`` measured schedules in
    all (fewer than the number of kernels is fine: the rest keep the analytic schedule);
    records go to the JSON database in ``work_dir`` as they are measured (created; earlier
    records are kept and seed the search).

    Resuming: schedules this database already holds for the target count towards
    ``trials`` and an analytic schedule measured before is not measured again, so an
    interrupted run, rerun, measures only what is missing.  Every record names the device
    it was measured on (the target's ``model``); one database holds one device.

    ``rpc`` (a :class:`schedules.rpc.Tracker`) measures on the servers registered under
    its key, several at once, instead of this machine; candidates are linked for the
    target's host triple (``qtvm.deploy.toolchain``, ``cross_cc`` names the compiler).

    Each kernel is tuned as a copy specialised to M = 1 (decode shapes; int8 prefill
    kernels at ``tune_a8.PREFILL_ROWS``); the winner is replayed on the symbolic kernel by
    :func:`apply_database`.  Latencies come from ``make_runner()`` (weights cold) locally, from
    the servers' own evaluator over RPC.  ``progress`` prints one stderr line per measured batch.
    """
    start = time.perf_counter()
    trials = _check_trials(trials)
    target = _check_target(target, remote=rpc is not None)
    _check_tuning_deps()
    say = (lambda text: print(f"[{_PROGRESS_PREFIX}] {text}", file=sys.stderr, flush=True)) if progress else None
    if rpc is not None:  # every check that can fail fast comes before any work
        from qtvm.deploy.toolchain import toolchain_for
        from schedules.rpc import check_tracker, describe_device

        toolchain = toolchain_for(target, cross_cc)
        known = check_tracker(rpc, log=say)
        device = describe_device(rpc, _device_type(target))
    else:
        toolchain, known, device = None, None, local_device()
    work_dir = Path(work_dir)
    report = TuneReport(work_dir=work_dir, trials=trials)
    tasks = _collect(mod, target, report.notes)
    if not tasks:
        if report.notes:  # packed kernels, none with a tuning space (a mixture of experts' routed matmuls)
            raise QtvmError(f"none of the module's packed kernels can be tuned ({report.notes[0]})",
                            "compile without a database: their analytic schedules are what tuning would seed")
        raise QtvmError("the module has no tunable qtvm kernels", "quantize the model (--quant int4-g128)")
    try:
        db = open_database(work_dir, create=True)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error types for bad JSON
        raise QtvmError(f"tuning database in '{work_dir}' is unreadable ({type(e).__name__})",
                        "delete it or choose another --db directory") from None
    _check_one_device(db, tasks, target, device, work_dir)
    measure_target = with_device(target, device)
    done_before = _measured_before(db, tasks, target)
    remaining = trials - sum(done_before.values())
    if progress:
        where = f"on {len(known)} RPC server(s) under key '{rpc.key}' ({', '.join(known)})" if rpc else "locally"
        print(f"[{_PROGRESS_PREFIX}] {len(tasks)} kernel(s), {trials} trials, database {work_dir}, measuring {where}: "
              f"{device}", file=sys.stderr, flush=True)
        if sum(done_before.values()):
            print(f"[{_PROGRESS_PREFIX}] resuming: {sum(done_before.values())} of {trials} trials already in the "
                  f"database, {max(0, remaining)} to measure", file=sys.stderr, flush=True)
    if rpc is None:  # the CPU this database's timings come from
        report.notes.append(_machine_line(record_machine(work_dir)))
    builder = make_builder(toolchain, shared=rpc is not None)
    runner = make_rpc_runner(rpc, len(known), say, known) if rpc is not None else make_runner()
    interrupt = _InterruptFlag()
    tracker = None
    try:
        _seed_analytic([t for t in tasks if not _has_analytic(db, t, target)], db, measure_target, builder, runner,
                       report.notes)
        tracker = _Progress([task.names[0] for task in tasks], trials, progress, done=trials - max(0, remaining),
                            interrupt=interrupt)
        if remaining > 0:
            _search(tasks, db, measure_target, builder, runner, tracker, remaining, seed)
        if interrupt.seen:
            raise KeyboardInterrupt
        report.measured = tracker.done
        report.history = tracker.history
        if tracker.done < trials:
            report.notes.append(f"the design space ran out of unmeasured schedules after {tracker.done} of "
                                f"{trials} trials")
        _confirm(tasks, db, measure_target, builder, runner, report)
        if interrupt.seen:
            raise KeyboardInterrupt
    except BaseException as e:
        _raise_stopped(e, interrupt.seen, runner, db, tasks, target, work_dir)
        raise
    finally:
        interrupt.restore()
        close_runner(runner)
        if tracker is not None and tracker.bar is not None:
            tracker.bar.close()
        if rpc is not None:
            report.notes.extend(runner.notes)
    report.device = device
    report.seconds = time.perf_counter() - start
    return report


@contextlib.contextmanager
def _plain_text_tables():
    """MetaSchedule prints its task table through pandas when it runs under a Jupyter
    kernel (``s_tir.meta_schedule.using_ipython``); pandas is no dependency of qtvm, so
    tuning from a notebook keeps the plain-text table."""
    import tvm_ffi

    name = "s_tir.meta_schedule.using_ipython"
    original = tvm_ffi.get_global_func(name)
    tvm_ffi.register_global_func(name, lambda: False, override=True)
    try:
        yield
    finally:
        tvm_ffi.register_global_func(name, original, override=True)


def _search(tasks, db, target, builder, runner, tracker, trials: int, seed) -> None:
    """MetaSchedule's evolutionary search over the knob spaces, ``trials`` measurements."""
    names = [task.names[0] for task in tasks]
    per_iter = max(1, min(8, -(-trials // len(tasks))))
    contexts = [
        _tune_context(task.workload_mod, target, space_generator(task.space),
                      ms.search_strategy.EvolutionarySearch(
                          population_size=64, init_measured_ratio=0.2, init_min_unmeasured=16,
                          max_fail_count=3, genetic_num_iters=3, genetic_mutate_prob=0.85, eps_greedy=0.25),
                      name, rand)
        for task, name, rand in zip(tasks, names, ms.utils.fork_seed(seed, n=len(tasks)))]
    with tempfile.TemporaryDirectory(prefix="qtvm-tune-") as scratch, _plain_text_tables():
        ms.tune_tasks(
            tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=scratch,
            max_trials_global=trials, max_trials_per_task=trials, num_trials_per_iter=per_iter,
            builder=builder, runner=runner, database=db,
            cost_model=ms.cost_model.XGBModel(num_warmup_samples=min(8, per_iter), num_tuning_cores=_cores(),
                                              verbose_eval=1 << 30),
            measure_callbacks=[ms.measure_callback.AddToDatabase(), ms.measure_callback.RemoveBuildArtifact(),
                               ms.measure_callback.UpdateCostModel(), tracker],
            task_scheduler="gradient",
        )


def _records_for(db, task: _Task, target) -> list:
    wl = db.commit_workload(task.workload_mod)
    key = _target_key(target)
    return [r for r in db.get_top_k(wl, 1 << 20) if r.target is not None and _target_key(r.target) == key]


def _measured_before(db, tasks, target) -> dict[str, int]:
    """Distinct tuned knob settings the database holds per kernel for this target."""
    out = {}
    for task in tasks:
        seen = {tuple(sorted(trace_knobs(r.trace).items())) for r in _records_for(db, task, target)}
        seen.discard(tuple(sorted(task.space.analytic.items())))
        out[task.names[0]] = len(seen)
    return out


def _has_analytic(db, task: _Task, target) -> bool:
    return any(trace_knobs(r.trace) == task.space.analytic and r.run_secs for r in _records_for(db, task, target))


def _check_one_device(db, tasks, target, device: str, work_dir: Path) -> None:
    """Timings from two devices are not comparable: a database holds one device's."""
    for task in tasks:
        others = {measured_on(r.target) for r in _records_for(db, task, target)} - {"", device}
        if others:
            raise QtvmError(f"tuning database '{work_dir}' holds measurements from {sorted(others)[0]}, "
                            f"this run measures on {device}", "use one --db directory per device")


class _InterruptFlag:
    """Remembers a Ctrl-C: raised inside a callback MetaSchedule's C++ called, the
    KeyboardInterrupt comes back out of ``tune_tasks`` as an anonymous RuntimeError."""

    def __init__(self) -> None:
        self.seen, self._previous = False, None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _raise_stopped(error: BaseException, interrupted: bool, runner, db, tasks, target, work_dir: Path) -> None:
    """An interrupted or failed search: say what the database kept and how to go on."""
    from schedules.rpc import NoServer

    kept = sum(len(_records_for(db, task, target)) for task in tasks)
    fatal = getattr(getattr(runner, "health", None), "fatal", None)
    text = f"{type(error).__name__}: {error}"
    if interrupted or isinstance(error, KeyboardInterrupt):
        raise KeyboardInterrupt(f"{kept} measured record(s) kept in '{work_dir}'; rerun the same command to "
                                "resume") from None
    if fatal or isinstance(error, NoServer) or "NoServer" in text:
        raise QtvmError(f"{fatal or error}; {kept} measured record(s) kept in '{work_dir}'",
                        "start an RPC server under the key and rerun the same command to resume") from None


def _seed_analytic(tasks, db, target, builder, runner, notes: list[str]) -> None:
    """Measure each kernel's analytic schedule (as a point of the design space) and
    record it: the search starts from it and apply_database compares against it."""
    schs = [task.space.schedule(task.workload_mod["main"], task.space.analytic) for task in tasks]
    for task, sch, secs in zip(tasks, schs, measure(schs, target, builder, runner)):
        if secs is None:
            notes.append(f"{task.names[0]}: the analytic schedule failed to build or run at M = 1")
        else:
            commit_record(db, db.commit_workload(task.workload_mod), sch, secs, target)


def _confirm(tasks, db, target, builder, runner, report: TuneReport) -> None:
    """Time the analytic and the best tuned schedule once more, interleaved, then report."""
    for task in tasks:
        wl = db.commit_workload(task.workload_mod)
        decision = _decide(db, wl, task.space, target)
        schs = [task.space.schedule(task.workload_mod["main"], task.space.analytic)]
        if decision.record is not None:  # replay the record itself: it may predate this space
            tuned = s_tir.Schedule(task.workload_mod["main"])
            decision.record.trace.apply_to_schedule(tuned, remove_postproc=True)
            schs.append(tuned)
        for sch, secs in zip(schs, measure(schs, target, builder, runner, rounds=2)):
            if secs is not None:
                commit_record(db, wl, sch, secs, target)
        report.kernels.append(_kernel_row(task, _decide(db, wl, task.space, target)))


def close_runner(runner) -> None:
    pool = getattr(runner, "pool", None)
    if pool is not None:
        pool.shutdown()


def apply_database(mod: tvm.IRModule, target, db_dir) -> tuple[tvm.IRModule, list[str]]:
    """Replace each qtvm kernel by its tuned schedule when the database in ``db_dir``
    has one for this kernel and target that measured faster than the analytic
    schedule (same runner, by more than ``MARGIN``); otherwise keep the analytic
    schedule.  Problems with the database are returned as one-line notes, never raised.
    """
    from qtvm.target import parse_target

    target = parse_target(target) if isinstance(target, str) else target
    db_dir = Path(db_dir)
    notes: list[str] = []
    if not db_dir.is_dir():
        return mod, [f"warning: tuning database '{db_dir}' does not exist; using analytic schedules"]
    missing = [name for name in DB_FILES if not (db_dir / name).is_file()]
    if missing:
        return mod, [f"warning: tuning database '{db_dir}' has no {' / '.join(missing)} (empty?); "
                     "using analytic schedules"]
    try:
        db = open_database(db_dir, create=False)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return mod, [f"warning: tuning database '{db_dir}' is unreadable ({type(e).__name__}: {first}); "
                     "using analytic schedules"]
    if len(db) == 0:
        return mod, [f"warning: tuning database '{db_dir}' holds no records (empty); using analytic schedules"]
    kernels = qtvm_kernels(mod)
    if not kernels:
        return mod, notes
    where = machine_note(db_dir)
    new = mod.clone()
    for gv, func in kernels:
        compute, why = unscheduled_kernel(func, target)
        if compute is None:
            continue  # not a tunable kernel: nothing to say per call
        try:
            wl_mod = workload_of(compute)
            if not db.has_workload(wl_mod):
                notes.append(f"{gv.name_hint}: not in the tuning database; analytic schedule")
                continue
            space = space_of(compute, target)
            decision = _decide(db, db.commit_workload(wl_mod), space, target)
        except Exception as e:  # noqa: BLE001 - a bad record must not stop a compile
            notes.append(f"warning: {gv.name_hint}: unreadable tuning records ({type(e).__name__}); "
                         "analytic schedule")
            continue
        if decision.record is None:
            notes.append(f"{gv.name_hint}: no tuned record for this target; analytic schedule")
            continue
        if decision.analytic_s is None:
            notes.append(f"{gv.name_hint}: no analytic measurement to compare with; analytic schedule")
            continue
        if not decision.use_tuned:
            notes.append(f"{gv.name_hint}: tuned {decision.tuned_s * 1e6:.1f} us is not faster than analytic "
                         f"{decision.analytic_s * 1e6:.1f} us; analytic schedule")
            continue
        try:
            tuned = _replay(decision.record, compute, func, target)
        except Exception as e:  # noqa: BLE001
            notes.append(f"warning: {gv.name_hint}: the tuned schedule does not apply to the symbolic kernel "
                         f"({type(e).__name__}); analytic schedule")
            continue
        new.update_func(gv, tuned)
        rows = tune_a8.rows_of(_kind(compute)) if _kind(compute) in tune_a8.KINDS else 1
        notes.append(f"{gv.name_hint}: tuned schedule ({decision.analytic_s * 1e6:.1f} -> "
                     f"{decision.tuned_s * 1e6:.1f} us at M={rows}; "
                     + " ".join(f"{k}={v}" for k, v in decision.tuned_knobs.items()) + ")"
                     + (f"; {where}" if where else ""))
    return new, notes


# --------------------------------------------------------------------------- CLI


def tune_command(args) -> int:
    from qtvm.deploy.toolchain import with_default_host
    from qtvm.pipeline import FLOAT, build_module
    from qtvm.target import parse_target, with_host

    _check_trials(args.trials)
    rpc = None
    if getattr(args, "rpc", None) or getattr(args, "device_key", None):
        from schedules.rpc import parse_tracker

        if not args.rpc:
            raise QtvmError("--device-key needs --rpc HOST:PORT (the tracker)")
        rpc = parse_tracker(args.rpc, args.device_key, getattr(args, "rpc_wait", 30.0))
    if args.quant == FLOAT:
        raise QtvmError("--quant none leaves no packed kernels to tune", "choose a preset such as int4-g128")
    if not Path(args.model).is_file():
        raise QtvmError(f"model file '{args.model}' does not exist")
    target = parse_target(args.target) if isinstance(args.target, str) else args.target
    target, host_note = with_default_host(with_host(target, getattr(args, "host", None)))
    target = _check_target(target, remote=rpc is not None)
    if rpc is not None:  # tracker, servers and device before the model is even read
        from qtvm.deploy.toolchain import toolchain_for
        from schedules.rpc import check_tracker

        toolchain_for(target, getattr(args, "cross_cc", None))
        check_tracker(rpc)
    from qtvm.frontend.bind import parse_bind_options
    from qtvm.frontend.onnx import parse_dim_options

    mod, _meta, _summary, build_notes = build_module(args.model, target, args.quant, getattr(args, "act", "fp32"),
                                                     dims=parse_dim_options(getattr(args, "dim", [])),
                                                     binds=parse_bind_options(getattr(args, "bind", [])))
    report = tune_kernels(mod, target, Path(args.db), args.trials, progress=not getattr(args, "quiet", False),
                          rpc=rpc, cross_cc=getattr(args, "cross_cc", None))
    print(f"tuned {len(report.kernels)} kernel(s) in {report.seconds:.0f} s; database: {report.work_dir}")
    print(f"measured on {report.device}")
    if rpc is None:
        print(f"latencies at M = 1 (int8 prefill: M = {tune_a8.PREFILL_ROWS}) with the weights cold (rotated over "
              "more than the L3)")
    else:
        print("latencies at M = 1 from the servers' evaluator (cache-hot weights: optimistic for GEMVs)")
    print(report.table())
    for note in ([host_note] if host_note else []) + build_notes + report.notes:
        print(note)
    return 0
