"""Lifted weights: the same numbers as constants, each weight once, the metadata untouched."""
import numpy as np
import pytest
import tvm
from tvm import relax

from qtvm.deploy.weights import PARAM_PREFIX, weight_index
from relay_passes.lift_weights import lift_weights


def _module(k=96, n=80, seed=0):
    """main calls a private-looking helper that reads w1; main reads w0 and w1; small bias stays."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((k, n)).astype("float32")
    w1 = rng.standard_normal((n, n)).astype("float32")
    bias = rng.standard_normal((n,)).astype("float32")  # 320 bytes: below MIN_BYTES
    c0, c1 = relax.const(w0), relax.const(w1)
    m = tvm.tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    y = relax.Var("y", relax.TensorType([m, n], "float32"))
    with bb.function("helper", [y]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(y, c1)))
        bb.emit_func_output(out)
    helper = bb.get().get_global_var("helper")
    x = relax.Var("x", relax.TensorType([m, k], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(relax.op.matmul(x, c0), relax.const(bias)))
            h = bb.emit(relax.Call(helper, [h]))
            out = bb.emit_output(bb.emit(relax.op.matmul(h, c1)))
        bb.emit_func_output(out)
    meta = np.frombuffer(b"{" + b" " * 8000 + b"}", dtype=np.uint8)  # a large constant that stays
    with bb.function("qtvm_metadata", []):
        bb.emit_func_output(relax.const(meta))
    return bb.get(), (w0, w1, bias)


def _run(ex, name, *args):
    return relax.VirtualMachine(ex, tvm.cpu())[name](*args)


@pytest.mark.parametrize("rows", [1, 5])
def test_lifted_weights_compute_what_the_constants_did(rows):
    mod, (w0, w1, bias) = _module()
    lifted = []

    @tvm.transform.module_pass(opt_level=0)
    def lift(m, _ctx):
        m, weights = lift_weights(m, keep=("qtvm_metadata",))
        lifted.extend(weights)
        return m

    pipeline = tvm.transform.Sequential([relax.get_pipeline("default"), lift])
    ex = tvm.compile(mod, target="llvm", relax_pipeline=pipeline)
    assert sorted(w.numpy().nbytes for w in lifted) == sorted([w0.nbytes, w1.nbytes])  # w1 once, bias stays
    vm = relax.VirtualMachine(ex, tvm.cpu())
    arity = int(vm.module["get_function_arity"]("main"))
    names = [vm.module["get_function_param_name"]("main", i) for i in range(arity)]
    assert names[0] == "x" and all(n.startswith(PARAM_PREFIX) for n in names[1:]) and len(names) == 3
    weights = [lifted[weight_index(n)] for n in names[1:]]
    x = np.random.default_rng(rows).standard_normal((rows, w0.shape[0])).astype("float32")
    got = vm["main"](tvm.runtime.tensor(x), *weights).numpy()
    h = x @ w0 + bias
    want = (h @ w1) @ w1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert int(vm.module["get_function_arity"]("qtvm_metadata")) == 0
    assert vm["qtvm_metadata"]().numpy().nbytes == 8002


def test_nothing_is_lifted_when_the_metadata_would_need_weights():
    mod, _ = _module()
    out, weights = lift_weights(mod, keep=("main",))  # main reads weights: kept functions may not
    assert weights == [] and out.same_as(mod)


def test_weight_index_reads_only_its_own_names():
    assert weight_index(f"{PARAM_PREFIX}12") == 12
    assert weight_index("x") is None and weight_index(PARAM_PREFIX) is None
    assert weight_index(f"{PARAM_PREFIX}1a") is None


def test_equal_tensors_made_apart_are_one_weight():
    """Every layer's zero points are often the same values in tensors of their own."""
    w = np.arange(64 * 32, dtype="float32").reshape(64, 32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 64], "float32"))
    with bb.function("main", [x]):
        a = bb.emit(relax.op.matmul(x, relax.const(w)))
        b = bb.emit(relax.op.matmul(x, relax.const(w.copy())))
        c = bb.emit(relax.op.matmul(x, relax.const(w + 1)))
        bb.emit_func_output(bb.emit(relax.op.add(relax.op.add(a, b), c)))
    out, weights = lift_weights(bb.get())
    assert len(weights) == 2
    assert [p.name for p in out["main"].params] == ["x", f"{PARAM_PREFIX}0", f"{PARAM_PREFIX}1"]
    ex = tvm.compile(out, target="llvm")
    xv = np.ones((2, 64), "float32")
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xv), *weights).numpy()
    np.testing.assert_allclose(got, xv @ w * 2 + xv @ (w + 1), rtol=1e-6)
