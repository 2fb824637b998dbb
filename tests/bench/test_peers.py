"""Each peer computes what its own dequantized weights say it should."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qtvm.bench import peers


def _w(K, N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal(K).astype(np.float32)


def _rel(y, ref):
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("K,N", [(256, 96), (1000, 93)])
@pytest.mark.parametrize("op", ["mv", "linear"])
def test_torch_fp32(K, N, op):
    W, x = _w(K, N)
    p = peers.torch_fp32_mv(W, op=op)
    assert p.weight_bytes == K * N * 4
    assert p.w.shape == (N, K) and p.w.is_contiguous()
    y = p(x)
    assert y.shape == (N,)
    assert _rel(y, p.reference(x)) < 1e-5
    # the reference is an independent computation, not the peer's own output
    assert _rel(p.reference(x), x.astype(np.float64) @ W.astype(np.float64)) < 1e-12


def test_torch_fp32_copy_has_own_memory():
    W, x = _w(256, 96)
    p = peers.torch_fp32_mv(W)
    c = p.copy()
    assert c.w.data_ptr() != p.w.data_ptr()
    np.testing.assert_allclose(c(x), p(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("K,N,g", [(256, 96, 32), (256, 96, 128), (1024, 64, 64), (512, 48, 256)])
def test_torch_int4_bf16(K, N, g):
    W, x = _w(K, N, seed=K + g)
    p = peers.torch_int4(W, g)
    G = K // g
    # packed uint8 [N, K/2] + bf16 scales/zeros [K/g, N, 2]
    assert tuple(p.packed.shape) == (N, K // 2) and p.packed.dtype == torch.uint8
    assert tuple(p.scales_zeros.shape) == (G, N, 2) and p.scales_zeros.dtype == torch.bfloat16
    assert p.weight_bytes == N * K // 2 + G * N * 2 * 2
    y = p(x)
    ref = p.reference(x)
    # output is bf16 (8-bit mantissa): per element within 2^-8 relative plus accumulation slack
    tol = 2.0**-8 * np.abs(ref) + 1e-3 * np.max(np.abs(ref))
    assert np.all(np.abs(y - ref) <= tol), np.max(np.abs(y - ref) - tol)
    # and the dequantized weights are a faithful 4-bit quantization of W
    step = (W.reshape(G, g, N).max(1) - W.reshape(G, g, N).min(1)) / 15
    err = np.abs(p._deq - W).reshape(G, g, N).max(1)
    assert np.all(err <= 0.5 * step * 1.02 + 1e-2 * np.abs(W).max())


@pytest.mark.parametrize("K,N,g", [(256, 96, 32), (1024, 64, 128)])
def test_torch_int4_fp32_activations_tight(K, N, g):
    W, x = _w(K, N, seed=3)
    p = peers.torch_int4(W, g, act_dtype=torch.float32)
    assert _rel(p(x), p.reference(x)) < 1e-5


def test_torch_int4_convention_is_q_minus_8():
    """Wrong convention (w = q*s + z, no -8 offset) would be far off: the test can fail."""
    W, x = _w(256, 64, seed=5)
    p = peers.torch_int4(W, 32, act_dtype=torch.float32)
    q = p._q.double().numpy()  # [N, K]
    sz = p._sz.double().numpy()  # [G, N, 2]
    s = np.repeat(sz[..., 0], 32, axis=0)  # [K, N]
    z = np.repeat(sz[..., 1], 32, axis=0)
    wrong = x.astype(np.float64) @ (q.T * s + z)
    right = x.astype(np.float64) @ ((q.T - 8) * s + z)
    y = p(x)
    assert _rel(y, right) < 1e-5
    assert _rel(y, wrong) > 1e-2


@pytest.mark.parametrize("K,N,g", [(1000, 96, 32), (256, 93, 32), (256, 96, 16)])
def test_torch_int4_rejects_unsupported_shapes(K, N, g):
    W, _ = _w(K, N)
    with pytest.raises(ValueError):
        peers.torch_int4(W, g)


def test_torch_int4_copy_has_own_memory():
    W, x = _w(256, 96)
    p = peers.torch_int4(W, 64)
    c = p.copy()
    assert c.packed.data_ptr() != p.packed.data_ptr()
    assert c.scales_zeros.data_ptr() != p.scales_zeros.data_ptr()
    np.testing.assert_array_equal(c(x), p(x))


@pytest.mark.parametrize("K,N,bs", [(256, 96, 32), (256, 96, 128), (1000, 93, 32), (1000, 93, 128), (1000, 8, 64)])
@pytest.mark.parametrize("acc", [0, 4])
def test_ort_matmulnbits(K, N, bs, acc):
    W, x = _w(K, N, seed=K + N + bs)
    p = peers.ort_matmulnbits(W, bs, accuracy_level=acc, threads=1)
    nb = -(-K // bs)
    B, scales, zps, _, _ = p._packed
    assert B.shape == (N, nb, bs // 2) and B.dtype == np.uint8
    assert scales.shape == (N * nb,) and scales.dtype == np.float32
    assert zps.shape == (N * ((nb + 1) // 2),) and zps.dtype == np.uint8
    assert p.weight_bytes == B.nbytes + scales.nbytes + zps.nbytes
    y = p(x)
    assert y.shape == (N,)
    assert _rel(y, p.reference(x)) < 2e-5
    if acc == 4:
        # int8 activations do change the numbers: the model of them matters
        assert _rel(y, p.reference_fp(x)) < 3e-2
    # a second input through the same binding
    x2 = -2.0 * x
    assert _rel(p(x2), p.reference(x2)) < 2e-5


def test_ort_plain_run_matches_io_binding():
    W, x = _w(1000, 93)
    a = peers.ort_matmulnbits(W, 32, threads=1)
    b = peers.ort_matmulnbits(W, 32, threads=1, use_io_binding=False)
    np.testing.assert_array_equal(a(x), b(x))


def test_ort_dequantized_weights_are_a_faithful_quantization():
    W, _ = _w(1000, 93)
    B, scales, zps, deq = peers.pack_matmulnbits(W, 128)
    nb = -(-1000 // 128)
    s = scales.reshape(93, nb)
    step = np.repeat(s, 128, axis=1)[:, :1000].T  # [K, N]
    assert np.all(np.abs(deq - W) <= 0.5 * step * 1.001 + 1e-6)
    # nibble order: element 0 of column 0 is the low nibble of B[0, 0, 0]
    zp0 = zps[0] & 0xF
    q00 = B[0, 0, 0] & 0xF
    assert deq[0, 0] == pytest.approx((int(q00) - int(zp0)) * float(s[0, 0]))


def test_ort_activation_model_is_needed():
    """Level-4 output differs from the fp activation product by more than the tolerance used."""
    W, x = _w(1000, 93, seed=11)
    p = peers.ort_matmulnbits(W, 128, accuracy_level=4, threads=1)
    y = p(x)
    assert _rel(y, p.reference_fp(x)) > 2e-4
    assert _rel(y, p.reference(x)) < 2e-5


def test_ort_copy_is_a_new_session():
    W, x = _w(256, 96)
    p = peers.ort_matmulnbits(W, 32, threads=1)
    c = p.copy()
    assert c.sess is not p.sess
    np.testing.assert_array_equal(c(x), p(x))


def test_peer_rejects_wrong_input_length():
    W, x = _w(256, 96)
    with pytest.raises(ValueError):
        peers.torch_fp32_mv(W)(x[:100])


def test_benchmark_peers_end_to_end_in_subprocess():
    """The benchmark entry, as the driver runs it: fresh process, thread env, JSON back."""
    import os

    from qtvm.bench import harness

    out = harness.run_in_subprocess(
        "qtvm.bench.peers:benchmark_peers",
        {
            "shapes": [[256, 96]],
            "threads": 1,
            "group_size": 32,
            "min_total_bytes": 200_000,
            "l3_bytes": 16_384,
            "probe_bytes": 1 << 20,
            "rounds": 2,
            "min_iters": 6,
            "min_probe_ratio": 0.0,  # a 1 MB probe measures caches, noisily: accept every round
        },
        harness.thread_env(1),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        stream_stderr=False,
        timeout=120,
    )
    rs = [harness.BenchResult.from_dict(d) for d in out["results"]]
    assert [r.kernel for r in rs] == ["torch_fp32_mv", "torch_int4_g32", "ort_matmulnbits_b32"]
    for r in rs:
        assert r.shape == (96, 256) and r.threads == 1
        assert r.median_us > 0 and r.gbps > 0
        assert r.extras["n_copies"] * r.weight_bytes >= 200_000
        assert len(r.extras["round_median_us"]) == 2
        assert r.extras["n_samples"] >= 6
        assert r.extras["pct_of_probe_bw"] > 0
        assert r.extras["hot_gbps"] == pytest.approx(r.weight_bytes / r.extras["hot_us"] / 1e3)  # cache-hot
    assert rs[2].extras["ort_shared_pool"] is True
    assert len(out["bandwidth_probes"]["256x96"]) == 4  # before and after each accepted round
    assert all("unstable" in r.extras and "rejected_round_probes" in r.extras for r in rs)


def test_benchmark_peers_rejects_rounds_with_low_bandwidth(monkeypatch):
    """A round bracketed by a bandwidth probe far below the best is re-run, and recorded."""
    from qtvm.bench import bandwidth

    script = iter([10.0, 10.0, 10.0, 4.0, 10.0, 9.5, 9.0] + [10.0] * 50)
    monkeypatch.setattr(bandwidth.BandwidthProbe, "measure", lambda self, *a, **k: next(script))
    out = peers.benchmark_peers(
        [(256, 96)], 1, ["torch_fp32"], min_total_bytes=300_000, l3_bytes=16_384,
        probe_bytes=1 << 16, rounds=2, min_iters=4,
    )
    (r,) = out["results"]
    # probes: reference 10; round 1 (10, 10) accepted; round 2 (4, 10) rejected; round 3 (9.5, 9.0) accepted
    assert r["extras"]["rejected_round_probes"] == [[4.0, 10.0]]
    assert r["extras"]["bw_probe_gbps"] == [10.0, 10.0, 9.5, 9.0]
    assert len(r["extras"]["round_median_us"]) == 2
    assert r["extras"]["unstable"] is False
    n = r["extras"]["n_copies"]
    assert n * 96 * 256 * 4 >= 300_000
    assert r["extras"]["n_samples"] == 2 * -(-max(4, 2 * n) // 2)  # only accepted rounds count


def test_benchmark_peers_idles_before_each_turn(monkeypatch):
    """Every peer's turn, every bandwidth probe and every cache-hot measurement follows an idle
    gap, so the previous runtime's spinning pool is not charged to what comes next."""
    from qtvm.bench import bandwidth, harness

    events = []
    monkeypatch.setattr(bandwidth.BandwidthProbe, "measure", lambda self, *a, **k: events.append("probe") or 10.0)
    monkeypatch.setattr(peers.time, "sleep", lambda s: events.append(("sleep", s)))
    real_rotating = harness.time_rotating
    monkeypatch.setattr(harness, "time_rotating", lambda *a, **k: events.append("turn") or real_rotating(*a, **k))
    peers.benchmark_peers([(256, 96)], 1, ["torch_fp32", "torch_fp32"], min_total_bytes=300_000,
                          l3_bytes=16_384, probe_bytes=1 << 16, rounds=2, min_iters=4, gap_s=0.125, hot_iters=2)
    timed = [i for i, e in enumerate(events) if e in ("probe", "turn")][1:]  # the first probe: the reference
    assert len(timed) == 2 * (2 + 2)  # 2 rounds: a probe, 2 turns, a probe
    assert all(events[i - 1] == ("sleep", 0.125) for i in timed)
    assert events.count(("sleep", 0.125)) == len(timed) + 2  # and one before each peer's cache-hot timing


def test_turn_order_rotates_so_each_peer_follows_the_probe_equally():
    from qtvm.bench.harness import turn_order

    assert [turn_order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert turn_order(1, 5) == [0] and turn_order(0, 2) == []


def test_benchmark_peers_rotates_the_turns_and_records_them(monkeypatch):
    """Round r starts with peer r mod P (a fixed order put one peer after every probe), and each
    result records its turn per accepted round; a rejected round still advances the rotation.
    Every turn calls each of its copies once before timing (not only the first round's)."""
    from qtvm.bench import bandwidth, harness

    script = iter([10.0, 10.0, 10.0, 4.0, 10.0] + [10.0] * 50)  # reference; round 1 ok; round 2 rejected
    monkeypatch.setattr(bandwidth.BandwidthProbe, "measure", lambda self, *a, **k: next(script))
    touched = []
    real_rotating = harness.time_rotating
    monkeypatch.setattr(harness, "time_rotating", lambda *a, **k: touched.append(k["touch_all"]) or real_rotating(*a, **k))
    out = peers.benchmark_peers([(256, 96)], 1, ["torch_fp32", "torch_fp32", "torch_fp32"], min_total_bytes=300_000,
                                l3_bytes=16_384, probe_bytes=1 << 16, rounds=3, min_iters=4, hot_iters=2,
                                gap_s=0.0)
    rs = out["results"]
    # orders: round 1 (0 1 2) accepted, round 2 (1 2 0) rejected, rounds 3 (2 0 1) and 4 (0 1 2) accepted
    assert [r["extras"]["round_turn"] for r in rs] == [[0, 1, 0], [1, 2, 1], [2, 0, 2]]
    assert all(r["extras"]["accepted_rounds"] == 3 for r in rs)
    assert touched == [True] * 12  # 4 rounds x 3 turns
