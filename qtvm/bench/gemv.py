"""`qtvm bench gemv`: qtvm's GEMV kernels beside the machine's read bandwidth and
its peers (torch fp32 mv, torch's int4 CPU kernel with bf16 activations,
onnxruntime MatMulNBits with accuracy_level=4), in one run.

qtvm kernels (the ones the compiler picks for M = 1: the int8 GEMV with ``--act int8``,
the 16-entry LUT GEMV for BCQ formats) are registered as peers, so they are timed by the same
interleaved, bandwidth-probed rounds with the same DRAM rotation
(``qtvm.bench.peers.benchmark_peers``); each thread count runs in a fresh
process because TVM's thread pool size is fixed at start-up.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from qtvm.bench import peers as peer_lib

DEFAULT_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096))  # (K, N) of LLaMA-7B's projections
DEFAULT_FORMATS = ("int4-g128", "int3-g128", "int2-g64", "e0m4-g128", "bcq3-g128")
PEERS = ("torch_fp32", "torch_int4", "ort_matmulnbits")
KERNEL_HOT_REPEATS = 15


class QtvmGemv(peer_lib.Peer):
    """One compiled qtvm kernel; copies share the code and own their weights."""

    def __init__(self, W: np.ndarray, preset: str, activations: str, target: str = "host", _shared=None):
        import tvm

        from qtvm import ops
        from qtvm.formats import get_format
        from qtvm.target import parse_target
        from schedules import column_block, compile_kernel

        self.K, self.N = W.shape
        self.name = f"qtvm {preset}" + (" act-int8" if activations == "int8" else "")
        self.fmt = preset
        if _shared is None:
            fmt, tgt = get_format(preset), parse_target(target)
            qt = fmt.quantize(W)
            nb = column_block(tgt)

            def build(func):  # (loaded module: its time_evaluator times in C++, its "main")
                module = compile_kernel(func, tgt).jit()
                return module, module["main"]

            from qtvm import bcq_a8_gemv, lut_gemv
            from schedules.x86_bcq import prefer_bcq_a8
            from schedules.x86_lut import prefer_lut16, prefer_lut16_a8

            if activations == "int8" and prefer_bcq_a8(fmt, self.K, tgt):  # BCQ, VBMI + VNNI: int8 nibble tables
                kernel = build(bcq_a8_gemv.bcq_a8_gemv_func(fmt, self.K, self.N, nb))
                arrays = ops.blocked_arrays(qt, nb)
            elif activations == "int8" and prefer_lut16_a8(fmt, self.K, tgt):  # BCQ: int16 tables
                kernel = build(lut_gemv.lut16_a8_gemv_func(fmt, self.K, self.N, nb))
                arrays = ops.blocked_arrays(qt, nb)
            elif activations == "int8":  # the GEMV rounds x itself
                kernel = build(ops.qmatmul_a8_func(fmt, self.K, self.N, nb))
                arrays = ops.a8_arrays(qt, nb)
            else:  # the GEMV the compiler picks: BCQ runs the 16-entry LUT kernel where it is faster
                dense = lut_gemv.lut16_gemv_func if prefer_lut16(fmt, self.K, tgt) else ops.qmatmul_func
                kernel = build(dense(fmt, self.K, self.N, nb))
                arrays = ops.blocked_arrays(qt, nb)
            _shared = (qt, arrays, kernel)
        self._shared = _shared
        qt, arrays, _ = _shared
        self._weights = _weights_like_the_runtime(arrays)
        self.weight_bytes = int(sum(a.nbytes for a in arrays))
        self._x = tvm.runtime.tensor(np.zeros((1, self.K), np.float32))
        self._y = tvm.runtime.tensor(np.zeros((1, self.N), np.float32))
        self._tensor = tvm.runtime.tensor

    def _set_input(self, x: np.ndarray) -> None:
        self._x = self._tensor(x.reshape(1, -1).astype(np.float32))

    def _calls(self) -> list:
        """(module, its "main", arguments) of each kernel one GEMV runs, in order (one: the int8
        GEMV rounds x itself). The functions are looked up once: a module's ``["main"]`` costs
        ~50 us, more than a small GEMV."""
        return [(*self._shared[2], (self._x, *self._weights, self._y))]

    def run(self) -> None:
        for _module, main, args in self._calls():
            main(*args)

    def kernel_seconds(self, iters: int) -> float:
        """Cache-hot seconds of one GEMV timed by TVM's own loop (no Python call per run):
        the kernels' compute ceiling, which a Python-timed call of a 10 us kernel hides
        under its dispatch cost. Each kernel's best of ``KERNEL_HOT_REPEATS`` repeats of ``iters``
        calls, summed: 5 repeats (about 10 ms at 1024 x 1024) read int2 and E0M4 at 60-65% of their
        best in one run on a shared VM; a busy moment lasts longer than that."""
        import tvm

        total = 0.0
        for module, _main, args in self._calls():
            timer = module.time_evaluator("main", tvm.cpu(), number=max(1, iters), repeat=KERNEL_HOT_REPEATS)
            total += min(timer(*args).results)
        return total

    def _output(self) -> np.ndarray:
        return self._y.numpy()

    def reference(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float64).reshape(1, -1) @ self._shared[0].dequantize().astype(np.float64)

    def copy(self) -> "QtvmGemv":
        twin = QtvmGemv.__new__(QtvmGemv)
        twin.__dict__.update(self.__dict__)
        twin._weights = _weights_like_the_runtime([a.numpy() for a in self._weights])
        return twin


def _weights_like_the_runtime(arrays) -> list:
    """Device copies of ``arrays`` on the pages a loaded artefact's weights get
    (``qtvm.runtime``: huge pages unless QTVM_HUGEPAGES=0)."""
    import tvm

    from qtvm.hugepages import NewMemoryOnHugePages

    with NewMemoryOnHugePages():
        return [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]  # a device copy each


def int8_activations(fmt, k: int, target: str = "host") -> bool:
    """Whether qtvm has an int8-activation GEMV for ``fmt`` on ``target``."""
    from qtvm import ops
    from qtvm.target import parse_target
    from schedules.x86_lut import prefer_lut16_a8

    return ops.supports_int8_activations(fmt, k) or prefer_lut16_a8(fmt, k, parse_target(target))


def register(formats, activations=("fp32",), target: str = "host") -> list[str]:
    """Add qtvm kernels to the peer registry; returns their names."""
    names = []
    for preset in formats:
        for act in activations:
            name = f"qtvm:{preset}:{act}"
            peer_lib.PEER_FACTORIES[name] = (
                lambda W, threads, p=preset, a=act, **kw: QtvmGemv(W, p, a, target))
            names.append(name)
    return names


def benchmark_child(shapes, threads: int, formats, activations, peers, rounds: int, reference_bw: float,
                    group_size: int = 128, target: str = "host") -> dict:
    """Runs in a fresh process per thread count (see ``run``).

    Every kernel timed together holds its own DRAM rotation (>= 4x L3), so the
    first format is timed with the peers and each other format on its own:
    memory stays a few GB whatever the number of formats.
    """
    from qtvm import ops
    from qtvm.formats import get_format

    results = []
    for i, preset in enumerate(formats):
        k_min = min(int(k) for k, _ in shapes)
        acts = [a for a in activations if a == "fp32" or int8_activations(get_format(preset), k_min, target)]
        names = register([preset], acts, target)
        out = peer_lib.benchmark_peers(shapes, threads, [*names, *(peers if i == 0 else ())],
                                       group_size=group_size, rounds=rounds, reference_bw=reference_bw)
        results += out["results"]
    return {"results": results}


def run(shapes=DEFAULT_SHAPES, threads=(1, 2), formats=DEFAULT_FORMATS, activations=("fp32", "int8"),
        peers=PEERS, rounds: int = 3, json_path: Path | None = None, target: str = "host",
        huge_pages: bool = True) -> list:
    from qtvm.bench import bandwidth, harness
    from qtvm.formats import get_format

    for preset in formats:
        get_format(preset)  # unknown presets fail before any measuring
    pages = harness.pages_meta(huge_pages)
    print(f"{harness.cpu_named()}; L3 {bandwidth.l3_cache_bytes() >> 20} MiB; CPU busy before start "
          f"{100 * harness.cpu_busy_fraction(1.0):.0f}%; weights of every kernel on {pages['weights_on']} "
          f"(THP mode {pages['thp_mode']})", flush=True)
    probe = bandwidth.BandwidthProbe(huge_pages=huge_pages)  # on the weights' pages
    bw = {}
    for t in threads:
        detail = probe.measure_detail(t, 5)
        bw[t] = max(detail.values())
        print(f"read bandwidth, {t} thread(s): {bw[t]:.2f} GB/s "
              f"({', '.join(f'{s} streams {v:.1f}' for s, v in detail.items())})", flush=True)
    del probe
    from qtvm.progress import bar

    results = []
    runs = bar(len(threads), "qtvm bench gemv", unit="thread count")
    for t in threads:
        runs.set_postfix_str(f"{t} thread(s)")
        out = harness.run_in_subprocess("qtvm.bench.gemv:benchmark_child", {
            "shapes": [list(s) for s in shapes], "threads": t, "formats": list(formats),
            "activations": list(activations), "peers": list(peers), "rounds": rounds, "reference_bw": bw[t],
            "target": target}, harness.thread_env(t, huge_pages))
        results += [harness.BenchResult.from_dict(d).with_bandwidth(bw[t]) for d in out["results"]]
        runs.update(1)
    runs.close()
    results.sort(key=lambda r: (r.shape, r.threads, r.kernel))
    print()
    harness.print_table(results, bw, extras=("pct_of_probe_bw", "hot_gbps", "kernel_hot_gbps"))
    print("%BW: of the read bandwidth measured at the start; pct_of_probe_bw: of the probes that bracket the "
          "row's own rounds (the figure to judge a row by where the host's bandwidth moved); hot_gbps: the "
          "same call repeated from Python on one copy (weights cache-resident), 10th percentile; "
          "kernel_hot_gbps (qtvm): the same, timed by TVM's own loop (no Python dispatch per call): the "
          "kernels' compute ceiling next to the DRAM-cold GB/s")
    moved = bandwidth_moved(results, bw)
    if moved:
        print("the host's read bandwidth moved during " + "; ".join(moved) + ": %BW is not comparable there")
    if json_path is not None:
        harness.write_json(results, json_path, {**harness.machine_meta(bw), "pages": pages})
        print(f"\nwrote {json_path}")
    return results


def bandwidth_moved(results, bw: dict, tolerance: float = 0.25) -> list[str]:
    """Rows whose bracketing probes read more than ``tolerance`` away from the start probe, as
    "K x N at T thr: probes P GB/s against S": on a 2-vCPU VM the two vCPUs sometimes sit on
    separate memory paths for a while (a row's probes read 70 GB/s against 37 at the start, and
    its %BW 165%), so such a row is judged by ``pct_of_probe_bw``."""
    from qtvm.bench import harness

    out = []
    for r in results:
        probes, start = r.extras.get("bw_probe_gbps"), bw.get(r.threads)
        if not probes or not start:
            continue
        mid = harness.median(probes)
        line = f"K {r.shape[1]} x N {r.shape[0]} at {r.threads} thr: probes {mid:.1f} GB/s against {start:.1f}"
        if abs(mid / start - 1.0) > tolerance and line not in out:
            out.append(line)
    return out


def add_bench_parser(subparsers):
    """Add ``qtvm bench`` and ``bench gemv``; returns the bench sub-command group."""
    b = subparsers.add_parser("bench", help="benchmarks against peers, side by side")
    bsub = b.add_subparsers(dest="bench_kind", required=True)
    g = bsub.add_parser("gemv", help="qtvm GEMV kernels vs read bandwidth, torch fp32/int4, ORT MatMulNBits")
    g.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in DEFAULT_SHAPES], metavar="KxN")
    g.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    g.add_argument("--act", default="fp32,int8", help="activation modes of qtvm kernels (fp32, int8; on a GPU "
                                                      "fp32, fp16)")
    g.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    g.add_argument("--peers", default=",".join(PEERS), help="comma list, or 'none'")
    g.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    g.add_argument("--target", default="host", help="host, an llvm target, or cuda (-arch=sm_XX optional: the "
                                                      "device's): GPU kernels vs HBM bandwidth and torch fp16")
    g.add_argument("--json", type=Path, default=Path("out/bench_gemv.json"))
    add_pages_argument(g)
    g.set_defaults(fn=bench_command)
    return bsub


def add_pages_argument(parser) -> None:
    parser.add_argument("--pages", choices=("huge", "default"), default="huge",
                        help="weights of every kernel (qtvm and peers) on transparent huge pages (default: what "
                             "qtvm's runtime does, and the peers' documented switches), or each allocator's "
                             "default (4 KiB pages where THP is 'madvise')")


def _parse_shape(text: str) -> tuple[int, int]:
    from qtvm.errors import QtvmError

    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise QtvmError(f"shape '{text}' is not KxN", "e.g. --shapes 4096x4096 4096x11008") from None
    if k < 1 or n < 1:
        raise QtvmError(f"shape '{text}' has a zero dimension")
    return k, n


def bench_command(args) -> int:
    from qtvm.errors import QtvmError

    shapes = [_parse_shape(s) for s in args.shapes]
    if any(t < 1 for t in args.threads):
        raise QtvmError("--threads must be >= 1")
    if args.rounds < 1:
        raise QtvmError("--rounds must be >= 1")
    acts = [a for a in args.act.split(",") if a]
    if args.target.split()[0] == "cuda":  # the GPU bench (qtvm/bench/gpu_gemv.py)
        from qtvm.bench import gpu_gemv

        acts = [a for a in acts if a != "int8"] or ["fp32"]
        if set(acts) - {"fp32", "fp16"}:
            raise QtvmError(f"--act on a GPU takes fp32 and/or fp16, not {args.act}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        gpu_gemv.run(shapes, [f for f in args.formats.split(",") if f], args.target, acts, args.rounds, args.json)
        return 0
    if set(acts) - {"fp32", "int8"}:
        raise QtvmError(f"--act takes fp32 and/or int8, not {args.act}")
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise QtvmError(f"unknown peers: {', '.join(unknown)}", f"choose from {', '.join(PEERS)}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    run(shapes, args.threads, [f for f in args.formats.split(",") if f], acts, peers, args.rounds, args.json,
        args.target, huge_pages=args.pages == "huge")
    return 0


