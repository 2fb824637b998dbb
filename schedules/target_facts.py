"""What a schedule needs to know about an x86 CPU target.

``cpu_facts(target)`` turns a TVM LLVM target into a :class:`CpuFacts`: vector
ISA, width, register count, FMA throughput and cache sizes.  The analytic model
(``schedules/model.py``) and the x86 schedule rules read only these facts.

Where the facts come from
-------------------------
* **The host** -- when the target's ``mcpu`` is unset, ``"native"``, or equal to
  the CPU name the host's LLVM reports (``llvm_get_system_cpu()``): the ISA from
  the ``flags`` line of ``/proc/cpuinfo`` (``avx512f`` -> AVX-512; ``avx2`` and
  ``fma`` -> AVX2), cache sizes from ``/sys/devices/system/cpu/cpu0/cache``, the
  core count from the CPUs this process may run on (``os.sched_getaffinity``,
  else ``os.cpu_count()``).  FMA/ALU port counts come from the table entry of
  the host's LLVM CPU name when it has one, else from ISA defaults.
* **A table** (:data:`CPU_TABLE`) for every other ``mcpu``: documented cache sizes
  of a representative part of that micro-architecture.  An ``mcpu`` that is
  neither the host nor in the table raises ``ValueError``.

``mattr`` then adjusts the ISA: ``+avx512f`` turns on AVX-512 facts on any CPU
(LLVM's ``avx512f`` implies ``avx2`` and ``fma``), ``-avx512f`` turns them off,
``+avx2`` lifts a baseline (SSE) CPU to AVX2 and ``-avx2`` drops to baseline.

Caveat for the pipeline: TVM 0.27 (LLVM 22) compiles a target *without* ``mcpu``
-- and one with ``mcpu="native"``, which LLVM rejects with "not valid ... using
default -mcpu=generic" -- for baseline x86-64 (SSE2).  The facts still describe
the host, as the target is meant for it, but code that calls AVX2 intrinsics
needs the CPU spelled out: use :func:`resolve_host_target` before building.

Definitions of the fields are on :class:`CpuFacts`.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

__all__ = [
    "CpuFacts",
    "CPU_TABLE",
    "ISA_RANK",
    "cpu_facts",
    "host_facts",
    "host_isa",
    "host_llvm_cpu",
    "host_supports",
    "known_mcpus",
    "resolve_host_target",
    "table_facts",
]

#: ISAs ordered by what they include: code for a lower rank runs on a higher one.
ISA_RANK: Mapping[str, int] = {"generic": 0, "avx2": 1, "avx512": 2}

#: Per-ISA register file: (vector bits, architectural vector registers in 64-bit mode).
_ISA_REGS: Mapping[str, tuple[int, int]] = {
    "generic": (128, 16),  # SSE2: 16 xmm
    "avx2": (256, 16),  # 16 ymm
    "avx512": (512, 32),  # 32 zmm
}

_KIB = 1024
_MIB = 1024 * 1024


@dataclass(frozen=True)
class CpuFacts:
    """Facts about one x86 CPU target, as the code generated for it sees them.

    isa:              "avx2" | "avx512" | "generic" (baseline SSE, 128-bit).
    vector_bits:      width of the vectors the code uses (256, 512, 128).
    f32_lanes:        fp32 lanes per vector (vector_bits // 32).
    vector_registers: architectural vector registers (AVX2: 16 ymm; AVX-512: 32 zmm;
                      SSE: 16 xmm).
    fma_ports:        full-width (``vector_bits``) FMA instructions that can issue per
                      cycle.  Zen 4 runs a 512-bit FMA as two halves on its two
                      256-bit pipes, so its AVX-512 value is 1; for the baseline ISA,
                      which has no FMA, it is the mul+add pairs per cycle (1).
    vector_alu_ports: full-width vector instructions of any kind (shift, and,
                      convert, FMA) that can issue per cycle; the unpack of packed
                      weights is limited by this, not by ``fma_ports``.
    l1d_bytes:        L1 data cache of one core.
    l2_bytes:         L2 cache of one core.
    l3_bytes:         L3 one core can reach (AMD: its CCX's L3, as sysfs reports it;
                      Intel: the whole shared L3).
    cores:            cores (host: CPUs this process may use; table: the
                      representative part; a target's ``num-cores`` overrides both).
    freq_ghz:         sustained all-core clock used for peak-rate estimates (table:
                      the representative part's base clock).
    prefetch_bytes:   how far ahead of its loads a weight-streaming kernel prefetches,
    prefetch_locality: into which cache (llvm.prefetch locality: 3 = L1, 2 = L2), and
    prefetch_source:  where that pair comes from: "default" (measured on the Intel Xeon
                      VM the first benchmarks ran on: 6 KiB into L2) or the table row's
                      measurement, which names its CPU; ``qtvm tune`` finds the pair per
                      machine (``schedules.tune_a8``).
    a8_pass_cols:     columns of one pass of the int8 GEMV over a group's rows (a multiple of
                      16), 0 = the whole column block in one pass (the default, measured on the
    a8_pass_source:   Intel Xeon VM); where a table row measured otherwise, it names its CPU.
    a8_fold_group:    the group size (values) whose int8 GEMV folds two groups' partials into its
    a8_fold_source:   accumulators at once, 0 = every group as it ends (the default); a measured
                      row names the one group size that streamed faster so on its CPU.
    prefill_prefetch: whether the int8 prefill kernel (4-row tiles: compute-bound) prefetches
    prefill_prefetch_source: its weights like the GEMV (default) or not (a measured row).
    lut_prefetch_bytes:     how far ahead the 16-entry LUT GEMV (BCQ) prefetches its bit stream,
    lut_a8_prefetch_bytes:  fp32 tables and int16 tables (``--act int8``); the defaults were
    lut_prefetch_source:    measured on AMD Zen 5 (``qtvm.intrin.x86_lut``), a row names its CPU.
    bcq_a8_prefetch_bytes:  the same distance for the int8 nibble-table BCQ GEMV (``qtvm.bcq_a8_gemv``);
    bcq_a8_prefetch_source: None = the int16 tables' (``lut_a8_prefetch_bytes``), else a row's measurement.
    mcpu:             the LLVM CPU name these facts describe.
    source:           "host" (read from this machine) or "table".
    """

    isa: str
    vector_bits: int
    f32_lanes: int
    vector_registers: int
    fma_ports: int
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int
    cores: int
    vector_alu_ports: int = 2
    freq_ghz: float = 2.5
    mcpu: str = ""
    source: str = "table"
    prefetch_bytes: int = 6144
    prefetch_locality: int = 2
    prefetch_source: str = "default"
    a8_pass_cols: int = 0
    a8_pass_source: str = "default"
    a8_fold_group: int = 0
    a8_fold_source: str = "default"
    prefill_prefetch: bool = True
    prefill_prefetch_source: str = "default"
    lut_prefetch_bytes: int = 6144
    lut_a8_prefetch_bytes: int = 4096
    lut_prefetch_source: str = "default"
    bcq_a8_prefetch_bytes: int | None = None
    bcq_a8_prefetch_source: str = "default"

    def __post_init__(self) -> None:
        if self.isa not in ISA_RANK:
            raise ValueError(f"isa must be one of {sorted(ISA_RANK)}, got {self.isa!r}")
        if self.vector_bits not in (128, 256, 512):
            raise ValueError(f"vector_bits must be 128, 256 or 512, got {self.vector_bits}")
        if self.f32_lanes * 32 != self.vector_bits:
            raise ValueError(
                f"f32_lanes ({self.f32_lanes}) must equal vector_bits/32 ({self.vector_bits // 32})"
            )
        for name in ("vector_registers", "fma_ports", "vector_alu_ports", "l1d_bytes", "cores"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("l2_bytes", "l3_bytes"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.freq_ghz <= 0:
            raise ValueError(f"freq_ghz must be > 0, got {self.freq_ghz}")
        if self.source not in ("host", "table"):
            raise ValueError(f"source must be 'host' or 'table', got {self.source!r}")

    @property
    def l1d_bits(self) -> int:
        return 8 * self.l1d_bytes

    @property
    def peak_fma_per_second(self) -> float:
        """Full-width FMA instructions per second on one core."""
        return self.fma_ports * self.freq_ghz * 1e9

    @property
    def peak_gflops(self) -> float:
        """fp32 GFLOP/s of all cores (an FMA is 2 flops per lane)."""
        return 2.0 * self.f32_lanes * self.fma_ports * self.freq_ghz * self.cores


@dataclass(frozen=True)
class _CpuSpec:
    """One row of the per-mcpu table (a representative part of the micro-architecture).

    ``fma256``/``valu256`` are the per-cycle rates of 256-bit instructions, used when
    the facts end up AVX2 (also for an AVX-512 CPU whose target says ``-avx512f``);
    ``fma512``/``valu512`` the rates of 512-bit ones.  The baseline ISA uses
    ``fma256``/``valu256`` too (128-bit ops issue at least as fast).
    """

    isa: str
    l1d: int
    l2: int
    l3: int
    cores: int
    freq_ghz: float
    fma256: int
    valu256: int
    fma512: int = 1
    valu512: int = 2
    part: str = ""
    # CpuFacts fields this row sets from a measurement on the CPU (each ``*_source`` names it)
    measured: Mapping[str, Any] = field(default_factory=dict)


# Sources: vendor product pages (cores, clocks, cache sizes) and the
# micro-architecture manuals / Agner Fog's tables (port counts).  l3 is what one
# core reaches: AMD = one CCX's L3 (Zen 2: 16 MiB per 4-core CCX; Zen 3/4/5: 32 MiB
# per 8-core CCD), Intel = the chip's shared L3.
_TABLE: dict[str, _CpuSpec] = {
    # AMD
    "znver1": _CpuSpec("avx2", 32 * _KIB, 512 * _KIB, 8 * _MIB, 32, 2.2,
                       fma256=1, valu256=2, part="EPYC 7601 (256-bit ops split in two 128-bit halves)"),
    "znver2": _CpuSpec("avx2", 32 * _KIB, 512 * _KIB, 16 * _MIB, 64, 2.25,
                       fma256=2, valu256=4, part="EPYC 7742"),
    "znver3": _CpuSpec("avx2", 32 * _KIB, 512 * _KIB, 32 * _MIB, 64, 2.45,
                       fma256=2, valu256=4, part="EPYC 7763"),
    "znver4": _CpuSpec("avx512", 32 * _KIB, 1 * _MIB, 32 * _MIB, 96, 2.4,
                       fma256=2, valu256=4, fma512=1, valu512=2,
                       part="EPYC 9654 (512-bit ops double-pumped on 256-bit pipes)",
                       measured={
                           "prefetch_bytes": 2048, "prefetch_locality": 2,
                           "prefetch_source": "AMD EPYC Zen 4 VM (family 25 model 17, 2 vCPUs): DRAM-cold int4-g128 "
                                              "int8 GEMVs, 4096^2 / 4096x11008 / 11008x4096, interleaved A/B in one "
                                              "process: 2 KiB into L2 1.16-1.59x faster than the 6 KiB default at 1 "
                                              "thread, 1.13-1.19x at 2; 1-3 KiB alike, 4 KiB and more, 16-column "
                                              "passes and any prefetch into L1 slower (L1: 0.6-0.8x)",
                           "a8_fold_group": 64,
                           "a8_fold_source": "AMD EPYC Zen 4 VM (2 vCPUs): int8 GEMVs, 1 thread, DRAM-cold, "
                                             "interleaved: two groups' partials zeroed together and folded at once "
                                             "1.21-1.31x faster for int4-g64 (4096^2, 11008 x 4096; 4 runs, the "
                                             "last with this schedule: 452 vs 565 us), 1.37-1.38x for int2-g64 "
                                             "(2 runs), same outputs bit for bit; cache-hot within 3%; one run under "
                                             "heavy host contention, kernels alternating call by call: 1.05x / "
                                             "0.95x; slower elsewhere: int4-g128 two groups at once 0.90x, int4-g32 two "
                                             "or four 0.87x / 0.80x. The fold's blocks as one loop (not each group's "
                                             "two blocks unrolled into one body): 1.03-1.2x faster again for int4, "
                                             "int3, e0m4 and int2 with groups of 64 (three shapes, medians of 3 "
                                             "rounds); folding four groups so 0.7x, int4-g32 two 0.86x",
                           "prefill_prefetch": False,
                           "prefill_prefetch_source": "AMD EPYC Zen 4 VM (2 vCPUs): int8 prefill kernel without "
                                                      "software prefetch 1.14-1.21x faster at M = 64, 0.97-1.13x at "
                                                      "M = 16 (1 thread, the three LLaMA shapes, interleaved)",
                           "lut_a8_prefetch_bytes": 2048,
                           "lut_prefetch_source": "AMD EPYC Zen 4 VM (2 vCPUs): bcq3-g128 int8-activation decode, "
                                                  "DRAM-cold, interleaved A/B: bit stream 1-2 KiB ahead 1.29-1.41x "
                                                  "faster than 4 KiB, 8 KiB 1.05-1.13x; the fp32-table kernel is "
                                                  "compute-bound here (~10 GB/s), its distance makes no difference"}),
    "znver5": _CpuSpec("avx512", 48 * _KIB, 1 * _MIB, 32 * _MIB, 128, 2.7,
                       fma256=2, valu256=4, fma512=2, valu512=4, part="EPYC 9755 (native 512-bit pipes)",
                       measured={
                           "prefetch_bytes": 6144, "prefetch_locality": 3,
                           "prefetch_source": "AMD EPYC Zen 5 VM (2 vCPUs): DRAM-cold int8 GEMVs with 16-column "
                                              "passes, interleaved A/B: 6 KiB into L1 1.01-1.07x faster than 4 KiB "
                                              "(int4, int3; 1 and 2 threads), 1.25x faster than 2 KiB; with "
                                              "whole-row passes 4 KiB into L1 was best, ~1.2x faster than 6 KiB "
                                              "into L2",
                           "a8_pass_cols": 16,
                           "a8_pass_source": "AMD EPYC Zen 5 VM (2 vCPUs): DRAM-cold int8 GEMVs, interleaved A/B in "
                                             "one process, 1 thread: 16-column passes 1.11-1.30x faster than whole "
                                             "64-column rows at K = 5504 / 11008 / 14336 (int4, int3), 0.98-1.04x "
                                             "at K = 4096 / 8192",
                           "prefill_prefetch": False,
                           "prefill_prefetch_source": "AMD EPYC Zen 5 VM (2 vCPUs): int8 prefill kernel without "
                                                      "software prefetch 1.01-1.15x faster weights-cold, 1.15-1.25x "
                                                      "hot (M = 4-128, 1 and 2 threads, interleaved A/B)",
                           "bcq_a8_prefetch_bytes": 0,
                           "bcq_a8_prefetch_source": "AMD EPYC Zen 5 VM (family 26 model 2, 2 vCPUs), 2026-12-02: "
                                                     "bcq3-g128 int8 nibble-table decode, DRAM-cold, interleaved A/B "
                                                     "in one process (4096^2, 11008x4096, 4096x11008; 3 runs of 7-9 "
                                                     "rounds): no software prefetch 1.34-1.63x faster than 4 KiB at 1 "
                                                     "thread on 4 of 5 shape-runs (0.88x on one), 1.09-1.19x at 2; "
                                                     "1 / 2 KiB 0.64-0.92x of none. Against the int16 tables: with "
                                                     "none 1.09-1.71x at 1 thread in two runs (0.87-1.28x in the "
                                                     "first), with 4 KiB 0.70-0.79x"}),
    # Intel client
    "haswell": _CpuSpec("avx2", 32 * _KIB, 256 * _KIB, 8 * _MIB, 4, 3.4,
                        fma256=2, valu256=3, part="Core i7-4770"),
    "broadwell": _CpuSpec("avx2", 32 * _KIB, 256 * _KIB, 6 * _MIB, 4, 3.3,
                          fma256=2, valu256=3, part="Core i7-5775C"),
    "skylake": _CpuSpec("avx2", 32 * _KIB, 256 * _KIB, 8 * _MIB, 4, 4.0,
                        fma256=2, valu256=3, part="Core i7-6700K"),
    "icelake-client": _CpuSpec("avx512", 48 * _KIB, 512 * _KIB, 8 * _MIB, 4, 1.3,
                               fma256=2, valu256=3, fma512=1, valu512=2, part="Core i7-1065G7"),
    "tigerlake": _CpuSpec("avx512", 48 * _KIB, 1280 * _KIB, 12 * _MIB, 4, 3.0,
                          fma256=2, valu256=3, fma512=1, valu512=2, part="Core i7-1185G7"),
    "rocketlake": _CpuSpec("avx512", 48 * _KIB, 512 * _KIB, 16 * _MIB, 8, 3.5,
                           fma256=2, valu256=3, fma512=1, valu512=2, part="Core i9-11900K",
                           measured={
                               "a8_fold_group": 128,
                               "a8_fold_source": "Intel Xeon VM that LLVM names rocketlake (family 6 model 167, "
                                                 "480 MiB L3, 2 vCPUs): int8 GEMVs, DRAM-cold, interleaved A/B "
                                                 "in one process, 5 rounds: two groups of 128 folded at once "
                                                 "1.02-1.08x faster at 4096 x 11008 (int4, int3, int2; 1 and 2 "
                                                 "threads), 0.98-1.01x at 4096^2 and 11008 x 4096 (int4, int3), "
                                                 "e0m4 1.02x; int4-g64 folded two 0.98x, four 0.94x"}),
    "alderlake": _CpuSpec("avx2", 48 * _KIB, 1280 * _KIB, 30 * _MIB, 16, 3.2,
                          fma256=2, valu256=3, part="Core i9-12900K (P-core caches; 8P+8E)"),
    # Intel server (Gold 6xxx / Platinum parts: two 512-bit FMA units per core)
    "skylake-avx512": _CpuSpec("avx512", 32 * _KIB, 1 * _MIB, 27 * _MIB + 512 * _KIB, 20, 2.4,
                               fma256=2, valu256=3, fma512=2, valu512=2, part="Xeon Gold 6148"),
    "cascadelake": _CpuSpec("avx512", 32 * _KIB, 1 * _MIB, 27 * _MIB + 512 * _KIB, 20, 2.5,
                            fma256=2, valu256=3, fma512=2, valu512=2, part="Xeon Gold 6248"),
    "icelake-server": _CpuSpec("avx512", 48 * _KIB, 1280 * _KIB, 60 * _MIB, 40, 2.3,
                               fma256=2, valu256=3, fma512=2, valu512=2, part="Xeon Platinum 8380"),
    "sapphirerapids": _CpuSpec("avx512", 48 * _KIB, 2 * _MIB, 105 * _MIB, 56, 2.0,
                               fma256=2, valu256=3, fma512=2, valu512=2, part="Xeon Platinum 8480+"),
    "emeraldrapids": _CpuSpec("avx512", 48 * _KIB, 2 * _MIB, 320 * _MIB, 64, 1.9,
                              fma256=2, valu256=3, fma512=2, valu512=2, part="Xeon Platinum 8592+",
                              measured={
                                  "prefetch_bytes": 4096, "prefetch_locality": 3,
                                  "prefetch_source": "Intel Xeon Emerald Rapids VM (2 vCPUs): DRAM-cold int4-g128 "
                                                     "int8 GEMVs, 4096^2 / 4096x11008 / 11008x4096, 1 and 2 "
                                                     "threads, interleaved A/B, three runs: 4 KiB into L1 "
                                                     "0.99-1.14x the 6 KiB-into-L2 default (median 1.03x, "
                                                     "slower in 2 of 12); 8 and 16 KiB, 16-column passes and "
                                                     "no prefetch slower"}),
    # Generic ISA levels: conservative stand-ins (no particular part).
    "x86-64": _CpuSpec("generic", 32 * _KIB, 256 * _KIB, 8 * _MIB, 4, 2.5,
                       fma256=1, valu256=2, part="baseline x86-64 (SSE2)"),
    "x86-64-v2": _CpuSpec("generic", 32 * _KIB, 256 * _KIB, 8 * _MIB, 4, 2.5,
                          fma256=1, valu256=2, part="x86-64-v2 (SSE4.2)"),
    "x86-64-v3": _CpuSpec("avx2", 32 * _KIB, 512 * _KIB, 16 * _MIB, 8, 2.5,
                          fma256=2, valu256=3, part="x86-64-v3 (AVX2+FMA)"),
    "x86-64-v4": _CpuSpec("avx512", 32 * _KIB, 1 * _MIB, 16 * _MIB, 8, 2.5,
                          fma256=2, valu256=3, fma512=1, valu512=2,
                          part="x86-64-v4 (AVX-512; one 512-bit FMA, the lowest common denominator)"),
}
_TABLE["generic"] = _TABLE["x86-64"]  # LLVM's own name for the baseline CPU
#: mcpu -> representative part (read-only).
CPU_TABLE: Mapping[str, _CpuSpec] = MappingProxyType(_TABLE)

_HOST_MCPU_ALIASES = ("", "native", "host")


def known_mcpus() -> list[str]:
    """The ``mcpu`` names the table covers (besides the host's own name)."""
    return sorted(CPU_TABLE)


# --------------------------------------------------------------------------- host


@functools.lru_cache(maxsize=1)
def host_llvm_cpu() -> str:
    """The CPU name the host's LLVM (the one inside TVM) gives this machine."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


def _cpuinfo_text() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def _host_flags() -> frozenset[str]:
    for line in _cpuinfo_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    # No /proc/cpuinfo (not Linux): ask LLVM what the host CPU has.
    try:
        import tvm
        from tvm.target import codegen

        t = tvm.target.Target({"kind": "llvm", "mcpu": host_llvm_cpu()})
        return frozenset(str(f) for f in codegen.llvm_get_cpu_features(t))
    except Exception:  # pragma: no cover - no TVM and no /proc
        return frozenset()


def _isa_from_flags(flags: frozenset[str]) -> str:
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "generic"


def host_isa() -> str:
    """The widest ISA this machine (and its OS) runs: "avx512", "avx2" or "generic".

    Read from the ``flags`` line of /proc/cpuinfo, which Linux clears for features
    the OS does not enable.
    """
    return _isa_from_flags(_host_flags())


def host_supports(facts: CpuFacts) -> bool:
    """Can this machine run code built for ``facts``?  (AVX-512 code on an AVX2 host: no.)"""
    return ISA_RANK[host_isa()] >= ISA_RANK[facts.isa]


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)", re.IGNORECASE)


def _parse_size(text: str) -> int:
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse cache size {text!r}")
    scale = {"": 1, "K": _KIB, "M": _MIB, "G": 1024 * _MIB}[m.group(2).upper()]
    return int(m.group(1)) * scale


def _read_host_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[int, int]:
    """{level: bytes} of the data/unified caches of cpu0 (empty if sysfs has none)."""
    sizes: dict[int, int] = {}
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text().strip())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            sizes[level] = size
    return sizes


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _host_freq_ghz(default: float) -> float:
    """Base clock if cpufreq exposes it, else the "cpu MHz" of /proc/cpuinfo (VMs
    report the TSC clock there), else ``default``."""
    base = Path("/sys/devices/system/cpu/cpu0/cpufreq/base_frequency")
    try:
        return int(base.read_text().strip()) / 1e6  # kHz -> GHz
    except (OSError, ValueError):
        pass
    for line in _cpuinfo_text().splitlines():
        if line.startswith("cpu MHz"):
            try:
                return float(line.split(":", 1)[1]) / 1e3
            except ValueError:
                break
    return default


_ISA_DEFAULT_SPEC = {
    "generic": CPU_TABLE["x86-64"],
    "avx2": CPU_TABLE["x86-64-v3"],
    "avx512": _CpuSpec("avx512", 32 * _KIB, 1 * _MIB, 16 * _MIB, 8, 2.5,
                       fma256=2, valu256=3, fma512=2, valu512=2),
}


def _host_spec() -> tuple[str, _CpuSpec]:
    """(host isa, a _CpuSpec filled from this machine)."""
    isa = host_isa()
    try:
        name = host_llvm_cpu()
    except Exception:  # pragma: no cover - TVM missing
        name = ""
    ref = CPU_TABLE.get(name, _ISA_DEFAULT_SPEC[isa])
    caches = _read_host_caches()
    spec = replace(  # the row's rates and measured facts, this machine's caches, cores and clock
        ref,
        isa=isa,
        l1d=caches.get(1, ref.l1d),
        l2=caches.get(2, ref.l2),
        l3=caches.get(3, ref.l3),
        cores=_host_cores(),
        freq_ghz=_host_freq_ghz(ref.freq_ghz),
        part=f"host ({name or 'unknown'})",
    )
    return name, spec


def host_facts() -> CpuFacts:
    """Facts of this machine (what ``cpu_facts`` returns for a target without mcpu)."""
    name, spec = _host_spec()
    return _facts_from_spec(spec, spec.isa, name, "host", cores=None)


# ----------------------------------------------------------------------- targets


def _target_attrs(target: Any) -> tuple[str, Mapping[str, Any]]:
    import tvm

    if isinstance(target, Mapping):
        target = tvm.target.Target(dict(target))
    if not isinstance(target, tvm.target.Target):
        raise TypeError(f"cpu_facts expects a tvm.target.Target (or its dict), got {type(target).__name__}")
    return str(target.kind.name), target.attrs


def _mattr_list(raw: Any) -> list[str]:
    if raw is None:
        return []
    items = [raw] if isinstance(raw, str) else [str(x) for x in raw]
    out: list[str] = []
    for item in items:
        out.extend(p.strip() for p in item.split(",") if p.strip())
    return out


def _apply_mattr(isa: str, mattr: list[str]) -> str:
    """Adjust ``isa`` by +/- feature flags, in order (LLVM semantics: avx512f implies avx2, fma)."""
    for feat in mattr:
        sign, name = feat[0], feat[1:]
        if sign not in "+-":
            raise ValueError(f"mattr entries must start with '+' or '-', got {feat!r}")
        if name == "avx512f":
            isa = "avx512" if sign == "+" else ("avx2" if isa == "avx512" else isa)
        elif name == "avx2":
            if sign == "+":
                isa = "avx2" if isa == "generic" else isa
            else:
                isa = "generic"
    return isa


def _facts_from_spec(spec: _CpuSpec, isa: str, mcpu: str, source: str, cores: int | None) -> CpuFacts:
    bits, regs = _ISA_REGS[isa]
    if isa == "avx512":
        fma, valu = spec.fma512, spec.valu512
    else:
        fma, valu = spec.fma256, spec.valu256
    return CpuFacts(
        isa=isa,
        vector_bits=bits,
        f32_lanes=bits // 32,
        vector_registers=regs,
        fma_ports=fma,
        l1d_bytes=spec.l1d,
        l2_bytes=spec.l2,
        l3_bytes=spec.l3,
        cores=int(cores) if cores else spec.cores,
        vector_alu_ports=valu,
        freq_ghz=spec.freq_ghz,
        mcpu=mcpu,
        source=source,
        **spec.measured,
    )


def _is_host_mcpu(mcpu: str) -> bool:
    if mcpu in _HOST_MCPU_ALIASES:
        return True
    try:
        return mcpu == host_llvm_cpu()
    except Exception:  # pragma: no cover - TVM missing
        return False


def cpu_facts(target: Any) -> CpuFacts:
    """Facts of an x86 LLVM target, e.g. ``Target({"kind": "llvm", "mcpu": "znver2"})``.

    Host when ``mcpu`` is unset, ``"native"`` or the host's LLVM CPU name; otherwise
    the :data:`CPU_TABLE` row.  ``mattr`` adjusts the ISA; ``num-cores`` overrides
    ``cores``.  Raises ``ValueError`` for a non-LLVM or non-x86 target and for an
    ``mcpu`` the table does not know (the message lists the known names).
    """
    kind, attrs = _target_attrs(target)
    if kind != "llvm":
        raise ValueError(f"cpu_facts needs an LLVM (CPU) target, got kind {kind!r}")
    triple = str(attrs.get("mtriple", "") or "")
    if triple and not re.match(r"^(x86_64|amd64|i[3-6]86)", triple):
        raise ValueError(f"cpu_facts covers x86 only; target triple is {triple!r}")
    mcpu = str(attrs.get("mcpu", "") or "")
    mattr = _mattr_list(attrs.get("mattr", None))
    num_cores = attrs.get("num-cores", None)
    num_cores = int(num_cores) if num_cores is not None and int(num_cores) > 0 else None

    if _is_host_mcpu(mcpu):
        name, spec = _host_spec()
        described = name if mcpu in _HOST_MCPU_ALIASES else mcpu
        return _facts_from_spec(spec, _apply_mattr(spec.isa, mattr), described, "host", num_cores)
    if mcpu not in CPU_TABLE:
        raise ValueError(
            f"unknown mcpu {mcpu!r}: not this host ({_safe_host_name()!r}) and not in the "
            f"table of known CPUs ({_llvm_opinion(mcpu, triple)}); known: {', '.join(known_mcpus())}"
        )
    return table_facts(mcpu, mattr, cores=num_cores)


def schedule_facts(target: Any):
    """What a schedule rule reads for ``target``: :func:`cpu_facts`, or for an ``mcpu`` the
    table does not know the defaults (the :class:`CpuFacts` field defaults, no measured row)."""
    try:
        return cpu_facts(target)
    except ValueError:
        return CpuFacts


def table_facts(mcpu: str, mattr: Any = (), *, cores: int | None = None) -> CpuFacts:
    """Facts of ``mcpu`` from :data:`CPU_TABLE` alone (never the host), adjusted by
    ``mattr`` (a list of "+feat"/"-feat", or a comma-separated string)."""
    spec = CPU_TABLE.get(mcpu)
    if spec is None:
        raise ValueError(f"unknown mcpu {mcpu!r}; known: {', '.join(known_mcpus())}")
    isa = _apply_mattr(spec.isa, _mattr_list(mattr))
    return _facts_from_spec(spec, isa, mcpu, "table", cores)


def _llvm_opinion(mcpu: str, triple: str) -> str:
    try:
        from tvm.target import codegen

        valid = bool(codegen.llvm_is_valid_cpu(mcpu, triple or "x86_64-linux-gnu"))
    except Exception:  # pragma: no cover - TVM missing
        return "LLVM not consulted"
    if valid:
        return "LLVM knows this CPU: add a row to schedules.target_facts.CPU_TABLE"
    return "LLVM does not know this CPU name either"


def _safe_host_name() -> str:
    try:
        return host_llvm_cpu()
    except Exception:  # pragma: no cover
        return "unknown"


def resolve_host_target(target: Any) -> Any:
    """The same target with ``mcpu`` spelled out as the host's LLVM CPU name when it
    is unset or ``"native"`` (which TVM 0.27 would otherwise build for generic
    x86-64).  Other targets are returned unchanged (as a Target)."""
    import tvm

    if isinstance(target, Mapping):
        target = tvm.target.Target(dict(target))
    mcpu = str(target.attrs.get("mcpu", "") or "")
    if str(target.kind.name) != "llvm" or mcpu not in _HOST_MCPU_ALIASES:
        return target
    config = {str(k): v for k, v in target.export().items()}
    config["mcpu"] = host_llvm_cpu()
    return tvm.target.Target(config)
