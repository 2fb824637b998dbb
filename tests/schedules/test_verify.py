"""The differential checker itself: it must catch a wrong schedule, at the binding where it is
wrong, and stay quiet for a right one."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from schedules.verify import bindings_for, compare, random_args, symbolic_vars, valid_binding

TARGET = tvm.target.Target({"kind": "llvm"})


def _row_sum():
    n, m = te.var("n", "int64"), te.var("m", "int64")
    x = te.placeholder((n, m), "float32", name="x")
    k = te.reduce_axis((0, m), name="k")
    y = te.compute((n,), lambda i: te.sum(x[i, k], axis=k), name="y")
    return te.create_prim_func([x, y])


def test_bindings_are_distinct_per_dim():
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    bs = bindings_for([n, m])
    assert bs[0] == {"n": 1, "m": 3} and len(bs) == 4
    assert all(b["n"] != b["m"] for b in bs)
    assert bindings_for([n, m], domains={"m": (512, 576)})[1] == {"n": 3, "m": 512}


def test_right_schedule_passes():
    func = _row_sum()
    sch = s_tir.Schedule(func)
    i, k = sch.get_loops(sch.get_sblock("y"))
    ko, ki = sch.split(k, [None, 4])
    sch.reorder(i, ko, ki)
    assert compare(func, sch.mod["main"], TARGET) == []
    assert [v.name for v in symbolic_vars(func)] == ["n", "m"]


def test_wrong_function_is_caught_at_the_bindings_where_it_is_wrong():
    """A "schedule" that reads the next row's sums: right only where there is one row (n = 1);
    the checker names the buffer and only the bindings with n > 1."""
    func = _row_sum()
    n, m = te.var("n", "int64"), te.var("m", "int64")
    x = te.placeholder((n, m), "float32", name="x")
    k = te.reduce_axis((0, m), name="k")
    y = te.compute((n,), lambda i: te.sum(x[tirx.min(i + 1, n - 1), k], axis=k), name="y")
    found = compare(func, te.create_prim_func([x, y]), TARGET)
    assert found and all(f.buffer == "y" and "elements off" in f.detail for f in found)
    assert sorted(f.binding["n"] for f in found) == [3, 64, 67]


def test_binding_shifted_until_dims_are_positive():
    s = te.var("s", "int64")
    x = te.placeholder((s,), "float32", name="x")
    y = te.compute(((s - 192) // 128 + 1,), lambda i: x[i * 128], name="y")
    func = te.create_prim_func([x, y])
    assert valid_binding(func, {"s": 3}) == {"s": 259}
    assert compare(func, func, TARGET) == []


def test_integer_divisors_are_never_zero():
    n = te.var("n", "int64")
    a = te.placeholder((n,), "int32", name="a")
    b = te.placeholder((n,), "int32", name="b")
    c = te.compute((n,), lambda i: tirx.floordiv(a[i], b[i]), name="c")
    args = random_args(te.create_prim_func([a, b, c]), {"n": 64}, np.random.default_rng(0))
    assert (args[1] != 0).all()
