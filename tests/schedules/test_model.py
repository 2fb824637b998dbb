"""The QIGen model: register tiles, exact cache tiles, roofline, plans."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from schedules.model import (
    GemvPlan,
    best_register_tile,
    cache_tile,
    cache_tile_bits,
    candidate_plans,
    estimate_gemv,
    estimate_gemv_seconds,
    pack_geometry,
    plan_gemv,
    rank_register_tiles,
    register_tiles,
)
from schedules.target_facts import table_facts

AVX2 = table_facts("znver3")  # 16 ymm, 8 lanes, 32 KiB L1d
AVX512 = table_facts("sapphirerapids")  # 32 zmm, 16 lanes, 48 KiB L1d


def test_avx2_and_avx512_register_files():
    assert (AVX2.vector_registers, AVX2.f32_lanes) == (16, 8)
    assert (AVX512.vector_registers, AVX512.f32_lanes) == (32, 16)


def test_pack_geometry():
    assert pack_geometry(4) == (8, 1)
    assert pack_geometry(2) == (16, 1)
    assert pack_geometry(3) == (32, 3)
    assert pack_geometry(8) == (4, 1)
    assert pack_geometry(6) == (16, 3)
    with pytest.raises(ValueError):
        pack_geometry(9)


# ---------------------------------------------------------------- register tile


@pytest.mark.parametrize("facts", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_register_tile_fits_and_none_is_missing(facts, bits):
    R = facts.vector_registers
    tiles = register_tiles(facts, bits)
    assert tiles
    for t in tiles:
        assert t.m_u + t.m_u * t.t_u + t.t_u <= R
        assert t.registers == t.m_u + t.m_u * t.t_u + t.t_u
        assert t.lanes == facts.f32_lanes
    # brute force: every packing-aligned (m_u, t_u) that fits is listed
    vpb, _ = pack_geometry(bits)
    want = {
        (m, t)
        for m in range(1, R + 1)
        for t in range(1, R + 1)
        if m + m * t + t <= R and (vpb % m == 0 or m % vpb == 0)
    }
    assert {(t.m_u, t.t_u) for t in tiles} == want
    reserved = register_tiles(facts, bits, reserved_registers=2)
    assert all(t.registers <= R - 2 for t in reserved)


# Hand derivation, AVX2 (R = 16, 8 lanes).  Widest t_u per m_u from
# m_u + m_u*t_u + t_u <= 16 (m_u must divide the values per pack block):
#   m_u=1: t_u=7 (15 regs)   m_u=2: t_u=4 (14)   m_u=4: t_u=2 (14)   m_u=8: none (8+9 > 16)
# Score = FMAs per load = m_u*t_u / (m_u broadcasts + t_u*packed vector loads):
#   int4/int2 (1 packed load per step):  (1,7) 7/8   (2,4) 8/6   (4,2) 8/6
#   int3 (32 values in 3 words; 2-value steps touch 18 words per 16 steps = 1.125,
#         4-value steps 10 per 8 = 1.25):  (2,4) 8/(2+4.5)   (4,2) 8/(4+2.5)  -> equal
# The tie goes to more accumulators: (2,4), a 32-column block (the [N/32, K/8, 32]
# layout ENVIRONMENT.md measured as the best fp32 variant).
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_best_avx2_tile_is_2x4(bits):
    t = best_register_tile(AVX2, bits)
    assert (t.m_u, t.t_u, t.columns) == (2, 4, 32)
    expected = {4: 8 / 6, 2: 8 / 6, 3: 8 / 6.5}[bits]
    assert t.score == pytest.approx(expected)
    runner_up = rank_register_tiles(AVX2, bits)[1]
    assert (runner_up.m_u, runner_up.t_u) == (4, 2)
    assert runner_up.score == pytest.approx(t.score)


# Hand derivation, AVX-512 (R = 32, 16 lanes):
#   m_u=1: t_u=15   m_u=2: t_u=10   m_u=4: t_u=5 (29 regs)   m_u=8: t_u=2   m_u=16: none
#   int4/int2: (1,15) 15/16  (2,10) 20/12  (4,5) 20/9 = 2.22  (8,2) 16/10   -> (4,5)
#   int3 (8-value steps touch 12 words per 4 steps = 1.5):
#         (2,10) 20/13.25  (4,5) 20/10.25 = 1.95  (8,2) 16/11            -> (4,5)
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_best_avx512_tile_is_4x5(bits):
    t = best_register_tile(AVX512, bits)
    assert (t.m_u, t.t_u, t.columns, t.registers) == (4, 5, 80, 29)
    expected = {4: 20 / 9, 2: 20 / 9, 3: 20 / 10.25}[bits]
    assert t.score == pytest.approx(expected)


def test_n_aware_tile_avoids_padding_small_n():
    # N = 64: (4,5) pads to 80 columns, 20/9 * 64/80 = 1.78 < (4,4): 16/8 * 1 = 2.0
    t = best_register_tile(AVX512, 4, N=64)
    assert (t.m_u, t.t_u) == (4, 4)
    # N = 4096: 20/9 * 4096/4160 = 2.19 still beats 2.0
    t = best_register_tile(AVX512, 4, N=4096)
    assert (t.m_u, t.t_u) == (4, 5)


def test_no_tile_when_registers_run_out():
    with pytest.raises(ValueError):
        best_register_tile(AVX2, 4, reserved_registers=14)


# ------------------------------------------------------------------- cache tile


def l1_lhs(m_b, t_b, bits, g, meta_bits):
    groups = 1 if g is None or m_b <= g else math.ceil(m_b / g)
    return 32 * m_b + bits * m_b * t_b + 32 * t_b + meta_bits * t_b * groups


def brute_force_tile(facts, bits, g, K, N, m_u, t_u, meta_bits):
    vpb, _ = pack_geometry(bits)
    m_step = math.lcm(m_u, vpb)
    t_step = t_u * facts.f32_lanes
    m_cap = -(-K // math.lcm(m_step, g or 1)) * math.lcm(m_step, g or 1)
    t_cap = -(-N // t_step) * t_step
    best = None
    for m_b in range(1, m_cap + 1):
        if m_b % m_u or m_b % vpb:
            continue
        if g is not None and m_b % g and g % m_b:
            continue
        for t_b in range(t_step, t_cap + 1, t_step):
            if l1_lhs(m_b, t_b, bits, g, meta_bits) <= facts.l1d_bits:
                key = (m_b * t_b, m_b, t_b)
                best = key if best is None or key > best else best
    return best


@pytest.mark.parametrize("l1_bytes", [64, 256, 600, 1024, 2048, 4096])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("g", [None, 32, 64])
@pytest.mark.parametrize("shape", [(100, 50), (256, 96), (40, 8)])
@pytest.mark.parametrize("meta_bits", [0, 64])
def test_cache_tile_is_the_exact_maximum(l1_bytes, bits, g, shape, meta_bits):
    facts = dataclasses.replace(AVX2, l1d_bytes=l1_bytes)
    K, N = shape
    for m_u, t_u in [(2, 4), (1, 1), (4, 2)]:
        want = brute_force_tile(facts, bits, g, K, N, m_u, t_u, meta_bits)
        if want is None:
            with pytest.raises(ValueError, match="no cache tile"):
                cache_tile(facts, bits, g, K, N, m_u, t_u, meta_bits=meta_bits)
            continue
        ct = cache_tile(facts, bits, g, K, N, m_u, t_u, meta_bits=meta_bits)
        assert (ct.m_b * ct.t_b, ct.m_b, ct.t_b) == want
        assert ct.bits_used == l1_lhs(ct.m_b, ct.t_b, bits, g, meta_bits) <= facts.l1d_bits


@pytest.mark.parametrize("facts", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("bits,g", [(4, 128), (3, 128), (2, 64), (4, None), (4, 32)])
def test_real_cache_tiles_fit_l1_and_divide(facts, bits, g):
    t = best_register_tile(facts, bits)
    ct = cache_tile(facts, bits, g, 4096, 11008, t.m_u, t.t_u)
    vpb, _ = pack_geometry(bits)
    assert 32 * ct.m_b + bits * ct.m_b * ct.t_b + 32 * ct.t_b <= facts.l1d_bits  # QIGen's L1 inequality
    assert ct.bits_used <= facts.l1d_bits
    assert ct.m_b % t.m_u == 0 and ct.m_b % vpb == 0  # eq. 5
    assert g is None or ct.m_b % g == 0 or g % ct.m_b == 0
    assert ct.t_b % (t.t_u * facts.f32_lanes) == 0
    # one more column step does not fit, and more than half of L1 is used
    t_step = t.t_u * facts.f32_lanes
    assert cache_tile_bits(ct.m_b, ct.t_b + t_step, bits, g) > facts.l1d_bits
    assert ct.bits_used > facts.l1d_bits // 2


def test_l1_fraction_shrinks_the_tile():
    full = cache_tile(AVX2, 4, 128, 4096, 4096, 2, 4)
    half = cache_tile(AVX2, 4, 128, 4096, 4096, 2, 4, l1_fraction=0.5)
    assert half.m_b * half.t_b < full.m_b * full.t_b
    assert half.bits_used <= AVX2.l1d_bits // 2


# --------------------------------------------------------------------- roofline


def test_int4_4096_gemv_on_zen3_bytes():
    e = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=2)
    weights = 4096 * 4096 // 2
    meta = 4096 * 32 * 2 + 4096 * 32 * 4 // 8  # fp16 scales, 4-bit zeros
    vectors = 4 * 4096 + 4 * 4096
    assert e.bytes_moved == weights + meta + vectors
    assert e.memory_seconds == pytest.approx(e.bytes_moved / 33e9)


def test_int4_4096_gemv_on_zen3_int8_activations_is_memory_bound():
    e = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=2, activation="int8")
    assert e.bound == "memory"
    assert e.seconds == e.memory_seconds > e.compute_seconds
    e1 = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=23, threads=1, activation="int8")
    assert e1.bound == "memory"


def test_int4_4096_gemv_on_zen3_fp32_activations_is_unpack_bound():
    # ENVIRONMENT.md measured the fp32-activation kernel compute-bound at 57-62% of
    # the 33 GB/s (2 threads) and 40-46% of 23 GB/s (1 thread); the model agrees.
    e2 = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=2, activation="fp32")
    assert e2.bound == "compute"
    assert 0.5 < e2.memory_seconds / e2.compute_seconds < 0.75
    e1 = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=23, threads=1, activation="fp32")
    assert e1.bound == "compute"
    assert 0.35 < e1.memory_seconds / e1.compute_seconds < 0.55
    # With every core of the EPYC 7763 the same GEMV is memory-bound again.
    assert estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33).bound == "memory"


def test_roofline_scales_sensibly():
    base = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=2)
    assert estimate_gemv_seconds(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=2) == base.seconds
    # fewer bits -> fewer bytes
    b2 = estimate_gemv(AVX2, 2, 128, 4096, 4096, bandwidth_gbps=33, threads=2)
    b3 = estimate_gemv(AVX2, 3, 128, 4096, 4096, bandwidth_gbps=33, threads=2)
    assert b2.bytes_moved < b3.bytes_moved < base.bytes_moved
    assert b3.bytes_moved - 4096 * 32 * 2 - 4096 * 32 * 3 // 8 - 8 * 4096 == 4096 * 4096 * 3 // 8
    # a large batch is compute-bound
    assert estimate_gemv(AVX2, 4, 128, 4096, 4096, M=256, bandwidth_gbps=33, threads=2).bound == "compute"
    # more threads help only the compute side
    more = estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, threads=4)
    assert more.compute_seconds == pytest.approx(base.compute_seconds / 2)
    assert more.memory_seconds == base.memory_seconds
    assert base.fraction_of_roofline(2 * base.seconds) == pytest.approx(0.5)
    assert base.achieved_gbps(base.bytes_moved / 20e9) == pytest.approx(20.0)
    # awkward K: partial last group and pack block are still counted
    odd = estimate_gemv(AVX2, 4, 128, 4100, 17, bandwidth_gbps=33, threads=1)
    assert odd.bytes_moved == 17 * 513 * 4 + 17 * 33 * 2 + math.ceil(17 * 33 * 4 / 8) + 4 * 4100 + 4 * 17
    with pytest.raises(ValueError):
        estimate_gemv(AVX2, 4, 128, 4096, 4096, bandwidth_gbps=33, activation="bf16")


# ------------------------------------------------------------------------- plan


def test_plan_for_llama_gemv_on_zen3():
    p = plan_gemv(AVX2, 4, 128, 4096, 4096)
    assert (p.m_u, p.t_u, p.lanes) == (2, 4, 8)
    assert p.weight_shape == (4096 // 32, 4096 // 8, 32)
    assert (p.k_tail, p.n_tail, p.n_groups) == (0, 0, 32)
    assert "uint32[128, 512, 32]" in p.weight_layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.m_u = 4


@pytest.mark.parametrize("facts", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("g", [None, 32, 128])
@pytest.mark.parametrize("K,N", [(100, 17), (4100, 11008), (8, 1), (130, 200)])
def test_plans_are_valid_on_awkward_shapes(facts, bits, g, K, N):
    p = plan_gemv(facts, bits, g, K, N)
    vpb, wpb = pack_geometry(bits)
    assert p.m_u + p.m_u * p.t_u + p.t_u <= facts.vector_registers
    assert p.m_b % p.m_u == 0 and p.m_b % vpb == 0
    assert g is None or p.m_b % g == 0 or g % p.m_b == 0
    assert p.t_b % (p.t_u * p.lanes) == 0
    assert cache_tile_bits(p.m_b, p.t_b, bits, g) <= facts.l1d_bits
    assert p.padded_K >= K and p.padded_K % vpb == 0 and p.padded_K - K < vpb
    assert p.padded_N >= N and p.padded_N % p.n_block == 0 and p.padded_N - N < p.n_block
    assert p.weight_shape == (p.padded_N // p.n_block, p.padded_K // vpb * wpb, p.n_block)
    assert p.n_tail == N % p.n_block and p.k_tail == K % p.m_b
    assert p.n_groups == (1 if g is None else math.ceil(K / g))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_weight_location_describes_the_layout(bits):
    """Pack with weight_location, unpack by reading the documented layout directly."""
    p = plan_gemv(AVX2, bits, 32, 70, 20)
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(70, 20))
    packed = np.zeros(p.weight_shape, dtype=np.uint64)
    for k, n in itertools.product(range(70), range(20)):
        j, w, c, bit = p.weight_location(k, n)
        v = int(q[k, n])
        packed[j, w, c] |= np.uint64((v << bit) & 0xFFFFFFFF)
        if bit + bits > 32:
            packed[j, w + 1, c] |= np.uint64(v >> (32 - bit))
    assert int(packed.max()) < 2**32
    vpb, wpb = pack_geometry(bits)
    for n in range(20):
        words = [int(x) for x in packed[n // p.n_block, :, n % p.n_block]]
        for k in range(70):
            kb = k // vpb
            stream = sum(words[kb * wpb + i] << (32 * i) for i in range(wpb))
            assert (stream >> (bits * (k % vpb))) & (2**bits - 1) == q[k, n]
    with pytest.raises(IndexError):
        p.weight_location(p.padded_K, 0)
    # block_weights re-blocks K-major words qweight[k_words, N] into the same array
    kmajor = np.zeros((p.k_words, 20), dtype=np.uint64)
    for n in range(20):
        kmajor[:, n] = packed[n // p.n_block, :, n % p.n_block]
    blocked = p.block_weights(kmajor.astype(np.uint32))
    assert blocked.shape == p.weight_shape and blocked.dtype == np.uint32
    np.testing.assert_array_equal(blocked, packed.astype(np.uint32))
    with pytest.raises(ValueError):
        p.block_weights(kmajor[:, :19])


def test_gemv_plan_rejects_broken_tiles():
    p = plan_gemv(AVX2, 4, 128, 4096, 4096)
    with pytest.raises(ValueError):
        dataclasses.replace(p, m_b=p.m_b + 2)
    with pytest.raises(ValueError):
        dataclasses.replace(p, t_b=p.t_b + 8)
    with pytest.raises(ValueError):
        dataclasses.replace(p, group_size=48)


def test_candidate_plans_start_with_the_plan():
    plans = candidate_plans(AVX2, 4, 128, 4096, 4096, limit=5)
    assert isinstance(plans[0], GemvPlan)
    assert plans[0] == plan_gemv(AVX2, 4, 128, 4096, 4096)
    assert [(p.m_u, p.t_u) for p in plans[:3]] == [(2, 4), (4, 2), (1, 7)]
    assert len(plans) == 5 and len({(p.m_u, p.t_u) for p in plans}) == 5
