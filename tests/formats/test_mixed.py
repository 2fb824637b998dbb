"""Mixed 2/4/16-bit intra-matrix format: selection, storage, bits/weight, kernels."""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import PRESETS, UniformFormat, get_format
from qtvm.formats.mixed import (MixedFormat, mixed_matmul_reference, mixed_parts, sparse_outlier_arrays,
                                sparse_outlier_func)
from schedules.x86 import schedule_qmatmul_x86

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})
NB = 64


def heavy(rng, k, n, scale=0.02):
    return (rng.standard_t(3, (k, n)) * scale).astype(np.float32)


# -- format object ---------------------------------------------------------------------
def test_preset_and_eq10():
    fmt = get_format("mixed-2-4-16")
    assert fmt == MixedFormat() and "mixed-2-4-16" in PRESETS
    assert fmt.eq10_bits(with_outliers=False) == pytest.approx(2.84375)
    assert fmt.eq10_bits() == pytest.approx(2.84375 + 32 * 0.002)
    assert fmt.describe()["family"] == "mixed"
    assert MixedFormat(outlier_frac=0.0).name != fmt.name


@pytest.mark.parametrize("kwargs, match", [
    ({"outlier_frac": 0.006}, r"0\.5 %"),
    ({"outlier_frac": -0.001}, "outlier_frac"),
    ({"frac_4bit": 1.5}, "frac_4bit"),
    ({"g1": 8}, "g1 = 8"),
    ({"g4": 100}, "g4 = 100"),
    ({"g2": 0}, "g2"),
    ({"scale_bits": 5}, "valid scale_bits: 2, 3, 4, 8"),
])
def test_validation(kwargs, match):
    with pytest.raises(QtvmError, match=match):
        MixedFormat(**kwargs)


def test_no_single_kernel():
    with pytest.raises(QtvmError, match="mixed_parts"):
        ops.qmatmul_func(MixedFormat(), 256, 8, NB)


def test_rejects_weights_beyond_fp16_and_bad_calibration():
    with pytest.raises(QtvmError, match="fp16"):
        MixedFormat().quantize(np.full((32, 2), 1e5, np.float32))
    with pytest.raises(QtvmError, match=r"width 30 .* 64 input rows"):
        MixedFormat().quantize(np.ones((64, 4), np.float32), np.ones((8, 30), np.float32))
    with pytest.raises(QtvmError, match="NaN"):
        MixedFormat().quantize(np.full((64, 4), np.nan, np.float32))


# -- bits per weight from stored bytes ---------------------------------------------------------
@pytest.mark.parametrize("outlier_frac", [0.0, 0.002])
def test_bits_per_weight_at_4096(outlier_frac):
    k = n = 4096
    fmt = MixedFormat(outlier_frac=outlier_frac)
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * 0.02
    qt = fmt.quantize(w)
    nnz = len(qt.arrays["outlier_values"])
    assert nnz == round(outlier_frac * k * n)
    assert qt.arrays["outlier_indices"].dtype == np.int16
    # Stored bits = eq. 10 (without outliers) + units4 list + CSR (32 bits per outlier, 32 per row pointer).
    n4 = len(qt.arrays["units4"])
    assert n4 == 64  # 25 % of 256 units
    csr_bits = 32 * (n + 1) + 32 * nnz if nnz else 0
    assert 8 * qt.nbytes == pytest.approx(k * n * fmt.eq10_bits(with_outliers=False) + 32 * n4 + csr_bits, abs=0.5)
    if outlier_frac == 0:
        assert qt.bits_per_weight == pytest.approx(2.84, abs=0.005)   # 2.84387
    else:
        assert qt.bits_per_weight == pytest.approx(2.9, abs=0.02)     # 2.91569
        # Eq. 10 with outliers counts 16-bit index + fp16 value; the row pointer adds 32 / K.
        assert qt.bits_per_weight - fmt.eq10_bits() == pytest.approx(32 / k, abs=1e-3)


# -- precision selection -----------------------------------------------------------------
def test_sensitivity_formula_matches_hessian_inverse():
    rng = np.random.default_rng(2)
    k, n = 96, 12
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = (rng.standard_normal((200, 8)) @ rng.standard_normal((8, k)) + 0.3 * rng.standard_normal((200, k))).astype(np.float32)
    fmt = MixedFormat()
    h = 2 * x.astype(np.float64).T @ x / len(x)
    h += 0.01 * np.mean(np.diag(h)) * np.eye(k)
    hinv = np.linalg.inv(h)
    per_row = (w.astype(np.float64) ** 2).sum(axis=1) / np.diag(hinv) ** 2
    np.testing.assert_allclose(fmt.sensitivity(w, x), per_row.reshape(-1, 16).sum(axis=1), rtol=1e-8)
    np.testing.assert_allclose(fmt.sensitivity(w), (w.astype(np.float64) ** 2).sum(axis=1).reshape(-1, 16).sum(axis=1),
                               rtol=1e-6)


def test_calibration_changes_which_units_get_4_bits():
    rng = np.random.default_rng(3)
    k, n = 512, 24           # 32 units, 8 of them 4-bit
    w = rng.standard_normal((k, n)).astype(np.float32)
    big_w = [1, 5, 9, 13, 17, 21, 25, 29]     # large weights, almost silent inputs
    loud_x = [0, 4, 8, 12, 16, 20, 24, 28]    # ordinary weights, loud inputs
    for u in big_w:
        w[u * 16:(u + 1) * 16] *= 5
    scale = np.ones(k)
    for u in big_w:
        scale[u * 16:(u + 1) * 16] = 0.01
    for u in loud_x:
        scale[u * 16:(u + 1) * 16] = 10
    x = (rng.standard_normal((1024, k)) * scale).astype(np.float32)
    fmt = MixedFormat()
    assert sorted(fmt.quantize(w).arrays["units4"].tolist()) == big_w      # ||w||^2 ranking
    assert sorted(fmt.quantize(w, x).arrays["units4"].tolist()) == loud_x  # Hessian ranking


def test_four_bit_count_is_aligned_to_whole_groups():
    fmt = MixedFormat()
    assert fmt.units_4bit(1000) == 16           # 63 units * 0.25 = 15.75 -> 2 groups of 8 units
    assert fmt.units_4bit(4096) == 64
    assert fmt.units_4bit(100) == 0             # 7 units: less than half a 4-bit group
    assert MixedFormat(frac_4bit=1.0).units_4bit(1000) == 63


# -- quantization quality and outliers ---------------------------------------------------------
@pytest.fixture(scope="module")
def heavy_layer():
    rng = np.random.default_rng(4)
    k, n = 1000, 37
    w = heavy(rng, k, n)
    x = (rng.standard_normal((512, 16)) @ rng.standard_normal((16, k)) + 0.5 * rng.standard_normal((512, k)))
    return w, x.astype(np.float32)


def test_outliers_are_the_largest_2bit_errors(heavy_layer):
    w, _ = heavy_layer
    k, n = w.shape
    with_o, without = MixedFormat().quantize(w), MixedFormat(outlier_frac=0.0).quantize(w)
    np.testing.assert_array_equal(with_o.arrays["units4"], without.arrays["units4"])
    indptr, indices, values = MixedFormat().outliers(with_o)
    assert len(values) == round(0.002 * k * n) and values.dtype == np.float16
    assert indptr[0] == 0 and indptr[-1] == len(values) and np.all(np.diff(indptr) >= 0)
    cols = np.repeat(np.arange(n), np.diff(indptr))
    rows = indices.astype(np.int64)
    for c in range(n):  # rows sorted within each column
        assert np.all(np.diff(rows[cols == c]) > 0)
    idx4 = MixedFormat().rows_of(with_o.arrays["units4"], k)
    assert not np.isin(rows, idx4).any()        # only from the 2-bit rows
    err0 = np.abs(without.dequantize() - w)
    chosen = np.zeros_like(w, bool)
    chosen[rows, cols] = True
    two_bit = np.ones(k, bool)
    two_bit[idx4] = False
    assert err0[chosen].min() >= err0[two_bit][~chosen[two_bit]].max()
    d = with_o.dequantize()
    # Outlier positions are exact up to fp16 rounding of the residual.
    assert np.all(np.abs(d[chosen] - w[chosen]) <= 1e-3 * np.abs(w[chosen]) + 1e-4)
    assert np.abs(d - w).max() < 0.5 * err0.max()
    assert np.linalg.norm(d - w) < 0.9 * np.linalg.norm(without.dequantize() - w)


def test_four_bit_rows_are_more_accurate(heavy_layer):
    w, x = heavy_layer
    qt = MixedFormat(outlier_frac=0.0).quantize(w, x)
    d = qt.dequantize()
    idx4 = MixedFormat().rows_of(qt.arrays["units4"], w.shape[0])
    rest = np.setdiff1d(np.arange(w.shape[0]), idx4)
    rel = lambda rows: np.linalg.norm(d[rows] - w[rows]) / np.linalg.norm(w[rows])
    assert rel(idx4) < 0.5 * rel(rest) and rel(rest) < 0.5
    # 4-bit error is at most half a step of the row's group (fp16 scale/min rounding aside).
    s4 = np.repeat(qt.arrays["scales4"].astype(np.float32), 128, axis=0)[: len(idx4)]
    assert np.all(np.abs(d[idx4] - w[idx4]) <= 0.5 * s4 + 1e-3 * np.abs(w[idx4]) + 1e-6)


def test_hessian_ranking_lowers_layer_output_error():
    rng = np.random.default_rng(9)
    k, n = 1024, 48
    w = heavy(rng, k, n)
    loud = np.exp(1.5 * rng.standard_normal(k))   # log-normal channel loudness: a few loud channels
    x = (rng.standard_normal((768, k)) * loud).astype(np.float32)
    ref = x.astype(np.float64) @ w
    err = lambda fmt, calib: np.linalg.norm(ref - x.astype(np.float64) @ fmt.quantize(w, calib).dequantize())
    hessian, norms = err(MixedFormat(), x), err(MixedFormat(), None)
    all_2bit = err(MixedFormat(frac_4bit=0.0), x)
    assert hessian < 0.9 * norms       # measured 0.83
    assert hessian < 0.7 * all_2bit    # measured 0.59


def test_zero_matrix_is_exact():
    qt = MixedFormat().quantize(np.zeros((300, 5), np.float32))
    assert np.all(qt.dequantize() == 0)


def test_large_k_uses_int32_indices():
    w = heavy(np.random.default_rng(5), 33000, 2)
    qt = MixedFormat(outlier_frac=0.005).quantize(w)
    assert qt.arrays["outlier_indices"].dtype == np.int32
    assert len(qt.arrays["outlier_values"]) == 330
    x = np.random.default_rng(6).standard_normal((2, 33000))
    np.testing.assert_allclose(mixed_matmul_reference(x, qt), x @ qt.dequantize().astype(np.float64), rtol=1e-9,
                               atol=1e-9)


# -- parts and kernels ---------------------------------------------------------------------
@pytest.mark.parametrize("frac", [0.25, 0.0, 1.0])
def test_parts_rebuild_the_matrix(heavy_layer, frac):
    w, x = heavy_layer
    k, n = w.shape
    qt = MixedFormat(frac_4bit=frac).quantize(w, x)
    idx4, p4, idx2, p2, csr = mixed_parts(qt)
    assert sorted(np.concatenate([idx4, idx2]).tolist()) == list(range(k))
    rebuilt = np.zeros((k, n))
    if p4 is not None:
        assert p4.fmt == UniformFormat(4, 128) and p4.k == len(idx4)
        rebuilt[idx4] = p4.dequantize()
    else:
        assert len(idx4) == 0
    if p2 is not None:
        assert p2.fmt == UniformFormat(2, 16) and p2.k == len(idx2)
        rebuilt[idx2] = p2.dequantize()
    else:
        assert len(idx2) == 0
    indptr, indices, values = csr
    np.add.at(rebuilt, (indices.astype(np.int64), np.repeat(np.arange(n), np.diff(indptr))), values.astype(np.float64))
    np.testing.assert_allclose(rebuilt, qt.dequantize(), rtol=1e-6, atol=1e-7)
    xs = np.random.default_rng(1).standard_normal((3, k))
    np.testing.assert_allclose(mixed_matmul_reference(xs, qt), xs @ qt.dequantize().astype(np.float64),
                               rtol=1e-6, atol=1e-6)
    # The kernel view's float32 scales are not what is counted: the compact form is smaller.
    assert qt.nbytes < sum(p.nbytes for p in (p4, p2) if p is not None)


def _compile(func):
    return tvm.compile(tvm.IRModule({"main": func}), target=TARGET)


def _sparse(func):
    """The outlier kernel scheduled by its x86 rule (parallel over columns), compiled."""
    from schedules import schedule_kernel
    from schedules.x86 import schedule_sparse_outliers_x86

    assert schedule_sparse_outliers_x86(func, TARGET) is not None
    return _compile(schedule_kernel(func, TARGET))


def _call(lib, args, m, n):
    out = tvm.runtime.tensor(np.zeros((m, n), np.float32))
    lib["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], out)
    return out.numpy()


def test_composite_kernels_match_reference(heavy_layer):
    w, x = heavy_layer
    k, n = w.shape
    qt = MixedFormat().quantize(w, x)
    idx4, p4, idx2, p2, csr = mixed_parts(qt)
    dense = [(idx, p, _compile(schedule_qmatmul_x86(ops.qmatmul_func(p.fmt, p.k, p.n, NB), TARGET).mod["main"]))
             for idx, p in ((idx4, p4), (idx2, p2))]
    sparse = _sparse(sparse_outlier_func(csr, k, n))
    rng = np.random.default_rng(7)
    for m in (1, 17):
        xs = rng.standard_normal((m, k)).astype(np.float32)
        y = _call(sparse, [xs, *sparse_outlier_arrays(csr)], m, n)
        for idx, part, lib in dense:
            y += _call(lib, [xs[:, idx], *ops.blocked_arrays(part, NB)], m, n)
        ref = mixed_matmul_reference(xs, qt)
        scale = np.abs(xs).astype(np.float64) @ np.abs(qt.dequantize().astype(np.float64))
        assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-6), m


def test_sparse_kernel_on_uneven_columns():
    k, n = 50, 6
    rng = np.random.default_rng(8)
    cols = [[], [3], list(range(0, 50, 2)), [], [49, 0, 7], [10, 11]]
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in cols])]).astype(np.int32)
    indices = np.array([r for c in cols for r in sorted(c)], np.int16)
    values = rng.standard_normal(len(indices)).astype(np.float16)
    dense = np.zeros((k, n))
    for j, c in enumerate(cols):
        for r in sorted(c):
            dense[r, j] = values[indptr[j] + sorted(c).index(r)]
    lib = _sparse(sparse_outlier_func((indptr, indices, values), k, n))
    for m in (1, 3, 67):
        xs = rng.standard_normal((m, k)).astype(np.float32)
        y = _call(lib, [xs, *sparse_outlier_arrays((indptr, indices, values))], m, n)
        np.testing.assert_allclose(y, xs.astype(np.float64) @ dense, rtol=1e-5, atol=1e-5)
    empty = (np.zeros(n + 1, np.int32), np.zeros(0, np.int16), np.zeros(0, np.float16))
    lib = _sparse(sparse_outlier_func(empty, k, n))
    assert np.all(_call(lib, [np.ones((2, k), np.float32), *sparse_outlier_arrays(empty)], 2, n) == 0)
