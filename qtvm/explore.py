"""Exploring one kernel's schedules, in Jupyter or a terminal.

    k = qtvm.explore.kernel("int4-g128", k=1024, n=1024, target="host")
    k.compute                      # the TE compute as TIR (what every schedule starts from)
    steps = k.steps()              # the analytic rule's schedule, one primitive at a time
    steps[3].tir, steps[3].code    # the TIR after step 3, and the primitive that made it
    k.source()                     # asm / CUDA / OpenCL, interesting instructions highlighted
    k.time()                       # cache-hot and DRAM-cold, checked against numpy
    k.tune(trials=8, work_dir=...) # MetaSchedule over the analytic schedule's knobs
    k.compare().plot()             # analytic, TVM default, tuned, dlight: one table, one chart
    k.roofline().plot()            # against the measured bandwidth and the format's bytes

The schedules of a kernel: ``analytic`` (qtvm's rule for the target, when one exists),
``tvm-default`` (the compute compiled as it is: what TVM does without a schedule, CPU only),
``dlight`` (TVM's default GPU rules, on the kernel specialised to one row), ``tuned``
(after :meth:`Kernel.tune`). Nothing here knows a target family: a target whose qtvm
rule lands (CUDA, OpenCL) shows its analytic schedule and source the same way.

Every result has ``_repr_html_`` (Jupyter) and a plain-text ``repr``. Timing needs a target
this machine can run; source and steps need none.
"""
from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from qtvm.errors import require_compiler_tvm

require_compiler_tvm()
import tvm
from tvm import s_tir

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.target import parse_target

#: Instructions worth seeing, per kind of source: the byte dots, the unpack, the FMAs.
HIGHLIGHT = {
    "asm": ("vpdpbusd", "vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vfmadd213ps", "vfmadd132ps", "vpsrlvd",
            "vpsrld", "vpand", "vcvtdq2ps", "vpbroadcastd", "vbroadcastss", "prefetcht0", "prefetcht1",
            "fmla", "sdot", "udot", "ushr"),
    "cuda": ("lop3", "prmt", "__dp4a", "__hfma2", "__shfl_down_sync", "__shfl_xor_sync", "__syncthreads",
             "ld.global.nc"),
    "opencl": ("as_half", "as_float", "mad", "dot", "sub_group_reduce_add", "barrier", "vload4"),
}
SCHEDULES = ("analytic", "tvm-default", "dlight", "tuned")
# dlight's GPU rules in the order TVM's own pipelines try them.
_DLIGHT_GPU = ("GEMV", "LowBatchGEMV", "Reduction", "GeneralReduction", "Fallback")


# ----------------------------------------------------------------------------- display


class Code:
    """Source text with some words highlighted; ``counts`` says how often each occurs."""

    def __init__(self, text: str, kind: str, words: tuple[str, ...] = (), title: str = ""):
        self.text, self.kind, self.title = text, kind, title
        self.words = tuple(words)
        self._pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.words)) + r")\b") if self.words else None

    @property
    def counts(self) -> dict[str, int]:
        """How many times each highlighted word occurs (the ones that occur)."""
        found: dict[str, int] = {}
        if self._pattern is not None:
            for m in self._pattern.finditer(self.text):
                found[m.group(1)] = found.get(m.group(1), 0) + 1
        return dict(sorted(found.items()))

    def lines(self) -> list[str]:
        return self.text.splitlines()

    def excerpt(self, word: str | None = None, before: int = 10, after: int = 30) -> "Code":
        """The lines around the first occurrence of ``word`` (default: the most frequent
        highlighted word): the hot loop, not the whole file."""
        lines = self.lines()
        if word is None:
            counts = self.counts
            word = max(counts, key=counts.get) if counts else None
        at = next((i for i, line in enumerate(lines) if word and re.search(rf"\b{re.escape(word)}\b", line)), 0)
        start = max(0, at - before)
        return Code("\n".join(lines[start:at + after]), self.kind, self.words,
                    f"{self.title} (lines {start + 1}-{min(len(lines), at + after)} of {len(lines)})")

    def _summary(self) -> str:
        counts = ", ".join(f"{w} x{n}" for w, n in self.counts.items())
        return f"{self.title}: {len(self.lines())} lines" + (f"; {counts}" if counts else "")

    def __repr__(self) -> str:
        return f"{self._summary()}\n{self.text}"

    def _repr_html_(self) -> str:
        body = html.escape(self.text)
        if self._pattern is not None:
            body = self._pattern.sub(lambda m: f'<mark style="background:#ffe08a">{m.group(1)}</mark>', body)
        return (f"<div><b>{html.escape(self._summary())}</b><pre style='max-height:32em;overflow:auto;"
                f"font-size:85%'>{body}</pre></div>")


def _html_table(header: list[str], rows: list[list[str]], caption: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


# ----------------------------------------------------------------------------- steps


@dataclass
class Step:
    """One schedule primitive and the TIR after it."""

    index: int
    primitive: str  # "split", "parallel", "tensorize", ...
    code: str  # the primitive as Python, as a trace prints it
    func: tvm.tirx.PrimFunc = field(repr=False)

    @property
    def tir(self) -> Code:
        return Code(self.func.script(), "tir", ("T.parallel", "T.vectorized", "T.unroll", "local"),
                    f"TIR after step {self.index}: {self.primitive}")

    def __repr__(self) -> str:
        return f"step {self.index}: {self.code}"

    def _repr_html_(self) -> str:
        return f"<div><code>{html.escape(repr(self))}</code></div>{self.tir._repr_html_()}"


class Steps(list):
    """The steps of one schedule; shows as a numbered list of primitives."""

    def __repr__(self) -> str:
        return "\n".join(repr(s) for s in self)

    def _repr_html_(self) -> str:
        items = "".join(f"<li value='{s.index}'><code>{html.escape(s.code)}</code></li>" for s in self)
        return f"<ol>{items}</ol>"


_BOOKKEEPING = {"GetSBlock", "GetLoops", "GetChildBlocks", "GetProducers", "GetConsumers", "SampleCategorical",
                "EnterPostproc"}


def replay_steps(func: tvm.tirx.PrimFunc, trace) -> Steps:
    """``trace`` replayed on ``func`` one primitive at a time. Look-ups (get_sblock,
    get_loops, samples) change nothing and are folded into the step that uses them."""
    insts = list(trace.insts)
    decisions = dict(trace.decisions)
    steps = Steps()
    shown = 0
    for i, inst in enumerate(insts):
        if inst.kind.name in _BOOKKEEPING:
            continue
        prefix = s_tir.Trace(insts[:i + 1], {k: v for k, v in decisions.items() if k in insts[:i + 1]})
        sch = s_tir.Schedule(func)
        prefix.apply_to_schedule(sch, remove_postproc=False)
        python = prefix.as_python()
        code = python[-1] if python else inst.kind.name
        shown += 1
        steps.append(Step(shown, _snake(inst.kind.name), code.strip(), sch.mod["main"]))
    return steps


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    schedule: str
    hot_us: float | None  # median, same weights every call (cache-resident when they fit)
    cold_us: float | None  # median, weights rotated over > 4x L3 of copies (streamed from DRAM)
    weight_bytes: int
    bytes_moved: int  # weights + activations + outputs, as the roofline counts them
    max_rel_err: float  # against numpy on the same (dequantized) weights
    copies: int = 0  # weight copies the cold timing rotated through

    @property
    def cold_gbps(self) -> float | None:
        return self.bytes_moved / (self.cold_us * 1e-6) / 1e9 if self.cold_us else None

    def row(self) -> list[str]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        return [self.schedule, f(self.hot_us, ".1f"), f(self.cold_us, ".1f"), f(self.cold_gbps, ".2f"),
                f"{self.max_rel_err:.1e}"]

    HEADER = ["schedule", "hot us", "cold us", "cold GB/s", "max rel err"]

    def __repr__(self) -> str:
        return _text_table(self.HEADER, [self.row()])

    def _repr_html_(self) -> str:
        return _html_table(self.HEADER, [self.row()])


def _median_us(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


# ----------------------------------------------------------------------------- the kernel


class Kernel:
    """One packed-weight matmul kernel (format, K x N, target, activations) and its schedules."""

    def __init__(self, fmt: str = "int4-g128", k: int = 4096, n: int = 4096, target: str = "host",
                 activations: str = "fp32", seed: int = 0):
        from schedules import facts

        self.fmt = get_format(fmt)
        self.k, self.n, self.activations = int(k), int(n), activations
        self.target_text = target if isinstance(target, str) else str(target)
        self.target = parse_target(target) if isinstance(target, str) else target
        target_facts = facts(self.target)
        self.nb = target_facts.col_block
        if activations == "int8":
            if not ops.supports_int8_activations(self.fmt, self.k):
                raise QtvmError(f"{self.fmt.name} at K = {self.k} has no int8-activation kernel",
                                "use activations='fp32', or a 2/3/4-bit uniform or e0m4 format")
            self.compute_func = ops.qmatmul_a8_func(self.fmt, self.k, self.n, self.nb)
        elif activations == "fp32":
            self.compute_func = ops.qmatmul_func(self.fmt, self.k, self.n, self.nb,
                                                 **target_facts.gemv_options(self.fmt, self.k))
        else:
            raise QtvmError(f"activations must be 'fp32' or 'int8', got {activations!r}")
        self._rng = np.random.default_rng(seed)
        self._schedules: dict[str, tuple[tvm.tirx.PrimFunc | None, object, str]] = {}
        self._built: dict[str, object] = {}
        self._data = None
        self.tune_report = None

    def __repr__(self) -> str:
        return (f"Kernel({self.fmt.name}, K={self.k}, N={self.n}, {self.activations} activations, "
                f"target {self.target_text})")

    # -- what the kernel is

    @property
    def compute(self) -> Code:
        """The TE compute as TIR: what every schedule starts from."""
        return Code(self.compute_func.script(), "tir", ("T.block", "T.sblock"), f"compute of {self!r}")

    # -- schedules

    def schedule(self, name: str = "analytic") -> tvm.tirx.PrimFunc:
        """The kernel under schedule ``name`` (see ``SCHEDULES``); a one-line error when it
        does not exist for this kernel, saying why."""
        func, _, why = self._schedule(name)
        if func is None:
            raise QtvmError(f"no '{name}' schedule for {self!r}: {why}")
        return func

    def available(self) -> dict[str, str]:
        """Each schedule name -> "" if it exists, else why not."""
        return {name: self._schedule(name)[2] for name in SCHEDULES}

    def _schedule(self, name: str):
        if name not in SCHEDULES:
            raise QtvmError(f"unknown schedule '{name}'", f"use one of {', '.join(SCHEDULES)}")
        if name not in self._schedules:
            self._schedules[name] = getattr(self, f"_make_{name.replace('-', '_')}")()
        return self._schedules[name]

    def _make_analytic(self):
        from schedules import family

        for rule in family(self.target).rules():
            sch = rule(self.compute_func, self.target)
            if sch is not None:
                return sch.mod["main"], sch.trace, ""
        return None, None, f"qtvm has no rule for target kind '{self.target.kind.name}' yet"

    def _make_tvm_default(self):
        if self.target.kind.name != "llvm":
            return None, None, "a GPU kernel needs a schedule (threads bound); see 'dlight'"
        return self.compute_func, None, ""

    def _make_dlight(self):
        from tvm.s_tir import dlight

        from schedules.tune import specialize_rows

        if self.target.kind.name == "llvm":
            return None, None, "dlight schedules GPU targets"
        func = specialize_rows(self.compute_func, 1)
        for name in _DLIGHT_GPU:
            try:
                sch = getattr(dlight.gpu, name)().apply(func, self.target, False)
            except Exception:  # noqa: BLE001 - a rule that fails on this structure does not apply
                sch = None
            if isinstance(sch, list):
                sch = sch[0] if sch else None
            if sch is not None:
                return sch.mod["main"], sch.trace, ""
        return None, None, "no dlight rule applies"

    def _make_tuned(self):
        return None, None, "not tuned yet: call .tune(trials=...)"

    def steps(self, name: str = "analytic") -> Steps:
        """The schedule's primitives replayed one by one; ``steps[i].tir`` is the TIR after
        step i, and ``.time(steps[i])`` times it."""
        func, trace, why = self._schedule(name)
        if trace is None:
            raise QtvmError(f"the '{name}' schedule of {self!r} has no steps: {why or 'it is the compute itself'}")
        from schedules.tune import specialize_rows

        start = specialize_rows(self.compute_func, 1) if name == "dlight" else self.compute_func
        return replay_steps(start, trace)

    # -- source

    def _build(self, name: str, func: tvm.tirx.PrimFunc):
        if name not in self._built:
            from schedules import compile_func

            self._built[name] = compile_func(func, self.target)
        return self._built[name]

    def source(self, name: str = "analytic") -> Code:
        """The generated source of schedule ``name``: asm for CPUs, CUDA C / OpenCL C for
        GPUs (generated here; no GPU needed), with the interesting instructions highlighted."""
        kind = self.target.kind.name
        if kind == "cuda":  # source only: with TVM's CUDA runtime loaded, tvm.compile would run nvcc/NVRTC
            from qtvm.testing.ptxas import cuda_source

            return Code(cuda_source(self.schedule(name), self.target), "cuda", HIGHLIGHT["cuda"],
                        f"{name} cuda source")
        ex = self._build(name, self.schedule(name))
        mod = ex.mod if hasattr(ex, "mod") else ex
        if kind == "llvm":
            return Code(mod.inspect_source("asm"), "asm", HIGHLIGHT["asm"], f"{name} asm for {self.target_text}")
        for sub in mod.imports:
            if sub.kind in ("cuda", "opencl"):
                return Code(sub.inspect_source(), sub.kind, HIGHLIGHT[sub.kind], f"{name} {sub.kind} source")
        raise QtvmError(f"no {kind} source in the built module")

    # -- timing

    def _runs_here(self) -> str:
        """'' when this machine can run the kernel, else why not."""
        from qtvm.hostinfo import host_cpu_flags
        from qtvm.target import cpu_flags_required

        if self.target.kind.name != "llvm":
            return f"this machine has no {self.target.kind.name} device"
        if "mtriple" in self.target.attrs and not str(self.target.attrs["mtriple"]).startswith("x86_64"):
            return f"the target is {self.target.attrs['mtriple']}"
        missing = sorted(set(cpu_flags_required(self.target)) - host_cpu_flags())
        return f"this CPU lacks {', '.join(missing)}" if missing else ""

    def _inputs(self):
        """Weights, activations and the reference output (float64), made once."""
        if self._data is None:
            w = (self._rng.standard_normal((self.k, self.n)) * 0.02).astype(np.float32)
            x = self._rng.standard_normal((1, self.k)).astype(np.float32)
            qt = self.fmt.quantize(w)
            w_hat = qt.dequantize().astype(np.float64)
            if self.activations == "int8":
                from qtvm.bench.prefill import int8_rounded

                arrays = ops.a8_arrays(qt, self.nb)
                acts = [tvm.runtime.tensor(x)]  # the GEMV rounds x itself
                ref = int8_rounded(x, self.fmt.padded_k(self.k)) @ w_hat
            else:
                arrays = ops.blocked_arrays(qt, self.nb)
                acts = [tvm.runtime.tensor(x)]
                ref = x.astype(np.float64) @ w_hat
            self._data = (arrays, acts, ref, qt)
        return self._data

    def time(self, name="analytic", *, cold: bool = True, repeats: int = 30, cold_bytes: int | None = None) -> Timing:
        """Median call time of schedule ``name`` (or of a :class:`Step`'s TIR): cache-hot
        (the same weights every call) and, with ``cold``, DRAM-cold (weights rotated over
        copies totalling > 4x L3, or ``cold_bytes`` in all: a small kernel on a CPU with a
        large L3 would need too many copies). The output is checked against numpy
        first: a wrong schedule shows its error, never only a time."""
        why = self._runs_here()
        if why:
            raise QtvmError(f"cannot time {self!r} here: {why}", "time a target this machine runs (target='host'); "
                                                                 "source and steps need no device")
        if isinstance(name, Step):
            label, func = f"step {name.index}: {name.primitive}", name.func
        else:
            label, func = name, self.schedule(name)
        fn = self._build(label, func)["main"]
        arrays, acts, ref, _ = self._inputs()
        weights = [tvm.runtime.tensor(a) for a in arrays]
        y = tvm.runtime.tensor(np.full((1, self.n), np.nan, np.float32))
        fn(*acts, *weights, y)
        got = y.numpy().astype(np.float64)
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)) if np.isfinite(got).all() else float("inf")
        hot = _median_us(lambda: fn(*acts, *weights, y), repeats)
        weight_bytes = int(sum(a.nbytes for a in arrays))
        moved = weight_bytes + sum(a.numpy().nbytes for a in acts) + 4 * self.n
        cold_us, copies = None, 0
        if cold:
            from qtvm.bench import harness

            try:  # cold_bytes, where given, is the rotation (not a floor under 4x the L3)
                rot = harness.rotating_copies(lambda i: [tvm.runtime.tensor(a) for a in arrays], weight_bytes,
                                              cold_bytes or 0, l3_bytes=None if cold_bytes is None else 0)
            except ValueError as e:
                raise QtvmError(f"cannot time {self!r} DRAM-cold: {e}",
                                "pass cold_bytes= (the bytes to rotate over) or cold=False") from None
            copies = len(rot)
            times = harness.time_rotating(lambda ws: fn(*acts, *ws, y), rot, warmup=2, iters=max(repeats, copies))
            cold_us = harness.median(times) * 1e6
            del rot
        return Timing(label, hot, cold_us, weight_bytes, moved, err, copies)

    def time_steps(self, name: str = "analytic", *, cold: bool = False, repeats: int = 20) -> "StepTimings":
        """Every step of schedule ``name`` timed (the compute first): what each primitive bought."""
        rows = [self.time("tvm-default", cold=cold, repeats=repeats)] if self.target.kind.name == "llvm" else []
        if rows:
            rows[0].schedule = "step 0: compute (no schedule)"
        for step in self.steps(name):
            try:
                rows.append(self.time(step, cold=cold, repeats=repeats))
            except Exception as e:  # noqa: BLE001 - an intermediate state TVM cannot build: say so
                last = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
                rows.append(Timing(f"step {step.index}: {step.primitive} (does not build: {last})", None, None, 0, 0,
                                   float("nan")))
        return StepTimings(rows)

    # -- tuning

    def tune(self, trials: int = 8, work_dir: str | Path | None = None, seed: int = 0):
        """MetaSchedule over the analytic schedule's knobs (``schedules.tune``); adds the
        ``tuned`` schedule (the best measured, whether or not it beats analytic) and keeps
        the report, whose ``history`` is the convergence curve."""
        import tempfile

        from schedules import tune as tuning

        analytic, _, why = self._schedule("analytic")
        if analytic is None or str(self.compute_func.attrs[ops.KERNEL_ATTR]) not in tuning.TUNABLE_KINDS:
            raise QtvmError(f"{self!r} has no tuning space", "tuning covers fp32-activation qmatmul kernels on llvm")
        work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="qtvm-explore-tune-"))
        name = f"qmatmul_{self.fmt.name.replace('-', '_')}_{self.k}x{self.n}"
        mod = tvm.IRModule({name: analytic.with_attr("global_symbol", name)})
        report = tuning.tune_kernels(mod, self.target, work_dir, trials, progress=False, seed=seed)
        row = report.kernels[0]
        if row.tuned_knobs:
            space = tuning.KnobSpace.of(self.compute_func, self.target)
            sch = space.schedule(self.compute_func, row.tuned_knobs)
            self._schedules["tuned"] = (sch.mod["main"], sch.trace, "")
        else:
            self._schedules["tuned"] = (None, None, "tuning measured no schedule")
        self._built.pop("tuned", None)
        self.tune_report = report
        return report

    def convergence(self) -> "Convergence":
        if self.tune_report is None:
            raise QtvmError("no tuning run yet", "call .tune(trials=...) first")
        return Convergence(self.tune_report)

    # -- comparing

    def compare(self, names=SCHEDULES, *, cold: bool = True, repeats: int = 30) -> "Comparison":
        """Each schedule that exists: its times (when this machine runs the target), its
        error against numpy, and its highlighted-instruction counts."""
        rows = []
        runs = not self._runs_here()
        for name in names:
            func, _, why = self._schedule(name)
            if func is None:
                rows.append((name, None, {}, why))
                continue
            timing = self.time(name, cold=cold, repeats=repeats) if runs else None
            rows.append((name, timing, self.source(name).counts, ""))
        return Comparison(self, rows)

    def roofline(self, timings: list[Timing] | None = None, bandwidth_gbps: float | None = None,
                 threads: int | None = None) -> "Roofline":
        """Timings against the roofline: memory roof = measured DRAM read bandwidth (measured
        now unless given) x the kernel's arithmetic intensity (2 K N flops over the bytes it
        streams: the format's stored bytes + activations + output)."""
        from qtvm.hostinfo import physical_cores

        threads = threads or physical_cores()
        if bandwidth_gbps is None:
            from qtvm.bench.bandwidth import BandwidthProbe

            probe = BandwidthProbe()  # its default buffer, as qtvm bench's: 2x the L3, at least 512 MiB
            bandwidth_gbps = probe.measure(threads, repeats=3)
            del probe
        timings = timings if timings is not None else [self.time("analytic")]
        return Roofline(self, list(timings), bandwidth_gbps, threads, self._peak_gflops(threads))

    def _peak_gflops(self, threads: int) -> float | None:
        from schedules.target_facts import cpu_facts

        try:
            f = cpu_facts(self.target)
        except ValueError:
            return None
        return 2.0 * f.f32_lanes * f.fma_ports * f.freq_ghz * threads


def kernel(fmt: str = "int4-g128", k: int = 4096, n: int = 4096, target: str = "host",
           activations: str = "fp32", seed: int = 0) -> Kernel:
    """A :class:`Kernel` to explore."""
    return Kernel(fmt, k, n, target, activations, seed)


# ----------------------------------------------------------------------------- results


class StepTimings(list):
    """Timings after each step: a table, and ``plot()`` (bar chart of hot/cold times)."""

    def __repr__(self) -> str:
        return _text_table(Timing.HEADER, [t.row() for t in self])

    def _repr_html_(self) -> str:
        return _html_table(Timing.HEADER, [t.row() for t in self])

    def plot(self, ax=None):
        import matplotlib.pyplot as plt

        rows = [t for t in self if t.hot_us is not None]
        ax = ax or plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))[1]
        labels = [t.schedule for t in rows]
        y = np.arange(len(rows))
        ax.barh(y - 0.2, [t.hot_us for t in rows], 0.4, label="cache-hot")
        if any(t.cold_us for t in rows):
            ax.barh(y + 0.2, [t.cold_us or 0 for t in rows], 0.4, label="DRAM-cold")
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("median time per call (us, log scale)")
        ax.legend()
        ax.figure.tight_layout()
        return ax


class Comparison:
    """Schedules side by side: one table (``repr`` / HTML) and one chart (``plot``)."""

    HEADER = ["schedule", "hot us", "cold us", "cold GB/s", "max rel err", "instructions"]

    def __init__(self, kernel: Kernel, rows):
        self.kernel, self.rows = kernel, rows

    def timings(self) -> list[Timing]:
        return [t for _, t, _, _ in self.rows if t is not None]

    def _table(self) -> list[list[str]]:
        out = []
        for name, timing, counts, why in self.rows:
            if why:
                out.append([name, "-", "-", "-", "-", f"n/a: {why}"])
                continue
            cells = timing.row() if timing is not None else [name, "-", "-", "-", "-"]
            out.append(cells + [", ".join(f"{w} x{n}" for w, n in counts.items()) or "-"])
        return out

    def __repr__(self) -> str:
        return f"{self.kernel!r}\n" + _text_table(self.HEADER, self._table())

    def _repr_html_(self) -> str:
        return _html_table(self.HEADER, self._table(), repr(self.kernel))

    def plot(self, ax=None):
        import matplotlib.pyplot as plt

        rows = [(n, t) for n, t, _, _ in self.rows if t is not None]
        ax = ax or plt.subplots(figsize=(7, 3))[1]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [t.hot_us for _, t in rows], 0.4, label="cache-hot")
        ax.bar(x + 0.2, [t.cold_us or 0 for _, t in rows], 0.4, label="DRAM-cold")
        ax.set_xticks(x, [n for n, _ in rows])
        ax.set_yscale("log")
        ax.set_ylabel("median us per call (log)")
        ax.set_title(repr(self.kernel), fontsize=9)
        ax.legend()
        ax.figure.tight_layout()
        return ax


class Roofline:
    """Measured GFLOP/s against min(peak, bandwidth x intensity)."""

    def __init__(self, kernel: Kernel, timings: list[Timing], bandwidth_gbps: float, threads: int,
                 peak_gflops: float | None):
        self.kernel, self.timings, self.bandwidth_gbps = kernel, timings, bandwidth_gbps
        self.threads, self.peak_gflops = threads, peak_gflops
        self.flops = 2.0 * kernel.k * kernel.n

    def intensity(self, t: Timing) -> float:
        return self.flops / t.bytes_moved

    def _rows(self) -> list[list[str]]:
        rows = []
        for t in self.timings:
            roof_us = t.bytes_moved / (self.bandwidth_gbps * 1e9) * 1e6
            for what, us in (("cold", t.cold_us), ("hot", t.hot_us)):
                if us:
                    rows.append([t.schedule, what, f"{us:.1f}", f"{t.bytes_moved / us / 1e3:.2f}",
                                 f"{100 * roof_us / us:.0f}%"])
        return rows

    HEADER = ["schedule", "timing", "us", "GB/s", "of bandwidth roof"]

    def _caption(self) -> str:
        t = self.timings[0]
        return (f"{self.kernel!r}: {t.bytes_moved / 1e6:.2f} MB per call ({8 * t.weight_bytes / (self.kernel.k * self.kernel.n):.3f} "
                f"bits/weight stored), intensity {self.intensity(t):.2f} flop/byte; measured read bandwidth "
                f"{self.bandwidth_gbps:.1f} GB/s with {self.threads} thread(s)")

    def __repr__(self) -> str:
        return self._caption() + "\n" + _text_table(self.HEADER, self._rows())

    def _repr_html_(self) -> str:
        return _html_table(self.HEADER, self._rows(), self._caption())

    def plot(self, ax=None):
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(6, 4))[1]
        ai = np.logspace(-1, 2, 200)
        roof = ai * self.bandwidth_gbps
        if self.peak_gflops:
            roof = np.minimum(roof, self.peak_gflops)
            ax.axhline(self.peak_gflops, color="grey", lw=0.8, ls=":")
        ax.loglog(ai, roof, color="black", lw=1.2, label=f"roof: {self.bandwidth_gbps:.0f} GB/s measured")
        for i, t in enumerate(self.timings):
            color = f"C{i}"
            for us, marker, what in ((t.cold_us, "o", "cold"), (t.hot_us, "^", "hot")):
                if us:
                    ax.plot(self.intensity(t), self.flops / (us * 1e-6) / 1e9, marker, color=color,
                            mfc=color if what == "cold" else "none", label=f"{t.schedule} ({what})")
        ax.set_xlabel("arithmetic intensity (flop / byte streamed)")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{self.kernel.fmt.name} GEMV {self.kernel.k} x {self.kernel.n}", fontsize=9)
        ax.legend(fontsize=7)
        ax.figure.tight_layout()
        return ax


class Convergence:
    """Best latency after each measured batch of a tuning run, against the analytic schedule."""

    def __init__(self, report):
        self.report = report
        self.points = [(done, min(best.values())) for done, best in report.history if best]

    def __repr__(self) -> str:
        k = self.report.kernels[0]
        head = (f"{self.report.measured} tuned schedules measured; analytic "
                f"{k.analytic_s * 1e6:.1f} us, best tuned {k.tuned_s * 1e6:.1f} us -> {k.use} is used"
                if k.analytic_s and k.tuned_s else f"{self.report.measured} tuned schedules measured")
        if not self.points:
            return head
        first, last = self.points[0], self.points[-1]
        return (f"{head}\nbest after the first batch ({first[0]} trials): {first[1] * 1e6:.1f} us; after all "
                f"{last[0]}: {last[1] * 1e6:.1f} us ({len(self.points)} batches; see .plot())")

    def plot(self, ax=None):
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(6, 3.2))[1]
        if self.points:
            ax.step([d for d, _ in self.points], [s * 1e6 for _, s in self.points], where="post", marker="o",
                    label="best tuned so far")
        k = self.report.kernels[0]
        if k.analytic_s:
            ax.axhline(k.analytic_s * 1e6, color="black", ls="--", lw=1, label="analytic schedule")
        ax.set_xlabel("trials measured")
        ax.set_ylabel("latency at M = 1 (us, cache-hot)")
        ax.legend()
        ax.figure.tight_layout()
        return ax
