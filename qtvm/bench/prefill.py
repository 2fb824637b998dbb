"""`qtvm bench prefill`: qtvm's prefill (M > 1 rows) matmul kernels beside their
peers, side by side, in one run.

Prefill multiplies M = batch x seq rows by the same weight at once, so the
work is compute-bound: weights are reused across rows and stay in cache, and
no DRAM rotation is needed (unlike ``qtvm bench gemv``). Kernels timed:

* qtvm with fp32 activations: ``qtvm.ops_gemm.qmatmul_gemm_func`` (each weight
  tile dequantized once, then an fp32 GEMM);
* qtvm with int8 activations: ``ops.quantize_activations_func`` (row tile 4)
  then ``ops.qmatmul_a8_gemm_func`` -- both timed, as a model runs both;
* torch fp32 ``x @ W.T`` (``torch.mm`` into a preallocated output, weight in
  nn.Linear's [N, K] layout: measured ~1.5x faster than a [K, N] weight here);
* torch's ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations;
* onnxruntime MatMulNBits, accuracy_level=4 (int8 activations), block size =
  the format's group size, through io_binding and one process-wide pool.

Each thread count runs in a fresh process (TVM sizes its pool once, from
``TVM_NUM_THREADS``); every kernel is checked against a float64 reference of
the weights it actually holds before it is timed, and the timing is
interleaved (A, B, C, then B, C, A, ...) so the noise of a shared machine is spread
over all kernels instead of charged to whichever ran last, or first. Reported: medians
of all timed calls.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from qtvm.bench.harness import POOL_WIND_DOWN_S, turn_order

DEFAULT_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # (K, N) of LLaMA-7B's projections
DEFAULT_ROWS = (16, 64, 128)
DEFAULT_FORMATS = ("int4-g128",)
PEERS = ("torch_fp32", "torch_int4", "ort_matmulnbits")
FP32_TOL, INT8_TOL = 1e-4, 2e-2  # max |y - ref| / max |ref|
_TORCH_INT4_GROUPS = (32, 64, 128, 256)


class PrefillKernel:
    """y[M, N] = x[M, K] @ W, weights prepared once per shape, buffers per M.

    ``bind(x)`` converts x and allocates the output (untimed), ``run()`` is
    the timed call, ``reference(x)`` is float64 from the weights (and the
    activation rounding) the kernel really uses.
    """

    name = "kernel"
    fmt = ""
    tol = FP32_TOL
    is_qtvm = False

    def bind(self, x: np.ndarray) -> None:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def output(self) -> np.ndarray:
        raise NotImplementedError

    def reference(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def int8_rounded(x: np.ndarray, kp: int) -> np.ndarray:
    """x as qtvm's activation kernel rounds it: symmetric int8 per 32 values of
    the padded K, scale max|x| / 127 in float32. float64 [M, K]."""
    from qtvm.ops import ACT_BLOCK

    m, k = x.shape
    xp = np.zeros((m, kp), np.float64)
    xp[:, :k] = x
    blocks = xp.reshape(m, -1, ACT_BLOCK)
    scale = (np.abs(blocks).max(-1, keepdims=True).astype(np.float32) / np.float32(127)).astype(np.float64)
    q = np.clip(np.round(blocks / np.where(scale > 0, scale, 1.0)), -127, 127)
    return (q * scale).reshape(m, kp)[:, :k]


class QtvmPrefill(PrefillKernel):
    """qtvm's prefill kernel for one format, fp32 or int8 activations.

    Compiled and scheduled exactly as the compiled model's kernels are
    (``schedules.schedule_kernel`` for the target, column block from
    ``schedules.column_block``); M is symbolic, so one build serves every M.
    """

    is_qtvm = True

    def __init__(self, qt, activations: str, preset: str, target: str = "host"):
        import tvm

        from qtvm import ops
        from qtvm.intrin.x86 import ROW_TILE
        from qtvm.ops_gemm import qmatmul_gemm_func
        from qtvm.target import parse_target
        from schedules import column_block, compile_kernel

        if activations not in ("fp32", "int8"):
            raise ValueError(f"activations must be fp32 or int8, not {activations!r}")
        tgt = parse_target(target)
        nb = column_block(tgt)
        fmt, K, N = qt.fmt, qt.k, qt.n

        def build(func):
            return compile_kernel(func, tgt)["main"]

        self.qt, self.K, self.N, self.activations = qt, K, N, activations
        self.fmt = preset
        self.name = f"qtvm {activations}-act"
        self.tol = INT8_TOL if activations == "int8" else FP32_TOL
        self._kp = fmt.padded_k(K)
        self._row_tile = ROW_TILE  # what the compiled model uses
        self._groups = self._kp // fmt.group_size_for(K)
        if activations == "int8":
            self._quant = build(ops.quantize_activations_func(fmt, K, ROW_TILE))
            self._mm = build(ops.qmatmul_a8_gemm_func(fmt, K, N, nb, ROW_TILE))
            arrays = ops.a8_arrays(qt, nb)
        else:
            self._mm = build(qmatmul_gemm_func(fmt, K, N, nb))
            arrays = ops.blocked_arrays(qt, nb)
        self._tensor = tvm.runtime.tensor
        self._weights = [self._tensor(a) for a in arrays]

    def bind(self, x: np.ndarray) -> None:
        m = x.shape[0]
        self._x = self._tensor(np.ascontiguousarray(x, np.float32))
        self._y = self._tensor(np.full((m, self.N), np.nan, np.float32))  # unwritten outputs fail the check
        mp = -(-m // self._row_tile) * self._row_tile
        self._acts = [self._tensor(np.zeros(s, d)) for s, d in (
            ((mp, self._kp), np.int8), ((mp, self._kp // 32), np.float32), ((mp, self._groups), np.float32))]

    def run(self) -> None:
        if self.activations == "int8":
            self._quant(self._x, *self._acts)
            self._mm(*self._acts, *self._weights, self._y)
        else:
            self._mm(self._x, *self._weights, self._y)

    def output(self) -> np.ndarray:
        return self._y.numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        xr = int8_rounded(x, self._kp) if self.activations == "int8" else np.asarray(x, np.float64)
        return xr @ self.qt.dequantize().astype(np.float64)


class TorchFp32Mm(PrefillKernel):
    """``torch.mm(x, w.T, out=y)`` with w [N, K] contiguous, as nn.Linear holds it."""

    name, fmt = "torch fp32 mm", "fp32"

    def __init__(self, W: np.ndarray):
        import torch

        self._torch = torch
        self._W = np.asarray(W, np.float32)
        self._w = torch.from_numpy(np.ascontiguousarray(self._W.T))

    def bind(self, x: np.ndarray) -> None:
        self._x = self._torch.from_numpy(np.array(x, np.float32))
        self._y = self._torch.empty(x.shape[0], self._w.shape[0], dtype=self._torch.float32)

    def run(self) -> None:
        self._torch.mm(self._x, self._w.t(), out=self._y)

    def output(self) -> np.ndarray:
        return self._y.numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float64) @ self._W.astype(np.float64)


class TorchInt4Mm(PrefillKernel):
    """torch's CPU int4 weight-only matmul, bf16 activations and output."""

    tol = INT8_TOL

    def __init__(self, W: np.ndarray, group_size: int):
        import torch

        from qtvm.bench.peers import quantize_int4_torch

        self._torch = torch
        q, self._sz, self._deq = quantize_int4_torch(W, group_size)
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        self.group_size = group_size
        self.name, self.fmt = "torch int4 mm (bf16)", f"int4-g{group_size}"

    def bind(self, x: np.ndarray) -> None:
        self._x = self._torch.from_numpy(np.array(x, np.float32)).to(self._torch.bfloat16)
        self._y = None

    def run(self) -> None:
        self._y = self._torch.ops.aten._weight_int4pack_mm_for_cpu(self._x, self._packed, self.group_size, self._sz)

    def output(self) -> np.ndarray:
        return self._y.float().numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        xb = self._torch.from_numpy(np.array(x, np.float32)).to(self._torch.bfloat16).double().numpy()
        return xb @ self._deq


class OrtMatMulNBitsMm(PrefillKernel):
    """onnxruntime MatMulNBits (bits=4, accuracy_level=4) on x[M, K].

    One session per shape with a symbolic row count, rebound per M through
    io_binding. With ``shared_pool`` (the benchmark's child process) all sessions
    share one process-wide pool of ``threads``; that pool is for good in the
    process, and every later session must then use it, so in-process callers
    (tests) leave it off.
    """

    tol = INT8_TOL

    def __init__(self, W: np.ndarray, block_size: int, threads: int, shared_pool: bool = False):
        import onnxruntime as ort

        from qtvm.bench import peers

        K, N = W.shape
        B, scales, zps, self._deq = peers.pack_matmulnbits(W, block_size)
        model = peers.build_matmulnbits_model(K, N, block_size, B, scales, zps, 4, rows="M")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if shared_pool:
            peers._ensure_shared_pool(threads)  # sized once per process: the child runs one thread count
            so.use_per_session_threads = False
        else:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self._ort = ort
        self._sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        self._ro = ort.RunOptions()
        self.N, self.block_size = N, block_size
        self.name, self.fmt = "ort MatMulNBits acc4", f"int4-g{block_size}"

    def bind(self, x: np.ndarray) -> None:
        self._xa = np.array(x, np.float32)
        self._ya = np.zeros((x.shape[0], self.N), np.float32)
        self._xv = self._ort.OrtValue.ortvalue_from_numpy(self._xa)
        self._yv = self._ort.OrtValue.ortvalue_from_numpy(self._ya)
        self._binding = self._sess.io_binding()
        self._binding.bind_ortvalue_input("x", self._xv)
        self._binding.bind_ortvalue_output("y", self._yv)

    def run(self) -> None:
        self._sess.run_with_iobinding(self._binding, self._ro)

    def output(self) -> np.ndarray:
        return self._yv.numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        from qtvm.bench.peers import ort_activation_int8

        xr = np.stack([ort_activation_int8(row, self.block_size) for row in np.asarray(x, np.float32)])
        return xr @ self._deq


def peer_group_size(preset: str, K: int) -> int:
    """Block size for the int4 peers: the (first) format's group if both peers take it, else 128."""
    from qtvm.formats import get_format

    g = get_format(preset).group_size_for(K)
    return g if g in _TORCH_INT4_GROUPS else 128


def make_kernels(W: np.ndarray, formats, activations, peers, threads: int, target: str = "host",
                 shared_pool: bool = False) -> list:
    """All kernels for one (K, N) weight: qtvm per format and activation mode, then the peers."""
    from qtvm.formats import get_format

    K, _ = W.shape
    kernels: list[PrefillKernel] = []
    for preset in formats:
        fmt = get_format(preset)
        qt = fmt.quantize(W)
        for act in activations:
            kernels.append(QtvmPrefill(qt, act, preset, target))
    g = peer_group_size(formats[0], K) if formats else 128
    for p in peers:
        if p == "torch_fp32":
            kernels.append(TorchFp32Mm(W))
        elif p == "torch_int4":
            kernels.append(TorchInt4Mm(W, g))
        elif p == "ort_matmulnbits":
            kernels.append(OrtMatMulNBitsMm(W, g, threads, shared_pool))
        else:
            raise ValueError(f"unknown peer {p!r}")
    return kernels


def check(kernel: PrefillKernel, x: np.ndarray) -> float:
    """Run once on x; raise if the output disagrees with the kernel's own reference."""
    kernel.bind(x)
    kernel.run()
    y, ref = kernel.output(), kernel.reference(x)
    err = float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    if not err < kernel.tol:  # NaN fails too
        raise AssertionError(f"{kernel.name} ({kernel.fmt}) at M={x.shape[0]} disagrees with its reference: "
                             f"rel err {err:.3g} >= {kernel.tol:g}")
    return err


def time_interleaved(kernels, rounds: int, budget_s: float, min_calls: int = 3,
                     warmup_s: float = 0.2, gap_s: float = POOL_WIND_DOWN_S) -> list[tuple[list[float], list[float]]]:
    """Per kernel: (all call times in seconds, per-round medians), kernels bound already.

    Warm-up first (caches, lazily allocated buffers, thread pools started);
    then ``rounds`` rounds of A, B, C, then B, C, A, ... (``harness.turn_order``), each kernel called for at least
    ``budget_s`` and ``min_calls`` times per round. Before each kernel's turn
    the process idles ``gap_s`` (``harness.POOL_WIND_DOWN_S``: the previous
    runtime's pool workers stop spinning); then one untimed call.
    """
    clock = time.perf_counter
    for k in kernels:
        end, n = clock() + warmup_s, 0
        while n < 2 or clock() < end:
            k.run()
            n += 1
    out = [([], []) for _ in kernels]
    for r in range(rounds):
        for j in turn_order(len(kernels), r):
            k, (times, meds) = kernels[j], out[j]
            time.sleep(gap_s)
            k.run()
            got: list[float] = []
            end = clock() + budget_s
            while len(got) < min_calls or clock() < end:
                t0 = clock()
                k.run()
                got.append(clock() - t0)
            times += got
            meds.append(float(np.median(got)))
    return out


def benchmark_child(shapes, threads: int, formats, activations, peers, rows, rounds: int,
                    budget_s: float = 0.25, target: str = "host", seed: int = 0, quiet_wait_s: float = 0.0) -> dict:
    """One thread count, in its own process (see ``run``): returns {"results": [row dicts]}.

    With ``quiet_wait_s`` > 0, each (shape, M) first waits up to that long for
    the machine's CPUs to be idle: on 2 cores one busy neighbour stalls every
    2-thread kernel (torch's OpenMP most of all). The busy fraction seen is
    kept in the rows.
    """
    import gc
    import os
    import sys

    from qtvm.bench import harness

    rng = np.random.default_rng(seed)
    results = []
    with harness.threads(threads):
        for K, N in shapes:
            K, N = int(K), int(N)
            W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
            t0 = time.perf_counter()
            kernels = make_kernels(W, formats, activations, peers, threads, target, shared_pool=True)
            print(f"[{threads} thr] {K}x{N}: {len(kernels)} kernels ready in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
            for M in rows:
                x = rng.standard_normal((int(M), K)).astype(np.float32)
                errs = [check(k, x) for k in kernels]
                busy = harness.wait_for_quiet(quiet_wait_s)[0] if quiet_wait_s > 0 else harness.cpu_busy_fraction(0.2)
                timed = time_interleaved(kernels, rounds, budget_s)
                flop, load = 2.0 * M * K * N, os.getloadavg()[0]  # others' work skews the times: keep it
                for k, err, (times, meds) in zip(kernels, errs, timed):
                    med = float(np.median(times))
                    results.append({
                        "kernel": k.name, "fmt": k.fmt, "qtvm": k.is_qtvm, "K": K, "N": N, "M": int(M),
                        "threads": threads, "median_ms": med * 1e3, "gflops": flop / med / 1e9,
                        "min_ms": min(times) * 1e3, "round_median_ms": [m * 1e3 for m in meds],
                        "n_calls": len(times), "rel_err": err, "loadavg_1min": load, "cpu_busy_before": busy})
                    print(f"[{threads} thr] {K}x{N} M={M}: {k.name:<22} {k.fmt:<12} {med * 1e3:9.3f} ms",
                          file=sys.stderr, flush=True)
            del kernels
            gc.collect()
    return {"results": results}


def add_speedups(results: list[dict]) -> list[dict]:
    """Set each row's ``best_qtvm_speedup`` = its time / the best qtvm time at the same
    (K, N, M, threads): how many times faster the best qtvm kernel is than this row."""
    best: dict[tuple, float] = {}
    for r in results:
        key = (r["K"], r["N"], r["M"], r["threads"])
        if r["qtvm"]:
            best[key] = min(best.get(key, math.inf), r["median_ms"])
    for r in results:
        b = best.get((r["K"], r["N"], r["M"], r["threads"]))
        r["best_qtvm_speedup"] = r["median_ms"] / b if b else None
    return results


def format_table(results: list[dict]) -> str:
    headers = ["kernel", "format", "K", "N", "M", "thr", "median ms", "GFLOP/s", "best qtvm speed-up"]
    rows = [[r["kernel"], r["fmt"], str(r["K"]), str(r["N"]), str(r["M"]), str(r["threads"]),
             f"{r['median_ms']:.3f}", f"{r['gflops']:.1f}",
             "-" if r.get("best_qtvm_speedup") is None else f"{r['best_qtvm_speedup']:.2f}x"] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out, prev = [line(headers), "  ".join("-" * w for w in widths)], None
    for r, row in zip(results, rows):
        key = (r["K"], r["N"], r["M"], r["threads"])
        if prev is not None and key != prev:
            out.append("")
        out.append(line(row))
        prev = key
    return "\n".join(out)


def run(shapes=DEFAULT_SHAPES, rows=DEFAULT_ROWS, formats=DEFAULT_FORMATS, activations=("fp32", "int8"),
        threads=(1, 2), peers=PEERS, rounds: int = 5, json_path: Path | None = None, target: str = "host",
        budget_s: float = 0.25, quiet_wait_s: float = 10.0) -> list[dict]:
    """Every thread count in a fresh process, then one table and (optionally) the JSON."""
    import os

    from qtvm.bench import harness

    print(f"{harness.cpu_named()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; "
          f"CPU busy before start {100 * harness.cpu_busy_fraction(1.0):.0f}%", flush=True)
    from qtvm.progress import bar

    results: list[dict] = []
    runs = bar(len(threads), "qtvm bench prefill", unit="thread count")
    for t in threads:
        runs.set_postfix_str(f"{t} thread(s)")
        out = harness.run_in_subprocess("qtvm.bench.prefill:benchmark_child", {
            "shapes": [list(s) for s in shapes], "threads": t, "formats": list(formats),
            "activations": list(activations), "peers": list(peers), "rows": [int(m) for m in rows],
            "rounds": rounds, "budget_s": budget_s, "target": target, "quiet_wait_s": quiet_wait_s},
            harness.thread_env(t))
        results += out["results"]
        runs.update(1)
    runs.close()
    order = {k: i for i, k in enumerate(dict.fromkeys(r["kernel"] + r["fmt"] for r in results))}
    results.sort(key=lambda r: (r["K"], r["N"], r["M"], r["threads"], order[r["kernel"] + r["fmt"]]))
    add_speedups(results)
    print()
    print(format_table(results))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if json_path is not None:
        harness.write_json(results, json_path, {
            "benchmark": "prefill", "rounds": rounds, "budget_s_per_round": budget_s, "target": target,
            "quiet_wait_s": quiet_wait_s, "pages": harness.pages_meta(True),
            "timing": "median of all timed calls; kernels interleaved per round; weights cache-resident"})
        print(f"wrote {json_path}")
    return results


def add_prefill_parser(bsub) -> None:
    """Add ``prefill`` to the ``qtvm bench`` sub-command group (``add_bench_parser``'s result)."""
    p = bsub.add_parser("prefill", help="qtvm prefill (M > 1 rows) kernels vs torch fp32/int4, ORT MatMulNBits")
    p.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in DEFAULT_SHAPES], metavar="KxN")
    p.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), metavar="M",
                   help="rows of x (batch x seq)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    p.add_argument("--act", default="fp32,int8", help="activation modes of qtvm kernels (fp32, int8)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--peers", default=",".join(PEERS), help="comma list, or 'none'")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per kernel per round")
    p.add_argument("--quiet-wait", type=float, default=10.0, metavar="S",
                   help="wait up to S seconds for idle CPUs before each shape and M (0: don't)")
    p.add_argument("--target", default="host")
    p.add_argument("--json", type=Path, default=Path("out/bench_prefill.json"))
    p.set_defaults(fn=prefill_command)


def prefill_command(args) -> int:
    """Check every option before anything is built or measured; QtvmError -> exit 2."""
    from qtvm.bench.gemv import _parse_shape
    from qtvm.errors import QtvmError

    shapes = [_parse_shape(s) for s in args.shapes]
    if any(m < 1 for m in args.rows):
        raise QtvmError("--rows must be >= 1")
    if any(t < 1 for t in args.threads):
        raise QtvmError("--threads must be >= 1")
    if args.rounds < 1:
        raise QtvmError("--rounds must be >= 1")
    if not args.budget > 0:
        raise QtvmError("--budget must be > 0 seconds")
    if not args.quiet_wait >= 0:
        raise QtvmError("--quiet-wait must be >= 0 seconds")
    acts = [a for a in args.act.split(",") if a]
    if not acts or set(acts) - {"fp32", "int8"}:
        raise QtvmError(f"--act takes fp32 and/or int8, not '{args.act}'")
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise QtvmError(f"unknown peers: {', '.join(unknown)}", f"choose from {', '.join(PEERS)}, or none")
    formats = [f for f in args.formats.split(",") if f]
    if not formats:
        raise QtvmError("--formats is empty", "e.g. --formats int4-g128")
    from qtvm import ops
    from qtvm.formats import PRESETS, get_format

    for preset in formats:
        fmt = get_format(preset)  # unknown presets raise QtvmError
        bad_k = [k for k, _ in shapes if not ops.supports_int8_activations(fmt, k)]
        if "int8" in acts and bad_k:
            able = [p for p in PRESETS if ops.supports_int8_activations(get_format(p), bad_k[0])]
            raise QtvmError(f"format {preset} has no int8-activation kernel (K={bad_k[0]}); formats that do: "
                            f"{', '.join(able)}", "or pass --act fp32")
    if "torch_int4" in peers:
        for k, n in shapes:
            g = peer_group_size(formats[0], k)
            if k % g or n % 16:
                raise QtvmError(f"torch_int4 cannot take shape {k}x{n} (needs K % {g} == 0 and N % 16 == 0)",
                                "drop it from --peers")
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QtvmError(f"cannot create the directory of --json {args.json}: {e.strerror}") from None
    run(shapes, args.rows, formats, acts, args.threads, peers, args.rounds, args.json, args.target, args.budget,
        args.quiet_wait)
    return 0
