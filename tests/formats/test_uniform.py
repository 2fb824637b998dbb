"""Uniform b-bit format: packing, quantization error, errors, and the compiled kernel."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import PRESETS, UniformFormat, get_format
from qtvm.formats.gptq import QZerosFormat
from schedules.x86 import schedule_qmatmul_x86
from tests.kernels import AVX2 as TARGET
from tests.kernels import NB, run_blocked

BITS = (2, 3, 4, 8)


# -- packing -------------------------------------------------------------------
@st.composite
def codes_for(draw, bits):
    fmt = UniformFormat(bits, None)
    blocks = draw(st.integers(1, 4))
    n = draw(st.integers(1, 5))
    codes = draw(hnp.arrays(np.uint32, (blocks * fmt.values_per_block, n),
                            elements=st.integers(0, fmt.qmax)))
    return fmt, codes


@pytest.mark.parametrize("bits", BITS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pack_unpack_round_trip(bits, data):
    fmt, codes = data.draw(codes_for(bits))
    words = fmt.pack(codes)
    assert words.dtype == np.int32
    assert words.shape == (codes.shape[0] // fmt.values_per_block * fmt.words_per_block, codes.shape[1])
    np.testing.assert_array_equal(fmt.unpack(words, codes.shape[0]), codes)


@pytest.mark.parametrize("j, bits_set", [
    (10, [(0, 30), (0, 31), (1, 0)]),   # value 10: bits 30..32 -> word 0 bits 30-31, word 1 bit 0
    (21, [(1, 31), (2, 0), (2, 1)]),    # value 21: bits 63..65 -> word 1 bit 31, word 2 bits 0-1
    (0, [(0, 0), (0, 1), (0, 2)]),
    (31, [(2, 29), (2, 30), (2, 31)]),
])
def test_three_bit_straddling_values(j, bits_set):
    fmt = UniformFormat(3, None)
    codes = np.zeros((32, 1), np.uint32)
    codes[j] = 7
    words = fmt.pack(codes).view(np.uint32)[:, 0]
    expected = np.zeros(3, np.uint64)
    for word, bit in bits_set:
        expected[word] |= np.uint64(1) << np.uint64(bit)
    np.testing.assert_array_equal(words.astype(np.uint64), expected)
    np.testing.assert_array_equal(fmt.unpack(fmt.pack(codes), 32), codes)
    # A straddling value with a distinct pattern (5 = 0b101) keeps its bit order.
    codes[j] = 5
    np.testing.assert_array_equal(fmt.unpack(fmt.pack(codes), 32)[j], [5])


# -- quantize / dequantize -----------------------------------------------------
def _group_bound(fmt: UniformFormat, qt) -> np.ndarray:
    """Per-element bound: half a step of the element's group (plus float32 rounding)."""
    gs = fmt.group_size_for(qt.k)
    scales = np.repeat(qt.arrays["scales"], gs, axis=0)[: qt.k]
    return 0.5 * scales.astype(np.float64) * (1 + 1e-5)


finite_weights = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 80), st.integers(1, 6)),
    elements=st.floats(-2.0 ** 100, 2.0 ** 100, width=32, allow_nan=False, allow_infinity=False))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [16, 32, None])
@settings(max_examples=30, deadline=None)
@given(w=finite_weights)
def test_quantize_error_within_half_step(bits, group, w):
    fmt = UniformFormat(bits, group)
    qt = fmt.quantize(w)
    d = qt.dequantize()
    assert d.shape == w.shape and d.dtype == np.float32
    err = np.abs(d.astype(np.float64) - w)
    bound = _group_bound(fmt, qt) + 1e-6 * np.abs(w).astype(np.float64) + 1e-37
    assert np.all(err <= bound), float((err - bound).max())
    zeros = qt.arrays["zeros"]
    assert np.all(zeros == np.round(zeros)) and zeros.min() >= 0 and zeros.max() <= fmt.qmax


@pytest.mark.parametrize("bits", BITS)
def test_error_shrinks_with_bits_on_gaussian(bits):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((512, 64)).astype(np.float32)
    fmt = UniformFormat(bits, 64)
    qt = fmt.quantize(w)
    err = np.abs(qt.dequantize() - w)
    # Max error is half a step; a Gaussian group of 64 spans about 5 sigma.
    assert err.max() <= 0.5 * qt.arrays["scales"].max() * (1 + 1e-5)
    assert err.mean() < 6.0 / 2 ** bits


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("k", [1, 50, 130, 1000])
def test_padding_of_k_not_multiple_of_group(bits, k):
    fmt = UniformFormat(bits, 128)
    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, 3)).astype(np.float32)
    qt = fmt.quantize(w)
    kp = fmt.padded_k(k)
    assert kp >= k and kp % 128 == 0 and kp % fmt.values_per_block == 0
    assert qt.arrays["qweight"].shape == (fmt.word_rows(k), 3)
    assert qt.arrays["scales"].shape == (kp // 128, 3)
    assert qt.dequantize().shape == (k, 3)
    # Padding rows are zeros: they dequantize to exactly 0 (the range always covers 0).
    codes = fmt.unpack(qt.arrays["qweight"], kp).astype(np.float64)
    zeros = np.repeat(qt.arrays["zeros"], 128, axis=0)
    np.testing.assert_array_equal(codes[k:], zeros[k:])
    assert np.all(np.abs(qt.dequantize() - w) <= _group_bound(fmt, qt) + 1e-6)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("c", [1.0, -1.0, 0.1, -0.3, 1e-3, 7.25, -123.456, 3.0e-30, 1e30])
def test_constant_groups_reconstruct_exactly(bits, c):
    w = np.full((64, 4), c, np.float32)
    w[:, 1] = -w[:, 1]
    w[32:, 2] = 0.5 * c  # two constant groups of 32 in column 2
    np.testing.assert_array_equal(UniformFormat(bits, 32).quantize(w).dequantize(), w)


@pytest.mark.parametrize("bits", BITS)
def test_many_random_constant_groups_reconstruct_exactly(bits):
    rng = np.random.default_rng(7)
    c = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-6, 6, 4000)).astype(np.float32)
    w = np.repeat(c[None, :], 64, axis=0)
    np.testing.assert_array_equal(UniformFormat(bits, 64).quantize(w).dequantize(), w)


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_rows_and_columns_are_exact(bits):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 10)).astype(np.float32)
    w[5] = 0
    w[40:72] = 0          # whole groups of zeros
    w[:, 3] = 0
    d = UniformFormat(bits, 32).quantize(w).dequantize()
    assert np.all(d[5] == 0) and np.all(d[40:72] == 0) and np.all(d[:, 3] == 0)
    assert np.all(np.isfinite(d))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_error_names_tensor(bad):
    w = np.ones((32, 4), np.float32)
    w[3, 1] = bad
    with pytest.raises(QtvmError, match="layers.0.mlp.up_proj.*1 NaN/Inf"):
        UniformFormat(4, 32).quantize(w, name="layers.0.mlp.up_proj")


def test_bad_shapes_rejected():
    with pytest.raises(QtvmError, match="2-D"):
        UniformFormat(4, 32).quantize(np.ones(8, np.float32))
    with pytest.raises(QtvmError, match="empty"):
        UniformFormat(4, 32).quantize(np.ones((0, 3), np.float32))


@pytest.mark.parametrize("bits", [0, 1, 5, 16])
def test_invalid_bits_lists_valid(bits):
    with pytest.raises(QtvmError, match=r"valid bits: 2, 3, 4, 8"):
        UniformFormat(bits, 128)


@pytest.mark.parametrize("group", [0, 8, 100, -16])
def test_invalid_group_lists_valid(group):
    with pytest.raises(QtvmError, match=r"valid group sizes: multiples of 16 \(presets: 16, 32, 64, 128, 256\)"):
        UniformFormat(4, group)


@pytest.mark.parametrize("group", [48, 512, 1024])
def test_model_block_sizes_beyond_presets(group):
    """Quantized ONNX models bring their own block sizes: any multiple of 16 packs and round-trips."""
    fmt = UniformFormat(4, group)
    assert fmt.name == f"int4-g{group}" and fmt.name not in PRESETS
    w = np.random.default_rng(group).standard_normal((200, 9)).astype(np.float32)
    qt = fmt.quantize(w)
    assert qt.arrays["scales"].shape == (fmt.num_groups(200), 9)
    assert np.abs(qt.dequantize() - w).max() <= 0.5 * qt.arrays["scales"].max() + 1e-6


def test_names_and_nominal_bits():
    assert UniformFormat(4, 128).name == "int4-g128"
    assert UniformFormat(3, None).name == "int3-col"
    assert get_format("int4-g128") == UniformFormat(4, 128)
    assert UniformFormat(4, 128).bits_per_weight_nominal() == pytest.approx(4.5)
    qt = UniformFormat(4, 128).quantize(np.ones((4096, 64), np.float32))
    assert qt.bits_per_weight == pytest.approx(4.5)


@pytest.mark.parametrize("bits,group", [(4, 128), (3, 64), (8, 32), (2, None)])
def test_f16_scales_are_what_the_codes_were_chosen_against(bits, group):
    """``-f16``: scales and zeros stored as float16; the codes are rounded against the
    stored scale, so the error stays half a step of it (plus the clip at the range's end
    where the scale rounded down: at most qmax x its float16 rounding, which is relative for
    normal scales and absolute, 2^-25, for the subnormal ones of the 1e-3 columns)."""
    fmt = UniformFormat(bits, group, "float16")
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((300, 37)) * rng.choice([1e-3, 0.05, 30.0], size=37)).astype(np.float32)
    qt = fmt.quantize(w)
    assert {name: a.dtype for name, a in qt.arrays.items()} == {
        "qweight": np.int32, "scales": np.float16, "zeros": np.float16}
    assert fmt.describe()["scales"] == fmt.describe()["zeros"] == "float16"
    same32 = UniformFormat(bits, group).quantize(w)  # the unrounded scales
    gs = fmt.group_size_for(qt.k)
    s16, s32 = (np.repeat(t.arrays["scales"].astype(np.float64), gs, axis=0)[: qt.k] for t in (qt, same32))
    err = np.abs(qt.dequantize().astype(np.float64) - w)
    assert np.all(err <= 0.5 * s16 + fmt.qmax * np.abs(s32 - s16) + 1e-6 * np.abs(w))
    assert np.abs(qt.dequantize() - w).mean() <= 1.01 * np.abs(same32.dequantize() - w).mean()


@pytest.mark.parametrize("value,word", [(1e6, "1.33e\\+05"), (1e-12, "1.33e-13")])
def test_f16_scales_beyond_float16_are_refused_with_the_float32_preset(value, word):
    w = np.full((128, 3), value, np.float32)
    w[0] = -value
    with pytest.raises(QtvmError, match=f"'weight' needs a scale of {word}.*float16.*int4-g128$"):
        get_format("int4-g128-f16").quantize(w)


def test_f16_names_and_nominal_bits():
    assert UniformFormat(4, 128, "float16").name == "int4-g128-f16" and get_format("int3-col-f16").bits == 3
    assert UniformFormat(4, 128, "float16").bits_per_weight_nominal() == pytest.approx(4.25)
    with pytest.raises(QtvmError, match="cannot store scales as bfloat16"):
        UniformFormat(4, 128, "bfloat16")
    assert QZerosFormat(4, 128, "float16").name == "int4-g128-f16-qz"  # GPTQ's own storage: 4.16 bits a weight
    assert get_format("int4-g128-f16-qz").bits_per_weight_nominal() == pytest.approx(4 + 20 / 128)


# -- compiled kernel vs numpy reference ------------------------------------------
_KERNELS: dict = {}


def _kernel(fmt: UniformFormat, k: int, n: int):
    key = (fmt, k, n)
    if key not in _KERNELS:
        func = ops.qmatmul_func(fmt, k, n, NB)
        _KERNELS[key] = tvm.compile(schedule_qmatmul_x86(func, TARGET).mod, target=TARGET)
    return _KERNELS[key]


def run_qmatmul(qt, x: np.ndarray) -> np.ndarray:
    return run_blocked(_kernel(qt.fmt, qt.k, qt.n), x, qt)


def check_kernel(fmt, k: int, n: int, seed: int = 0, ms=(1, 17)):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qt = fmt.quantize(w)
    d = qt.dequantize().astype(np.float64)
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = run_qmatmul(qt, x)
        ref = x.astype(np.float64) @ d
        scale = np.abs(x).astype(np.float64) @ np.abs(d)  # error scales with sum |x w|
        assert y.shape == (m, n)
        assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-6), (fmt.name, k, n, m)


INT4_SHAPES = [(k, n) for k in (128, 1000, 4096) for n in (1, 37)] + [(128, 4096), (1000, 4096)]


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("k, n", INT4_SHAPES)
def test_int4_kernel_matches_reference(group, k, n):
    check_kernel(UniformFormat(4, group), k, n, seed=k + n)


@pytest.mark.parametrize("bits, group, k, n", [
    (2, 16, 300, 70), (2, 64, 1000, 37), (2, None, 77, 5), (2, 128, 16, 1),
    (3, 128, 1000, 37), (3, 32, 33, 65), (3, None, 200, 3), (3, 16, 97, 129),
    (8, 32, 256, 65), (8, 128, 1000, 37), (8, None, 5, 2), (8, 16, 50, 64),
])
def test_low_and_high_bit_kernels_on_awkward_shapes(bits, group, k, n):
    check_kernel(UniformFormat(bits, group), k, n, seed=bits * 1000 + k)


@pytest.mark.parametrize("bits, group, k, n", [(4, 128, 1000, 37), (3, 64, 300, 70), (2, 32, 128, 1), (8, None, 77, 5)])
def test_f16_scale_kernels_on_awkward_shapes(bits, group, k, n):
    check_kernel(UniformFormat(bits, group, "float16"), k, n, seed=bits * 1000 + k)


def test_kernel_exact_on_constant_and_zero_weights():
    w = np.zeros((256, 40), np.float32)
    w[:128, :20] = 0.3
    w[128:, 20:] = -1.7
    qt = UniformFormat(4, 128).quantize(w)
    np.testing.assert_array_equal(qt.dequantize(), w)
    x = np.random.default_rng(0).standard_normal((17, 256)).astype(np.float32)
    np.testing.assert_allclose(run_qmatmul(qt, x), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
