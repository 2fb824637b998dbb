"""Prefill latency: the GEMV rule vs the GEMM rule vs torch fp32, by rows M.

    python benchmarks/prefill.py                          # M = 1 8 32 128, K = N = 4096, int4-g128, host
    python benchmarks/prefill.py --ms 1 2 3 4 5 6 8      # find the GEMV/GEMM crossover
    python benchmarks/prefill.py --threads 1 --mcpu znver3

Kernels, all on the same x[M, K] and weight:
  gemv   qtvm.ops.qmatmul_func + schedules.x86.schedule_qmatmul_x86 (unpacks per row)
  gemm   qtvm.ops_gemm.qmatmul_gemm_func + schedules.x86_gemm.schedule_qmatmul_gemm_x86
  torch  torch.nn.functional.linear(x, W^T) on the dequantized fp32 weight
         (torch.set_num_threads = --threads)

TVM's pool size is read from TVM_NUM_THREADS when its runtime starts, so this
script sets it from --threads before importing tvm. Weights stay cache-hot
(each kernel is called on the same arrays; this host's L3 holds them), so the
small-M numbers are the compute cost of the kernels, not DRAM-bound decode
latency. Every kernel's output is checked against torch before it is timed.
Timing: --rounds interleaved rounds per M (gemv, gemm, torch in turn), each
calling a kernel for at least --budget seconds; the table shows medians of
all calls. The machine's load average is printed: other processes on these
2-core machines slow every kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 32, 128], help="rows of x")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--format", default="int4-g128")
    ap.add_argument("--threads", type=int, default=_usable_cores())
    ap.add_argument("--mcpu", default=None, help="LLVM CPU (default: this host's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per kernel per round")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time per call (only with --threads 1); less "
                         "sensitive to other processes on a shared machine than wall time")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures latency only with --threads 1 (CPU time adds up over threads)")

    os.environ["TVM_NUM_THREADS"] = str(a.threads)  # before tvm starts its pool
    import numpy as np
    import tvm

    from qtvm import ops
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_func
    from schedules.target_facts import host_llvm_cpu
    from schedules.x86 import col_block, schedule_qmatmul_x86
    from schedules.x86_gemm import gemm_tiles, schedule_qmatmul_gemm_x86

    mcpu = a.mcpu or host_llvm_cpu()
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    fmt = get_format(a.format)
    nb = col_block(target)
    k, n = a.k, a.n

    t0 = time.perf_counter()
    gemv_func = ops.qmatmul_func(fmt, k, n, nb)
    gemm_func = qmatmul_gemm_func(fmt, k, n, nb)
    gemv = tvm.compile(schedule_qmatmul_x86(gemv_func, target).mod, target=target)["main"]
    gemm = tvm.compile(schedule_qmatmul_gemm_x86(gemm_func, target).mod, target=target)["main"]
    tiles = gemm_tiles(gemm_func.attrs[ops.FORMAT_ATTR], target)
    build_s = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    weights = [tvm.runtime.tensor(arr) for arr in ops.blocked_arrays(qt, nb)]
    w_fp32 = qt.dequantize()

    kernels = {}

    def tvm_kernel(fn):
        def setup(x):
            xt = tvm.runtime.tensor(x)
            out = tvm.runtime.tensor(np.zeros((x.shape[0], n), np.float32))
            return (lambda: fn(xt, *weights, out)), (lambda: out.numpy())
        return setup

    kernels["gemv"] = tvm_kernel(gemv)
    kernels["gemm"] = tvm_kernel(gemm)
    if not a.no_torch:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(a.threads)
        w_t = torch.from_numpy(np.ascontiguousarray(w_fp32.T))  # Linear's [N, K]

        def torch_setup(x):
            xt = torch.from_numpy(x)
            box = {}

            def call():
                with torch.inference_mode():
                    box["y"] = F.linear(xt, w_t)
            return call, (lambda: box["y"].numpy())

        kernels["torch"] = torch_setup

    load_before = os.getloadavg()
    print(f"{a.format} K={k} N={n}  target llvm -mcpu={mcpu}  threads={a.threads}  clock={a.clock}  "
          f"GEMM tiles m_r={tiles.rows} n_r={tiles.cols} kc={tiles.depth}  (built in {build_s:.1f} s)")
    print(f"load average before: {load_before[0]:.2f} (1 min)")

    rows = []
    for m in a.ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w_fp32.astype(np.float64)
        calls = {}
        for name, setup in kernels.items():
            call, result = setup(x)
            call()
            err = np.linalg.norm(result() - ref) / np.linalg.norm(ref)
            if not err < 1e-5:
                raise SystemExit(f"{name} at M={m}: relative error {err:.2e}")
            calls[name] = call
        times = {name: [] for name in calls}
        clock = time.perf_counter if a.clock == "wall" else time.process_time
        for _ in range(a.rounds):
            for name, call in calls.items():
                call()  # re-warm after the other kernels
                start, count = time.perf_counter(), 0
                while True:
                    t = clock()
                    call()
                    times[name].append(clock() - t)
                    count += 1
                    if time.perf_counter() - start >= a.budget and count >= 3:
                        break
        med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        rows.append({"m": m, **{f"{name}_ms": v for name, v in med.items()},
                     "calls": {name: len(ts) for name, ts in times.items()}})
        print(f"  M={m}: " + "  ".join(f"{name} {v:.3f} ms" for name, v in med.items()), flush=True)

    load_after = os.getloadavg()
    flops = lambda m, ms: 2.0 * m * k * n / (ms * 1e-3) / 1e9  # noqa: E731
    header = f"{'M':>5} {'GEMV ms':>10} {'GEMM ms':>10}" + ("" if a.no_torch else f" {'torch ms':>10}") \
        + f" {'GEMV/GEMM':>10}" + ("" if a.no_torch else f" {'torch/GEMM':>10}") + f" {'GEMM GF/s':>10}"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['m']:>5} {r['gemv_ms']:>10.3f} {r['gemm_ms']:>10.3f}"
        if not a.no_torch:
            line += f" {r['torch_ms']:>10.3f}"
        line += f" {r['gemv_ms'] / r['gemm_ms']:>10.2f}"
        if not a.no_torch:
            line += f" {r['torch_ms'] / r['gemm_ms']:>10.2f}"
        line += f" {flops(r['m'], r['gemm_ms']):>10.1f}"
        print(line)
    wins = [r["m"] for r in rows if r["gemm_ms"] < r["gemv_ms"]]
    print()
    print(f"GEMM faster than GEMV from M = {min(wins)} (of the M measured)" if wins else "GEMM never faster")
    print(f"load average after: {load_after[0]:.2f} (1 min)"
          + ("  -- other processes were running; expect noisy, pessimistic numbers"
             if max(load_before[0], load_after[0]) > a.threads * 0.5 else ""))
    if a.json:
        a.json.write_text(json.dumps({"format": a.format, "k": k, "n": n, "mcpu": mcpu, "threads": a.threads,
                                      "tiles": vars(tiles), "load": [load_before, load_after], "rows": rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
