"""A MetaSchedule runner that times weight-streaming kernels with their weights cold,
and the record of the machine a tuning database was measured on.

MetaSchedule's ``LocalRunner`` calls a kernel with the same arguments every time, so
a GEMV's weights sit in the last-level cache and its latency says how fast it
computes, not how well it streams from DRAM: it cannot find the prefetch distance or
the column split a memory-bound kernel needs.  :class:`ColdRunner` builds enough
copies of a kernel's arguments that together they exceed 4x the L3 (and
``min_total_bytes``; at most ``MAX_COPIES``), and calls the kernel on them in turn, so
every timed call reads its weights from DRAM (as ``qtvm.bench.harness.time_rotating``
does for the benchmarks).  Each result is the median per-call time of a round over the copies;
``rounds`` rounds give a candidate's ``run_secs``.

Kernels run in this process, on TVM's thread pool (every core, or
``TVM_NUM_THREADS``), like the compiled model.  The candidates come from qtvm's own
verified design spaces (``schedules.tune``, ``schedules.tune_a8``), built by the
in-process builder, so a separate worker process buys no safety here.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from qtvm.bench.harness import rotation_count
from qtvm.errors import QtvmError

MIN_TOTAL_BYTES = 256 << 20
#: At most this many copies: a kernel under 4x the L3 / MAX_COPIES (940 KB on a 480 MiB L3) rotates over
#: fewer bytes than the L3 and is timed partly cache-resident. Making and touching 100k copies of a tiny
#: kernel for a 480 MiB L3 took 5 minutes a candidate; what such a kernel streams is not what tuning weighs.
MAX_COPIES = 2048
MACHINE_FILE = "qtvm_machine.json"
RUNNER_NAME = "cold-weights"


def _l3_bytes() -> int:
    from qtvm.bench.bandwidth import l3_cache_bytes

    return l3_cache_bytes()


def _random_tensor(info, rng: np.random.Generator):
    shape, dtype = [int(d) for d in info.shape], str(info.dtype)
    if dtype.startswith("float"):
        data = rng.standard_normal(shape).astype(dtype)
    elif dtype.startswith(("int", "uint")):
        data = rng.integers(-100, 100, shape).astype(dtype) if dtype.startswith("int") else \
            rng.integers(0, 200, shape).astype(dtype)
    else:
        data = np.zeros(shape, dtype)
    return tvm.runtime.tensor(data)


@derived_object
class _Done(ms.runner.PyRunnerFuture):
    def __init__(self, result) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self):
        return self._result


@derived_object
class ColdRunner(ms.runner.PyRunner):
    """Times each candidate over rotated copies of its arguments (weights cold)."""

    def __init__(self, rounds: int = 5, calls_per_round: int = 64, min_total_bytes: int = MIN_TOTAL_BYTES,
                 l3_bytes: int | None = None) -> None:
        self.rounds, self.calls_per_round = int(rounds), int(calls_per_round)
        self.min_total_bytes = int(min_total_bytes)
        self.l3 = _l3_bytes() if l3_bytes is None else int(l3_bytes)
        self._copies: dict[str, list] = {}  # argument signature -> copies (kept across candidates)

    def _copies_for(self, args_info) -> list:
        key = json.dumps([[str(a.dtype), [int(d) for d in a.shape]] for a in args_info])
        if key not in self._copies:
            self._copies.clear()  # one workload's copies at a time
            per_copy = sum(int(np.prod([int(d) for d in a.shape])) * tvm.DataType(str(a.dtype)).bits // 8
                           for a in args_info)
            n = min(MAX_COPIES, rotation_count(max(per_copy, 1), self.min_total_bytes, l3_bytes=self.l3))
            from qtvm.hugepages import NewMemoryOnHugePages

            rng = np.random.default_rng(0)
            with NewMemoryOnHugePages():  # on the pages a loaded artefact's weights get (qtvm.runtime)
                first = [_random_tensor(a, rng) for a in args_info]
                self._copies[key] = [first] + [[tvm.runtime.tensor(t.numpy()) for t in first] for _ in range(n - 1)]
        return self._copies[key]

    def time_function(self, func, args_info) -> list[float]:
        """``rounds`` medians of per-call seconds, each round continuing the rotation."""
        copies = self._copies_for(args_info)
        for args in copies:  # touch every copy once (page faults, lazy init) before timing
            func(*args)
        clock, i, out = time.perf_counter_ns, 0, []
        per_round = max(self.calls_per_round, 1)
        for _ in range(self.rounds):
            times = []
            for _ in range(per_round):
                args = copies[i % len(copies)]
                i += 1
                t0 = clock()
                func(*args)
                times.append((clock() - t0) * 1e-9)
            out.append(statistics.median(times))
        return out

    def run(self, runner_inputs):
        results = []
        for item in runner_inputs:
            try:
                lib = tvm.runtime.load_module(item.artifact_path)
                func = lib[lib.entry_name] if hasattr(lib, "entry_name") and lib.entry_name else lib["main"]
                secs = self.time_function(func, item.args_info)
                results.append(_Done(ms.runner.RunnerResult(secs, None)))
            except Exception as e:  # noqa: BLE001 - a failed candidate is a result
                results.append(_Done(ms.runner.RunnerResult(None, f"{type(e).__name__}: {e}"[:2000])))
        return results


# ------------------------------------------------------------------ machine record


def machine() -> dict:
    """The CPU a measurement belongs to (model name, ISA flags, L3, cores) and the runner."""
    from qtvm.bench.harness import cpu_model
    from qtvm.hostinfo import host_cpu_flags

    flags = host_cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "cpu_id": _cpu_id(),
        "isa": sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))),
        "l3_bytes": _l3_bytes(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": os.environ.get("TVM_NUM_THREADS", ""),
        "runner": RUNNER_NAME,
        "machine": platform.machine(),
    }


def _cpu_id() -> str:
    """The CPU's vendor, family, model and stepping, and LLVM's name for it."""
    from qtvm.hostinfo import cpu_identity

    try:
        from schedules.target_facts import host_llvm_cpu

        llvm = host_llvm_cpu()
    except Exception:  # noqa: BLE001
        llvm = "?"
    return f"{cpu_identity()} (llvm: {llvm})"


def _same_machine(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("cpu_model", "cpu_id", "isa", "l3_bytes", "runner"))


def record_machine(db_dir: Path) -> dict:
    """Write (or check) the database's machine record before tuning into it: one database
    holds the measurements of one CPU and runner; another CPU's records are refused."""
    path = Path(db_dir) / MACHINE_FILE
    here = machine()
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            raise QtvmError(f"tuning database '{db_dir}' has an unreadable {MACHINE_FILE}",
                            "delete it or choose another --db directory") from None
        if not _same_machine(old, here):
            raise QtvmError(f"tuning database '{db_dir}' was measured on '{old.get('cpu_model')}' "
                            f"[{old.get('cpu_id')}] ({old.get('runner')}), this machine is "
                            f"'{here['cpu_model']}' [{here['cpu_id']}]",
                            "tune into another --db directory: timings of two CPUs do not compare")
        return old
    here["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(here, indent=2) + "\n")
    os.replace(tmp, path)
    return here


def read_machine(db_dir: Path) -> dict | None:
    try:
        return json.loads((Path(db_dir) / MACHINE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def machine_note(db_dir: Path) -> str | None:
    """One line for the compile notes: where the database was measured (and whether here)."""
    rec = read_machine(db_dir)
    if rec is None:
        return None
    where = f"tuning database measured on '{rec.get('cpu_model')}' [{rec.get('cpu_id')}] ({rec.get('runner')} runner)"
    if not _same_machine(rec, machine()):
        return f"warning: {where}; this machine is '{machine()['cpu_model']}': its schedules may not suit it"
    return where
