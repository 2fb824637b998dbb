"""If branches as functions of their own: TVM's memory planner cannot lend their storage past
the If (it did: the VM segfaulted on either path)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from relay_passes.outline_branches import is_branch_function, outline_branches

ROOT = Path(__file__).resolve().parents[2]


def _module(dtype: str = "float32") -> tuple[tvm.IRModule, list[np.ndarray]]:
    """out = (If(flag, cast(tanh(exp(x) @ w1)), 0), cast(tanh(exp(x) @ w2))), x of ``dtype``, the
    branch's chain computed in float32 (as fp32_accumulate writes a float16 one): the branch's
    exp and matmul storages are free when the same-sized ones after the If are asked for."""
    rng = np.random.default_rng(1)
    ws = [rng.standard_normal((16, 8)).astype("float32") for _ in range(2)]
    x = relax.Var("x", relax.TensorType([2, 16], dtype))
    flag = relax.Var("flag", relax.TensorType([], "bool"))

    def chain(w, emit):
        wide = emit(relax.op.astype(x, "float32")) if dtype != "float32" else x
        y = emit(relax.op.tanh(emit(relax.op.matmul(emit(relax.op.exp(wide)), relax.const(w)))))
        return emit(relax.op.astype(y, dtype)) if dtype != "float32" else y

    bindings = []

    def bind(expr):
        var = relax.Var(f"b{len(bindings)}", None)
        bindings.append(relax.VarBinding(var, expr))
        return var

    bb = relax.BlockBuilder()
    with bb.function("main", [x, flag]):
        branch_out = chain(ws[0], bind)
        branch = bb.normalize(relax.SeqExpr([relax.BindingBlock(bindings)], branch_out))
        zero = bb.emit(relax.op.zeros(relax.ShapeExpr([2, 8]), dtype))
        chosen = bb.emit(relax.If(flag, branch, zero))
        bb.emit_func_output(relax.Tuple([chosen, chain(ws[1], bb.emit)]))
    return bb.get(), ws


def _run(dtype: str, outline: bool) -> dict:
    """Compiled and run on both paths (in a child process: the unplanned module crashes)."""
    mod, ws = _module(dtype)
    if outline:
        mod, _ = outline_branches(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(dtype)
    outs = {str(flag): [o.numpy().astype("float32").tolist() for o in vm["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(flag)))] for flag in (True, False)}
    return {"outs": outs, "x": x.astype("float32").tolist()}


def _in_child(dtype: str, outline: bool) -> subprocess.CompletedProcess:
    code = (f"import json; from tests.relay_passes.test_outline_branches import _run; "
            f"print(json.dumps(_run({dtype!r}, {outline})))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_branch_made_a_function_runs_both_paths(dtype):
    mod, ws = _module(dtype)
    out, count = outline_branches(mod)
    assert count == 1
    branch = next(f for gv, f in out.functions_items() if gv.name_hint == "main_if1_then")
    assert [gv.name_hint for gv in out.functions if is_branch_function(gv.name_hint)] == ["main_if1_then"]
    assert "R.matmul" in branch.script() and "R.matmul" in out["main"].script()  # the one after the If stays
    run = _in_child(dtype, outline=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    x = np.asarray(got["x"], np.float32)
    want = [np.tanh(np.exp(x) @ w) for w in ws]
    tol = 1e-5 if dtype == "float32" else 2e-3
    for flag, first in (("True", want[0]), ("False", np.zeros((2, 8)))):
        chosen, after = (np.asarray(o) for o in got["outs"][flag])
        np.testing.assert_allclose(chosen, first, atol=tol)
        np.testing.assert_allclose(after, want[1], atol=tol)


def test_tvm_still_lends_a_branch_storage_past_its_if():
    """Why the pass exists: the same module unoutlined crashes TVM 0.27's VM. If this fails, TVM's
    planner was fixed and ``outline_branches`` may go."""
    run = _in_child("float32", outline=False)
    assert run.returncode != 0 and "AllocTensor" in run.stderr, run.stderr[-2000:]


def test_a_branch_that_binds_nothing_stays():
    """A branch that only names a value is not worth a call."""
    x = relax.Var("x", relax.TensorType([2, 16], "float32"))
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, flag]):
        y = bb.emit(relax.op.exp(x))
        kept = bb.emit(relax.If(flag, relax.SeqExpr([], x), relax.SeqExpr([], y)))
        bb.emit_func_output(kept)
    mod = bb.get()
    out, count = outline_branches(mod)
    assert count == 0 and out.same_as(mod)


def test_a_branch_reading_a_shape_bound_outside_gets_it_as_an_argument():
    """n comes from the outer function's match_cast: the branch's function takes it (TVM's
    free_vars lists it), and both paths compute what they did."""
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    n = tvm.tirx.Var("n", "int64")
    s = relax.Var("s", relax.TensorType(None, "float32", ndim=1))
    bb = relax.BlockBuilder()
    with bb.function("main", [s, flag]):
        sized = bb.match_cast(s, relax.TensorType([n], "float32"))
        z = relax.Var("z", None)
        branch = bb.normalize(relax.SeqExpr([relax.BindingBlock([relax.VarBinding(
            z, relax.op.exp(relax.op.zeros(relax.ShapeExpr([n]), "float32")))])], z))
        bb.emit_func_output(bb.emit(relax.If(flag, branch, sized)))
    out, count = outline_branches(bb.get())
    assert count == 1 and "main_if1_then(n)" in out["main"].script()
    vm = relax.VirtualMachine(tvm.compile(out, target="llvm"), tvm.cpu())
    x = np.arange(5, dtype="float32")
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(True))).numpy(),
                                  np.ones(5, np.float32))
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(False))).numpy(), x)
