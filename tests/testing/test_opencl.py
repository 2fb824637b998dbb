"""The PoCL harness itself: host replay (kernels in order, workspaces, symbolic dims,
scalars, host loops), argument checks, fp16 as float."""
from __future__ import annotations

import numpy as np
import pytest
from tvm import s_tir, te, tirx

from qtvm.errors import QtvmError
from qtvm.testing import opencl
from tests.gpu import needs_opencl


def two_stage(dtype="float32"):
    """B = A * 2 (a workspace), C = B + 1: two kernels, one intermediate, symbolic rows."""
    m = te.var("m", "int64")
    a = te.placeholder((m, 64), dtype, name="A")
    b = te.compute((m, 64), lambda i, j: a[i, j] * tirx.const(2, dtype), name="B")
    c = te.compute((m, 64), lambda i, j: b[i, j] + tirx.const(1, dtype), name="C")
    sch = s_tir.Schedule(te.create_prim_func([a, c]))
    for name in ("B", "C"):
        i, j = sch.get_loops(sch.get_sblock(name))
        sch.bind(i, "blockIdx.x")
        sch.bind(j, "threadIdx.x")
    return sch.mod["main"]


@needs_opencl
def test_two_kernels_and_a_workspace():
    prog = opencl.build(two_stage())
    assert prog.source.count("// Function: ") == 2
    for rows in (1, 5):
        a = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
        c = np.full_like(a, np.nan)
        prog.run(a, c)
        np.testing.assert_allclose(c, a * 2 + 1, rtol=1e-6)


@needs_opencl
def test_half_as_float():
    prog = opencl.build(two_stage("float16"), half_as_float=True)
    assert "half" not in prog.source
    a = np.arange(128, dtype=np.float16).reshape(2, 64)
    c = np.full_like(a, np.nan)
    prog.run(a, c)
    np.testing.assert_array_equal(c, a * 2 + 1)


@needs_opencl
def test_bad_arguments_are_named():
    prog = opencl.build(two_stage())
    with pytest.raises(QtvmError, match="takes 2 arrays"):
        prog.run(np.zeros((2, 64), np.float32))
    with pytest.raises(QtvmError, match="bound to both"):
        prog.run(np.zeros((2, 64), np.float32), np.zeros((3, 64), np.float32))
    with pytest.raises(QtvmError, match="is float64"):
        prog.run(np.zeros((2, 64)), np.zeros((2, 64)))


def test_reinterpreting_half_bits_refuses():
    for source in ("ushort x = as_ushort(h);", "half2 v = (*(half2 *)(&(w)));"):
        with pytest.raises(QtvmError, match="reinterprets fp16 bits"):
            opencl._half_as_float(source)


def test_as_half_is_emulated_bit_exactly():
    """``as_half2`` (the OpenCL unpack intrinsics) becomes a vload_half2 of the same bits."""
    source = opencl._half_as_float("half2 v = as_half2(w);")
    assert "float2 v = qtvm_as_half2(w);" in source and "vload_half2" in source
