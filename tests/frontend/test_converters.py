"""qtvm's converters on small graphs made of the shape patterns exporters emit, each
compiled once and checked against onnxruntime at several bindings of each symbolic dim."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.describe import summary
from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model  # the compiler's TVM first (qtvm.runtime alone loads the runtime library)

SEQS = (1, 3, 64, 67)
INT64_MAX = np.iinfo(np.int64).max


def _const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype)))


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _x(name="x", dims=("batch", "seq"), elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(dims))


def _seq_of(x="x", out="s"):
    """s = Shape(x)[1] as a 1-element vector, the legacy exporter's way."""
    return [helper.make_node("Shape", [x], [f"{out}_shape"]), _const(f"{out}_i", [1]),
            helper.make_node("Gather", [f"{out}_shape", f"{out}_i"], [out], axis=0)]


def _compile(tmp_path, model, name="m"):
    from qtvm import runtime

    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    result = compile_model(path, tmp_path / f"{name}.so", "host", "none")
    return runtime.load(result.path), result, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _check(module, session, make_feeds):
    for seq in SEQS:
        x = make_feeds(seq)
        got = module.run(x)
        for out, want in zip(session.get_outputs(), session.run(None, x)):
            assert got[out.name].shape == want.shape, (seq, out.name)
            np.testing.assert_allclose(got[out.name], want, rtol=1e-5, atol=1e-5, err_msg=f"seq {seq}")


def _floats(seq, batch=2):
    return {"x": np.random.default_rng(seq).standard_normal((batch, seq)).astype(np.float32)}


def test_range_of_a_computed_length_is_seq(tmp_path):
    """Range(0, Shape(x)[1]) and Range(seq, 2 * seq) have length seq, not a fresh symbol,
    so adding them to x keeps the shape [batch, seq]."""
    nodes = _seq_of() + [
        _const("zero", 0), _const("one", 1), _const("two", 2),
        helper.make_node("Squeeze", ["s", "zero_axes"], ["s0"]),
        helper.make_node("Range", ["zero", "s0", "one"], ["r"]),
        helper.make_node("Mul", ["s0", "two"], ["s2"]),
        helper.make_node("Range", ["s0", "s2", "one"], ["r2"]),
        helper.make_node("Add", ["r", "r2"], ["rr"]),
        helper.make_node("Cast", ["rr"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "rf"], ["y"]),
    ]
    nodes.insert(0, _const("zero_axes", [0]))
    module, result, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y", ("batch", "seq"))]))
    assert result.metadata["outputs"][0]["shape"] == ["batch", "seq"]
    _check(module, session, _floats)


def test_range_from_a_symbolic_start_fused_with_its_consumers(tmp_path):
    """XGLM with a KV cache: positions Range(past, past + seq) + 2 read rows of a sinusoid
    table; the arange from ``past``, fused with its consumers, made TVM's FuseTIR define
    ``past`` twice (an internal error). Ranges of step -1 and 2 from symbolic starts too."""
    table = numpy_helper.from_array(np.sin(np.arange(300, dtype=np.float32) / 7).reshape(300, 1), "table")
    nodes = _seq_of() + _seq_of("p", "q") + [
        _const("zero_axes", [0]), _const("one", 1), _const("m1", -1), _const("two", 2), _const("z", 0),
        helper.make_node("Squeeze", ["s", "zero_axes"], ["s0"]), helper.make_node("Squeeze", ["q", "zero_axes"], ["q0"]),
        helper.make_node("Add", ["q0", "s0"], ["end"]),
        helper.make_node("Range", ["q0", "end", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "zero_axes"], ["pos2"]),
        helper.make_node("Add", ["pos2", "two"], ["pos3"]),
        helper.make_node("Gather", ["table", "pos3"], ["rows"], axis=0),  # [1, seq, 1]
        _const("last", [2]), helper.make_node("Squeeze", ["rows", "last"], ["emb"]),
        helper.make_node("Range", ["s0", "z", "m1"], ["down"]),  # seq, seq - 1, .., 1
        helper.make_node("Mul", ["s0", "two"], ["s2"]), helper.make_node("Add", ["q0", "s2"], ["end2"]),
        helper.make_node("Range", ["q0", "end2", "two"], ["even"]),  # past, past + 2, ..: seq of them
        helper.make_node("Add", ["down", "even"], ["b"]),
        helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "bf"], ["xb"]), helper.make_node("Add", ["xb", "emb"], ["y"]),
    ]
    model = _model(nodes, [_x(), _x("p", ("batch", "past"))], [_x("y", ("batch", "seq"))], [table])
    module, _, session = _compile(tmp_path, model)
    feeds = lambda seq: {**_floats(seq), "p": np.zeros((2, seq % 5), np.float32)}  # noqa: E731 (past 0 too)
    _check(module, session, feeds)


def test_reshape_chain_and_minus_one(tmp_path):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape into heads and back with -1 and 0."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]), _const("i0", 0), _const("i1", 1), _const("ax", [0]),
        helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]), helper.make_node("Unsqueeze", ["s", "ax"], ["s1"]),
        _const("heads", [2, 4]),
        helper.make_node("Concat", ["b1", "s1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["h"]),
        helper.make_node("Transpose", ["h"], ["t"], perm=[0, 2, 1, 3]),
        _const("flat", [0, -1, 4]),
        helper.make_node("Reshape", ["t", "flat"], ["y"]),
    ]
    model = _model(nodes, [_x(dims=("batch", "seq", 8))], [_x("y", ("batch", "n", 4))])
    module, result, session = _compile(tmp_path, model)
    assert result.metadata["outputs"][0]["shape"] == ["batch", "seq * 2", 4]
    _check(module, session, lambda seq: {"x": np.random.default_rng(seq).standard_normal((2, seq, 8)).astype(np.float32)})


def test_reshape_minus_one_through_a_constant_inside_a_symbolic_dim(tmp_path):
    """[batch, seq, 64] -> [0, -1, 16] -> [0, -1, 64]: the -1 of the second is seq * 4 * 16 / 64
    = seq, where the 4 sits inside the symbolic dim (onnxruntime-genai's qwen3 per-head norm)."""
    nodes = [_const("heads", [0, -1, 16]), helper.make_node("Reshape", ["x", "heads"], ["h"]),
             _const("back", [0, -1, 64]), helper.make_node("Reshape", ["h", "back"], ["y"])]
    model = _model(nodes, [_x(dims=("batch", "seq", 64))], [_x("y", ("batch", "n", 64))])
    module, result, session = _compile(tmp_path, model)
    assert result.metadata["outputs"][0]["shape"] == ["batch", "seq", 64]
    _check(module, session, lambda seq: {"x": np.random.default_rng(seq).standard_normal((2, seq, 64)).astype(np.float32)})



def test_reshape_minus_one_cancels_a_factor_of_a_product_dim(tmp_path):
    """[batch, 4, seq, seq] -> [-1, 0, 0] (batch*4) -> [batch, 4, seq, -1]: the -1 is
    batch*4*seq*seq / (batch*4*seq) = seq, with batch a factor inside the dim batch*4
    (BLOOM's attention scores, transformers' legacy and dynamo exports)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]), _const("i0", [0]), _const("i2", [2]),
        helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "i2"], ["s"], axis=0),
        _const("merge", [-1, 0, 0]), helper.make_node("Reshape", ["x", "merge"], ["m"]),
        _const("four", [4]), _const("rest", [-1]),
        helper.make_node("Concat", ["b", "four", "s", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["m", "target"], ["y"]),
    ]
    model = _model(nodes, [_x(dims=("batch", 4, "seq", "seq"))], [_x("y", ("batch", 4, "seq", "n"))])
    module, result, session = _compile(tmp_path, model)
    assert result.metadata["outputs"][0]["shape"] == ["batch", 4, "seq", "seq"]
    _check(module, session,
           lambda seq: {"x": np.random.default_rng(seq).standard_normal((3, 4, seq, seq)).astype(np.float32)})

def test_legacy_expand_pattern_and_constant_of_shape(tmp_path):
    """The legacy exporter's Expand: ConstantOfShape(Shape(shape)) of ones, * -1, Equal,
    Where, Expand; and ConstantOfShape of a computed [seq, seq] shape."""
    nodes = _seq_of() + [
        _const("ax", [0]), _const("b1", [1]),
        helper.make_node("Concat", ["b1", "s"], ["shape"], axis=0),  # [1, seq]
        helper.make_node("Shape", ["shape"], ["rank"]),
        helper.make_node("ConstantOfShape", ["rank"], ["ones"], value=numpy_helper.from_array(np.array([1], np.int64))),
        _const("neg", -1), helper.make_node("Mul", ["ones", "neg"], ["minus"]),
        helper.make_node("Equal", ["shape", "minus"], ["is_neg"]),
        helper.make_node("Where", ["is_neg", "ones", "shape"], ["target"]),
        _const("row", [[0.5]], np.float32),
        helper.make_node("Expand", ["row", "target"], ["half"]),  # [1, seq] of 0.5
        helper.make_node("Concat", ["s", "s"], ["square"], axis=0),
        helper.make_node("ConstantOfShape", ["square"], ["m"], value=numpy_helper.from_array(np.array([0.25], np.float32))),
        helper.make_node("MatMul", ["x", "m"], ["xm"]),  # [batch, seq]: 0.25 * row sums
        helper.make_node("Mul", ["xm", "half"], ["y"]),
        # ConstantOfShape with a scalar shape (an empty shape vector): a scalar.
        _const("empty", np.zeros(0, np.int64)),
        helper.make_node("ConstantOfShape", ["empty"], ["c"], value=numpy_helper.from_array(np.array([3.0], np.float32))),
        helper.make_node("Add", ["y", "c"], ["z"]),
    ]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("z")]))
    _check(module, session, _floats)


def test_slice_of_a_position_table_records_its_limit(tmp_path):
    """token_type_ids[:, :seq] of a [1, 80] table: the model takes seq <= 80; the slice to
    INT64_MAX of x is the whole axis."""
    from qtvm import runtime

    table = numpy_helper.from_array(np.arange(80, dtype=np.int64).reshape(1, 80) % 7, "table")
    nodes = _seq_of() + [
        _const("zero", [0]), _const("one", [1]), _const("big", [INT64_MAX]),
        helper.make_node("Slice", ["table", "zero", "s", "one"], ["ids"]),
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Expand", ["ids", "xs"], ["ids2"]),
        helper.make_node("Cast", ["ids2"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Slice", ["x", "zero", "big", "one"], ["whole"]),
        helper.make_node("Add", ["whole", "f"], ["y"]),
    ]
    module = _check_with_seq_limit(tmp_path, nodes, table, 80)
    assert isinstance(module, runtime.Module)


def _check_with_seq_limit(tmp_path, nodes, table, limit: int):
    """x [batch, seq] -> y through ``nodes`` reading ``table``: compiled with the limit seq <=
    ``limit`` recorded, equal to onnxruntime at SEQS, refused past the limit at run time."""
    module, result, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")], [table]))
    assert result.metadata["dim_limits"] == {"seq": limit}
    _check(module, session, _floats)
    with pytest.raises(QtvmError, match=f"this model takes seq <= {limit}"):
        module.run(_floats(limit + 1))
    return module


def _tail_start(form):
    """The start of x[-seq:] of an 80-column table the way exporters write it: 80 - seq
    (MPT's legacy export), max(0, 80 - seq) (torch.export's sym_max), -seq."""
    nodes = _seq_of() + [_const("d", [80]), _const("z", [0])]
    if form == "d-seq":
        return nodes + [helper.make_node("Sub", ["d", "s"], ["start"])]
    if form == "max":
        return nodes + [helper.make_node("Sub", ["d", "s"], ["ds"]), helper.make_node("Max", ["z", "ds"], ["start"])]
    return nodes + [helper.make_node("Neg", ["s"], ["start"])]


@pytest.mark.parametrize("form", ["d-seq", "max", "neg"])
def test_slice_of_a_table_s_last_seq_columns_records_its_limit(tmp_path, form):
    """bias[:, -seq:] of a [1, 80] table (MPT's ALiBi) added to a [batch, seq] tensor: its
    length is min(seq, 80), which is seq where the model works at all, so the import takes
    seq <= 80 (recorded, refused beyond at run time) and reads the right columns."""
    table = numpy_helper.from_array(np.linspace(-3, 3, 80, dtype=np.float32).reshape(1, 80), "table")
    nodes = _tail_start(form) + [
        _const("big", [INT64_MAX]), _const("one", [1]),
        helper.make_node("Slice", ["table", "start", "big", "one"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["y"]),
    ]
    _check_with_seq_limit(tmp_path, nodes, table, 80)


def _centred_slice(frames: str, c2: int):
    """pe[100 - n : c2 + n] of a [199, 2] table, n = seq, seq // 3 or seq % 7 * 20; y = the window's column
    sums + sum(x), rows = the window's shape."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((199, 2)).astype(np.float32), "pe")
    nodes = _seq_of() + [_const("c1", [100]), _const("c2", [c2]), _const("zero", [0])]
    if frames == "seq":
        nodes.append(helper.make_node("Identity", ["s"], ["n"]))
    elif frames == "seq // 3":
        nodes += [_const("three", [3]), helper.make_node("Div", ["s", "three"], ["n"])]
    else:  # seq % 7 * 20
        nodes += [_const("seven", [7]), _const("twenty", [20]), helper.make_node("Mod", ["s", "seven"], ["m"]),
                  helper.make_node("Mul", ["m", "twenty"], ["n"])]
    nodes += [
        helper.make_node("Sub", ["c1", "n"], ["start"]), helper.make_node("Add", ["c2", "n"], ["end"]),
        helper.make_node("Slice", ["pe", "start", "end", "zero"], ["window"]),
        helper.make_node("ReduceSum", ["window", "zero"], ["sums"], keepdims=1),  # [1, 2]
        helper.make_node("Shape", ["window"], ["rows"]),
        helper.make_node("ReduceSum", ["x"], ["xs"], keepdims=1),  # [1, 1]
        helper.make_node("Add", ["sums", "xs"], ["y"]),
    ]
    outputs = [_x("y", (1, 2)), helper.make_tensor_value_info("rows", TensorProto.INT64, [2])]
    return _model(nodes, [_x()], outputs, [table], opset=13)


@pytest.mark.parametrize("frames, c2, key, limit, seqs", [
    ("seq", 99, "seq", 100, (1, 3, 64, 100)),  # start >= 0 limits: 100 - seq >= 0
    ("seq // 3", 100, "seq // 3 + 100", 199, (1, 3, 67, 299)),  # the table's end limits
])
def test_slice_of_a_table_s_centre_records_its_limit(tmp_path, frames, c2, key, limit, seqs):
    """pe[100 - n : c2 + n] of a [199, 2] table (wav2vec2-Conformer's relative positions, n the
    frames: seq, or an expression of it): start + end is constant, so the import assumes the
    start >= 0 (the model gives the wrong number of rows otherwise) and the end within the
    table, records the limit on the end, reads rows 100 - n .. c2 + n - 1, and refuses longer
    inputs at run time."""
    module, result, session = _compile(tmp_path, _centred_slice(frames, c2))
    assert result.metadata["dim_limits"] == {key: limit}
    for seq in seqs:
        x = _floats(seq)
        got, want = module.run(x), session.run(None, x)
        np.testing.assert_array_equal(got["rows"], want[1])
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5, err_msg=f"seq {seq}")
    with pytest.raises(QtvmError, match="this model takes"):
        module.run(_floats(seqs[-1] + 3))


def test_slice_of_a_table_s_centre_that_may_be_empty_is_refused(tmp_path):
    """pe[100 - seq // 3 : 99 + seq // 3] has 2 (seq // 3) - 1 rows: none (a clamped, empty
    slice) at seq < 3, so the window rule declines and the unknown sign is named."""
    with pytest.raises(QtvmError, match="Slice bound 100 - seq // 3 may be negative"):
        _compile(tmp_path, _centred_slice("seq // 3", 99))


def test_slice_of_a_table_s_centre_with_a_limit_the_runtime_cannot_check_is_refused(tmp_path):
    """pe[100 - seq % 7 * 20 : 100 + seq % 7 * 20]: the limit on its end would be written in a
    syntax the runtime cannot evaluate (``%``), so it could not refuse inputs past it; the rule
    declines and the unknown sign is named."""
    with pytest.raises(QtvmError, match="may be negative"):
        _compile(tmp_path, _centred_slice("seq % 7 * 20", 100))


def test_slice_of_a_one_column_table_from_max_0_1_minus_seq_needs_no_limit(tmp_path):
    """bias[:, max(0, 1 - seq):] of a [1, 1] table (MPT's torch.export, the query axis): its
    length min(seq, 1) is 1 for every seq >= 1; it broadcasts, and seq stays unlimited."""
    table = numpy_helper.from_array(np.array([[0.5]], np.float32), "table")
    nodes = _seq_of() + [
        _const("one_s", [1]), _const("z", [0]), _const("big", [INT64_MAX]), _const("one", [1]),
        helper.make_node("Sub", ["one_s", "s"], ["ds"]), helper.make_node("Max", ["z", "ds"], ["start"]),
        helper.make_node("Slice", ["table", "start", "big", "one"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["y"]),
    ]
    module, result, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")], [table]))
    assert result.metadata["dim_limits"] == {}
    _check(module, session, _floats)


def _causal_table_with_a_cache(form):
    """Scores s [batch, seq, past + seq] masked by a [40, 40] lower-triangular table sliced the
    way a cached causal mask is: GPT-Neo's rows past .. past + seq - 1, columns :past + seq
    ("window"), or MPT's last past + seq columns of a [1, 40] bias ("tail": start 40 - past - seq)."""
    d = 40
    nodes = _seq_of("p", "q") + _seq_of("x", "n") + [
        helper.make_node("Add", ["q", "n"], ["total"]), _const("zero", [0]), _const("one", [1]),
        _const("ax", [0]), _const("ax1", [1]), _const("d", [d]), _const("big", [INT64_MAX])]
    if form == "window":
        table = numpy_helper.from_array(np.tril(np.ones((d, d), np.float32)) * 5, "table")
        nodes += [helper.make_node("Slice", ["table", "q", "total", "ax"], ["rows"]),
                  helper.make_node("Slice", ["rows", "zero", "total", "ax1"], ["mask"])]  # [seq, past + seq]
    else:
        table = numpy_helper.from_array(np.linspace(-2, 2, d, dtype=np.float32).reshape(1, d), "table")
        nodes += [helper.make_node("Sub", ["d", "total"], ["start"]),
                  helper.make_node("Slice", ["table", "start", "big", "ax1"], ["mask"])]  # [1, past + seq]
    nodes.append(helper.make_node("Add", ["s", "mask"], ["y"]))
    scores = _x("s", ("batch", "seq", "past + seq"))
    model = _model(nodes, [_x(), _x("p", ("batch", "past")), scores], [_x("y", ("batch", "seq", "past + seq"))],
                   [table])
    return model, d


@pytest.mark.parametrize("form", ["window", "tail"])
def test_slice_of_a_table_to_past_plus_seq_records_a_limit_on_the_sum(tmp_path, form):
    """A causal-mask or ALiBi table sliced to the cache's total length past + seq: its length is
    past + seq where the model works at all, so the import takes past + seq <= the table's length
    (a limit on the sum, recorded and refused beyond at run time, not on each symbol), reads the
    right rows at past 0 and > 0 (onnxruntime), and past may still be 0."""
    model, d = _causal_table_with_a_cache(form)
    module, result, session = _compile(tmp_path, model)
    assert result.metadata["dim_limits"] == {"past + seq": d}
    assert result.metadata["may_be_zero"] == ["past"]
    assert f"batch, past >= 0, past + seq 1..{d}, seq" in summary(result.metadata)  # qtvm inspect
    rng = np.random.default_rng(0)

    def feeds(past, seq, batch=2):
        return {"x": rng.standard_normal((batch, seq)).astype(np.float32),
                "p": np.zeros((batch, past), np.float32),
                "s": rng.standard_normal((batch, seq, past + seq)).astype(np.float32)}

    for past, seq in ((0, 1), (0, 7), (5, 1), (9, 4), (d - 3, 3), (0, d)):
        f = feeds(past, seq)
        np.testing.assert_allclose(module.run(f)["y"], session.run(None, f)[0], rtol=1e-6, err_msg=f"{past}, {seq}")
    with pytest.raises(QtvmError, match=f"past \\+ seq = {d + 1} .*this model takes past \\+ seq <= {d}"):
        module.run(feeds(d - 2, 3))


@pytest.mark.parametrize("form", ["range_from_past", "range_plus_past"])
def test_positions_gathered_from_a_table_record_a_limit_on_the_sum(tmp_path, form):
    """Learned positions with a cache: Range(past, past + seq) (torch.export's GPT-2, XGLM) or
    Range(0, seq) + past (GPT-2's legacy export), plus an offset of 2 (XGLM, OPT), unsqueezed and
    gathered from a [40, 1] table: the model works while past + seq + 2 <= 40, so past + seq <= 38
    is recorded (the gather wraps or clips out-of-range positions silently), the rows match
    onnxruntime, and longer inputs are refused at run time. (past sizes no output here, so it is
    >= 1, as in any model without a cache output.)"""
    d = 40
    table = numpy_helper.from_array(np.linspace(-1, 1, d, dtype=np.float32).reshape(d, 1), "table")
    nodes = _seq_of() + _seq_of("p", "q") + [
        _const("zero_axes", [0]), _const("z", 0), _const("one", 1), _const("two", 2),
        helper.make_node("Squeeze", ["s", "zero_axes"], ["s0"]),
        helper.make_node("Squeeze", ["q", "zero_axes"], ["q0"])]
    if form == "range_from_past":
        nodes += [helper.make_node("Add", ["q0", "s0"], ["end"]),
                  helper.make_node("Range", ["q0", "end", "one"], ["pos"])]
    else:
        nodes += [helper.make_node("Range", ["z", "s0", "one"], ["r"]), helper.make_node("Add", ["r", "q0"], ["pos"])]
    nodes += [helper.make_node("Add", ["pos", "two"], ["pos2"]),
              helper.make_node("Unsqueeze", ["pos2", "zero_axes"], ["ids"]),  # [1, seq]
              helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),  # [1, seq, 1]
              _const("last", [2]), helper.make_node("Squeeze", ["rows", "last"], ["emb"]),
              helper.make_node("Add", ["x", "emb"], ["y"])]
    model = _model(nodes, [_x(), _x("p", ("batch", "past"))], [_x("y", ("batch", "seq"))], [table])
    module, result, session = _compile(tmp_path, model)
    assert result.metadata["dim_limits"] == {"past + seq": d - 2}
    rng = np.random.default_rng(0)

    def feeds(past, seq):
        return {"x": rng.standard_normal((2, seq)).astype(np.float32), "p": np.zeros((2, past), np.float32)}

    for past, seq in ((1, 1), (1, 9), (5, 1), (30, 8), (1, d - 3)):
        f = feeds(past, seq)
        np.testing.assert_allclose(module.run(f)["y"], session.run(None, f)[0], rtol=1e-6, err_msg=f"{past}, {seq}")
    with pytest.raises(QtvmError, match=f"past \\+ seq = {d - 1} .*this model takes past \\+ seq <= {d - 2}"):
        module.run(feeds(30, 9))


def test_slice_from_a_bound_of_unknown_sign_is_refused(tmp_path):
    """x[:, seq - 4:]: for seq < 4 the start is negative and counts from the end (onnxruntime),
    which a clamp to 0 would not do; the sign is not known when compiling, so it is refused."""
    nodes = _seq_of() + [_const("four", [4]), _const("big", [INT64_MAX]), _const("one", [1]),
                         helper.make_node("Sub", ["s", "four"], ["start"]),
                         helper.make_node("Slice", ["x", "start", "big", "one"], ["y"])]
    with pytest.raises(QtvmError, match="seq - 4 may be negative"):
        _compile(tmp_path, _model(nodes, [_x()], [_x("y", ("batch", "k"))]))


def test_gather_indices_negative_and_out_of_range(tmp_path):
    """GatherND/GatherElements/Gather: negative indices as ONNX says; out-of-range ones
    (which onnxruntime refuses) read a clipped element instead of stray memory."""
    nodes = [
        helper.make_node("GatherND", ["x", "nd"], ["a"]),
        helper.make_node("GatherElements", ["x", "el"], ["b"], axis=1),
        helper.make_node("Gather", ["x", "g"], ["c"], axis=1),
    ]
    inputs = [_x(), _x("nd", ("k", 2), TensorProto.INT64), _x("el", ("batch", "m"), TensorProto.INT64),
              _x("g", ("m2",), TensorProto.INT64)]
    outputs = [_x("a", ("k",)), _x("b", ("batch", "m")), _x("c", ("batch", "m2"))]
    module, _, session = _compile(tmp_path, _model(nodes, inputs, outputs))

    def make(seq):
        rng = np.random.default_rng(seq)
        return {"x": rng.standard_normal((2, seq)).astype(np.float32),
                "nd": np.array([[0, -1], [-2, 0], [1, seq - 1]], np.int64),
                "el": rng.integers(-seq, seq, (2, 5)).astype(np.int64),
                "g": np.array([-1, 0, seq - 1], np.int64)}
    _check(module, session, make)
    x = make(3)
    x.update(nd=np.array([[5, 99], [-9, -9]], np.int64), el=np.array([[7] * 5, [-8] * 5], np.int64))
    got = module.run(x)
    np.testing.assert_array_equal(got["a"], [x["x"][1, 2], x["x"][0, 0]])  # clipped to the last / first
    np.testing.assert_array_equal(got["b"], np.stack([np.full(5, x["x"][0, 2]), np.full(5, x["x"][1, 0])]))


def test_unrelated_symbolic_dims_name_the_tensors_and_dims():
    from qtvm.frontend.onnx import import_onnx

    nodes = [helper.make_node("Add", ["x", "z"], ["y"], name="add_mask")]
    model = _model(nodes, [_x(), _x("z", ("batch", "total"))], [_x("y")])
    with pytest.raises(QtvmError) as info:
        import_onnx(model)
    text = str(info.value)
    assert "Add node 'add_mask'" in text
    assert "'x' [batch, seq] (axis -1: seq)" in text and "'z' [batch, total] (axis -1: total)" in text
    assert "cannot be related" in text and "past + seq" in text  # the fix says how to relate them


def test_a_dim_the_exporter_named_is_restated_with_dim(tmp_path):
    """torch.export names an attention mask's length on its own (s53); the import cannot
    relate it to past + seq and says which --dim restates it; with it the model compiles,
    matches onnxruntime, and the runtime checks the mask against past + seq."""
    from qtvm import runtime
    from qtvm.frontend.onnx import parse_dim_options

    nodes = [helper.make_node("Concat", ["past", "x"], ["all"], axis=1), helper.make_node("Add", ["all", "mask"], ["y"])]
    model = _model(nodes, [_x(), _x("past", ("batch", "past")), _x("mask", ("batch", "s53"))],
                   [_x("y", ("batch", "s53"))])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(QtvmError, match=r"--dim s53=EXPR"):
        compile_model(path, tmp_path / "no.so", "host", "none")
    assert not (tmp_path / "no.so").exists()
    result = compile_model(path, tmp_path / "m.so", "host", "none", dims=parse_dim_options(["s53=past + seq"]))
    assert [i["shape"] for i in result.metadata["inputs"]][2] == ["batch", "past + seq"]
    module, session = runtime.load(result.path), ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch, seq, past in ((1, 1, 0), (2, 3, 5), (3, 1, 17)):
        feeds = {"x": rng.standard_normal((batch, seq)).astype(np.float32),
                 "past": rng.standard_normal((batch, past)).astype(np.float32),
                 "mask": rng.standard_normal((batch, past + seq)).astype(np.float32)}
        np.testing.assert_allclose(module.run(feeds)["y"], session.run(None, feeds)[0], rtol=1e-6)
    with pytest.raises(QtvmError, match="past \\+ seq"):
        module.run({**feeds, "mask": np.zeros((3, 5), np.float32)})


@pytest.mark.parametrize("options, message", [
    (["s53"], "--dim 's53' is not NAME=EXPRESSION"),
    (["=past + seq", "s53=past +"], "--dim '=past \\+ seq', 's53=past \\+' is not NAME=EXPRESSION"),
    (["s99=past + seq"], "--dim names 's99', which no input dim is called \\(the inputs' dims: batch, past, seq\\)"),
])
def test_dim_option_errors_name_the_problem(tmp_path, options, message):
    from qtvm.frontend.onnx import parse_dim_options

    nodes = [helper.make_node("Concat", ["past", "x"], ["y"], axis=1)]
    path = tmp_path / "m.onnx"
    onnx.save(_model(nodes, [_x(), _x("past", ("batch", "past"))], [_x("y", ("batch", "n"))]), str(path))
    with pytest.raises(QtvmError, match=message):
        compile_model(path, tmp_path / "m.so", "host", "none", dims=parse_dim_options(options))
    assert not (tmp_path / "m.so").exists()


def test_dimension_expression_needs_its_symbols_defined():
    from qtvm.frontend.onnx import import_onnx

    model = _model([helper.make_node("Identity", ["m"], ["y"])], [_x("m", ("batch", "past + seq"))],
                   [_x("y", ("batch", "n"))])
    with pytest.raises(QtvmError, match="dimension 'past \\+ seq' of input 'm' uses 'past', 'seq'"):
        import_onnx(model)


def test_tile_by_a_symbolic_repeat(tmp_path):
    """DeBERTa's relative positions: Range(seq) as a row, tiled by [seq, 1], subtracted from its
    column; TVM's Tile named the output dims anew, and the Sub could not relate them."""
    seq = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "one"], ["n"], axis=0)]
    nodes = [_const("zero", 0), _const("one", 1), _const("ax0", [0]), _const("ax1", [1]), _const("ones", [1]), *seq,
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "ax0"], ["row"]), helper.make_node("Unsqueeze", ["r", "ax1"], ["col"]),
             helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
             helper.make_node("Concat", ["n1", "ones"], ["reps"], axis=0),
             helper.make_node("Tile", ["row", "reps"], ["rows"]), helper.make_node("Sub", ["col", "rows"], ["rel"]),
             helper.make_node("Cast", ["rel"], ["relf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "relf"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")]))
    _check(module, session, _floats)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_to_sizes_that_carry_the_batch_dim(tmp_path, mode):
    """MobileViT: Resize's sizes are Concat(Shape(x)[:2], [h, w]), a symbolic batch in them;
    TVM's converter took only a constant (and reads only the spatial entries)."""
    nodes = [_const("start", [0]), _const("end", [2]), _const("hw", [6, 10]),
             helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Slice", ["shape", "start", "end"], ["nc"]),
             helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
             helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode=mode)]
    model = _model(nodes, [_x("x", ("batch", 3, 4, 5))], [_x("y", ("batch", 3, 6, 10))], opset=13)
    module, _, session = _compile(tmp_path, model)
    for batch in (1, 3):
        x = {"x": np.random.default_rng(batch).standard_normal((batch, 3, 4, 5)).astype(np.float32)}
        np.testing.assert_allclose(module.run(x)["y"], session.run(None, x)[0], rtol=1e-5, atol=1e-5)


def test_pow_by_a_half_is_a_square_root(tmp_path):
    """x ** 0.5 of a tensor and of a scalar constant (DINOv2's legacy export takes the square
    root of its patch count so): both crashed the converter on the dtype's type."""
    nodes = [_const("half", 0.5, np.float32), _const("four", 4.0, np.float32),
             helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("Pow", ["ax", "half"], ["r"]),
             helper.make_node("Pow", ["four", "half"], ["two"]), helper.make_node("Mul", ["r", "two"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")]))
    _check(module, session, _floats)


def test_pow_by_small_constants_is_exact(tmp_path):
    """x ** 2 and x ** 3 become multiplications (no pow of a negative base)."""
    nodes = [_const("two", 2.0, np.float32), _const("three", 3.0, np.float32),
             helper.make_node("Pow", ["x", "two"], ["a"]), helper.make_node("Pow", ["x", "three"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")]))
    _check(module, session, _floats)
    x = np.array([[-2.0, -0.5, 3.0]], np.float32)
    np.testing.assert_array_equal(module.run({"x": x})["y"], x * x + x * x * x)


def _strided_convs_then_slice(end_from_shape: bool):
    """wav2vec2's feature encoder in small: two strided Conv1d over audio samples (frames =
    seq // 10 - 1), then its positional conv's padding slice, frames - 1 as the end (the legacy
    exporter writes Shape - 1), or as Div(seq, 10) - 2 (the dynamo exporter's ONNX Div)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 1, 10)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 3)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], strides=[5]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], strides=[2]),
             _const("zero", [0]), _const("one", [1]), _const("two", [2]), _const("ten", [10])]
    if end_from_shape:
        nodes += [helper.make_node("Shape", ["c2"], ["sh"]), helper.make_node("Gather", ["sh", "two"], ["n"], axis=0)]
    else:
        nodes += [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "two"], ["samples"], axis=0),
                  helper.make_node("Div", ["samples", "ten"], ["tenth"]), helper.make_node("Sub", ["tenth", "one"], ["n"])]
    nodes += [helper.make_node("Sub", ["n", "one"], ["end"]),
              helper.make_node("Slice", ["c2", "zero", "end", "two"], ["y"])]
    return _model(nodes, [_x("x", ("batch", 1, "seq"))], [_x("y", ("batch", 4, "frames"))], inits)


@pytest.mark.parametrize("end_from_shape", [True, False])
def test_convolutions_give_their_input_a_minimum_length(tmp_path, end_from_shape):
    """A Conv's output must be at least 1 long (onnxruntime refuses less), so its input is at
    least the window: seq >= 20 here, which makes the slice's end seq // 10 - 2 provably
    non-negative; both were refused as of unknown sign. The artefact records the minimum: the
    runtime refuses a shorter input by name, inspect shows it, check binds above it."""
    from qtvm.check import default_bindings

    module, result, session = _compile(tmp_path, _strided_convs_then_slice(end_from_shape))
    assert module.metadata["dim_minimums"] == {"seq": 20}
    for batch, seq in ((1, 20), (2, 29), (1, 30), (3, 803)):
        x = {"x": np.random.default_rng(seq).standard_normal((batch, 1, seq)).astype(np.float32)}
        np.testing.assert_allclose(module.run(x)["y"], session.run(None, x)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(QtvmError, match=r"seq = 19, but this model takes seq >= 20 .* pad the input to at least 20"):
        module.run({"x": np.zeros((1, 1, 19), np.float32)})
    with pytest.raises(Exception):  # onnxruntime agrees that 19 is too short
        session.run(None, {"x": np.zeros((1, 1, 19), np.float32)})
    assert "symbolic dims: batch, seq >= 20\n" in summary(result.metadata) + "\n"
    assert all(b["seq"] >= 20 for b in default_bindings(["batch", "seq"], module.metadata["dim_minimums"]))


def test_integer_division_of_a_length_relates_to_a_window_s_output(tmp_path):
    """Reshape to [batch, Div(seq, 10), -1] of a pooled [batch, 2, seq // 10]: ONNX's Div
    truncates, and TVM's analyzer kept T.Div(seq, 10) apart from seq // 10 (the -1 did not
    divide); for a non-negative length the two are one."""
    nodes = [_const("two", [2]), _const("ten", [10]), _const("zero", [0]), _const("minus", [-1]),
             helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[10], strides=[10]),
             helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "two"], ["samples"], axis=0),
             helper.make_node("Div", ["samples", "ten"], ["frames"]),
             helper.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
             helper.make_node("Concat", ["b", "frames", "minus"], ["target"], axis=0),
             helper.make_node("Reshape", ["p", "target"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x("x", ("batch", 2, "seq"))], [_x("y", ("batch", "f", 2))]))
    for batch, seq in ((1, 10), (2, 37), (3, 400)):
        x = {"x": np.random.default_rng(seq).standard_normal((batch, 2, seq)).astype(np.float32)}
        np.testing.assert_allclose(module.run(x)["y"], session.run(None, x)[0], rtol=1e-5, atol=1e-5)


def test_constant_of_shape_filled_with_minus_infinity(tmp_path):
    """A mask of -inf to a computed shape (PhiMoE's dynamo export): TVM's legalization of
    ``full`` crashed on a non-finite fill (it reads the dtype as a string)."""
    nodes = _seq_of() + [helper.make_node("ConstantOfShape", ["s"], ["m"],
                                          value=numpy_helper.from_array(np.array([-np.inf], np.float32))),
                         helper.make_node("Max", ["x", "m"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y")]))
    _check(module, session, _floats)


def test_top_k_unsorted_is_run_sorted(tmp_path):
    """TopK sorted=0 (a group-limited MoE router picks groups so): ONNX leaves the order to the
    implementation, TVM's converter refused it; sorted is one valid order, and the set of
    values and indices is onnxruntime's."""
    nodes = [_const("k", [3]), helper.make_node("TopK", ["x", "k"], ["v", "i"], sorted=0)]
    model = _model(nodes, [_x()], [_x("v", ("batch", 3)), _x("i", ("batch", 3), TensorProto.INT64)])
    module, _, session = _compile(tmp_path, model)
    for seq in (3, 8, 67):
        x = _floats(seq)
        got, (v, i) = module.run(x), session.run(None, x)
        np.testing.assert_array_equal(np.sort(got["v"], axis=1), np.sort(v, axis=1))
        np.testing.assert_array_equal(np.sort(got["i"], axis=1), np.sort(i, axis=1))
        assert (np.diff(got["v"], axis=1) <= 0).all()  # largest first


def test_isnan_and_isinf_of_bfloat16(tmp_path):
    """TVM has no isnan/isinf of bfloat16 (compiling failed, a bfloat16 dynamo export of
    Mixtral tests its mask so): they run on the input widened to float32, exactly numpy's."""
    import ml_dtypes

    from qtvm import runtime

    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("IsInf", ["x"], ["inf"])]
    model = _model(nodes, [_x(elem=TensorProto.BFLOAT16)],
                   [_x("nan", elem=TensorProto.BOOL), _x("inf", elem=TensorProto.BOOL)], opset=20)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module = runtime.load(compile_model(path, tmp_path / "m.so", "host", "none").path)
    for seq in (1, 7):
        x = np.random.default_rng(seq).standard_normal((2, seq)).astype(np.float32)
        x[0, 0], x[1, -1] = np.nan, -np.inf
        x[0, -1] = np.inf if seq > 1 else x[0, -1]
        got = module.run({"x": x.astype(ml_dtypes.bfloat16)})
        np.testing.assert_array_equal(got["nan"], np.isnan(x))
        np.testing.assert_array_equal(got["inf"], np.isinf(x))


def test_constant_of_shape_bfloat16_minus_infinity(tmp_path):
    """ConstantOfShape of a bfloat16 -inf to a computed shape (PhiMoE's bfloat16 dynamo mask):
    ml_dtypes' bfloat16 is not of numpy kind "f", so the non-finite fill reached TVM's ``full``,
    which crashes on it; it is a broadcast as float ones are."""
    import ml_dtypes

    from qtvm import runtime

    fill = numpy_helper.from_array(np.array([-np.inf], ml_dtypes.bfloat16))
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("ConstantOfShape", ["shape"], ["c"], value=fill),
             helper.make_node("Add", ["x", "c"], ["y"])]
    model = _model(nodes, [_x(elem=TensorProto.BFLOAT16)], [_x("y", elem=TensorProto.BFLOAT16)])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    module = runtime.load(compile_model(path, tmp_path / "m.so", "host", "none").path)
    for seq in (1, 5):
        x = np.random.default_rng(seq).standard_normal((2, seq)).astype(ml_dtypes.bfloat16)
        got = module.run({"x": x})["y"].astype(np.float32)
        assert got.shape == (2, seq) and np.isneginf(got).all()


def test_layer_norm_of_mixed_types_is_refused_by_name(tmp_path):
    """torch.onnx's legacy exporter gives a float16 model's LayerNorm float32 data and float16
    weights (GPT-2, BERT, OPT): one line naming the node, the types and the export that works
    (it was TVM's op signature dump); one type throughout still imports."""
    from qtvm.errors import QtvmError

    def model(data_type):
        scale = numpy_helper.from_array(np.ones(4, np.float16), "scale")
        bias = numpy_helper.from_array(np.zeros(4, np.float16), "bias")
        node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], name="ln", axis=-1)
        return _model([node], [_x(dims=("batch", 4), elem=data_type)], [_x("y", ("batch", 4), data_type)],
                      [scale, bias])

    path = tmp_path / "m.onnx"
    onnx.save(model(TensorProto.FLOAT), str(path))
    with pytest.raises(QtvmError, match=r"LayerNormalization node 'ln': its float32 data and float16 scale and bias "
                                        r"differ in type .*export with dynamo=True"):
        compile_model(path, tmp_path / "m.so", "host", "none")
    onnx.save(model(TensorProto.FLOAT16), str(path))
    assert compile_model(path, tmp_path / "m.so", "host", "none").path.exists()


@pytest.mark.parametrize("op,attrs", [("Elu", {"alpha": 0.7}), ("Selu", {}), ("ThresholdedRelu", {"alpha": 0.3}),
                                      ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("Clip", {}), ("PRelu", {}),
                                      ("Mod", {"fmod": 1})])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_half_precision_activations_run_in_float32(tmp_path, op, attrs, elem):
    """Elu, Selu and ThresholdedRelu of float16/bfloat16 failed to import (TVM builds them from
    float32 constants); HardSigmoid computed alpha * x + beta in float16 (10 ulps off); bfloat16
    Clip, PRelu and fmod failed to compile: each runs on float32 copies, within one rounding of
    onnxruntime's float32 result (the inputs made half first). Found by ONNX's float32 node
    tests made half precision."""
    import ml_dtypes

    from qtvm import runtime

    half = np.float16 if elem == TensorProto.FLOAT16 else ml_dtypes.bfloat16
    second = {"Clip": ["", "hi"], "PRelu": ["slope"], "Mod": ["d"]}.get(op, [])
    rng = np.random.default_rng(3)
    values = {"x": rng.standard_normal((2, 9)) * 3, "hi": np.array(1.5), "slope": rng.standard_normal(9),
              "d": rng.uniform(0.5, 2, (2, 9)) * rng.choice([-1, 1], (2, 9))}

    def graph(t):
        feeds = [n for n in ["x", *second] if n]
        inputs = [_x(n, np.shape(values[n]) or (), t) for n in feeds]
        return _model([helper.make_node(op, ["x", *second], ["y"], **attrs)], inputs, [_x("y", (2, 9), t)])

    path = tmp_path / "m.onnx"
    onnx.save(graph(elem), str(path))
    module = runtime.load(compile_model(path, tmp_path / "m.so", "host", "none").path)
    session = ort.InferenceSession(graph(TensorProto.FLOAT).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: np.asarray(values[n]).astype(half) for n in ["x", *second] if n}
    got = module.run(feeds)["y"]
    want = session.run(None, {n: v.astype(np.float32) for n, v in feeds.items()})[0].astype(half)  # one rounding
    ulp = np.spacing(np.abs(want).astype(np.float32)) * (2 ** 13 if elem == TensorProto.FLOAT16 else 2 ** 16)
    assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp).all()


def _ties(seq, batch=2):
    """Values with many ties (TopK's order among equal values is ONNX's: the lower index first)."""
    return {"x": np.random.default_rng(seq).integers(-3, 4, (batch, seq)).astype(np.float32)}


@pytest.mark.parametrize("largest", [1, 0])
def test_top_k_of_the_whole_axis_is_a_sort(tmp_path, largest):
    """k = the axis's length, an expression of the dims: torch.onnx writes torch.sort and argsort
    so (JetMoE's router); TVM's converter took only a constant k. Values and indices, ties
    included, are onnxruntime's."""
    nodes = _seq_of() + [helper.make_node("TopK", ["x", "s"], ["v", "i"], largest=largest)]
    model = _model(nodes, [_x()], [_x("v"), _x("i", elem=TensorProto.INT64)])
    module, _, session = _compile(tmp_path, model)
    for seq in SEQS:
        x = _ties(seq)
        got, (v, i) = module.run(x), session.run(None, x)
        np.testing.assert_array_equal(got["v"], v, err_msg=f"seq {seq}")
        np.testing.assert_array_equal(got["i"], i, err_msg=f"seq {seq}")


def test_top_k_of_a_symbolic_k_short_of_the_axis_is_refused(tmp_path):
    nodes = _seq_of() + [_const("one", [1]), helper.make_node("Sub", ["s", "one"], ["k"]),
                         helper.make_node("TopK", ["x", "k"], ["v", "i"])]
    model = _model(nodes, [_x()], [_x("v", ("batch", "k")), _x("i", ("batch", "k"), TensorProto.INT64)])
    with pytest.raises(QtvmError, match=r"k \(seq - 1\) is computed from the input dims and is not the whole axis"):
        _compile(tmp_path, model)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_torch_sort_and_argsort_exports(tmp_path, exporter):
    """torch.sort / argsort along a symbolic dim, as torch.onnx exports them."""
    import torch

    class Sort(torch.nn.Module):  # stable=True does not export (either exporter)
        def forward(self, x):
            values, order = torch.sort(x, dim=-1, descending=True)
            return values, order, torch.argsort(x, dim=-1)

    x = torch.from_numpy(_ties(5)["x"])
    path = tmp_path / "m.onnx"
    if exporter == "legacy":
        torch.onnx.export(Sort(), (x,), str(path), input_names=["x"], output_names=["v", "i", "j"],
                          dynamic_axes={"x": {0: "batch", 1: "seq"}}, dynamo=False)
    else:
        dims = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
        torch.onnx.export(Sort(), (x,), str(path), input_names=["x"], output_names=["v", "i", "j"],
                          dynamic_shapes=dims, dynamo=True)
    module, _, session = _compile(tmp_path, onnx.load(str(path)))
    for seq in (2, 3, 64, 67):
        x = _ties(seq)
        got, want = module.run(x), session.run(None, x)
        for name, w in zip(("v", "i", "j"), want):
            np.testing.assert_array_equal(got[name], w, err_msg=f"{name}, seq {seq}")


def test_split_by_sizes_that_are_expressions_of_the_dims(tmp_path):
    """x split into its first seq - 1 columns and the last: TVM's converter took only constant sizes."""
    nodes = _seq_of() + [_const("one", [1]), helper.make_node("Sub", ["s", "one"], ["head"]),
                         helper.make_node("Concat", ["head", "one"], ["sizes"], axis=0),
                         helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1)]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("a", ("batch", "h")), _x("b", ("batch", 1))]))
    _check(module, session, _floats)


def test_split_by_sizes_from_input_values_is_refused(tmp_path):
    """Sizes computed from the data (a mixture of experts grouped by expert): outputs whose
    lengths depend on values, refused by name (TVM's converter said 'Dynamic Split not yet supported')."""
    nodes = [helper.make_node("Abs", ["n"], ["sizes"]),
             helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1)]
    model = _model(nodes, [_x(), helper.make_tensor_value_info("n", TensorProto.INT64, [2])],
                   [_x("a", ("batch", "p")), _x("b", ("batch", "q"))])
    with pytest.raises(QtvmError, match="split sizes are computed from input values at run time"):
        _compile(tmp_path, model)


def _pad_to_chunks(mode="constant", chunk=8):
    """Mamba-2's chunked scan (Bamba, Falcon-H1, dynamo export): the sequence padded to a
    multiple of the chunk by (c - seq % c) % c, split into chunks, summed per chunk, and the
    padded sequence sliced back to seq."""
    nodes = _seq_of() + [
        _const("c", [chunk]), _const("zeros", [0, 0, 0, 0]), _const("zero", [0]), _const("one", [1]),
        _const("fill", 0.5, np.float32), _const("chunked", [0, -1, chunk, 4]), _const("flat", [0, -1, 4]),
        helper.make_node("Mod", ["s", "c"], ["r"]), helper.make_node("Sub", ["c", "r"], ["cr"]),
        helper.make_node("Mod", ["cr", "c"], ["amount"]),
        helper.make_node("Concat", ["zeros", "amount", "zero"], ["pads"], axis=0),  # after seq only
        helper.make_node("Pad", ["x", "pads", "fill"], ["padded"], mode=mode),
        helper.make_node("Reshape", ["padded", "chunked"], ["chunks"]),
        helper.make_node("ReduceSum", ["chunks", "c_axis"], ["sums"], keepdims=0),
        helper.make_node("Reshape", ["chunks", "flat"], ["back"]),
        helper.make_node("Slice", ["back", "zero", "s", "one"], ["y"]),
    ]
    axis = numpy_helper.from_array(np.array([2], np.int64), "c_axis")
    x = _x("x", ("batch", "seq", 4))
    return _model(nodes, [x], [_x("y", ("batch", "seq", 4)), _x("sums", ("batch", "n", 4))], inits=[axis], opset=18)


def test_pad_by_amounts_that_are_expressions_of_the_dims(tmp_path):
    """TVM's converter took only constant pads ('Dynamic pads are not supported yet'); the chunk
    count is then (seq - seq % -8) // 8, with batch multiplied in where a reshape is checked, and
    the slice back is min(seq, the padded length), which the analyzer proves but did not simplify."""
    module, _, session = _compile(tmp_path, _pad_to_chunks())
    for seq in (1, 3, 8, 64, 67):
        x = {"x": np.random.default_rng(seq).standard_normal((2, seq, 4)).astype(np.float32)}
        got = module.run(x)
        for out, want in zip(session.get_outputs(), session.run(None, x)):
            assert got[out.name].shape == want.shape, (seq, out.name)
            np.testing.assert_allclose(got[out.name], want, rtol=1e-5, atol=1e-5, err_msg=f"seq {seq}")


def test_pad_by_symbolic_amounts_in_another_mode_is_refused(tmp_path):
    with pytest.raises(QtvmError, match="symbolic in mode 'reflect'"):
        _compile(tmp_path, _pad_to_chunks(mode="reflect"))


def test_pad_by_amounts_of_unknown_sign_is_refused(tmp_path):
    nodes = _seq_of() + [_const("four", [4]), _const("zero", [0]),
                         helper.make_node("Sub", ["four", "s"], ["amount"]),
                         helper.make_node("Concat", ["zero", "zero", "zero", "amount"], ["pads"], axis=0),
                         helper.make_node("Pad", ["x", "pads"], ["y"])]
    with pytest.raises(QtvmError, match="not shown to be non-negative"):
        _compile(tmp_path, _model(nodes, [_x()], [_x("y", ("batch", "k"))]))


def _dft_model(inverse_too: bool):
    """x [batch, seq, 4] as a real signal: its DFT along seq (opset 20, axis an input), then
    (inverse_too) that spectrum's inverse, which gives x back as a complex signal."""
    nodes = [_const("last", [3]), _const("axis", 1),
             helper.make_node("Unsqueeze", ["x", "last"], ["signal"]),
             helper.make_node("DFT", ["signal", "", "axis"], ["y"])]
    outputs = [_x("y", ("batch", "seq", 4, 2))]
    if inverse_too:
        nodes.append(helper.make_node("DFT", ["y", "", "axis"], ["z"], inverse=1))
        outputs.append(_x("z", ("batch", "seq", 4, 2)))
    return _model(nodes, [_x("x", ("batch", "seq", 4))], outputs, opset=20)


def test_dft_along_a_symbolic_axis(tmp_path):
    """TVM's importer has no DFT (FNet's token mixing, torch.fft in dynamo exports): the tables
    are built from the axis's length at run time, so one artefact serves every seq."""
    module, _, session = _compile(tmp_path, _dft_model(inverse_too=True))
    for seq in (1, 2, 3, 8, 64, 67):
        x = {"x": np.random.default_rng(seq).standard_normal((2, seq, 4)).astype(np.float32)}
        got = module.run(x)
        exact = np.fft.fft(x["x"].astype(np.float64), axis=1)
        exact = np.stack([exact.real, exact.imag], axis=-1)
        scale = np.abs(exact).max()
        np.testing.assert_allclose(got["y"], exact, rtol=0, atol=2e-7 * scale, err_msg=f"seq {seq}")
        # onnxruntime's own DFT is off by up to 1.7e-5 of the scale at lengths such as 67 and 100
        np.testing.assert_allclose(got["y"], session.run(None, x)[0], rtol=0, atol=5e-5 * scale)
        np.testing.assert_allclose(got["z"][..., 0], x["x"], rtol=1e-5, atol=1e-6)
        assert np.abs(got["z"][..., 1]).max() < 1e-6  # a real signal's spectrum inverts to a real signal


def test_torch_fft_dynamo_export(tmp_path):
    """FNet's mixing, torch.fft.fftn over (seq, hidden) keeping the real part, as torch.onnx's dynamo
    exporter writes it (two DFTs; the legacy exporter refuses torch.fft)."""
    import torch

    class Mix(torch.nn.Module):
        def forward(self, x):
            return torch.fft.fftn(x, dim=(1, 2)).real

    path = tmp_path / "m.onnx"
    torch.onnx.export(Mix(), (torch.randn(2, 5, 8),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_shapes={"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}, dynamo=True)
    module, _, session = _compile(tmp_path, onnx.load(str(path)))
    for seq in (1, 3, 16, 67):
        feeds = {"x": np.random.default_rng(seq).standard_normal((2, seq, 8)).astype(np.float32)}
        exact = np.fft.fftn(feeds["x"].astype(np.float64), axes=(1, 2)).real
        got, scale = module.run(feeds)["y"], np.abs(exact).max()
        np.testing.assert_allclose(got, exact, rtol=0, atol=4e-7 * scale, err_msg=f"seq {seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=0, atol=5e-5 * scale)


def test_add_of_lengths_equal_for_every_seq_but_written_apart(tmp_path):
    """x[:, :(seq + 10) // 20] + x[:, :seq // 10 - seq // 20]: the two lengths are equal for every
    seq (qtvm proves it by their period, as for SEW-D's frame counts); TVM's inference cannot, and
    left the add without a shape and without a kernel until the second input was match-cast."""
    nodes = _seq_of() + [_const("ten", [10]), _const("twenty", [20]), _const("zero", [0]), _const("one", [1]),
                         helper.make_node("Add", ["s", "ten"], ["s10"]),
                         helper.make_node("Div", ["s10", "twenty"], ["len1"]),
                         helper.make_node("Div", ["s", "ten"], ["tenths"]),
                         helper.make_node("Div", ["s", "twenty"], ["twentieths"]),
                         helper.make_node("Sub", ["tenths", "twentieths"], ["len2"]),
                         helper.make_node("Slice", ["x", "zero", "len1", "one"], ["a"]),
                         helper.make_node("Slice", ["x", "zero", "len2", "one"], ["b"]),
                         helper.make_node("Add", ["a", "b"], ["y"])]
    module, _, session = _compile(tmp_path, _model(nodes, [_x()], [_x("y", ("batch", "n"))]))
    for seq in (1, 9, 10, 19, 20, 29, 30, 67, 400):
        x = _floats(seq)
        np.testing.assert_array_equal(module.run(x)["y"], session.run(None, x)[0], err_msg=f"seq {seq}")
