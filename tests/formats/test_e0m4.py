"""E0M4 FP4 weights: bit-level encode/decode, zero exactness, MAE vs INT4, the qmatmul kernel."""

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import te

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import PRESETS, UniformFormat, get_format
from qtvm.formats.e0m4 import E0M4Format, mae, mae_ratio_vs_int4
from tests.kernels import AVX2 as TARGET
from tests.kernels import NB, compile_scheduled, rel_err, run_blocked



def test_presets_and_description():
    for g in (32, 64, 128):
        assert get_format(f"e0m4-g{g}") == E0M4Format(g)
        assert get_format(f"e0m4-g{g}-f16") == E0M4Format(g, "fp16")
    desc = PRESETS["e0m4-g128"].describe()
    assert desc["family"] == "e0m4" and desc["bits"] == 4 and desc["values_per_block"] == 8
    assert PRESETS["e0m4-g128-f16"].describe()["decode"] == "fp16"


@pytest.mark.parametrize("kwargs, needle", [
    ({"group_size": 48}, "valid group sizes: 16, 32, 64, 128, 256 or full column"),
    ({"decode": "bf16"}, "valid decodes: fp32, fp16"),
])
def test_bad_configuration_lists_valid_values(kwargs, needle):
    with pytest.raises(QtvmError, match="E0M4") as err:
        E0M4Format(**kwargs)
    assert needle in str(err.value)


@settings(max_examples=40, deadline=None)
@given(words=st.integers(1, 6), n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_code_pack_round_trip(words, n, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (8 * words, n)).astype(np.uint32)
    packed = E0M4Format.pack(codes)
    assert packed.dtype == np.int32 and packed.shape == (words, n)
    assert np.array_equal(E0M4Format.unpack(packed), codes)


@settings(max_examples=200, deadline=None)
@given(v=st.floats(1.0, 2.0, exclude_max=True, width=32))
def test_encode_is_top4_plus_rounding_bit(v):
    """code = min(y1 + y2, 15): round half up of the 4-bit fraction, top clipped."""
    frac16 = (np.float64(np.float32(v)) - 1.0) * 16.0  # exact
    expected = min(int(np.floor(frac16 + 0.5)), 15)
    assert int(E0M4Format.encode(np.array([v]))[0]) == expected


def test_code_values_both_decodes():
    codes = np.arange(16)
    exact = 1.0 + codes / 16.0
    assert np.array_equal(E0M4Format.code_values(codes, "fp32"), exact.astype(np.float32))
    f16 = E0M4Format.code_values(codes, "fp16")
    assert f16.dtype == np.float16 and np.array_equal(f16, exact.astype(np.float16))


@pytest.mark.parametrize("decode", ["fp32", "fp16"])
def test_te_decode_matches_numpy_bit_for_bit(decode):
    """The TE decode (shift, OR the exponent of 1.0, reinterpret) of every code."""
    fmt = E0M4Format(32, decode)
    codes = np.arange(16, dtype=np.uint32)[::-1].reshape(16, 1)  # two words, codes 15..0
    words = te.placeholder((2,), "int32", name="words")
    out = te.compute((16,), lambda k: fmt.te_decode_terms(lambda name, row: words[row], k)[0], name="f")
    lib = tvm.compile(te.create_prim_func([words, out]), target=TARGET)
    got = tvm.runtime.tensor(np.zeros(16, np.float32))
    lib(tvm.runtime.tensor(E0M4Format.pack(codes)[:, 0].copy()), got)
    expected = np.float16(1.0) + codes[:, 0].astype(np.float16) / np.float16(16.0)  # numpy float16
    assert np.array_equal(got.numpy(), expected.astype(np.float32))
    recipe = E0M4Format.code_values(codes[:, 0], decode).astype(np.float32)  # numpy bit recipe
    assert np.array_equal(got.numpy().view(np.uint32), recipe.view(np.uint32))


def test_zero_maps_exactly():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((512, 40)) * 0.05).astype(np.float32)
    w[7] = 0.0  # an all-zero row
    w[rng.random(w.shape) < 0.1] = 0.0  # scattered exact zeros
    fmt = get_format("e0m4-g128")
    qt = fmt.quantize(w)
    d = qt.dequantize()
    assert np.array_equal(d[w == 0], np.zeros(int((w == 0).sum()), np.float32))
    # How: -bias / scale = 1 + c0 / 16 exactly (the low fraction bits are zero).
    scale, bias = qt.arrays["scales"].astype(np.float64), qt.arrays["bias"].astype(np.float64)
    t = -bias / scale
    assert np.array_equal(t * 16, np.round(t * 16)) and np.all((t >= 1) & (t < 2))
    t32 = t.astype(np.float32).view(np.uint32)
    assert np.all(t32 & np.uint32((1 << 19) - 1) == 0)


def test_error_bound_and_constant_groups():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 8)).astype(np.float32)
    w[:, 0] = 0.731  # constant groups (positive, negative, zero) are exact
    w[:, 1] = -2.5
    w[:, 2] = 0.0
    w[:128, 3] = rng.uniform(1.0, 2.0, 128)  # a group away from zero
    qt = get_format("e0m4-g128").quantize(w)
    d = qt.dequantize()
    assert np.array_equal(d[:, :3], w[:, :3])
    span = np.repeat(np.ptp(np.concatenate([w.reshape(2, 128, 8), np.zeros((2, 1, 8))], 1), axis=1), 128, 0)
    # 16 steps of span / 16: half a step of rounding, plus the top 1/32 clip and the
    # half-step shift that keeps zero on a code.
    assert np.all(np.abs(d - w) <= span * (1.5 / 16) + 1e-6)


def test_nan_inf_and_overflowing_range():
    w = np.ones((64, 4), np.float32)
    w[0, 0] = np.inf
    with pytest.raises(QtvmError, match="mlp.down contains 1 NaN/Inf"):
        get_format("e0m4-g32").quantize(w, name="mlp.down")
    huge = np.full((32, 2), 3e38, np.float32)
    huge[0] = -3e38
    with pytest.raises(QtvmError, match="big.w has a group range too wide"):
        get_format("e0m4-g32").quantize(huge, name="big.w")


def test_bits_per_weight_at_4096():
    for g in (32, 64, 128):
        qt = E0M4Format(g).quantize(np.ones((4096, 4), np.float32))
        assert qt.bits_per_weight == pytest.approx(4 + 64 / g)


def test_mae_vs_int4_on_gaussian_weights():
    """Transformer-Lite Table 2: E0M4 beats INT4 at group 128 (paper: ratio ~0.955)."""
    w = (np.random.default_rng(2).standard_normal((2048, 512)) * 0.02).astype(np.float32)
    ratio = mae_ratio_vs_int4(w, 128)
    assert 0.93 < ratio < 0.99
    assert ratio == pytest.approx(mae(w, E0M4Format(128)) / mae(w, UniformFormat(4, 128)))
    assert mae(w, E0M4Format(128, "fp16")) == mae(w, E0M4Format(128))  # same values either decode


# -- the compiled qmatmul kernel ----------------------------------------------------

@pytest.mark.parametrize("name, k, n", [("e0m4-g128", 1000, 37), ("e0m4-g32-f16", 300, 1), ("e0m4-g64", 300, 37)])
def test_qmatmul_kernel_matches_reference(name, k, n):
    rng = np.random.default_rng(k * n)
    qt = get_format(name).quantize(rng.standard_normal((k, n)).astype(np.float32))
    deq = qt.dequantize().astype(np.float64)
    lib = compile_scheduled(ops.qmatmul_func(qt.fmt, k, n, NB), TARGET)
    for m in (1, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ref = x.astype(np.float64) @ deq
        assert rel_err(run_blocked(lib, x, qt), ref) < 1e-5
