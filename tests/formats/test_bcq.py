"""BCQ weights: packing, the alternating quantizer, exact uniform -> BCQ, the qmatmul kernel."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import PRESETS, UniformFormat, get_format
from qtvm.formats.bcq import VALID_BITS, BCQFormat, from_uniform
from tests.kernels import AVX2 as TARGET
from tests.kernels import NB, compile_scheduled, run_blocked



def _sq_err(qt, w):
    return float(((qt.dequantize().astype(np.float64) - w) ** 2).sum())


def test_presets_and_description():
    for q in (2, 3, 4):
        for g in (32, 64, 128):
            fmt = get_format(f"bcq{q}-g{g}")
            assert fmt == BCQFormat(q, g)
            desc = fmt.describe()
            assert desc["family"] == "bcq" and desc["bits"] == q and desc["values_per_block"] == 32
            assert desc["group_size"] == g
    assert "bcq3-g128" in PRESETS


@pytest.mark.parametrize("kwargs, needle", [
    ({"bits": 9}, "valid plane counts (bits): 1, 2, 3, 4, 5, 6, 7, 8"),
    ({"bits": 0}, "valid plane counts"),
    ({"bits": 3, "group_size": 100}, "valid group sizes: 16, 32, 64, 128, 256 or full column"),
    ({"bits": 3, "iters": -1}, "non-negative"),
])
def test_bad_configuration_lists_valid_values(kwargs, needle):
    with pytest.raises(QtvmError, match="BCQ") as err:
        BCQFormat(**kwargs)
    assert needle in str(err.value)


@settings(max_examples=40, deadline=None)
@given(q=st.sampled_from(VALID_BITS), chunks=st.integers(1, 4), n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_plane_pack_round_trip(q, chunks, n, seed):
    fmt = BCQFormat(q, 32)
    planes = np.random.default_rng(seed).integers(0, 2, (q, 32 * chunks, n)).astype(bool)
    words = fmt.pack(planes)
    assert words.dtype == np.int32 and words.shape == (chunks * q, n)
    assert np.array_equal(fmt.unpack(words, 32 * chunks), planes)


def test_plane_layout_is_interleaved_per_32_rows():
    fmt = BCQFormat(3, 32)
    planes = np.zeros((3, 64, 1), bool)
    planes[2, 37, 0] = True  # plane 2, chunk 1, bit 5
    words = fmt.pack(planes).view(np.uint32)
    assert words[1 * 3 + 2, 0] == 1 << 5 and words.sum() == 1 << 5


@pytest.mark.parametrize("q", [2, 3, 4])
def test_alternating_beats_greedy(q):
    w = np.random.default_rng(q).standard_normal((512, 48)).astype(np.float32)
    fmt = BCQFormat(q, 128)
    greedy, alt = fmt.quantize_greedy(w), fmt.quantize(w)
    assert _sq_err(alt, w) < 0.97 * _sq_err(greedy, w)
    # ... and never worse on any single group/column (the best iterate is kept).
    d_g = ((greedy.dequantize() - w) ** 2).reshape(4, 128, 48).sum(axis=1)
    d_a = ((alt.dequantize() - w) ** 2).reshape(4, 128, 48).sum(axis=1)
    assert np.all(d_a <= d_g * (1 + 1e-5) + 1e-12)


def test_error_bounded_by_group_range():
    w = np.random.default_rng(7).standard_normal((256, 40)).astype(np.float32)
    for q in (2, 3, 4):
        fmt = BCQFormat(q, 64)
        err = np.abs(fmt.quantize(w).dequantize() - w).reshape(4, 64, 40).max(axis=1)
        span = np.ptp(w.reshape(4, 64, 40), axis=1)
        assert np.all(err <= span / 2)
    rms = [np.sqrt(_sq_err(BCQFormat(q, 64).quantize(w), w) / w.size) for q in (1, 2, 3, 4)]
    assert rms == sorted(rms, reverse=True) and rms[-1] < 0.15


def test_padding_rows_and_bits_per_weight():
    fmt = get_format("bcq3-g128")
    w = np.random.default_rng(0).standard_normal((1000, 5)).astype(np.float32)
    qt = fmt.quantize(w)
    assert qt.arrays["bits"].shape == (1024 // 32 * 3, 5)
    assert qt.arrays["alpha"].shape == (8 * 3, 5) and qt.arrays["bias"].shape == (8, 5)
    assert fmt.unpack(qt.arrays["bits"], 1024)[:, 1000:].sum() == 0  # padding stays bit 0
    assert qt.dequantize().shape == (1000, 5)
    # Stored bytes at K = 4096 (bits/weight does not depend on N).
    for q, g in [(2, 128), (3, 128), (4, 128), (3, 32), (3, 64)]:
        wide = BCQFormat(q, g, iters=0).quantize(np.ones((4096, 4), np.float32))
        assert wide.bits_per_weight == pytest.approx(q + 32 * (q + 1) / g)


def test_nan_and_inf_name_the_tensor():
    w = np.ones((64, 4), np.float32)
    w[3, 1] = np.nan
    w[5, 2] = np.inf
    with pytest.raises(QtvmError, match="layers.0.q_proj contains 2 NaN/Inf"):
        get_format("bcq3-g32").quantize(w, name="layers.0.q_proj")


def test_constant_groups_and_zero_rows_are_exact():
    w = np.random.default_rng(3).standard_normal((256, 6)).astype(np.float32)
    w[:128, 0] = 0.3721  # one constant group
    w[128:, 1] = -5.0
    w[:, 2] = 0.0  # an all-zero column
    w[:, 3] = 1e-30  # tiny constant, no division trouble
    qt = get_format("bcq3-g128").quantize(w)
    d = qt.dequantize()
    assert np.all(np.isfinite(d))
    assert np.array_equal(d[:128, 0], w[:128, 0]) and np.array_equal(d[128:, 1], w[128:, 1])
    assert np.array_equal(d[:, 2:4], w[:, 2:4])
    zero = np.zeros((96, 3), np.float32)
    assert np.array_equal(get_format("bcq2-g32").quantize(zero).dequantize(), zero)
    # All-zero rows (dead input features) quantize fine; the error stays bounded.
    w[10:20] = 0.0
    d = get_format("bcq4-g64").quantize(w).dequantize()
    assert np.all(np.isfinite(d)) and np.abs(d - w).max() < np.ptp(w)


# -- exact uniform -> BCQ ---------------------------------------------------------

@pytest.mark.parametrize("bits, group", [(2, 128), (3, 128), (4, 32), (4, None), (8, 64), (4, 16)])
def test_from_uniform_matches_uniform(bits, group):
    """alpha_i = 2^(i-2) s is exact; the bias s((2^q-1)/2 - z) is rounded once to fp32."""
    k, n = 200, 33
    w = np.random.default_rng(bits).standard_normal((k, n)).astype(np.float32)
    uq = UniformFormat(bits, group).quantize(w)
    bq = from_uniform(uq)
    assert bq.fmt == BCQFormat(bits, group)
    ref, got = uq.dequantize(), bq.dequantize()
    # Each element is off by at most the bias's rounding plus one final rounding.
    gs = bq.fmt.group_size_for(k)
    bias = np.repeat(bq.arrays["bias"], gs, axis=0)[:k]
    bound = 0.5 * np.spacing(np.abs(bias)) + np.spacing(np.abs(ref))
    assert np.all(np.abs(got.astype(np.float64) - ref) <= bound)
    assert np.mean(got == ref) > 0.5  # most elements are bit-identical


@pytest.mark.parametrize("bits, group", [(2, 64), (3, 128), (4, 128), (8, 32)])
def test_from_uniform_bit_exact_when_bias_fits_fp32(bits, group):
    """With scales of <= 15 significant bits, s((2^q-1)/2 - z) is exact: bit-identical."""
    k, n = 300, 21
    w = np.random.default_rng(10 + bits).standard_normal((k, n)).astype(np.float32)
    uq = UniformFormat(bits, group).quantize(w)
    m, e = np.frexp(uq.arrays["scales"].astype(np.float64))
    short = np.ldexp(np.round(m * 2**15) / 2**15, e).astype(np.float32)
    uq = type(uq)(uq.fmt, k, n, dict(uq.arrays, scales=short))
    bq = from_uniform(uq)
    assert np.array_equal(bq.dequantize(), uq.dequantize())


def test_from_uniform_rejects_other_formats():
    qt = get_format("bcq2-g32").quantize(np.ones((32, 2), np.float32))
    with pytest.raises(QtvmError, match="uniform"):
        from_uniform(qt)


# -- the compiled qmatmul kernel ----------------------------------------------------

def _compile(qt):
    """The scheduled, compiled qmatmul for ``qt``; returns run(x) -> y."""
    lib = compile_scheduled(ops.qmatmul_func(qt.fmt, qt.k, qt.n, NB), TARGET)
    return lambda x: run_blocked(lib, x, qt)


@pytest.mark.parametrize("name, k, n", [("bcq3-g128", 1000, 37), ("bcq2-g32", 300, 1), ("bcq4-g64", 300, 37)])
def test_qmatmul_kernel_matches_reference(name, k, n):
    rng = np.random.default_rng(k + n)
    qt = get_format(name).quantize(rng.standard_normal((k, n)).astype(np.float32))
    deq = qt.dequantize().astype(np.float64)
    run = _compile(qt)
    for m in (1, 17):  # one compiled kernel, symbolic M
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ deq
        assert np.abs(run(x) - ref).max() / np.abs(ref).max() < 1e-5


def test_qmatmul_kernel_on_converted_uniform():
    rng = np.random.default_rng(5)
    uq = UniformFormat(3, 128).quantize(rng.standard_normal((1000, 37)).astype(np.float32))
    x = rng.standard_normal((1, 1000)).astype(np.float32)
    ref = x.astype(np.float64) @ uq.dequantize().astype(np.float64)
    got = _compile(from_uniform(uq))(x)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
