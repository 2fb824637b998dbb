"""exact_reduction_identities: float max/min reductions start from -inf/+inf, as in ONNX,
numpy and onnxruntime, so an all -inf row's max is -inf (not the lowest finite float)."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from schedules.numerics import exact_reduction_identities


def _reduce_module(kind: str, dtype: str = "float32") -> tvm.IRModule:
    x = te.placeholder((3, 5), dtype, name="x")
    k = te.reduce_axis((0, 5), name="k")
    fn = te.max if kind == "max" else te.min
    y = te.compute((3,), lambda i: fn(x[i, k], axis=k), name="y")
    return tvm.IRModule({"main": te.create_prim_func([x, y]).with_attr("global_symbol", "main")})


def _run(mod, x: np.ndarray) -> np.ndarray:
    lib = tvm.compile(mod, target="llvm")
    y = tvm.runtime.tensor(np.full((x.shape[0],), np.nan, x.dtype))
    lib["main"](tvm.runtime.tensor(x), y)
    return y.numpy()


def _rows():
    x = np.array([[1.0, -2.0, 3.0, np.nan, 0.5], [-np.inf] * 5, [np.inf] * 5], np.float32)
    x[0, 3] = -7.0
    return x


def test_max_of_an_all_minus_inf_row_is_minus_inf():
    x = _rows()
    before = _run(_reduce_module("max"), x)
    assert before[1] == np.finfo(np.float32).min  # TVM's own identity: what the pass repairs
    after = _run(exact_reduction_identities(_reduce_module("max")), x)
    np.testing.assert_array_equal(after, x.max(axis=1))


def test_min_of_an_all_plus_inf_row_is_plus_inf():
    x = _rows()
    after = _run(exact_reduction_identities(_reduce_module("min")), x)
    np.testing.assert_array_equal(after, x.min(axis=1))


def test_other_reductions_and_int_max_are_untouched():
    x = te.placeholder((4,), "float32", name="x")
    k = te.reduce_axis((0, 4), name="k")
    s = te.compute((1,), lambda i: te.sum(x[k], axis=k), name="s")
    mod = tvm.IRModule({"main": te.create_prim_func([x, s])})
    assert exact_reduction_identities(mod).same_as(mod)
    ints = _reduce_module("max", "int32")
    assert exact_reduction_identities(ints).same_as(ints)


def test_rewritten_reductions_still_take_rfactor_on_x86():
    """With max from -inf, TVM's rfactor must still recognise the reduction (the reducers
    registered by schedules.numerics): the x86 rule vectorizes softmax over a constant 64
    through rfactor over the lanes instead of leaving it unscheduled; rows of -inf give NaN
    as numpy does, every other row numpy's softmax."""
    from tvm import relax, tirx

    from schedules.x86_generic import schedule_generic_ops
    from tests.kernels import AVX2

    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, 64], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x, axis=1))
        bb.emit_func_output(out)
    mod = schedule_generic_ops(bb.get(), AVX2)
    (softmax,) = [f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert softmax.attrs.get("tir.is_scheduled") and "_rf" in softmax.script()
    vm = relax.VirtualMachine(tvm.compile(mod, target=AVX2), tvm.cpu())
    xs = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    xs[2] = -np.inf
    got = vm["main"](tvm.runtime.tensor(xs)).numpy()
    with np.errstate(invalid="ignore"):
        e = np.exp(xs - xs.max(axis=1, keepdims=True))
        np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), rtol=1e-5)
