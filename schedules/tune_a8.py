"""MetaSchedule design spaces of the int8-activation kernels (``schedules.x86``'s
``schedule_qmatmul_a8_x86`` GEMV and ``schedule_qmatmul_a8_gemm_x86`` prefill), with
their knobs:

  streams            column blocks one parallel task streams (GEMV; divides the blocks)
  tile_cols          columns of one pass over a group's rows (GEMV; a multiple of 16)
  prefetch_bytes     how far ahead each step prefetches its weight lines (0: none)
  prefetch_locality  into which cache (llvm.prefetch locality: 3 = L1, 2 = L2)
  unroll             each group's 32-value blocks unrolled (pragma_auto_unroll_max_step
                     256) or a loop (0)
  fold_groups        groups whose partials the GEMV folds into its accumulators at once
                     (``x86.a8_fold_groups``; whole-row passes only; the prefill kernel: 1)

``tile_cols`` and ``unroll`` are ``sample_categorical`` decisions (the analytic value
weighted most; the rule takes them as ExprRVs, so a mutated decision replays exactly);
``streams``, ``fold_groups`` and the prefetch pair change the loop nest or which
TensorIntrin is used, so each of their combinations is a design space of its own.  The
fold is a knob because what it gains depends on the CPU: on Zen 4 groups of 64 streamed
1.2-1.4x faster folding two at once, groups of 128 and 32 slower (``target_facts``).  The
analytic point is the rule's default (target facts: ``schedules.x86.a8_prefetch``).
Timings come from ``schedules.tune_runner.ColdRunner``: weights rotated over more than
the L3, so a memory-bound kernel is ranked by how it streams from DRAM.  The GEMV is
measured at M = 1, the prefill kernel at M = ``PREFILL_ROWS``.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from qtvm import ops
from schedules.knob_space import DesignSpaces

KINDS = ("qmatmul_a8", "qmatmul_a8_gemm")
KNOB_NAMES = ("streams", "tile_cols", "prefetch_bytes", "prefetch_locality", "unroll", "fold_groups")
PREFILL_ROWS = 64
PREFETCH_BYTES = (0, 2048, 4096, 8192, 16384)
PREFETCH_LOCALITIES = (3, 2)
STREAMS = (1, 2)
UNROLL = (0, 256)  # pragma_auto_unroll_max_step of each group's block loop
FOLD_GROUPS = (1, 2, 4)
FOLD_MAX_K = 256  # rows of one fold at most (the most measured; folds past 128 rows were slower on Zen 4)


def compute_of(kind: str, fmt, desc: dict) -> tvm.tirx.PrimFunc:
    """The unscheduled kernel of ``kind`` for the format description a kernel carries."""
    k, n, nb = int(desc["k"]), int(desc["n"]), int(desc["col_block"])
    if kind == "qmatmul_a8":
        return ops.qmatmul_a8_func(fmt, k, n, nb)
    return ops.qmatmul_a8_gemm_func(fmt, k, n, nb, int(desc["row_tile"]))


def rows_of(kind: str) -> int:
    """The row count M a kernel of ``kind`` is measured at."""
    return 1 if kind == "qmatmul_a8" else PREFILL_ROWS


def _probs(cands: list, analytic) -> list[float]:
    """The analytic value 60 %, the rest shared evenly."""
    if len(cands) == 1:
        return [1.0]
    return [0.6 if c == analytic else 0.4 / (len(cands) - 1) for c in cands]


@dataclass(frozen=True)
class A8KnobSpace(DesignSpaces):
    """The knobs of one int8-activation kernel on one target (same interface as
    ``schedules.tune.KnobSpace``: ``analytic``, ``apply``, ``design_spaces``, ``schedule``)."""

    kind: str
    desc: dict
    target: tvm.target.Target
    streams: tuple[int, ...]
    prefetch: tuple[tuple[int, int], ...]
    folds: tuple[int, ...]
    analytic: dict

    @staticmethod
    def of(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> "A8KnobSpace":
        from schedules import x86

        kind = str(func.attrs[ops.KERNEL_ATTR])
        desc = {str(k): v for k, v in func.attrs[ops.FORMAT_ATTR].items()}
        nb = int(desc["col_block"])
        nblk = -(-int(desc["n"]) // nb)
        gemv = kind == "qmatmul_a8"
        default = tuple(int(v) for v in x86.a8_prefetch(target, prefill=not gemv))
        prefetch = [(0, 0)] + [(b, loc) for b in PREFETCH_BYTES if b for loc in PREFETCH_LOCALITIES]
        if default not in prefetch:
            prefetch.append(default)
        streams = tuple(s for s in STREAMS if nblk % s == 0) if gemv else (1,)
        tile = x86.a8_tile_cols(target, nb) if gemv else 0
        fold = x86.a8_fold_groups(target, desc) if gemv and tile == nb else 1
        folds = _folds(desc, fold) if gemv else (1,)
        analytic = {"streams": 1, "tile_cols": tile, "prefetch_bytes": default[0],
                    "prefetch_locality": default[1], "unroll": 0, "fold_groups": fold}
        return A8KnobSpace(kind, desc, target, streams, tuple(prefetch), folds, analytic)

    def _tiles(self, streams: int) -> list[int]:
        from qtvm.intrin.x86 import STEP_COLS

        cols = int(self.desc["col_block"]) * streams
        return [c for c in range(STEP_COLS, cols + 1, STEP_COLS) if cols % c == 0]

    def apply(self, sch: s_tir.Schedule, knobs: dict | None = None, *, streams: int = 1,
              prefetch: tuple[int, int] | None = None, fold: int | None = None) -> None:
        """Schedule ``sch`` (the unscheduled kernel) with sampled knobs, or ``knobs``' values."""
        from schedules import x86
        from schedules.tune import KNOB_PREFIX

        knobs = knobs or {}
        if knobs:
            streams = int(knobs["streams"])
            prefetch = (int(knobs["prefetch_bytes"]), int(knobs["prefetch_locality"]))
            fold = int(knobs.get("fold_groups", self.analytic["fold_groups"]))
        prefetch = prefetch or (self.analytic["prefetch_bytes"], self.analytic["prefetch_locality"])
        fold = self.analytic["fold_groups"] if fold is None else fold
        gemv = self.kind == "qmatmul_a8"

        def sample(name, cands, analytic):
            value = knobs.get(name)
            if value is not None and value not in cands:
                raise ValueError(f"{name}={value} is not one of {cands}")
            decision = None if value is None else cands.index(value)
            return sch.sample_categorical(list(cands), _probs(cands, analytic), decision=decision)

        cols = int(self.desc["col_block"]) * streams
        if gemv and fold > 1:
            tile = cols  # a fold reads whole rows: not a decision
        else:
            tiles = self._tiles(streams) if gemv else [0]
            tile = sample("tile_cols", tiles, x86.a8_tile_cols(self.target, cols) if gemv else 0)
        unroll = sample("unroll", list(UNROLL), 0)
        out = sch.get_sblock(ops.BLOCK_OUT)
        for name, value in (("streams", streams), ("tile_cols", tile), ("prefetch_bytes", prefetch[0]),
                            ("prefetch_locality", prefetch[1]), ("unroll", unroll), ("fold_groups", fold)):
            sch.annotate(out, KNOB_PREFIX + name, value)
        if gemv:
            x86.apply_qmatmul_a8_x86(sch, self.target, streams=streams, tile_cols=tile, prefetch=prefetch,
                                     unroll=unroll, fold_groups=fold)
        else:
            x86.apply_qmatmul_a8_gemm_x86(sch, self.target, prefetch=prefetch, unroll=unroll)

    def design_spaces(self, sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        """The ScheduleFn: one design space per (streams, prefetch, fold)."""
        return self._spaces(sch, [{"streams": s, "prefetch": p, "fold": f}
                                  for s in self.streams for p in self.prefetch for f in self.folds])


def _folds(desc: dict, analytic: int) -> tuple[int, ...]:
    """Fold counts that divide the groups and cover at most ``FOLD_MAX_K`` rows, and the analytic one."""
    from schedules import x86

    group, groups = int(desc["group"]), x86.group_count(desc)
    folds = {f for f in FOLD_GROUPS if groups % f == 0 and (f == 1 or f * group <= FOLD_MAX_K)}
    return tuple(sorted(folds | {analytic}))
