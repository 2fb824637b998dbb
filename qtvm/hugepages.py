"""Weights on 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight once per token. On 4 KiB pages every page costs a TLB
walk and the hardware prefetchers stop at each page boundary: a TVM kernel streaming 9 MiB
of weights per call read 29 GB/s on 4 KiB pages and 39-40 GB/s on huge pages (AMD EPYC
Zen 5 VM, 1 thread, same run). TVM allocates a module's constants with plain ``malloc``,
which gets 4 KiB pages unless the system's THP mode is ``always`` (most distributions ship
``madvise``), so after loading an artefact the runtime asks the kernel to back the memory
that appeared during the load with huge pages: ``madvise(MADV_HUGEPAGE)`` for what is
faulted in later, ``MADV_COLLAPSE`` (Linux >= 6.1) to move what is already there.

Only memory mapped during the load is moved: a block that reuses memory freed earlier in the
process (glibc serves blocks below its mmap threshold, up to 32 MiB once it has adapted, from
its heap) stays where it is. In a fresh process, as a deployment loads its artefact, that is
all of it; in a long-lived one (a notebook) some smaller constants may be missed.

Nothing here changes numbers; on a kernel or machine without THP every call is a no-op.
``QTVM_HUGEPAGES=0`` turns it off (to compare, or where memory is tight: a collapsed
range holds whole 2 MiB pages).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
ENV = "QTVM_HUGEPAGES"

Range = tuple[int, int]  # [start, end) of virtual addresses


def enabled() -> bool:
    """False where the user turned it off (``QTVM_HUGEPAGES=0``) or the OS is not Linux."""
    return os.environ.get(ENV, "1") != "0" and Path("/proc/self/maps").exists()


def thp_mode(path: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> str:
    """The system's THP mode ("always", "madvise", "never"), or "unavailable"."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def parse_anonymous_ranges(maps_text: str) -> list[Range]:
    """Writable private anonymous mappings (and the brk heap) of a /proc/<pid>/maps text:
    where malloc puts large blocks."""
    out = []
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        name = fields[5] if len(fields) > 5 else ""
        if name not in ("", "[heap]"):
            continue
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        out.append((lo, hi))
    return out


def anonymous_ranges() -> list[Range]:
    try:
        return parse_anonymous_ranges(Path("/proc/self/maps").read_text())
    except OSError:
        return []


def new_ranges(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of ``after`` that no range of ``before`` covers (memory mapped since)."""
    old = sorted(before)
    out = []
    for lo, hi in sorted(after):
        cur = lo
        for olo, ohi in old:
            if ohi <= cur or olo >= hi:
                continue
            if olo > cur:
                out.append((cur, olo))
            cur = max(cur, ohi)
            if cur >= hi:
                break
        if cur < hi:
            out.append((cur, hi))
    return out


def huge_aligned(r: Range) -> Range | None:
    """``r`` shrunk to whole 2 MiB pages, or None when it holds none."""
    lo = -(-r[0] // HUGE_PAGE) * HUGE_PAGE
    hi = r[1] // HUGE_PAGE * HUGE_PAGE
    return (lo, hi) if hi > lo else None


@functools.lru_cache(maxsize=1)
def libc_madvise():
    """libc's madvise (found once: ``find_library`` takes ~1 ms, and a load calls this per chunk)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def back_with_huge_pages(ranges: list[Range], collapse: bool = True) -> int:
    """Ask for huge pages over the whole 2 MiB pages of ``ranges``; returns the bytes
    advised (``collapse`` False: memory not written yet, which then faults in as huge
    pages) or collapsed now (0 where THP is off, the kernel predates MADV_COLLAPSE, or
    memory is too fragmented: the ranges stay as they were, which is always correct)."""
    if not enabled() or thp_mode() in ("never", "unavailable"):
        return 0
    madvise = libc_madvise()
    done = 0
    for r in ranges:
        aligned = huge_aligned(r)
        if aligned is None:
            continue
        lo, hi = aligned
        advised = madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
        if (madvise(lo, hi - lo, MADV_COLLAPSE) == 0) if collapse else advised:
            done += hi - lo
    return done


def _smaps_text() -> str:
    try:
        return Path("/proc/self/smaps").read_text()
    except OSError:
        return ""


def smaps_entries(smaps_text: str) -> list[tuple[Range, dict[str, int]]]:
    """(range, {field: bytes}) of each mapping in a /proc/<pid>/smaps text (kB fields only)."""
    out: list[tuple[Range, dict[str, int]]] = []
    for line in smaps_text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            out.append(((lo, hi), {}))
        elif out and fields[0].endswith(":") and len(fields) == 3 and fields[2] == "kB":
            out[-1][1][fields[0][:-1]] = int(fields[1]) * 1024
    return out


def _overlaps(a: Range, ranges: list[Range]) -> bool:
    return any(lo < a[1] and hi > a[0] for lo, hi in ranges)


def huge_bytes(ranges: list[Range], smaps_text: str | None = None) -> int:
    """Bytes of the mappings overlapping ``ranges`` that huge pages back now (AnonHugePages)."""
    entries = smaps_entries(_smaps_text() if smaps_text is None else smaps_text)
    return sum(f.get("AnonHugePages", 0) for r, f in entries if _overlaps(r, ranges))


def populated(ranges: list[Range], smaps_text: str | None = None, min_fraction: float = 0.9) -> list[Range]:
    """The ranges whose mapping is at least ``min_fraction`` resident: data written in (weights
    copied to their place), not a thread stack or an arena mostly untouched, which a
    collapse would fill with 2 MiB pages of zeros."""
    entries = smaps_entries(_smaps_text() if smaps_text is None else smaps_text)
    out = []
    for r in ranges:
        for (lo, hi), f in entries:
            if lo <= r[0] and r[1] <= hi:
                if f.get("Rss", 0) >= min_fraction * (hi - lo):
                    out.append(r)
                break
    return out


class NewMemoryOnHugePages:
    """``with NewMemoryOnHugePages() as new: <allocate>``: afterwards the memory mapped
    inside the block is on huge pages where the system allows; ``new.ranges`` and
    ``new.collapsed`` (bytes) say what was done. ``written=False``: the block allocates
    without writing (``tvm.runtime.empty``), so the new ranges are only advised and fault
    in as huge pages when first written: no copy. ``start()`` / ``finish()`` are the same
    two steps for a caller that decides after allocating whether to move anything."""

    def __init__(self, written: bool = True):
        self.written = written
        self.ranges: list[Range] = []
        self.collapsed = 0

    def start(self) -> "NewMemoryOnHugePages":
        self._before = anonymous_ranges() if enabled() else []
        return self

    def finish(self) -> int:
        """Move what was mapped since ``start``; returns the bytes moved (or advised)."""
        if enabled():
            # only ranges that can hold a huge page: reading smaps costs ~50 ms in a large process
            fresh = [r for r in new_ranges(self._before, anonymous_ranges()) if huge_aligned(r) is not None]
            self.ranges = (populated(fresh) if fresh else []) if self.written else fresh
            self.collapsed = back_with_huge_pages(self.ranges, collapse=self.written)
        return self.collapsed

    def __enter__(self) -> "NewMemoryOnHugePages":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.finish()
