"""GPTQ quantizer, act-order reordering and packed-zero (-qz) uniform presets."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import PRESETS, UniformFormat, get_format
from qtvm.formats.gptq import ActOrderFormat, QZerosFormat, gptq_quantize, reorder_for_kernel
from tests.kernels import AVX2 as TARGET
from tests.kernels import NB, compile_scheduled, run_blocked



def correlated(rng, s: int, k: int, rank: int = 16, noise: float = 0.1, mix=None):
    """Activations with a low-rank + noise covariance and uneven channel scales."""
    if mix is None:
        mix = rng.standard_normal((rank, k)) * rng.uniform(0.2, 3.0, k)
    x = rng.standard_normal((s, mix.shape[0])) @ mix + noise * rng.standard_normal((s, k))
    return x.astype(np.float32), mix


def out_err(x, w, d) -> float:
    x = x.astype(np.float64)
    return float(np.linalg.norm(x @ w - x @ d.astype(np.float64)))


def run_kernel(qt, x):
    return run_blocked(compile_scheduled(ops.qmatmul_func(qt.fmt, qt.k, qt.n, NB), TARGET), x, qt)


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(0)
    k, n = 256, 96
    x, mix = correlated(rng, 1024, k)
    held, _ = correlated(rng, 512, k, mix=mix)
    w = rng.standard_normal((k, n)).astype(np.float32)
    return w, x, held


@pytest.mark.parametrize("fmt, act_order", [
    (UniformFormat(4, 128), False), (UniformFormat(4, 128), True), (UniformFormat(3, 64), False),
    (UniformFormat(2, 32), True), (UniformFormat(4, None), False)], ids=str)
def test_gptq_beats_rtn_on_layer_output(layer, fmt, act_order):
    w, x, held = layer
    rtn = fmt.quantize(w).dequantize()
    gq = gptq_quantize(w, x, fmt, act_order=act_order).dequantize()
    # On calibration data and on held-out data from the same distribution.
    assert out_err(x, w, gq) < 0.5 * out_err(x, w, rtn)
    assert out_err(held, w, gq) < 0.5 * out_err(held, w, rtn)
    # Every row still sits on its group's grid: error vs the weight is bounded by the range.
    assert np.all(np.isfinite(gq))


def test_plain_gptq_is_a_uniform_tensor_the_kernel_runs(layer):
    w, x, _ = layer
    k, n = 200, 37  # K not a multiple of the group
    w, x = w[:k, :n], x[:, :k]
    fmt = UniformFormat(4, 64)
    qt = gptq_quantize(w, x, fmt, block_size=48)
    assert type(qt.fmt) is UniformFormat and qt.fmt == fmt
    assert set(qt.arrays) == {"qweight", "scales", "zeros"}
    assert qt.nbytes == fmt.quantize(w).nbytes
    d = qt.dequantize()
    kp = fmt.padded_k(k)
    codes = fmt.unpack(qt.arrays["qweight"], kp)
    assert np.all(codes[k:] == np.repeat(qt.arrays["zeros"], 64, axis=0)[k:])  # padding dequantizes to 0
    xs = np.random.default_rng(3).standard_normal((17, k)).astype(np.float32)
    ref = xs.astype(np.float64) @ d
    np.testing.assert_allclose(run_kernel(qt, xs), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_diagonal_hessian_reduces_to_round_to_nearest():
    """Uncorrelated channels: nothing to compensate, GPTQ == RTN exactly."""
    rng = np.random.default_rng(1)
    k, n = 128, 40
    x = np.zeros((2 * k, k), np.float32)
    x[np.arange(k), np.arange(k)] = rng.uniform(0.5, 2.0, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    fmt = UniformFormat(3, 32)
    rtn, gq = fmt.quantize(w), gptq_quantize(w, x, fmt, block_size=32)
    for name in ("qweight", "scales", "zeros"):
        np.testing.assert_array_equal(gq.arrays[name], rtn.arrays[name])


def test_lazy_block_updates_match_row_by_row(layer):
    w, x, _ = layer
    fmt = UniformFormat(4, 32)
    rows = gptq_quantize(w, x, fmt, block_size=1).dequantize()
    for block in (16, 100, 1000):
        d = gptq_quantize(w, x, fmt, block_size=block).dequantize()
        # Same arithmetic in another order: identical up to rare float ties.
        assert np.mean(d != rows) < 1e-3
        assert out_err(x, w, d) == pytest.approx(out_err(x, w, rows), rel=1e-3)
    # Groups that straddle blocks take their parameters from the pending-updated rows.
    fmt = UniformFormat(4, 128)
    rows = gptq_quantize(w, x, fmt, block_size=1).dequantize()
    assert np.mean(gptq_quantize(w, x, fmt, block_size=48).dequantize() != rows) < 1e-3


def test_act_order_reorders_to_uniform_kernel(layer):
    w, x, _ = layer
    k, n = 250, 37
    w, x = w[:k, :n], x[:, :k]
    fmt = UniformFormat(4, 64)
    qt = gptq_quantize(w, x, fmt, act_order=True)
    assert isinstance(qt.fmt, ActOrderFormat) and qt.fmt.base == fmt
    g_idx = qt.arrays["g_idx"]
    assert g_idx.dtype == np.int32 and g_idx.shape == (k,)
    # Groups follow decreasing diag(H): the first group holds the most active channels.
    energy = (x.astype(np.float64) ** 2).sum(axis=0)
    order = np.argsort(-energy, kind="stable")
    np.testing.assert_array_equal(g_idx[order], np.arange(k) // 64)
    perm, flat = reorder_for_kernel(qt)
    assert type(flat.fmt) is UniformFormat and "g_idx" not in flat.arrays
    assert sorted(perm.tolist()) == list(range(k))
    np.testing.assert_array_equal(qt.dequantize()[perm], flat.dequantize())
    xs = np.random.default_rng(5).standard_normal((17, k)).astype(np.float32)
    ref = xs.astype(np.float64) @ qt.dequantize().astype(np.float64)
    y = run_kernel(flat, xs[:, perm])
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(QtvmError, match="reorder_for_kernel"):
        ops.qmatmul_func(qt.fmt, k, n, NB)
    with pytest.raises(QtvmError, match="no g_idx"):
        reorder_for_kernel(flat)


def test_act_order_with_packed_zeros_and_three_bits(layer):
    w, x, _ = layer
    fmt = get_format("int3-g32-qz")
    qt = gptq_quantize(w, x, fmt, act_order=True, block_size=64)
    assert "qzeros" in qt.arrays and "zeros" not in qt.arrays
    perm, flat = reorder_for_kernel(qt)
    assert flat.fmt == fmt
    np.testing.assert_array_equal(qt.dequantize()[perm], flat.dequantize())


def test_reorder_rejects_uneven_groups(layer):
    w, x, _ = layer
    qt = gptq_quantize(w[:128], x[:, :128], UniformFormat(4, 32), act_order=True)
    g_idx = qt.arrays["g_idx"].copy()
    g_idx[:5] = 0
    bad = type(qt)(qt.fmt, qt.k, qt.n, dict(qt.arrays, g_idx=g_idx))
    with pytest.raises(QtvmError, match="contiguous"):
        reorder_for_kernel(bad)


def test_calibration_width_mismatch_names_both_widths():
    w = np.ones((128, 8), np.float32)
    with pytest.raises(QtvmError, match=r"width 100 .*q_proj.* 128 input rows"):
        gptq_quantize(w, np.ones((16, 100), np.float32), UniformFormat(4, 128), name="q_proj")
    with pytest.raises(QtvmError, match="shape"):
        gptq_quantize(w, np.ones(128, np.float32), UniformFormat(4, 128))
    with pytest.raises(QtvmError, match="NaN"):
        gptq_quantize(w, np.full((4, 128), np.nan, np.float32), UniformFormat(4, 128))
    with pytest.raises(QtvmError, match="block_size"):
        gptq_quantize(w, np.ones((4, 128), np.float32), UniformFormat(4, 128), block_size=0)


def test_dead_channels_are_rounded_not_dropped(layer):
    w, x, _ = layer
    x = x.copy()
    x[:, 10] = 0.0
    fmt = UniformFormat(8, 128)
    d = gptq_quantize(w, x, fmt).dequantize()
    rtn = fmt.quantize(w).dequantize()
    # The dead row keeps its weights (on the 8-bit grid of its group).
    step = np.abs(rtn - w).max() * 2 + 1e-6
    assert np.all(np.abs(d[10] - w[10]) <= 2 * step)
    assert np.abs(d[10]).max() > 0.5


# -- packed zeros ---------------------------------------------------------------------
def test_qz_presets_registered_and_smaller():
    for bits in (2, 3, 4, 8):
        for g in ("g32", "g128", "col"):
            fmt = PRESETS[f"int{bits}-{g}-qz"]
            assert isinstance(fmt, QZerosFormat) and fmt.describe()["zeros"] == "packed"
    w = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)
    plain, packed = get_format("int4-g128").quantize(w), get_format("int4-g128-qz").quantize(w)
    assert packed.bits_per_weight == pytest.approx(4 + 36 / 128)
    assert plain.bits_per_weight == pytest.approx(4.5)
    np.testing.assert_array_equal(plain.dequantize(), packed.dequantize())
    assert packed.arrays["qzeros"].dtype == np.int32


@pytest.mark.parametrize("name, k, n", [("int4-g128-qz", 1000, 37), ("int3-g32-qz", 1000, 37),
                                        ("int2-g16-qz", 300, 70), ("int8-col-qz", 130, 5),
                                        ("int3-g16-qz", 40, 3)])
def test_qz_kernel_matches_reference(name, k, n):
    fmt = get_format(name)
    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qt = fmt.quantize(w)
    np.testing.assert_array_equal(qt.dequantize(), UniformFormat(fmt.bits, fmt.group_size).quantize(w).dequantize())
    for m in (1, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64)
        np.testing.assert_allclose(run_kernel(qt, x), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max() + 1e-6)


def test_gptq_into_qz_format_matches_float_zeros(layer):
    w, x, _ = layer
    a = gptq_quantize(w, x, get_format("int4-g64"))
    b = gptq_quantize(w, x, get_format("int4-g64-qz"))
    np.testing.assert_array_equal(a.dequantize(), b.dequantize())
    assert b.nbytes < a.nbytes
