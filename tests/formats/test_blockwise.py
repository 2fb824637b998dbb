"""Foreign block-quantized weights -> uniform tensors: exact against the stored definition."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm.errors import QtvmError
from qtvm.formats.blockwise import BlockQuantized, PackedCodes, unpack_low_first
from qtvm.formats.uniform import UniformFormat


def weight(rows, cols, bits, group, axis, g_idx=False, seed=0, float_zeros=False):
    rng = np.random.default_rng(seed)
    length = (rows, cols)[axis]
    groups = -(-length // group) if group else 1
    red = (groups, cols) if axis == 0 else (rows, groups)
    zeros = rng.uniform(0, 2 ** bits - 1, red) if float_zeros else rng.integers(0, 2 ** bits, red)
    gi = rng.permutation(np.arange(length) // group) if g_idx else None
    return BlockQuantized("test weight", bits, rng.integers(0, 2 ** bits, (rows, cols)).astype(np.uint8),
                          rng.uniform(0.01, 0.1, red).astype(np.float32), zeros.astype(np.float32), axis, group, gi)


@pytest.mark.parametrize("rows,cols,bits,group,axis,g_idx", [
    (70, 37, 4, 32, 0, False), (70, 37, 4, 16, 0, True), (37, 70, 4, 32, 1, False), (100, 9, 8, None, 0, False),
    (50, 11, 3, 16, 0, False),  # 3-bit runs of 32 rows: one group past the stored ones, padding only
    (64, 5, 2, 48, 0, False)], ids=str)
def test_for_matmul_equals_definition(rows, cols, bits, group, axis, g_idx):
    w = weight(rows, cols, bits, group, axis, g_idx, float_zeros=bits == 4)
    transposed = axis == 1
    qt, perm = w.for_matmul(transposed)
    assert isinstance(qt.fmt, UniformFormat) and (qt.fmt.bits, qt.fmt.group_size) == (bits, group)
    ref = w.dequantize_reference()
    ref = ref.T if transposed else ref
    x = np.random.default_rng(1).standard_normal((4, ref.shape[0]))
    got = (x[:, perm] if perm is not None else x) @ qt.dequantize().astype(np.float64)
    assert np.abs(got - x @ ref).max() <= 1e-5 * np.abs(x @ ref).max()
    assert (perm is not None) == g_idx


def test_groups_along_the_output_axis_do_not_fit():
    w = weight(32, 64, 4, 16, 1)
    assert "run along the output axis" in w.why_not(transposed=False)
    with pytest.raises(QtvmError, match="test weight cannot run on qtvm's kernels"):
        w.for_matmul(False)
    assert w.why_not(transposed=True) is None


def test_per_tensor_fits_both_ways():
    w = BlockQuantized("t", 8, np.arange(12, dtype=np.uint8).reshape(3, 4), np.full((1, 1), 0.5, np.float32),
                       np.full((1, 1), 3.0, np.float32), None, None)
    for transposed in (False, True):
        qt, _ = w.for_matmul(transposed)
        ref = (np.arange(12).reshape(3, 4) - 3.0) * 0.5
        np.testing.assert_array_equal(qt.dequantize(), ref.T if transposed else ref)


@pytest.mark.parametrize("bits,group", [(5, 32), (4, 8), (4, 40)])
def test_unsupported_bits_and_groups_named(bits, group):
    with pytest.raises(QtvmError, match=f"test weight has {bits}-bit weights|test weight has block size {group}"):
        BlockQuantized("test weight", bits, np.zeros((64, 8), np.uint8), np.ones((2, 8), np.float32),
                       np.zeros((2, 8), np.float32), 0, group)


@pytest.mark.parametrize("k,n,bits,block,g_idx", [
    (70, 37, 4, 32, False), (128, 5, 4, 128, False), (100, 9, 8, 16, False), (200, 33, 2, 64, False),
    (70, 37, 4, 16, True), (50, 11, 2, 16, False)], ids=str)
def test_matmul_nbits_bytes_repack_as_unpacked_codes(k, n, bits, block, g_idx):
    """Codes kept as MatMulNBits' bytes (re-laid as whole words at 2, 4 and 8 bits) give the
    arrays the unpacked codes give, bit for bit, whatever the stored padding codes hold."""
    rng = np.random.default_rng(3)
    blocks = -(-k // block)
    columns = rng.integers(0, 256, (n, blocks * block * bits // 8), dtype=np.uint8)  # padding codes: noise
    packed = PackedCodes(columns, bits, k)
    codes = unpack_low_first(columns, bits)[:, :k].T
    assert packed.shape == codes.shape and np.array_equal(packed.unpack(), codes)
    scales = rng.uniform(0.01, 0.1, (blocks, n)).astype(np.float32)
    zeros = rng.integers(0, 2 ** bits, (blocks, n)).astype(np.float32)
    gi = rng.permutation(np.arange(k) // block) if g_idx else None
    fast, fast_perm = BlockQuantized("t", bits, packed, scales, zeros, 0, block, gi).for_matmul()
    slow, slow_perm = BlockQuantized("t", bits, np.ascontiguousarray(codes), scales, zeros, 0, block, gi).for_matmul()
    assert fast.fmt.name == slow.fmt.name and list(fast.arrays) == list(slow.arrays)
    for name in fast.arrays:
        assert fast.arrays[name].dtype == slow.arrays[name].dtype
        np.testing.assert_array_equal(fast.arrays[name], slow.arrays[name], err_msg=name)
    assert (fast_perm is None and slow_perm is None) or np.array_equal(fast_perm, slow_perm)
    assert packed.words(fast.fmt.padded_k(k)) is not None  # the word path was the one taken


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_is_unpack_inverse_on_narrow_codes(bits):
    """UniformFormat.pack takes the codes of any unsigned dtype (uint8 from a stored model)."""
    fmt = UniformFormat(bits, 32)
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (96, 7))
    words = fmt.pack(codes.astype(np.uint8))
    np.testing.assert_array_equal(words, fmt.pack(codes.astype(np.uint32)))
    np.testing.assert_array_equal(fmt.unpack(words, 96), codes)
