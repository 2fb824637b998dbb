"""Peers only: DRAM read bandwidth, then torch fp32 / torch int4 / ORT MatMulNBits
GEMVs with weights rotated from DRAM, one fresh process per thread count.

    python benchmarks/peers_only.py                      # 1 and 2 threads, three LLaMA-7B shapes
    python benchmarks/peers_only.py --threads 1 --shapes 4096x4096 --json /tmp/peers.json

Shapes are KxN (K = reduction length, N = outputs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtvm.bench import bandwidth, harness  # noqa: E402


def _shape(s: str) -> tuple[int, int]:
    k, n = s.lower().split("x")
    return int(k), int(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", type=_shape, nargs="+", default=[(4096, 4096), (4096, 11008), (11008, 4096)])
    ap.add_argument("--peers", nargs="+", default=["torch_fp32", "torch_int4", "ort_matmulnbits"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--ort-per-session-threads", action="store_true",
                    help="give every ORT session its own pool instead of one shared global pool")
    ap.add_argument("--bw-repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to this long for the CPU to be idle (<15%% busy) before starting, "
                    "and before each timing round")
    ap.add_argument("--reference-bw", type=float, nargs="+", default=None, metavar="GBPS",
                    help="read bandwidth per --threads entry to judge rounds by, instead of this run's "
                    "own start-up measurement (use a value measured on a quiet machine)")
    ap.add_argument("--json", type=Path, default=None, help="write results here (atomically)")
    a = ap.parse_args(argv)

    busy = harness.cpu_busy_fraction(1.0)  # other processes would steal the cores
    waited = 0.0
    while busy > 0.15 and waited < a.wait_quiet:
        time.sleep(4.0)
        waited += 5.0
        busy = harness.cpu_busy_fraction(1.0)
    print(f"CPU busy before start: {100 * busy:.0f}% ({harness.cpu_model()}, L3 {bandwidth.l3_cache_bytes() >> 20} MiB)")
    if busy > 0.15:
        print("WARNING: other processes are using the CPU; timings will be pessimistic", file=sys.stderr)

    bw: dict[int, float] = {}
    probe = bandwidth.BandwidthProbe()  # >= 8x L3, >= 512 MiB, allocated once
    for t in a.threads:
        detail = probe.measure_detail(t, a.bw_repeats)
        bw[t] = max(detail.values())
        cells = ", ".join(f"{s} streams {v:.1f}" for s, v in detail.items())
        print(f"read bandwidth, {t} thread(s): {bw[t]:.2f} GB/s ({cells})", flush=True)
    if a.reference_bw:
        if len(a.reference_bw) != len(a.threads):
            ap.error("--reference-bw needs one value per --threads entry")
        bw = {t: max(bw[t], v) for t, v in zip(a.threads, a.reference_bw)}
    del probe  # give the memory back before the children allocate theirs

    results: list[harness.BenchResult] = []
    for t in a.threads:
        out = harness.run_in_subprocess(
            "qtvm.bench.peers:benchmark_peers",
            {
                "shapes": [list(s) for s in a.shapes],
                "threads": t,
                "peers": a.peers,
                "group_size": a.group_size,
                "ort_shared_pool": not a.ort_per_session_threads,
                "reference_bw": bw[t],
                "rounds": a.rounds,
                "quiet_wait_s": a.wait_quiet,
            },
            harness.thread_env(t),
        )
        results += [harness.BenchResult.from_dict(d).with_bandwidth(bw.get(t)) for d in out["results"]]

    results.sort(key=lambda r: (r.shape, r.threads))
    print()
    # %BW: of the bandwidth measured at the start; pct_of_probe_bw: of the
    # bandwidth probed between the interleaved timing rounds of that shape.
    harness.print_table(results, bw, baseline="torch_fp32_mv", extras=("pct_of_probe_bw", "n_copies"))
    if a.json:
        harness.write_json(results, a.json, {**harness.machine_meta(bw), "cpu_busy_before": busy})
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
