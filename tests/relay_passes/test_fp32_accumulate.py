"""fp32_accumulate: float16/bfloat16 matmuls and reductions accumulate in float32 (what
onnxruntime returns), elementwise ops keep their type, float32 graphs are untouched."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from relay_passes.fp32_accumulate import fp32_accumulate


def _module(dtype: str, k: int = 256):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType([4, k], dtype))
    b = relax.Var("b", relax.TensorType([k, 8], dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            mm = bb.emit(relax.op.matmul(a, b))
            sm = bb.emit(relax.op.nn.softmax(mm))
            total = bb.emit(relax.op.sum(a, axis=[1]))
            scaled = bb.emit(relax.op.multiply(sm, sm))  # elementwise: stays in its type
            out = bb.emit_output(relax.Tuple([scaled, total]))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, *args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in args])
    return [o.numpy() for o in out]


def test_float16_matmul_softmax_and_sum_match_float32_accumulation():
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (4, 256)).astype(np.float16)
    b = rng.uniform(-1, 1, (256, 8)).astype(np.float16)
    mod, widened = fp32_accumulate(_module("float16"))
    assert widened == 3
    scaled, total = _run(mod, a, b)
    assert scaled.dtype == np.float16 and total.dtype == np.float16
    mm = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16).astype(np.float32)
    e = np.exp(mm - mm.max(axis=1, keepdims=True))
    sm = (e / e.sum(axis=1, keepdims=True)).astype(np.float16)
    np.testing.assert_array_equal(total, a.astype(np.float32).sum(axis=1).astype(np.float16))
    # one rounding of the softmax (compared at float16's own spacing) and the product's own rounding
    np.testing.assert_allclose(scaled.astype(np.float32), (sm * sm).astype(np.float32), rtol=2e-3, atol=1e-6)
    # without the pass a 256-term float16 sum drifts by more than that
    _, plain_total = _run(_module("float16"), a, b)
    exact = a.astype(np.float64).sum(axis=1)
    assert np.abs(total - exact).max() < np.abs(plain_total.astype(np.float64) - exact).max()


def test_float32_graphs_are_unchanged():
    mod = _module("float32")
    out, widened = fp32_accumulate(mod)
    assert widened == 0
    tvm.ir.assert_structural_equal(out, mod)
