"""Analytic model of a low-bit-weight GEMV on a CPU: tiles and a roofline.

This is the performance model of QIGen (Pegolotti, Frantar, Alistarh, Püschel,
"QIGen: Generating Efficient Kernels for Quantized Inference on Large Language
Models", 2023) written for our kernels.  The schedules read one
:class:`GemvPlan` from :func:`plan_gemv`; the tuner uses :func:`candidate_plans`
(plans in the order worth trying) and :func:`estimate_gemv` (roofline, for
seeding and for reporting % of roofline).

Problem and notation
--------------------
``y[n] = sum_k x[k] * W[k, n]`` with ``W`` of ``K`` rows (input) by ``N`` columns
(output), weights of ``b`` bits with a scale (and zero) per group of ``g``
consecutive rows of one column (``group_size=None``: one group spans all of K).

Packing.  Weights are packed along K into 32-bit words.  When ``b`` divides 32 a
word holds ``32/b`` values; otherwise (int3) a *block* of ``32/gcd(32, b)``
values fills ``b/gcd(32, b)`` words as one little-endian bit stream (int3: 32
values in 3 words; a value may straddle two words).  ``values_per_block`` and
``words_per_block`` name that unit (int4: 8 and 1; int2: 16 and 1; int3: 32 and 3).

Register tile (micro-GEMV), QIGen's ``m_u x t_u``
-------------------------------------------------
* ``m_u`` counts **K values** (rows of W) consumed per micro step -- not packed
  words.  It either divides ``values_per_block`` or is a multiple of it, so steps
  line up with the packing.
* ``t_u`` counts **output vectors** of ``lanes`` fp32 columns each; a micro step
  covers ``t_u * lanes`` columns.
* Register accounting (QIGen's register constraint):  ``m_u + m_u*t_u + t_u + reserved <= R``:
  ``m_u`` registers hold broadcast activations ``x[k]``, ``m_u*t_u`` hold the
  unpacked weight vectors of the step, ``t_u`` are the accumulators.  ``R`` is
  ``facts.vector_registers``; ``reserved`` (default 0) sets registers aside.  The
  model counts every unpacked weight of a step as live although a compiler only
  needs a few at a time; that slack is what holds the mask constant and the
  packed word being shifted, which is why ``reserved`` defaults to 0.
* Score: FMAs per register load, ``m_u*t_u / (m_u + t_u * w(m_u))``, where
  ``w(m_u)`` is the average number of packed weight vectors a step loads (exact
  for the bit layout: 1 for int4/int2 whenever ``m_u`` <= values per word; int3
  steps that straddle a word boundary load two).  The unpack work per weight is
  the same for every tile, so the tile decides only how well loads are amortised.
  Ties go to more accumulators (more independent FMA chains hide FMA latency),
  then to the smaller ``m_u``.  When ``N`` is known the score is multiplied by
  ``N / round_up(N, t_u*lanes)``, the useful fraction of the zero-padded columns.
  Common LLM widths (4096, 11008 = 2^8*43, 14336 = 2^11*7) are multiples of any
  power-of-two column block up to 256, so the factor only matters for odd or
  small N.

Cache tile (mini-GEMV), QIGen's ``m_b x t_b``
---------------------------------------------
``m_b`` rows of K times ``t_b`` columns, sized so that the activation slice (fp32),
the packed weights (b bits), the output slice (fp32) and the tile's group
metadata fit in L1 (QIGen's L1 constraint, plus a metadata term):

    32*m_b + b*m_b*t_b + 32*t_b + meta_bits*t_b*groups(m_b) <= l1_fraction * 8 * l1d_bytes

with ``groups(m_b)`` the groups a tile touches (``m_b/g`` when ``g | m_b``, 1 when
``m_b | g`` or per-channel) and ``meta_bits`` (default 64: an fp32 scale and an
fp32 scaled zero) per group and column; ``meta_bits=0`` gives QIGen's inequality.
Divisibility (QIGen eq. 5): ``m_b`` is a multiple of ``lcm(m_u,
values_per_block)`` and, when grouped, either a multiple or a divisor of ``g``
(a tile holds whole groups, or lies inside one group); ``t_b`` is a multiple of
``t_u*lanes``.  Tiles are capped at the (rounded-up) problem.  Objective:
maximise ``m_b * t_b`` (weights per mini-GEMV, i.e. the most L1-resident work
per tile), ties to the larger ``m_b``.  The solver is exact: for each feasible
``m_b`` the inequality is linear in ``t_b`` so its largest feasible multiple is
computed in closed form, and all ``m_b`` are enumerated.

Awkward shapes
--------------
A plan is valid for any K, N >= 1.  The packed weight array is zero-padded to
``padded_K = k_blocks*values_per_block`` rows and ``padded_N = n_blocks*t_u*lanes``
columns; padded rows must meet zero activations (or be cut by loop bounds --
with an asymmetric zero point a zero code is not a zero weight), padded columns'
outputs are discarded.  K need not be a multiple of ``g`` (the last group is
short) nor of ``m_b`` (``k_tail`` rows are left after the full cache tiles);
``n_tail`` is ``N mod (t_u*lanes)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .target_facts import CpuFacts

if TYPE_CHECKING:  # numpy is only needed by GemvPlan.block_weights
    import numpy as np

__all__ = [
    "CacheTile",
    "GemvPlan",
    "RegisterTile",
    "RooflineEstimate",
    "best_register_tile",
    "cache_tile",
    "cache_tile_bits",
    "candidate_plans",
    "estimate_gemv",
    "estimate_gemv_seconds",
    "pack_geometry",
    "plan_gemv",
    "rank_register_tiles",
    "register_tiles",
]

ACT_BITS = 32  # fp32 activations
OUT_BITS = 32  # fp32 outputs
WORD_BITS = 32


def _check_bits(bits: int) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    return bits


def _group(group_size: Optional[int]) -> Optional[int]:
    """Normalise a group size: None, -1 and 0 mean one group per column."""
    if group_size is None or group_size in (-1, 0):
        return None
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, -1 or None, got {group_size!r}")
    return group_size


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_geometry(bits: int) -> tuple[int, int]:
    """(values_per_block, words_per_block) of b-bit values packed along K in 32-bit words."""
    _check_bits(bits)
    g = math.gcd(WORD_BITS, bits)
    return WORD_BITS // g, bits // g


def _words_touched(start: int, count: int, bits: int) -> int:
    """32-bit words holding values start .. start+count-1 of a block's bit stream."""
    first = (start * bits) // WORD_BITS
    last = ((start + count) * bits - 1) // WORD_BITS
    return last - first + 1


def _packed_loads_per_step(m_u: int, bits: int) -> float:
    """Average packed weight vectors one column vector loads per micro step of m_u values."""
    vpb, wpb = pack_geometry(bits)
    if m_u % vpb == 0:
        return (m_u // vpb) * wpb
    steps = vpb // m_u
    return sum(_words_touched(s * m_u, m_u, bits) for s in range(steps)) / steps


# --------------------------------------------------------------- register tile


@dataclass(frozen=True)
class RegisterTile:
    """A micro-GEMV register tile: m_u K values x t_u output vectors (see module doc)."""

    m_u: int
    t_u: int
    lanes: int
    registers: int  # m_u + m_u*t_u + t_u
    packed_loads: float  # packed weight vectors loaded per step, per output vector
    score: float  # FMAs per register load

    @property
    def columns(self) -> int:
        return self.t_u * self.lanes


def _m_u_candidates(bits: int, registers: int) -> list[int]:
    vpb, _ = pack_geometry(bits)
    cands = [d for d in range(1, vpb + 1) if vpb % d == 0]
    m = 2 * vpb
    while 2 * m + 1 <= registers:
        cands.append(m)
        m += vpb
    return [m for m in cands if 2 * m + 1 <= registers]


def register_tiles(facts: CpuFacts, bits: int, *, reserved_registers: int = 0) -> list[RegisterTile]:
    """Every feasible (m_u, t_u): ``m_u + m_u*t_u + t_u + reserved <= vector_registers``,
    m_u aligned with the packing (divides or is a multiple of values_per_block), t_u >= 1."""
    _check_bits(bits)
    budget = facts.vector_registers - reserved_registers
    tiles = []
    for m_u in _m_u_candidates(bits, budget):
        loads = _packed_loads_per_step(m_u, bits)
        t_u = 1
        while m_u + m_u * t_u + t_u <= budget:
            tiles.append(
                RegisterTile(
                    m_u=m_u,
                    t_u=t_u,
                    lanes=facts.f32_lanes,
                    registers=m_u + m_u * t_u + t_u,
                    packed_loads=loads,
                    score=(m_u * t_u) / (m_u + t_u * loads),
                )
            )
            t_u += 1
    return tiles


def _tile_key(tile: RegisterTile, N: Optional[int]) -> tuple[float, int, int]:
    score = tile.score
    if N is not None:
        score *= N / _round_up(N, tile.columns)
    return (round(score, 12), tile.t_u, -tile.m_u)


def rank_register_tiles(
    facts: CpuFacts, bits: int, N: Optional[int] = None, *, reserved_registers: int = 0
) -> list[RegisterTile]:
    """Feasible register tiles, best first (the order the tuner should try them)."""
    tiles = register_tiles(facts, bits, reserved_registers=reserved_registers)
    return sorted(tiles, key=lambda t: _tile_key(t, N), reverse=True)


def best_register_tile(
    facts: CpuFacts, bits: int, N: Optional[int] = None, *, reserved_registers: int = 0
) -> RegisterTile:
    """The register tile with the highest score (see module doc for score and ties)."""
    ranked = rank_register_tiles(facts, bits, N, reserved_registers=reserved_registers)
    if not ranked:
        raise ValueError(
            f"no register tile fits {facts.vector_registers} registers "
            f"with {reserved_registers} reserved"
        )
    return ranked[0]


# ------------------------------------------------------------------ cache tile


@dataclass(frozen=True)
class CacheTile:
    """A mini-GEMV cache tile: m_b rows of K x t_b columns of N."""

    m_b: int
    t_b: int
    bits_used: int  # left-hand side of the L1 inequality
    bits_available: int  # right-hand side


def _tile_groups(m_b: int, g: Optional[int]) -> int:
    if g is None or m_b <= g:
        return 1
    return -(-m_b // g)


def cache_tile_bits(m_b: int, t_b: int, bits: int, group_size: Optional[int], *, meta_bits: int = 64) -> int:
    """Left-hand side of the L1 inequality for an m_b x t_b tile (bits)."""
    g = _group(group_size)
    return (
        ACT_BITS * m_b
        + bits * m_b * t_b
        + OUT_BITS * t_b
        + meta_bits * t_b * _tile_groups(m_b, g)
    )


def _m_b_candidates(K: int, m_step: int, g: Optional[int]) -> list[int]:
    if g is None:
        cap = _round_up(K, m_step)
    else:
        cap = _round_up(K, math.lcm(m_step, g))
    out = []
    for m_b in range(m_step, cap + 1, m_step):
        if g is None or m_b % g == 0 or g % m_b == 0:
            out.append(m_b)
    return out


def cache_tile(
    facts: CpuFacts,
    bits: int,
    group_size: Optional[int],
    K: int,
    N: int,
    m_u: int,
    t_u: int,
    *,
    meta_bits: int = 64,
    l1_fraction: float = 1.0,
) -> CacheTile:
    """The exact maximiser of ``m_b * t_b`` (ties: larger ``m_b``) subject to

    ``32*m_b + bits*m_b*t_b + 32*t_b + meta_bits*t_b*groups(m_b) <= l1_fraction*8*l1d_bytes``,
    ``m_b`` a multiple of ``lcm(m_u, values_per_block)`` and, when grouped, a multiple
    or a divisor of ``group_size``; ``t_b`` a multiple of ``t_u*lanes``;
    ``m_b <= K`` and ``t_b <= N`` after rounding up to those steps (see module doc).
    Raises ``ValueError`` when not even the smallest tile fits.
    """
    _check_bits(bits)
    if K < 1 or N < 1:
        raise ValueError(f"K and N must be >= 1, got K={K}, N={N}")
    if m_u < 1 or t_u < 1:
        raise ValueError(f"m_u and t_u must be >= 1, got {m_u}, {t_u}")
    if not 0 < l1_fraction <= 1:
        raise ValueError(f"l1_fraction must be in (0, 1], got {l1_fraction}")
    g = _group(group_size)
    vpb, _ = pack_geometry(bits)
    m_step = math.lcm(m_u, vpb)
    t_step = t_u * facts.f32_lanes
    t_cap = _round_up(N, t_step)
    budget = int(l1_fraction * facts.l1d_bits)

    best: Optional[tuple[int, int, int]] = None  # (product, m_b, t_b)
    for m_b in _m_b_candidates(K, m_step, g):
        per_col = bits * m_b + OUT_BITS + meta_bits * _tile_groups(m_b, g)
        room = budget - ACT_BITS * m_b
        if room < per_col * t_step:
            continue
        t_b = min(room // per_col // t_step * t_step, t_cap)
        key = (m_b * t_b, m_b, t_b)
        if best is None or key > best:
            best = key
    if best is None:
        raise ValueError(
            f"no cache tile fits L1 ({budget} bits) for bits={bits}, group={g}, "
            f"m_u={m_u}, t_u={t_u}, lanes={facts.f32_lanes}"
        )
    _, m_b, t_b = best
    return CacheTile(m_b=m_b, t_b=t_b, bits_used=cache_tile_bits(m_b, t_b, bits, g, meta_bits=meta_bits),
                     bits_available=budget)


# ------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class GemvPlan:
    """Everything a CPU GEMV schedule needs: tiles and the packed-weight layout.

    Weight layout (uint32): ``weight_shape = (n_blocks, k_words, n_block)`` with
    ``n_block = t_u*lanes`` columns per block and ``k_words = k_blocks *
    words_per_block``.  Word ``[j, w, c]`` holds packed bits of column
    ``j*n_block + c``; K value ``k`` of that column sits in the bit stream of pack
    block ``k // values_per_block`` (words ``kb*words_per_block ..``) at bit
    ``b*(k % values_per_block)``, little-endian (see :meth:`weight_location`).
    A vector load of ``lanes`` consecutive ``c`` gives one word of ``lanes`` columns,
    so a micro step loads ``t_u`` contiguous vectors.  It is a re-blocking of the
    ``qweight[k_words, N]`` words of ``qtvm.formats.uniform`` (same bit order):
    ``blocked[j, w, c] == qweight[w, j*n_block + c]``, zero past N
    (:meth:`block_weights`).
    """

    isa: str
    bits: int
    group_size: Optional[int]  # None: one group per column
    K: int
    N: int
    lanes: int
    m_u: int
    t_u: int
    m_b: int
    t_b: int
    values_per_block: int
    words_per_block: int

    def __post_init__(self) -> None:
        if self.m_b % self.m_u or self.m_b % self.values_per_block:
            raise ValueError(f"m_b={self.m_b} must be a multiple of m_u={self.m_u} and {self.values_per_block}")
        if self.t_b % self.n_block:
            raise ValueError(f"t_b={self.t_b} must be a multiple of t_u*lanes={self.n_block}")
        g = self.group_size
        if g is not None and self.m_b % g and g % self.m_b:
            raise ValueError(f"m_b={self.m_b} must be a multiple or a divisor of group_size={g}")

    @property
    def n_block(self) -> int:
        return self.t_u * self.lanes

    @property
    def n_blocks(self) -> int:
        return -(-self.N // self.n_block)

    @property
    def padded_N(self) -> int:
        return self.n_blocks * self.n_block

    @property
    def n_tail(self) -> int:
        return self.N % self.n_block

    @property
    def k_blocks(self) -> int:
        return -(-self.K // self.values_per_block)

    @property
    def padded_K(self) -> int:
        return self.k_blocks * self.values_per_block

    @property
    def k_words(self) -> int:
        return self.k_blocks * self.words_per_block

    @property
    def k_tail(self) -> int:
        return self.K % self.m_b

    @property
    def n_groups(self) -> int:
        return 1 if self.group_size is None else -(-self.K // self.group_size)

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.n_blocks, self.k_words, self.n_block)

    @property
    def weight_layout(self) -> str:
        vpb, wpb, nb = self.values_per_block, self.words_per_block, self.n_block
        return (
            f"uint32[{self.n_blocks}, {self.k_words}, {nb}] = "
            f"[ceil(N/{nb}), ceil(K/{vpb})*{wpb}, {nb}]: word [j, w, c] holds column j*{nb}+c; "
            f"K value k is at bit {self.bits}*(k%{vpb}) of the {wpb}-word block k//{vpb} "
            f"(little-endian); zero padding to K={self.padded_K}, N={self.padded_N}"
        )

    def weight_location(self, k: int, n: int) -> tuple[int, int, int, int]:
        """(j, w, c, bit): weight (k, n) starts at bit ``bit`` of word ``[j, w, c]``;
        when ``bit + bits > 32`` its high bits continue at bit 0 of word ``w + 1``."""
        if not (0 <= k < self.padded_K and 0 <= n < self.padded_N):
            raise IndexError(f"({k}, {n}) outside the padded {self.padded_K} x {self.padded_N}")
        stream = self.bits * (k % self.values_per_block)
        w = (k // self.values_per_block) * self.words_per_block + stream // WORD_BITS
        return (n // self.n_block, w, n % self.n_block, stream % WORD_BITS)


    def block_weights(self, qweight: "np.ndarray") -> "np.ndarray":
        """Re-block packed words ``qweight[k_words, N]`` (K-major, as the formats pack
        them) into ``weight_shape``, zero-filling the padded columns."""
        import numpy as np

        q = np.asarray(qweight)
        if q.shape != (self.k_words, self.N):
            raise ValueError(f"qweight must have shape {(self.k_words, self.N)}, got {q.shape}")
        padded = np.zeros((self.k_words, self.padded_N), dtype=q.dtype)
        padded[:, : self.N] = q
        return np.ascontiguousarray(padded.reshape(self.k_words, self.n_blocks, self.n_block).transpose(1, 0, 2))


def _plan_from_tile(
    facts: CpuFacts, bits: int, g: Optional[int], K: int, N: int, tile: RegisterTile,
    meta_bits: int, l1_fraction: float,
) -> GemvPlan:
    ct = cache_tile(facts, bits, g, K, N, tile.m_u, tile.t_u, meta_bits=meta_bits, l1_fraction=l1_fraction)
    vpb, wpb = pack_geometry(bits)
    return GemvPlan(
        isa=facts.isa, bits=bits, group_size=g, K=K, N=N, lanes=facts.f32_lanes,
        m_u=tile.m_u, t_u=tile.t_u, m_b=ct.m_b, t_b=ct.t_b,
        values_per_block=vpb, words_per_block=wpb,
    )


def plan_gemv(
    facts: CpuFacts,
    fmt_bits: int,
    group_size: Optional[int],
    K: int,
    N: int,
    *,
    reserved_registers: int = 0,
    meta_bits: int = 64,
    l1_fraction: float = 1.0,
) -> GemvPlan:
    """The model's plan for ``y[1, N] = x[1, K] @ W[K, N]`` with ``fmt_bits``-bit weights:
    the best register tile for this N, then the exact cache tile for it."""
    _check_bits(fmt_bits)
    if K < 1 or N < 1:
        raise ValueError(f"K and N must be >= 1, got K={K}, N={N}")
    g = _group(group_size)
    tile = best_register_tile(facts, fmt_bits, N, reserved_registers=reserved_registers)
    return _plan_from_tile(facts, fmt_bits, g, K, N, tile, meta_bits, l1_fraction)


def candidate_plans(
    facts: CpuFacts,
    fmt_bits: int,
    group_size: Optional[int],
    K: int,
    N: int,
    *,
    limit: int = 8,
    reserved_registers: int = 0,
    meta_bits: int = 64,
    l1_fraction: float = 1.0,
) -> list[GemvPlan]:
    """Up to ``limit`` plans, best register tile first (dominated tiles -- the same m_u
    with fewer accumulators than the best for that m_u -- come after all others)."""
    _check_bits(fmt_bits)
    g = _group(group_size)
    ranked = rank_register_tiles(facts, fmt_bits, N, reserved_registers=reserved_registers)
    widest: dict[int, int] = {}
    for t in ranked:
        widest[t.m_u] = max(widest.get(t.m_u, 0), t.t_u)
    ordered = [t for t in ranked if t.t_u == widest[t.m_u]] + [t for t in ranked if t.t_u != widest[t.m_u]]
    plans = []
    for tile in ordered[:limit]:
        plans.append(_plan_from_tile(facts, fmt_bits, g, K, N, tile, meta_bits, l1_fraction))
    return plans


# -------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class RooflineEstimate:
    """Roofline time of one GEMV/GEMM call: max(memory time, compute time)."""

    seconds: float
    memory_seconds: float
    compute_seconds: float
    bytes_moved: int
    vector_ops: float  # all full-width vector instructions (unpack + FMA + rescale)
    fma_ops: float  # the multiply-class ones among them
    bound: str  # "memory" | "compute"

    def fraction_of_roofline(self, measured_seconds: float) -> float:
        """How close a measured time is to this estimate (1.0 = at the roofline)."""
        return self.seconds / measured_seconds

    def achieved_gbps(self, measured_seconds: float) -> float:
        return self.bytes_moved / measured_seconds / 1e9


def _fp32_unpack_ops_per_vector(bits: int) -> float:
    """Vector instructions to turn packed words into one fp32 weight vector, averaged
    over a pack block: and + convert per value, a shift unless the value starts at
    bit 0 of its word, and shift-left + or for a value straddling two words."""
    vpb, _ = pack_geometry(bits)
    total = 0
    for i in range(vpb):
        off = (i * bits) % WORD_BITS
        total += 2 + (1 if off else 0) + (2 if off + bits > WORD_BITS else 0)
    return total / vpb


def _u8_unpack_ops_per_vector(bits: int) -> float:
    """Vector instructions per byte vector when widening packed weights to u8 for the
    int8-activation dot (and per value, a shift unless it is the low field; +1 for
    widths that do not divide 8)."""
    if 8 % bits == 0:
        per = 8 // bits
        return (2 * per - 1) / per
    return 2.0 + 1.0


def estimate_gemv(
    facts: CpuFacts,
    bits: int,
    group_size: Optional[int],
    K: int,
    N: int,
    M: int = 1,
    *,
    bandwidth_gbps: float,
    threads: Optional[int] = None,
    activation: str = "fp32",
    scale_bytes: int = 2,
    zero_bits: Optional[int] = None,
) -> RooflineEstimate:
    """Roofline estimate of ``y[M, N] = x[M, K] @ W[K, N]`` with packed ``bits``-bit W.

    Memory: packed weights (``ceil(K/values_per_block)*words_per_block`` words per
    column) + per group and column a scale (``scale_bytes``, fp16 by default) and a
    zero (``zero_bits``, default ``bits``; 0 for symmetric formats) + fp32
    activations and outputs, over ``bandwidth_gbps`` (the DRAM bandwidth the
    ``threads`` achieve).

    Compute, counted in full-width vector instructions on ``threads`` cores at
    ``freq_ghz``; time = max(all ops / vector_alu_ports, FMA-class ops / fma_ports):

    * ``activation="fp32"``: per vector of ``lanes`` weights the unpack (shift, and,
      convert; see ``_fp32_unpack_ops_per_vector``), shared by the M rows, plus one
      FMA per row; per group and output vector two FMAs (scale, zero term).
    * ``activation="int8"`` (x quantized per 32 values, u8 x s8 dot with
      pmaddubsw + pmaddwd + add): per byte vector (vector_bits/8 weights) the u8
      unpack, shared by the rows, plus 3 ops per row; per 32 K values and output
      vector a convert + FMA rescale, plus the group ops.

    The counts are approximations meant to rank schedules and report a % of
    roofline, not to predict cycles.
    """
    _check_bits(bits)
    if min(K, N, M) < 1:
        raise ValueError(f"K, N, M must be >= 1, got K={K}, N={N}, M={M}")
    if bandwidth_gbps <= 0:
        raise ValueError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps}")
    threads = facts.cores if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    g = _group(group_size)
    vpb, wpb = pack_geometry(bits)
    zbits = bits if zero_bits is None else zero_bits
    n_groups = 1 if g is None else -(-K // g)
    L = facts.f32_lanes

    weight_bytes = 4 * N * (-(-K // vpb)) * wpb
    meta_bytes = N * n_groups * scale_bytes + -(-(N * n_groups * zbits) // 8)
    act_bytes = 4 * M * K
    out_bytes = 4 * M * N
    total_bytes = weight_bytes + meta_bytes + act_bytes + out_bytes

    weights = K * N
    group_ops = 2.0 * M * n_groups * N / L
    if activation == "fp32":
        unpack = weights / L * _fp32_unpack_ops_per_vector(bits)
        fma = M * weights / L + group_ops
        vector_ops = unpack + fma
    elif activation == "int8":
        byte_lanes = facts.vector_bits // 8
        unpack = weights / byte_lanes * _u8_unpack_ops_per_vector(bits)
        dot = M * weights / byte_lanes * 3.0
        rescale = 2.0 * M * (-(-K // 32)) * N / L
        fma = M * weights / byte_lanes * 2.0 + rescale / 2 + group_ops
        vector_ops = unpack + dot + rescale + group_ops
    else:
        raise ValueError(f"activation must be 'fp32' or 'int8', got {activation!r}")

    cycles = max(vector_ops / facts.vector_alu_ports, fma / facts.fma_ports) / threads
    compute_s = cycles / (facts.freq_ghz * 1e9)
    memory_s = total_bytes / (bandwidth_gbps * 1e9)
    return RooflineEstimate(
        seconds=max(compute_s, memory_s),
        memory_seconds=memory_s,
        compute_seconds=compute_s,
        bytes_moved=total_bytes,
        vector_ops=vector_ops,
        fma_ops=fma,
        bound="memory" if memory_s >= compute_s else "compute",
    )


def estimate_gemv_seconds(
    facts: CpuFacts,
    bits: int,
    group_size: Optional[int],
    K: int,
    N: int,
    M: int = 1,
    *,
    bandwidth_gbps: float,
    threads: Optional[int] = None,
    activation: str = "fp32",
) -> float:
    """``estimate_gemv(...).seconds``."""
    return estimate_gemv(
        facts, bits, group_size, K, N, M,
        bandwidth_gbps=bandwidth_gbps, threads=threads, activation=activation,
    ).seconds
