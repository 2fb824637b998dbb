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


def test_one_float32_copy_of_an_input_per_block():
    """q, k and v read one float32 copy of their input (combine_matmuls groups matmuls by
    input); a copy made in an If branch's block is not reused outside it."""
    rng = np.random.default_rng(1)
    ws = [rng.standard_normal((16, 8)).astype("float16") for _ in range(4)]
    x = relax.Var("x", relax.TensorType([2, 16], "float16"))
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    t = relax.Var("t", relax.TensorType([2, 8], "float16"))
    branch = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(t, relax.op.matmul(x, relax.const(ws[2])))])], t)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, flag]):
        q = bb.emit(relax.op.matmul(x, relax.const(ws[0])))
        k = bb.emit(relax.op.matmul(x, relax.const(ws[1])))
        chosen = bb.emit(relax.If(flag, branch, q))
        v = bb.emit(relax.op.matmul(x, relax.const(ws[3])))
        bb.emit_func_output(relax.Tuple([q, k, chosen, v]))
    mod, changed = fp32_accumulate(bb.get())
    assert changed == 4
    text = mod["main"].script()
    assert text.count('R.astype(x, dtype="float32")') == 2  # the outer block's, the branch's
    branch_text = text[text.index("if flag:"):text.index("else:")]
    assert 'R.astype(x, dtype="float32")' in branch_text  # its own copy, not the outer one
    # (running this module crashes TVM's VM, as it did before copies were shared: not run here)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        outs = [bb.emit(relax.op.matmul(x, relax.const(w))) for w in ws[:3]]
        bb.emit_func_output(relax.Tuple(outs))
    mod, changed = fp32_accumulate(bb.get())
    assert changed == 3 and mod["main"].script().count("R.astype(x,") == 1
    xv = rng.standard_normal((2, 16)).astype("float16")
    got = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(xv))
    for out, w in zip(got, ws):
        want = (xv.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
        np.testing.assert_array_equal(out.numpy(), want)
