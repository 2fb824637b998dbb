"""Folding of shape-computing nodes into expressions over the dimension symbols."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from qtvm.frontend.shapes import MAX_ELEMENTS, Folder, Symbols, dim_text, known_from_numpy


@pytest.fixture
def sym():
    return Symbols()


def _known(values):
    return known_from_numpy(np.asarray(values, np.int64))


def test_dim_params_and_relations(sym):
    past, seq = sym.var("past"), sym.var("seq")
    assert sym.dim("seq").same_as(seq)
    total = sym.dim("past + seq")
    assert sym.equal(total, seq + past)
    # TVM's simplifier does not distribute; the polynomial comparison does.
    assert sym.equal(sym.var("batch") * (past * 16 + seq * 16) * 4, sym.var("batch") * total * 64)
    assert not sym.equal(total, seq)
    assert sym.prove(past + seq >= 0)  # symbols are non-negative
    assert sym.broadcast([1, seq, 4], [sym.var("batch"), 1, seq + 0, 4]) == [sym.var("batch"), 1, seq, 4]
    assert sym.broadcast([seq], [sym.var("other")]) == [None]


def test_dim_text(sym):
    past, seq = sym.var("past"), sym.var("seq")
    assert dim_text(sym.norm(past + seq)) == "past + seq"
    assert dim_text(sym.norm(seq * 2)) == "seq * 2"
    assert dim_text((past + seq) * 2) == "(past + seq) * 2"


def test_shape_gather_concat_reshape_chain(sym):
    """The legacy exporter's head split: Shape -> Gather -> Unsqueeze -> Concat."""
    fold = Folder(sym)
    batch, seq = sym.var("batch"), sym.var("seq")
    (shape,) = fold.fold("Shape", {}, [None], lambda i: [batch, seq, 64])
    assert shape.ints()[:2] == [batch, seq] and shape.ints()[2] == 64
    (s,) = fold.fold("Gather", {"axis": 0}, [shape, _known(1)], None)
    assert s.values.shape == () and s.ints() == [seq]
    (s1,) = fold.fold("Unsqueeze", {}, [s, _known([0])], None)
    (target,) = fold.fold("Concat", {"axis": 0}, [s1, _known([4, 16])], None)
    assert target.ints() == [seq, 4, 16]
    (prod,) = fold.fold("Mul", {}, [s, _known(4)], None)
    (back,) = fold.fold("Div", {}, [prod, _known(4)], None)  # integer Div: truncation, simplified
    assert back.ints() == [seq]


def test_comparisons_and_where(sym):
    fold = Folder(sym)
    seq = sym.var("seq")
    shape = fold.fold("Concat", {"axis": 0}, [_known([1]), fold.fold("Unsqueeze", {}, [
        fold.fold("Gather", {"axis": 0}, [fold.fold("Shape", {}, [None], lambda i: [seq])[0], _known(0)], None)[0],
        _known([0])], None)[0]], None)[0]
    (minus,) = fold.fold("Mul", {}, [_known([1, 1]), _known(-1)], None)
    (eq,) = fold.fold("Equal", {}, [shape, minus], None)
    assert eq.ints() == [False, False]  # seq >= 0 is known, so seq == -1 is false
    (picked,) = fold.fold("Where", {}, [eq, _known([1, 1]), shape], None)
    assert picked.ints() == [1, seq]
    (lt,) = fold.fold("Less", {}, [shape, _known([2, 2])], None)
    assert lt.ints()[0] is True and not isinstance(lt.ints()[1], bool)  # seq < 2: unknown
    (sel,) = fold.fold("Where", {}, [lt, _known([7, 7]), _known([8, 8])], None)
    assert sel.ints()[0] == 7 and "Select" in type(sel.ints()[1]).__name__


def test_numeric_folding_and_limits(sym):
    fold = Folder(sym)
    (ones,) = fold.fold("ConstantOfShape", {"value": numpy_helper.from_array(np.array([1], np.int64))},
                        [_known([4])], None)
    assert ones.numpy().tolist() == [1, 1, 1, 1] and ones.dtype == np.int64
    (r,) = fold.fold("Range", {}, [_known(2), _known(11), _known(3)], None)
    assert r.numpy().tolist() == [2, 5, 8]
    # Too big to be a shape: left to the data path.
    assert fold.fold("Range", {}, [_known(0), _known(MAX_ELEMENTS + 1), _known(1)], None) is None
    # Float arithmetic on symbols is not folded.
    seq = sym.var("seq")
    s = fold.fold("Shape", {}, [None], lambda i: [seq])[0]
    assert fold.fold("Cast", {"to": TensorProto.FLOAT}, [s], None) is None
    # A symbolic Shape of an unknown shape: not folded.
    assert fold.fold("Shape", {}, [None], lambda i: None) is None
    assert fold.fold("NonZero", {}, [_known([1, 0])], None) is None


def test_slice_and_split_of_known(sym):
    fold = Folder(sym)
    seq = sym.var("seq")
    shape = fold.fold("Shape", {}, [None], lambda i: [2, seq, 4, 16])[0]
    (tail,) = fold.fold("Slice", {}, [shape, _known([-2]), _known([np.iinfo(np.int64).max])], None)
    assert tail.ints() == [4, 16]
    a, b = fold.fold("Split", {"axis": 0}, [shape, _known([1, 3])], None)
    assert a.ints() == [2] and b.ints() == [seq, 4, 16]


def test_positive_symbols_relate_more():
    """min(1, seq) (x[:, :1] of a [batch, seq] tensor) is 1 only if seq >= 1."""
    from tvm import tirx

    for minimum, expected in ((0, False), (1, True)):
        sym = Symbols(minimum=minimum)
        seq = sym.var("seq")
        assert sym.equal(tirx.min(sym.expr(1), seq), 1) is expected


def _onnxruntime(op: str, attrs: dict, arrays: list, out_dtype) -> np.ndarray:
    import onnxruntime as ort
    from onnx import helper

    names = [f"i{j}" for j in range(len(arrays))]
    tensor_type = helper.np_dtype_to_tensor_dtype
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], "g",
        [helper.make_tensor_value_info(n, tensor_type(a.dtype), a.shape) for n, a in zip(names, arrays)],
        [helper.make_tensor_value_info("y", tensor_type(np.dtype(out_dtype)), None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, arrays)))[0]


@pytest.mark.parametrize("attrs,indices,depth,values", [
    ({}, [1], 3, [0, 1]),  # the legacy export of repeat_interleave: Tile's repeats
    ({"axis": 0}, [[0, 2], [-1, 5]], 4, [-3, 7]),  # negative counts from the end; out of range: all off
    ({"axis": 1}, [[1, 0, 3]], 4, np.float32([0.5, 2.0])),
])
def test_onehot_of_known_matches_onnx(sym, attrs, indices, depth, values):
    """Legacy MoE exports (Mixtral) build Tile's repeats from a OneHot of constants."""
    arrays = [np.asarray(indices, np.int64), np.asarray([depth], np.int64), np.asarray(values)]
    (got,) = Folder(sym).fold("OneHot", attrs, [known_from_numpy(a) for a in arrays], None)
    want = _onnxruntime("OneHot", attrs, arrays, arrays[2].dtype)
    assert got.dtype == want.dtype and got.numpy().shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)


def test_onehot_with_a_symbolic_value_and_too_big(sym):
    fold = Folder(sym)
    seq = sym.var("seq")
    on = fold.fold("Concat", {"axis": 0}, [_known([1]), fold.fold("Shape", {}, [None], lambda i: [seq])[0]], None)[0]
    (got,) = fold.fold("OneHot", {}, [_known([2, 0]), _known([3]), on], None)
    assert [list(row) for row in got.values] == [[1, 1, seq], [seq, 1, 1]]
    assert fold.fold("OneHot", {}, [_known([0]), _known([MAX_ELEMENTS + 1]), _known([0, 1])], None) is None


def test_transpose_of_known(sym):
    """MobileBERT's legacy export computes its Pad's pads from constants through a Transpose."""
    fold = Folder(sym)
    pads = np.arange(6, dtype=np.int64).reshape(3, 2)
    (t,) = fold.fold("Transpose", {"perm": [1, 0]}, [known_from_numpy(pads)], None)
    np.testing.assert_array_equal(t.numpy(), pads.T)
    cube = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    (r,) = fold.fold("Transpose", {}, [known_from_numpy(cube)], None)  # no perm: the axes reversed
    np.testing.assert_array_equal(r.numpy(), _onnxruntime("Transpose", {}, [cube], np.int64))
    seq = sym.var("seq")
    shape = fold.fold("Shape", {}, [None], lambda i: [2, seq])[0]
    (u,) = fold.fold("Transpose", {}, [fold.fold("Unsqueeze", {}, [shape, _known([0])], None)[0]], None)
    assert [list(row) for row in u.values] == [[2], [seq]]


@pytest.mark.parametrize("base, exponent", [(np.float32(16.0), np.float32(0.5)), (np.int64([2, 3]), np.int64(3)),
                                            (np.float32([2.0, 9.0]), np.float32([-1.0, 0.5]))])
def test_pow_of_known_matches_onnx(sym, base, exponent):
    """DINOv2's legacy export: Cast(Pow(16.0, 0.5)) patches a side, in a Reshape's shape."""
    fold = Folder(sym)
    base, exponent = np.asarray(base), np.asarray(exponent)
    (p,) = fold.fold("Pow", {}, [known_from_numpy(base), known_from_numpy(exponent)], None)
    want = _onnxruntime("Pow", {}, [base, exponent], base.dtype)
    np.testing.assert_array_equal(p.numpy(), want)
    assert p.dtype == base.dtype


def test_pow_of_a_symbol_or_a_negative_int_power_is_left_to_the_graph(sym):
    fold = Folder(sym)
    seq = sym.var("seq")
    shape = fold.fold("Shape", {}, [None], lambda i: [2, seq])[0]
    assert fold.fold("Pow", {}, [shape, _known([2])], None) is None
    assert fold.fold("Pow", {}, [_known([2]), _known([-1])], None) is None


@pytest.mark.parametrize("op", ["Ceil", "Floor", "Sqrt"])
def test_float_unary_of_known_matches_onnx(sym, op):
    """MobileViT's legacy export computes its patch grid as ceil(h / 2) * 2 in float."""
    x = np.float32([0.5, 2.0, 2.25, 7.0])
    (got,) = Folder(sym).fold(op, {}, [known_from_numpy(x)], None)
    np.testing.assert_array_equal(got.numpy(), _onnxruntime(op, {}, [x], np.float32))
    shape = Folder(sym).fold("Shape", {}, [None], lambda i: [2, sym.var("seq")])[0]
    assert Folder(sym).fold(op, {}, [shape], None) is None  # a symbol stays a graph op


def test_at_least_finds_the_smallest_length_and_declines_what_it_cannot_read(sym):
    """A conv chain's output length grows with its input: the smallest input that gives >= 1 is
    found exactly (brute force agrees); a dim that does not grow by its form, or has two
    symbols, leaves no minimum (nothing is assumed that might be wrong)."""
    seq = sym.var("seq")
    frames = sym.norm(((seq - 10) // 5 + 1 - 3) // 2 + 1)
    sym.at_least(frames, 1)
    want = next(s for s in range(1000) if ((s - 10) // 5 + 1 - 3) // 2 + 1 >= 1)
    assert sym.minimums == {"seq": want} == {"seq": 20}
    assert sym.prove(seq // 10 - 2 >= 0)  # the padding slice's end, refused before
    sym.at_least(seq - 5, 1)  # already true: nothing more recorded
    assert sym.minimums == {"seq": 20}
    other, batch = sym.var("other"), sym.var("batch")
    sym.at_least(sym.norm(30 - other), 1)
    sym.at_least(sym.norm(other * batch - 3), 1)
    assert "other" not in sym.minimums and "batch" not in sym.minimums


def _random_quasi_linear(rng, s, depth=3):
    """A random expression of s from the forms Symbols._periodic reads (and a product of s by s,
    which it must decline)."""
    from tvm import tirx

    c = lambda v: tirx.IntImm("int64", int(v))  # noqa: E731
    if depth == 0 or rng.random() < 0.25:
        return s if rng.random() < 0.6 else c(rng.integers(-40, 40))
    a, b = _random_quasi_linear(rng, s, depth - 1), _random_quasi_linear(rng, s, depth - 1)
    kind = rng.integers(0, 8)
    if kind == 0:
        return a + b
    if kind == 1:
        return a - b
    if kind == 2:
        return a * c(rng.integers(-3, 4))
    if kind == 3:
        return tirx.floordiv(a, c(rng.integers(1, 25)))
    if kind == 4:
        return tirx.floormod(a, c(rng.integers(1, 25)))
    if kind == 5:
        return tirx.Div(a, c(rng.integers(1, 25)))
    if kind == 6:
        return tirx.min(a, b) if rng.random() < 0.5 else tirx.max(a, b)
    return a * b if rng.random() < 0.1 else a + c(rng.integers(-40, 40))


def _evaluate(e, s: int) -> int:
    from tvm import tirx

    if isinstance(e, tirx.IntImm):
        return int(e.value)
    if isinstance(e, tirx.Var):
        return s
    a, b = _evaluate(e.a, s), _evaluate(e.b, s)
    if isinstance(e, tirx.Add):
        return a + b
    if isinstance(e, tirx.Sub):
        return a - b
    if isinstance(e, tirx.Mul):
        return a * b
    if isinstance(e, tirx.FloorDiv):
        return a // b
    if isinstance(e, tirx.FloorMod):
        return a % b
    if isinstance(e, tirx.Div):
        return int(a / b) if abs(a) < 2 ** 52 else -(-a // b) if a < 0 else a // b
    if isinstance(e, tirx.Min):
        return min(a, b)
    return max(a, b)


@pytest.mark.parametrize("low", [0, 30, 400])
def test_periodic_proofs_are_sound(low):
    """What Symbols proves of an expression of one symbol (>= 0, == 0) beyond TVM's analyzer,
    by its period, holds at every value from the symbol's smallest on (checked by brute force
    over the first 4000), over 600 random expressions; and it proves some."""
    from tvm import tirx

    rng = np.random.default_rng(low)
    proved = 0
    for _ in range(600):
        sym = Symbols()
        s = sym.var("seq")
        if low:
            sym.at_least(s, low)
        e = _random_quasi_linear(rng, s)
        zero = tirx.IntImm("int64", 0)
        values = [_evaluate(e, v) for v in range(low, low + 4000)]
        if sym.prove(tirx.GE(e, zero)):
            proved += 1
            assert min(values) >= 0, e
        if sym.equal(e, 0):
            assert not any(values), e
    assert proved > 100


def test_periodic_proofs_of_frame_arithmetic():
    """SEW's pad (seq // 10 - (seq - 10) // 20 * 2 - 1, 0 or 1) is non-negative, SEW-D's two frame
    counts are equal from seq >= 30, and what is false is not proven."""
    from tvm import tirx

    sym = Symbols()
    s = sym.var("seq")
    c = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    pad = tirx.floordiv(s, c(10)) - tirx.floordiv(s - c(10), c(20)) * c(2) - c(1)
    assert sym.prove(tirx.GE(pad, c(0)))
    assert not sym.prove(tirx.GE(pad, c(1)))
    assert not sym.prove(tirx.GE(tirx.floordiv(s, c(10)) - c(1), c(0)))  # negative below 10
    pooled = tirx.floordiv(s - c(30), c(20)) + c(1)
    sliced = tirx.min(tirx.Div(tirx.floordiv(s, c(10)) - c(3), c(2)) + c(1), tirx.floordiv(s - c(10), c(20)))
    assert not sym.equal(pooled, sliced)  # the truncating division's numerator is negative below 30
    sym.at_least(s, 30)
    assert sym.equal(pooled, sliced)
