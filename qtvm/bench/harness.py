"""DRAM-honest timing of GEMV kernels, and reporting.

Why rotation
------------
A GEMV reads every weight once per call. Timed in a loop over the *same*
weights (``time_evaluator``, MetaSchedule's runner, ``timeit`` on one
tensor), the weights stay in the last-level cache after the first call and the
kernel looks faster than it can ever be in a model, where each layer's weights
come from DRAM. :func:`rotating_copies` makes enough independent copies of a
kernel's weights that together they exceed 4x L3 (and 600 MB by default);
:func:`time_rotating` calls the kernel on the copies in turn, so by the time a
copy comes round again it has been evicted and every timed call reads DRAM.

Threads
-------
* torch: :func:`threads` sets ``torch.set_num_threads`` for a block.
* onnxruntime: per session (``intra_op_num_threads``) or a global pool; see
  :mod:`qtvm.bench.peers`.
* TVM: the runtime's thread pool size is read from the ``TVM_NUM_THREADS``
  environment variable (falling back to ``OMP_NUM_THREADS``, then the number
  of cores) **once, when the TVM runtime's thread pool starts**. Changing the
  variable afterwards has no effect, so a benchmark that compares thread
  counts must run each thread count in a fresh process:
  :func:`run_in_subprocess` with ``env=thread_env(n)`` does this (and is
  harmless for torch and onnxruntime too, whose OpenMP/MLAS pools also read
  their environment at start-up).

Reporting
---------
:class:`BenchResult` is one row (kernel, shape (N, K), format, threads,
median microseconds, weight bytes, GB/s of weight bytes, % of the measured
read bandwidth at that thread count). :func:`print_table` prints the rows
aligned, with a ratio against a chosen baseline row; :func:`write_json`
writes them atomically with machine metadata (:func:`machine_meta`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from qtvm.atomic import atomic_file
from qtvm.bench.bandwidth import l3_cache_bytes

from qtvm.hostinfo import cpu_identity, host_cpu_flags

__all__ = [
    "DEFAULT_MIN_TOTAL_BYTES",
    "BenchResult",
    "rotation_count",
    "rotating_copies",
    "time_rotating",
    "median",
    "threads",
    "thread_env",
    "run_in_subprocess",
    "machine_meta",
    "cpu_model",
    "cpu_named",
    "cpu_busy_fraction",
    "wait_for_quiet",
    "format_table",
    "print_table",
    "write_json",
]

DEFAULT_MIN_TOTAL_BYTES = 600 * 1000 * 1000
"""Default floor for the total bytes of rotated copies (600 MB)."""

L3_MULTIPLE = 4
"""Rotated copies together exceed this many times the L3 size."""


# --------------------------------------------------------------------------
# rotation and timing
# --------------------------------------------------------------------------


def rotation_count(
    bytes_per_copy: int,
    min_total_bytes: int | None = None,
    *,
    l3_bytes: int | None = None,
) -> int:
    """How many copies of ``bytes_per_copy`` make the total exceed 4x L3.

    The total also reaches ``min_total_bytes`` (600 MB when None). At least
    two copies are always used.
    """
    if bytes_per_copy <= 0:
        raise ValueError("bytes_per_copy must be positive")
    l3 = l3_cache_bytes() if l3_bytes is None else int(l3_bytes)
    floor = DEFAULT_MIN_TOTAL_BYTES if min_total_bytes is None else int(min_total_bytes)
    # strictly more than 4x L3, and at least `floor`
    need_for_l3 = L3_MULTIPLE * l3 // bytes_per_copy + 1
    need_for_floor = -(-floor // bytes_per_copy)
    return max(2, need_for_l3, need_for_floor)


def rotating_copies(
    make_copy: Callable[[int], object],
    bytes_per_copy: int,
    min_total_bytes: int | None = None,
    *,
    l3_bytes: int | None = None,
    max_copies: int = 100_000,
) -> list:
    """Build enough independent copies that each timed call reads DRAM.

    ``make_copy(i)`` must return an object holding its *own* weight memory
    (``bytes_per_copy`` bytes that the kernel streams per call). The total
    exceeds 4x L3 and is at least ``min_total_bytes`` (default 600 MB).
    """
    n = rotation_count(bytes_per_copy, min_total_bytes, l3_bytes=l3_bytes)
    if n > max_copies:
        raise ValueError(
            f"{n} copies of {bytes_per_copy} B needed to exceed the cache; "
            f"above max_copies={max_copies} (kernel too small to time from DRAM this way)"
        )
    return [make_copy(i) for i in range(n)]


#: Seconds to idle before a runtime's turn: the previous runtime's pool workers keep spinning
#: after its last call (measured on the Zen 4 VM: TVM ~50 ms of CPU, onnxruntime ~20 ms, torch
#: ~4 ms), and on a 2-core machine they take a core from the next kernel's threads (a 4096^2
#: int4 GEMV at 2 threads right after MatMulNBits: median +11%, p90 3.99 ms against 0.41).
POOL_WIND_DOWN_S = 0.1


def time_rotating(
    call: Callable[[object], None],
    copies: Sequence[object],
    *,
    warmup: int,
    iters: int,
    touch_all: bool = True,
) -> list[float]:
    """Per-call wall times (seconds) of ``call(copy)``, cycling through copies.

    ``warmup`` untimed calls come first (continuing the same rotation). With
    ``touch_all`` (default) the warm-up is extended so every copy has been
    called at least once before timing (first calls often allocate: ORT
    sessions, lazily packed weights). Report the median
    (:func:`median`) -- the mean is pulled by interrupts.
    """
    if not copies:
        raise ValueError("no copies to time")
    if iters < 1:
        raise ValueError("iters must be >= 1")
    n = len(copies)
    n_warm = max(int(warmup), n if touch_all else 0)
    i = 0
    for _ in range(n_warm):
        call(copies[i % n])
        i += 1
    clock = time.perf_counter_ns
    out: list[float] = []
    for _ in range(iters):
        c = copies[i % n]
        t0 = clock()
        call(c)
        t1 = clock()
        out.append((t1 - t0) * 1e-9)
        i += 1
    return out


def turn_order(n_peers: int, round_index: int) -> list[int]:
    """The peers' order in round ``round_index``: rotated by one each round, so each peer runs
    first after the round's bandwidth probe as often as the others. On the Intel Xeon VM the
    same kernel read 8.9 GB/s right after a probe and 12.1 GB/s after its own previous turn
    (int4-g128 int8 GEMV, medians of 8 alternations), and a later run reversed the sign: a
    fixed order charged that to whichever peer came first (qtvm's kernels, always)."""
    start = round_index % n_peers if n_peers else 0
    return [*range(start, n_peers), *range(start)]


def median(times: Iterable[float]) -> float:
    return statistics.median(list(times))


# --------------------------------------------------------------------------
# result records
# --------------------------------------------------------------------------


@dataclasses.dataclass
class BenchResult:
    """One benchmark row.

    ``shape`` is (N, K): N output features, K reduction length.
    ``weight_bytes`` are the bytes the kernel must stream per call (packed
    weights + scales/zeros), ``gbps`` = weight_bytes / median time / 1e9, and
    ``pct_of_bandwidth`` = 100 * gbps / (measured read bandwidth at the same
    thread count) when that bandwidth is known.
    """

    kernel: str
    shape: tuple[int, int]
    fmt: str
    threads: int
    median_us: float
    weight_bytes: int
    gbps: float
    pct_of_bandwidth: float | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_times(
        cls,
        kernel: str,
        shape: tuple[int, int],
        fmt: str,
        threads: int,
        times_s: Sequence[float],
        weight_bytes: int,
        bandwidth_gbps: float | None = None,
        **extras: Any,
    ) -> "BenchResult":
        med = median(times_s)
        gbps = weight_bytes / med / 1e9 if med > 0 else math.inf
        pct = 100.0 * gbps / bandwidth_gbps if bandwidth_gbps else None
        ex = dict(extras)
        ex.setdefault("n_samples", len(times_s))
        ex.setdefault("min_us", min(times_s) * 1e6)
        ex.setdefault("p90_us", _quantile(times_s, 0.9) * 1e6)
        return cls(kernel, (int(shape[0]), int(shape[1])), fmt, int(threads), med * 1e6,
                   int(weight_bytes), gbps, pct, ex)

    def with_bandwidth(self, bandwidth_gbps: float | None) -> "BenchResult":
        pct = 100.0 * self.gbps / bandwidth_gbps if bandwidth_gbps else self.pct_of_bandwidth
        return dataclasses.replace(self, pct_of_bandwidth=pct)

    def to_dict(self) -> dict[str, Any]:
        """``shape`` is (N, K); ``k`` and ``n`` say so in the JSON (a table of it once read the
        shape as K x N and swapped the two non-square rows)."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["n"], d["k"] = self.shape
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BenchResult":
        d = dict(d)
        for derived in ("n", "k"):  # written by to_dict from the shape
            d.pop(derived, None)
        d["shape"] = tuple(d["shape"])
        d.setdefault("extras", {})
        return cls(**d)


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# --------------------------------------------------------------------------
# tables and JSON
# --------------------------------------------------------------------------


def _baseline_for(
    row: BenchResult, results: Sequence[BenchResult], baseline: str | Callable[[BenchResult], bool] | None
) -> BenchResult | None:
    if baseline is None:
        return None
    pred = baseline if callable(baseline) else (lambda r: r.kernel == baseline or r.fmt == baseline)
    for r in results:
        if pred(r) and r.shape == row.shape and r.threads == row.threads:
            return r
    return None


def format_table(
    results: Sequence[BenchResult],
    bandwidth_by_threads: Mapping[int, float] | None = None,
    *,
    baseline: str | Callable[[BenchResult], bool] | None = None,
    extras: Sequence[str] = (),
) -> str:
    """Aligned text table of results.

    Columns: kernel, format, K, N, threads, median us, GB/s of weight bytes,
    % of the measured read bandwidth at that thread count (from
    ``bandwidth_by_threads``, else the row's own figure), and -- when
    ``baseline`` names a kernel or format (or is a predicate) -- the speedup
    ``baseline_us / row_us`` against the baseline row with the same shape and
    thread count ("1.00x" on the baseline itself, ">1" = faster). ``extras``
    names keys of ``BenchResult.extras`` to show as further columns.
    """
    bw = {int(k): float(v) for k, v in (bandwidth_by_threads or {}).items()}
    headers = ["kernel", "format", "K", "N", "thr", "median_us", "GB/s", "%BW"]
    if baseline is not None:
        headers.append("vs_base")
    headers += list(extras)
    rows: list[list[str]] = []
    for r in results:
        pct = 100.0 * r.gbps / bw[r.threads] if r.threads in bw and bw[r.threads] > 0 else r.pct_of_bandwidth
        cells = [
            r.kernel,
            r.fmt,
            str(r.shape[1]),  # shape is (N, K); shown K first, as shapes are given (KxN)
            str(r.shape[0]),
            str(r.threads),
            f"{r.median_us:.1f}",
            f"{r.gbps:.2f}",
            "-" if pct is None else f"{pct:.1f}",
        ]
        if baseline is not None:
            b = _baseline_for(r, results, baseline)
            cells.append("-" if b is None or r.median_us <= 0 else f"{b.median_us / r.median_us:.2f}x")
        for key in extras:
            v = r.extras.get(key)
            cells.append("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v))
        rows.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    left = {0, 1}  # text columns left-aligned, numbers right-aligned

    def fmt_line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [fmt_line(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt_line(row) for row in rows]
    if bw:
        lines.append(
            "read bandwidth: "
            + ", ".join(f"{t} thr {v:.1f} GB/s" for t, v in sorted(bw.items()))
        )
    return "\n".join(lines)


def print_table(
    results: Sequence[BenchResult],
    bandwidth_by_threads: Mapping[int, float] | None = None,
    *,
    baseline: str | Callable[[BenchResult], bool] | None = None,
    extras: Sequence[str] = (),
    file: TextIO | None = None,
) -> str:
    """Print :func:`format_table` (to stdout by default) and return the text."""
    text = format_table(results, bandwidth_by_threads, baseline=baseline, extras=extras)
    print(text, file=file if file is not None else sys.stdout)
    return text


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_named() -> str:
    """The model name and the family/model numbers, for a benchmark's header line."""
    return f"{cpu_model()} ({cpu_identity()})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Fraction of all CPU time that was busy over ``interval`` seconds.

    Taken from /proc/stat: run it before a benchmark to notice other
    processes competing for the cores (whose work would be charged to the
    kernels being timed). Returns NaN when /proc/stat cannot be read.
    """

    def snap() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals[:8]), idle

    a = snap()
    time.sleep(interval)
    b = snap()
    if a is None or b is None or b[0] == a[0]:
        return math.nan
    total = b[0] - a[0]
    return 1.0 - (b[1] - a[1]) / total


def wait_for_quiet(
    max_wait_s: float, threshold: float = 0.15, interval: float = 0.3
) -> tuple[float, float]:
    """Block (while this process is idle) until the CPUs are idle.

    Samples :func:`cpu_busy_fraction` over ``interval`` until it is at most
    ``threshold`` or ``max_wait_s`` has passed. Other processes on the
    machine (a test suite, a compile) steal cores from the kernel being timed,
    and with 2 threads a descheduled worker stalls the whole parallel region,
    so benchmark rounds should start on a quiet machine. Returns
    ``(last busy fraction, seconds waited)``.
    """
    t0 = time.monotonic()
    busy = cpu_busy_fraction(interval)
    while (math.isnan(busy) or busy > threshold) and time.monotonic() - t0 < max_wait_s:
        if math.isnan(busy):
            break
        busy = cpu_busy_fraction(interval)
    return busy, time.monotonic() - t0


def machine_meta(bandwidth_by_threads: Mapping[int, float] | None = None) -> dict[str, Any]:
    """CPU, cache, library versions and date, for a results file.

    Versions are read from package metadata, so nothing is imported (importing
    TVM here could start its runtime in the wrong process).
    """
    flags = host_cpu_flags()
    meta: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_id": cpu_identity(),
        "n_cpus": os.cpu_count(),
        "isa": sorted(f for f in flags if f in {"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile"}),
        "l3_bytes": l3_cache_bytes(),
        "python": platform.python_version(),
        "versions": {
            "torch": _version("torch"),
            "onnxruntime": _version("onnxruntime"),
            "tvm": _version("apache-tvm"),
            "numpy": _version("numpy"),
        },
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg": _loadavg(),
    }
    if bandwidth_by_threads is not None:
        meta["read_bandwidth_gbps"] = {str(int(k)): float(v) for k, v in bandwidth_by_threads.items()}
    return meta


def _loadavg() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def write_json(
    results: Sequence[BenchResult],
    path: str | os.PathLike[str],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``{"meta": ..., "results": [...]}`` to ``path`` atomically.

    ``meta`` is merged over :func:`machine_meta` (pass
    ``{"read_bandwidth_gbps": {...}}`` or call ``machine_meta(bw)`` yourself).
    The JSON goes to a temporary file in the same directory, is fsynced, and
    replaces ``path`` with ``os.replace``: a reader sees the old file or the
    new one, never half of one, and no temporary file is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    m = machine_meta()
    if meta:
        m.update(dict(meta))
    if "read_bandwidth_gbps" in m and isinstance(m["read_bandwidth_gbps"], Mapping):
        m["read_bandwidth_gbps"] = {str(k): float(v) for k, v in m["read_bandwidth_gbps"].items()}
    doc = {"meta": m, "results": [r.to_dict() if isinstance(r, BenchResult) else dict(r) for r in results]}
    text = json.dumps(doc, indent=2, sort_keys=False, default=_json_default, allow_nan=True)
    with atomic_file(path, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    try:  # numpy scalars and arrays
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------
# threads and subprocesses
# --------------------------------------------------------------------------


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``; restore afterwards.

    This controls torch's intra-op pool only. TVM's pool size comes from
    ``TVM_NUM_THREADS`` read when the TVM runtime starts, and cannot be
    changed from here: run each thread count in a fresh process
    (:func:`run_in_subprocess` with ``env=thread_env(n)``).
    """
    if n < 1:
        raise ValueError("threads must be >= 1")
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) its mmap'd blocks


def thread_env(n: int, huge_pages: bool = True) -> dict[str, str]:
    """Environment that pins every runtime's pool to ``n`` threads at start-up, and with
    ``huge_pages`` puts every kernel's weights on transparent huge pages: qtvm's runtime
    collapses its own (``qtvm.hugepages``), glibc's malloc (onnxruntime, TVM tensors) and
    torch's allocator are asked to by their documented switches. Streaming weights from
    4 KiB pages cost 25-30% of the read bandwidth on the Zen 5 VM, so comparing kernels on
    different page sizes would measure the allocator, not the kernel."""
    s = str(int(n))
    env = {
        "TVM_NUM_THREADS": s,
        "OMP_NUM_THREADS": s,
        "MKL_NUM_THREADS": s,
        "OPENBLAS_NUM_THREADS": s,
        "QTVM_BENCH_THREADS": s,
    }
    if huge_pages:
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        env.update({
            "GLIBC_TUNABLES": ":".join(t for t in (tunables, HUGE_PAGE_TUNABLE) if t),
            "THP_MEM_ALLOC_ENABLE": "1",  # torch's CPU allocator: 2 MiB-aligned, madvised blocks
            "QTVM_HUGEPAGES": "1",
        })
    else:
        env.update({"QTVM_HUGEPAGES": "0", "THP_MEM_ALLOC_ENABLE": "0"})
    return env


def pages_meta(huge_pages: bool) -> dict[str, str]:
    """What a results file records about page sizes."""
    from qtvm.hugepages import thp_mode

    return {"weights_on": "transparent huge pages" if huge_pages else "default allocation (4 KiB pages)",
            "thp_mode": thp_mode()}


_RESULT_FD_ENV = "QTVM_SUBPROCESS_RESULT_FD"


def _resolve(qualname: str) -> Callable[..., Any]:
    if ":" in qualname:
        mod_name, attr = qualname.split(":", 1)
    else:
        mod_name, _, attr = qualname.rpartition(".")
        if not mod_name:
            raise ValueError(f"{qualname!r} is not 'module:function' or 'module.function'")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{qualname} is not callable")
    return obj


def run_in_subprocess(
    fn_qualname: str,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stream_stderr: bool = True,
) -> dict:
    """Call ``fn_qualname(**kwargs)`` in a fresh Python process; return its dict.

    ``fn_qualname`` is ``"package.module:function"`` (or
    ``"package.module.function"``); the function takes JSON-able keyword
    arguments and returns a JSON-able dict. ``env`` is added to a copy of this
    process's environment -- e.g. :func:`thread_env` -- so runtimes that size
    their thread pools at start-up (TVM via ``TVM_NUM_THREADS``) start with the
    right count. The result comes back as JSON on the child's stdout; while the
    function runs, the child's stdout is redirected to stderr, so prints from
    libraries cannot corrupt it. The child's stderr is passed through (and its
    tail quoted in the error when the child fails).
    """
    child_env = dict(os.environ)
    if env:
        child_env.update({str(k): str(v) for k, v in env.items()})
    # make this checkout importable in the child even when not installed
    root = str(Path(__file__).resolve().parents[2])
    pp = child_env.get("PYTHONPATH", "")
    if root not in pp.split(os.pathsep):
        child_env["PYTHONPATH"] = root + (os.pathsep + pp if pp else "")
    payload = json.dumps({"fn": fn_qualname, "kwargs": dict(kwargs or {})})
    proc = subprocess.Popen(
        [sys.executable, "-m", "qtvm.bench.harness", "--child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env,
        cwd=cwd,
        text=True,
    )
    err_chunks: list[str] = []
    out_chunks: list[str] = []

    import threading

    def pump_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_chunks.append(line)
            if stream_stderr:
                sys.stderr.write(line)
                sys.stderr.flush()

    def pump_out() -> None:
        assert proc.stdout is not None
        out_chunks.append(proc.stdout.read())

    readers = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
    for t in readers:
        t.start()
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:  # child died before reading; its stderr says why
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for t in readers:
            t.join(5)
        raise TimeoutError(f"{fn_qualname} did not finish within {timeout} s")
    for t in readers:  # EOF follows the child's exit
        t.join()
    out = "".join(out_chunks)
    stderr_tail = "".join(err_chunks)[-4000:]
    if proc.returncode != 0:
        raise RuntimeError(
            f"subprocess running {fn_qualname} exited with {proc.returncode}:\n{stderr_tail}"
        )
    try:
        result = json.loads(out)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"subprocess running {fn_qualname} wrote no JSON result: {out[:500]!r}") from e
    if not isinstance(result, dict):
        raise RuntimeError(f"{fn_qualname} returned {type(result).__name__}, expected a dict")
    return result


def _child_main() -> int:
    req = json.loads(sys.stdin.read())
    # Keep the real stdout for the result; send everything else to stderr.
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)
    fn = _resolve(req["fn"])
    result = fn(**req["kwargs"])
    if not isinstance(result, Mapping):
        raise TypeError(f"{req['fn']} returned {type(result).__name__}, expected a dict")
    with os.fdopen(result_fd, "w") as out:
        json.dump(dict(result), out, default=_json_default)
        out.flush()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child_main())
    print("usage: python -m qtvm.bench.harness --child  (internal; see run_in_subprocess)", file=sys.stderr)
    sys.exit(2)
