from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import s_tir

from qtvm.formats import get_format
from qtvm.intrin import x86


def test_int4_units_are_4_consecutive_values_in_low_then_high_nibbles():
    """Unit u = values 4u..4u+3, one a byte: unit 0 the low nibbles of word 0 (values 0-3), unit 1
    its high nibbles (4-7), so the activations of a block stay in their natural order."""
    codes = np.arange(32, dtype=np.uint32).reshape(32, 1) % 16
    word0 = int(x86.pack_byte_planes(codes, 4).view(np.uint32)[0, 0])
    assert [(word0 >> (8 * byte)) & 15 for byte in range(4)] == [0, 1, 2, 3]
    assert [(word0 >> (8 * byte + 4)) & 15 for byte in range(4)] == [4, 5, 6, 7]


@pytest.mark.parametrize("bits", x86.BITS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_byte_planes_round_trip(bits, data):
    blocks, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    codes = rng.integers(0, 1 << bits, (blocks * 32, n)).astype(np.uint32)
    words = x86.pack_byte_planes(codes, bits)
    assert words.shape == (blocks * bits, n) and words.dtype == np.int32  # still `bits` bits a weight
    np.testing.assert_array_equal(x86.unpack_byte_planes(words, bits), codes)


@pytest.mark.parametrize("bits", (2, 4))
def test_2_and_4_bit_byte_planes_are_the_storage_words_shuffled(bits):
    """``byte_plane_words`` re-lays the storage packing's words in place, any shape, to what
    ``pack_byte_planes`` packs from the codes."""
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (128, 3)).astype(np.uint32)
    stored = get_format(f"int{bits}-g128").pack(codes)
    np.testing.assert_array_equal(x86.byte_plane_words(stored, bits), x86.pack_byte_planes(codes, bits))
    blocked = stored.reshape(-1, 3, 1).transpose(1, 0, 2)  # a column-blocked view: not contiguous
    np.testing.assert_array_equal(x86.byte_plane_words(blocked, bits)[:, :, 0].T, x86.pack_byte_planes(codes, bits))
    assert not np.array_equal(stored, x86.pack_byte_planes(codes, bits))


def test_int3_units_0_to_5_sit_whole_in_one_byte_field():
    """Unit u (values 4u..4u+3) in word u % 3 at bit 3 * (u // 3) of every byte: units 0-5
    whole (one mask each), units 6 and 7 their low 2 bits there and their high bit at bit u
    of word 2's bytes."""
    for u in range(8):
        for code in range(1, 8):
            codes = np.zeros((32, 1), np.uint32)
            codes[4 * u:4 * u + 4] = code
            words = x86.pack_byte_planes(codes, 3).view(np.uint32)[:, 0].astype(np.int64)
            lo = code if u < 6 else code & 3
            expect = [0, 0, 0]
            expect[u % 3] = sum(lo << (8 * byte + 3 * (u // 3)) for byte in range(4))
            if u >= 6 and code >> 2:
                expect[2] |= sum(1 << (8 * byte + u) for byte in range(4))
            assert list(words) == expect, (u, code)


def test_every_intrinsic_is_registered_with_a_systematic_name():
    for bits in x86.BITS:
        for isa, lanes in x86.ISAS.items():
            name = x86.intrin_name(bits, isa)
            assert name == f"qtvm_dot_u{bits}s8_i32x{x86.STEP_COLS}_{isa}"
            assert s_tir.TensorIntrin.get(name) is not None
            tile = x86.tile_intrin_name(bits, isa)
            assert tile == f"qtvm_gemm_u{bits}s8_i32x{lanes}_{x86.ROW_TILE}x{x86.TILE_VECS[isa]}_{isa}"
            assert s_tir.TensorIntrin.get(tile) is not None
