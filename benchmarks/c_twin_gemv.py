"""Is the int8 GEMV's gap to the bandwidth probe in its code or in the memory it reads?

Times, in one process and interleaved (order rotated each round), on the same rotated copies:

* qtvm's int4-g128 ``--act int8`` GEMV, as ``qtvm bench gemv`` builds it;
* a C twin of its hot loop (written here, gcc -O3 -march=native): the same arrays (weights
  column-blocked 64 wide, fp32 scales and zeros per group), read in the same order (per
  32-value block four 16-column steps, each four 256-byte-strided lines, prefetched 6 KiB ahead
  into L2) with the same work per line (two masks and two ``vpdpbusd`` per line, a shift, a
  convert and an FMA per step). It does not compute the product: it is a twin of the traffic
  and the instruction mix, so where it reads no faster than the TVM kernel the code is not
  what holds the kernel back;
* the bandwidth probe (``qtvm.bench.bandwidth``, best of 1, 2, 4 streams) on its own buffer as
  large as the rotation.

    python benchmarks/c_twin_gemv.py                      # the bench's rotation, then 8 GiB
    python benchmarks/c_twin_gemv.py --rotations-mib 0 4096 --json out/twin.json

Needs gcc, AVX-512 VNNI (the twin's intrinsics) and about twice the largest rotation in RAM (the
probe's buffer is as large as the rotation). One thread unless ``--threads`` (the twin then splits its
column blocks between OpenMP threads, evenly, as TVM's parallel loop does; the qtvm kernel rounds x
itself, serially before its parallel loop, which the twin does not), weights on
huge pages as the bench puts them (glibc.malloc.hugetlb=1, set here before anything allocates).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TWIN_C = r"""
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* One call: the column blocks of one copy, as qtvm's kernel walks them (see the module docstring);
   with threads > 1 the blocks split evenly between OpenMP threads, as TVM's parallel loop splits them. */
float twin_gemv(const uint8_t *w, const float *scales, const float *zeros, size_t n_blocks, size_t rows,
                size_t groups, int prefetch_bytes, const int8_t *x, int threads) {
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8((char)0xf0);
    const size_t blocks_per_group = rows / 4 / groups;   /* 32-value blocks (4 rows of 256 B) a group */
    float total = 0.0f;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(+:total)
    for (size_t cb = 0; cb < n_blocks; ++cb) {
        const uint8_t *wb = w + cb * rows * 256;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (size_t g = 0; g < groups; ++g) {
            __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (size_t b = 0; b < blocks_per_group; ++b) {
                const size_t blk = g * blocks_per_group + b;
                const uint8_t *p = wb + blk * 1024;
                const int32_t *xa = (const int32_t *)(x + (blk * 32) % 4096);
                for (int s = 0; s < 4; ++s) {
                    if (prefetch_bytes)
                        for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)p + r * 256 + s * 64 + prefetch_bytes, _MM_HINT_T1);
                    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                    for (int r = 0; r < 4; ++r) {
                        __m512i v = _mm512_load_si512(p + r * 256 + s * 64);
                        d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(v, lo), _mm512_set1_epi32(xa[2 * r]));
                        d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(v, hi), _mm512_set1_epi32(xa[2 * r + 1]));
                    }
                    d0 = _mm512_add_epi32(d0, _mm512_srai_epi32(d1, 4));
                    part[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(1.0f / (1 + s)), part[s]);
                }
            }
            const float *sc = scales + (cb * groups + g) * 64, *ze = zeros + (cb * groups + g) * 64;
            for (int s = 0; s < 4; ++s)
                acc[s] = _mm512_fmadd_ps(part[s], _mm512_loadu_ps(sc + 16 * s), _mm512_add_ps(acc[s], _mm512_loadu_ps(ze + 16 * s)));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
    return total;
}
"""


def build_twin() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp(prefix="qtvm-twin-")) / "twin.so"
    src = out.with_suffix(".c")
    src.write_text(TWIN_C)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out)],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.twin_gemv.restype = ctypes.c_float
    lib.twin_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return lib


def twin_layout(copy) -> tuple[list[int], int, int, int]:
    """(addresses of weights, scales, zeros; column blocks, packed rows, groups) of one copy, after
    checking they are laid out as the twin reads them (int32 rows of 64 columns, eight 4-bit codes
    a word, a scale and a zero per group and column); raises ValueError naming what differs."""
    import torch

    qweight, scales, zeros = copy._weights
    n_blocks, rows, cols = qweight.shape
    if (cols, str(qweight.dtype), rows % 4) != (64, "int32", 0):
        raise ValueError(f"the kernel's weights are {tuple(qweight.shape)} {qweight.dtype}; the twin reads int32 rows "
                         "of 64 columns (an AVX-512 host's column block)")
    groups = scales.shape[1]
    if tuple(scales.shape) != (n_blocks, groups, 64) or tuple(zeros.shape) != tuple(scales.shape) \
            or (rows // 4) % groups or rows * 8 != groups * 128:
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} are not one per 128-value group "
                         f"of {rows * 8} and column block: the twin no longer matches the kernel")
    return [torch.from_dlpack(a).data_ptr() for a in copy._weights], n_blocks, rows, groups


def measure(k: int, n: int, rotation_bytes: int | None, rounds: int, calls: int, threads: int = 1) -> dict:
    import numpy as np

    from qtvm.bench import harness
    from qtvm.bench.bandwidth import BandwidthProbe
    from qtvm.bench.gemv import QtvmGemv

    rng = np.random.default_rng(0)
    gemv = QtvmGemv((rng.standard_normal((k, n)) * 0.05).astype(np.float32), "int4-g128", "int8")
    gemv.set_input(rng.standard_normal(k).astype(np.float32))
    copies = harness.rotating_copies(lambda i: gemv if i == 0 else gemv.copy(), gemv.weight_bytes, rotation_bytes)
    _, n_blocks, rows, groups = twin_layout(copies[0])
    addresses = [twin_layout(c)[0] for c in copies]
    twin, x8 = build_twin(), np.zeros(4096, np.int8)
    probe = BandwidthProbe(max(len(copies) * gemv.weight_bytes, 256 << 20), huge_pages=True)
    cursor = {"i": 0}

    def rotated(call):
        def turn() -> float:  # as ``qtvm bench gemv`` times a turn: every copy once, then the timed calls
            times = []
            for it in range(len(copies) + calls):
                c = cursor["i"] % len(copies)
                cursor["i"] += 1
                t0 = time.perf_counter_ns()
                call(c)
                if it >= len(copies):
                    times.append(time.perf_counter_ns() - t0)
            return gemv.weight_bytes / statistics.median(times)
        return turn

    kinds = {
        "qtvm kernel": rotated(lambda c: copies[c].run()),
        "C twin": rotated(lambda c: twin.twin_gemv(*addresses[c], n_blocks, rows, groups, 6144, x8.ctypes.data,
                                                    threads)),
        "probe": lambda: probe.measure(threads, repeats=1, streams=(1, 2, 4)),
    }
    names = list(kinds)
    got = {name: [] for name in names}
    for r in range(rounds):
        for j in harness.turn_order(len(names), r):
            got[names[j]].append(kinds[names[j]]())
    return {"copies": len(copies), "rotation_gib": len(copies) * gemv.weight_bytes / 2**30,
            "gbps": {name: statistics.median(v) for name, v in got.items()}, "rounds": got}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x4096", help="KxN")
    ap.add_argument("--rotations-mib", type=int, nargs="+", default=[0, 8192],
                    help="total bytes of the rotated copies (0: the bench's default, > 4x L3)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=86, help="timed calls a turn")
    ap.add_argument("--threads", type=int, default=1, help="threads of the kernel, the twin and the probe")
    ap.add_argument("--json", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from qtvm.bench import harness

    k, n = (int(v) for v in args.shape.lower().split("x"))
    rows = []
    print(harness.cpu_named(), flush=True)
    for mib in args.rotations_mib:
        row = measure(k, n, (mib << 20) or None, args.rounds, args.calls, args.threads)
        g = row["gbps"]
        cells = ", ".join(f"{name} {v:5.2f} GB/s ({100 * v / g['probe']:3.0f}%)" for name, v in g.items() if name != "probe")
        print(f"{args.threads} thread(s), rotation {row['rotation_gib']:5.2f} GiB ({row['copies']} copies): {cells}; "
              f"probe {g['probe']:5.2f}", flush=True)
        rows.append(row)
    if args.json:
        harness.write_json([], args.json, {"shape": [k, n], "threads": args.threads, "twin": rows})
    return 0


if __name__ == "__main__":
    if not os.environ.get("QTVM_TWIN_CHILD"):  # glibc reads its tunables at start-up only: re-run with them
        from qtvm.bench.harness import thread_env

        env = {**os.environ, **thread_env(parse_args().threads), "QTVM_TWIN_CHILD": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    raise SystemExit(main())
