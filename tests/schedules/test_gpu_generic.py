"""The ops around the kernels on GPU targets: every function of the bundled model that
``schedules/gpu_generic.py`` schedules, run on PoCL against the same function unscheduled
on the CPU, with the symbolic dims (batch, seq) bound to 1, 3, 64 and 67."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from qtvm.formats.mixed import SPARSE_ATTR
from qtvm.pipeline import build_module
from qtvm.testing import opencl
from qtvm.testing.differential import compare_on_opencl
from schedules import gpu_generic
from tests.gpu import SM80, needs_opencl


@pytest.fixture(scope="module")
def modules(tiny_llama_path):
    mod, *_ = build_module(tiny_llama_path, SM80, "mixed-2-4-16")  # the format with the most kernel kinds
    return gpu_generic.legalize_and_fuse(mod, SM80), gpu_generic.schedule_generic_ops(mod, SM80)


def _outputs_per_function(mod) -> dict[str, int]:
    """call_tir's output count for each PrimFunc (outputs are its last parameters)."""
    counts = {}

    def visit(e):
        if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir"):
            counts[e.args[0].name_hint] = len(e.ty.fields) if isinstance(e.ty, relax.TupleType) else 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return counts


def test_every_function_is_scheduled_and_metadata_kept(modules):
    _, scheduled = modules
    names = {gv.name_hint for gv in scheduled.get_global_vars()}
    assert "qtvm_metadata" in names and "main" in names
    prims = {gv.name_hint: f for gv, f in scheduled.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert all(gpu_generic.is_scheduled(f) for f in prims.values()), \
        sorted(n for n, f in prims.items() if not gpu_generic.is_scheduled(f))
    assert any("outliers" in n for n in prims)  # mixed-2-4-16's CSR term, scheduled by gpu_sparse


@needs_opencl
def test_scheduled_functions_match_unscheduled_on_opencl(modules):
    fused, scheduled = modules
    outputs = _outputs_per_function(scheduled)
    checked, failures = 0, {}
    fused_names = {gv.name_hint for gv in fused.get_global_vars()}
    for gv, func in scheduled.functions.items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc) or name not in fused_names:
            continue
        reference = fused[name]
        if gpu_generic.is_scheduled(reference) or SPARSE_ATTR in (func.attrs or {}):
            continue  # qtvm kernels, the row scan, the CSR outliers: tested on their own
        result = compare_on_opencl(func, reference, outputs.get(name, 1), name=name)
        checked += 1
        if not result.worst <= 2e-6:
            failures[name] = result.errors
    assert checked >= 20 and not failures, failures


@needs_opencl
def test_cumsum_row_scan():
    """Positions are a cumsum of ones: the row scan that replaces TVM's GPU scan."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3, n], "int64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.cumsum(x, axis=2))
        bb.emit_func_output(out)
    mod = gpu_generic.schedule_generic_ops(bb.get(), SM80)
    (func,) = [f for gv, f in mod.functions.items() if gv.name_hint.startswith("row_cumsum")]
    rng = np.random.default_rng(0)
    for length in (1, 67, 700):
        a = rng.integers(0, 5, (6, length)).astype(np.int64)  # [2, 3, n] as rows
        got = np.full_like(a, -1)
        opencl.build(func).run(a, got)
        np.testing.assert_array_equal(got, np.cumsum(a, axis=1))


def test_other_targets_untouched(tiny_llama_path):
    mod, *_ = build_module(tiny_llama_path, tvm.target.Target({"kind": "llvm"}), "none")
    assert gpu_generic.schedule_generic_ops(mod, tvm.target.Target({"kind": "llvm"})).same_as(mod)


@needs_opencl
def test_shape_values_from_the_importer_are_bound_to_threads(tmp_path):
    """A dim used as data (x + float(seq)) is computed by the importer's
    ``qtvm_shape_values*`` function, marked scheduled for the CPU: on a GPU its loop must be
    bound (unbound, the host would write device memory); run on PoCL at seq = 1, 3, 64, 67."""
    import onnx
    from onnx import TensorProto, helper

    from qtvm.pipeline import build_module

    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "one"], ["g"], axis=0),
             helper.make_node("Cast", ["g"], ["c"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "c"], ["y"])]
    graph = helper.make_graph(nodes, "shape_as_data",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    path = tmp_path / "shape_as_data.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    mod, *_ = build_module(path, SM80, "none")
    values = {gv.name_hint: f for gv, f in mod.functions.items() if gv.name_hint.startswith("qtvm_shape_values")}
    assert values and not any(gpu_generic.binds_threads(f) for f in values.values())
    scheduled = gpu_generic.schedule_generic_ops(mod, SM80)
    prims = {gv.name_hint: f for gv, f in scheduled.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert all(gpu_generic.binds_threads(f) for f in prims.values()), sorted(prims)
    for name, reference in values.items():
        assert compare_on_opencl(prims[name], reference, name=name).worst == 0.0


@needs_opencl
def test_max_and_softmax_of_minus_inf_rows_on_opencl():
    """Float max/min start from -inf/+inf on GPUs too (schedules/numerics.py): a row of -inf
    has max -inf, +inf rows min +inf, and dlight's cross-thread reductions (softmax over a
    symbolic length, max/min over a constant 200, not a multiple of the threads) still lower
    with those identities. Each scheduled function runs on PoCL against numpy at several lengths."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3, n], "float32"))
    z = relax.Var("z", relax.TensorType([n, 200], "float32"))
    with bb.function("main", [x, z]):
        with bb.dataflow():
            soft = bb.emit_output(relax.op.nn.softmax(x, axis=1))
            top = bb.emit_output(relax.op.max(z, axis=[1]))
            low = bb.emit_output(relax.op.min(z, axis=[1]))
        bb.emit_func_output(relax.Tuple([soft, top, low]))
    mod = gpu_generic.schedule_generic_ops(bb.get(), SM80)
    prims = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert sorted(prims) == ["max", "min", "softmax"]
    assert "T.float32(\"-inf\")" in prims["max"].script() and "T.float32(\"inf\")" in prims["min"].script()
    rng = np.random.default_rng(0)
    for length in (1, 67, 300):
        xs = rng.standard_normal((3, length)).astype(np.float32)
        xs[1] = -np.inf
        got = np.full_like(xs, -1.0)
        opencl.build(prims["softmax"]).run(xs, got)
        with np.errstate(invalid="ignore"):
            e = np.exp(xs - xs.max(axis=1, keepdims=True))
            np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), rtol=1e-6)  # NaN row as numpy
        zs = rng.standard_normal((length, 200)).astype(np.float32)
        zs[0], zs[-1] = -np.inf, np.inf
        for name, ref in (("max", zs.max(axis=1)), ("min", zs.min(axis=1))):
            out = np.full((length,), np.nan, np.float32)
            opencl.build(prims[name]).run(zs, out)
            np.testing.assert_array_equal(out, ref)


def test_empty_concat_operands_are_dropped():
    """concat((a, empty)) is a, concat((a, empty, b)) is concat((a, b)): the rewrite the GPU
    legalization runs first (an empty operand's zero-extent copy loop broke dlight's fallback)."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, n, 16], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            empty = bb.emit(relax.op.strided_slice(x, axes=[2], begin=[16], end=[16]))
            alone = bb.emit(relax.op.concat([x, empty], axis=-1))
            pair = bb.emit(relax.op.concat([alone, empty, x], axis=2))
            out = bb.emit_output(relax.op.add(pair, pair))
        bb.emit_func_output(out)
    before = bb.get()
    mod = gpu_generic._without_empty_concat_operands(before)
    script = mod["main"].script()
    assert "strided_slice" not in script and script.count("R.concat") == 1, script
    a = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    got, want = (tvm.relax.VirtualMachine(tvm.compile(m, "llvm"), tvm.cpu())["main"](tvm.runtime.tensor(a)).numpy()
                 for m in (mod, before))
    np.testing.assert_array_equal(got, want)
    assert got.shape == (2, 5, 32)


@needs_opencl
def test_phi3_rotary_with_an_empty_pass_through_builds_for_gpus(hf_model):
    """Phi-3 (legacy export) rotates the whole head and concatenates the empty rest
    ([batch, heads, seq, 0]): its CUDA and OpenCL builds failed with TVM's 'Divide by zero'
    inside dlight. Now every function is scheduled, and the rotary's fused functions (where
    the concat was) match their unscheduled selves on PoCL at seq 1, 3, 64, 67."""
    mod, *_ = build_module(hf_model("phi3", "legacy"), SM80, "int4-g128")
    fused, scheduled = gpu_generic.legalize_and_fuse(mod, SM80), gpu_generic.schedule_generic_ops(mod, SM80)
    prims = {gv.name_hint: f for gv, f in scheduled.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert all(gpu_generic.is_scheduled(f) for f in prims.values())
    fused_names = {gv.name_hint for gv in fused.get_global_vars()}
    rotary = [name for name in prims if "concatenate" in name and name in fused_names]
    assert rotary
    outputs = _outputs_per_function(scheduled)
    for name in rotary:
        assert compare_on_opencl(prims[name], fused[name], outputs.get(name, 1), name=name).worst <= 2e-6, name
