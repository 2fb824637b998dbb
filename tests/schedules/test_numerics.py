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
