from __future__ import annotations

from tvm import s_tir

from qtvm.intrin import x86


def test_plane_order_is_the_inverse_of_plane_index():
    for bits in (2, 4):
        order = x86.plane_order(bits)
        assert sorted(order) == list(range(32 // bits))
        assert [x86.plane_index(bits, j) for j in order] == list(range(32 // bits))


def test_int4_planes_are_even_then_odd_nibbles():
    assert x86.plane_order(4) == [0, 2, 4, 6, 1, 3, 5, 7]


def test_every_intrinsic_is_registered_with_a_systematic_name():
    for bits in (2, 4):
        for isa, lanes in x86.ISAS.items():
            name = x86.intrin_name(bits, isa)
            assert name == f"qtvm_dot_u{bits}s8_i32x{lanes}_{isa}"
            assert s_tir.TensorIntrin.get(name) is not None
