"""Matmuls sharing an input run as one: the graph rule on its own, the formats that allow it,
and whole models compiled with and without it (the same outputs bit for bit)."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from qtvm.formats import PRESETS
from relay_passes.combine_matmuls import combine_matmuls
from relay_passes.quantize_weights import MATMUL
from tests.gpu import needs_opencl

LLVM = tvm.target.Target({"kind": "llvm"})


def _count_matmuls(mod) -> int:
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(
        isinstance(e, relax.Call) and e.op == MATMUL))
    return sum(found)


def _graph(rng):
    """x -> three matmuls (one weight through permute_dims, one member a dataflow output),
    one by a different K, one by a computed weight; y -> one matmul (nothing to share)."""
    w1 = rng.standard_normal((64, 48)).astype(np.float32)
    w2 = rng.standard_normal((64, 16)).astype(np.float32)
    w3_t = rng.standard_normal((40, 64)).astype(np.float32)  # [N, K]: Gemm transB's form
    w4 = rng.standard_normal((48, 8)).astype(np.float32)
    w5 = rng.standard_normal((64, 8)).astype(np.float32)
    s = tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([2, s, 64], "float32"))
    y = relax.Var("y", relax.TensorType([s, 64], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.const(w1)))
            t = bb.emit(relax.op.permute_dims(relax.const(w3_t), [1, 0]))
            b = bb.emit(relax.op.multiply(a, a))
            c = bb.emit(relax.op.matmul(x, t))
            d = bb.emit_output(relax.op.matmul(x, relax.const(w2)))
            e = bb.emit(relax.op.matmul(b, relax.const(w4)))  # a's output: K = 48, its own input
            computed = bb.emit(relax.op.add(relax.const(w5), relax.const(w5)))
            f = bb.emit(relax.op.matmul(x, computed))  # not a constant weight
            g = bb.emit(relax.op.matmul(y, relax.const(w5)))
            out = bb.emit_output(relax.op.concat([b, c, f], axis=2))
        bb.emit_func_output(relax.Tuple([out, d, e, g]))
    return bb.get()


def _run(mod, *args):
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in args])]


def test_members_become_slices_of_one_matmul():
    rng = np.random.default_rng(0)
    mod = _graph(rng)
    new, groups = combine_matmuls(mod)
    assert groups == [[48, 40, 16]]  # x's three constant weights, in binding order
    assert _count_matmuls(mod) == 6 and _count_matmuls(new) == 4  # e, f and g stay
    assert _constant_pointers(new) <= _constant_pointers(mod)  # the members' weights, not a copy
    for s in (1, 5):
        x = rng.standard_normal((2, s, 64)).astype(np.float32)
        y = rng.standard_normal((s, 64)).astype(np.float32)
        for got, want in zip(_run(new, x, y), _run(mod, x, y)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_nothing_to_combine_leaves_the_module():
    rng = np.random.default_rng(1)
    x = relax.Var("x", relax.TensorType([3, 32], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((32, 8)).astype(np.float32))))
            b = bb.emit_output(relax.op.matmul(a, relax.const(rng.standard_normal((8, 4)).astype(np.float32))))
        bb.emit_func_output(b)
    mod = bb.get()
    new, groups = combine_matmuls(mod)
    assert groups == [] and new.same_as(mod)


def test_formats_that_allow_it_quantize_columns_alone():
    """The property the rule rests on, for every preset that claims it (and mixed-2-4-16,
    which ranks whole rows across columns, does not claim it)."""
    rng = np.random.default_rng(2)
    w1 = rng.standard_normal((300, 40)).astype(np.float32)  # K not a multiple of any group
    w2 = (3 * rng.standard_normal((300, 24))).astype(np.float32)
    claiming = [name for name, fmt in PRESETS.items() if fmt.columns_independent]
    assert "mixed-2-4-16" not in claiming and {"int4-g128", "int3-g128", "bcq3-g128", "e0m4-g128"} <= set(claiming)
    for name in claiming:
        fmt = PRESETS[name]
        both = fmt.quantize(np.concatenate([w1, w2], axis=1))
        apart = [fmt.quantize(w1), fmt.quantize(w2)]
        dequantized = np.concatenate([qt.dequantize() for qt in apart], axis=1)
        np.testing.assert_array_equal(both.dequantize(), dequantized, err_msg=name)
        # and stored side by side (what quantize_weights' column blocks rest on)
        assert both.arrays.keys() == apart[0].arrays.keys(), name
        for array in both.arrays:
            joined = np.concatenate([qt.arrays[array] for qt in apart], axis=-1)
            np.testing.assert_array_equal(both.arrays[array], joined, err_msg=f"{name} {array}")


def _gpu_kernels(target):
    """(name, func(fmt, k, n), rows) of the GPU kernels a combined layer runs under ``target``
    (the fp16 GEMV where the format has one)."""
    from qtvm import ops
    from qtvm.ops_gemm import qmatmul_gemm_func
    from qtvm.target import parse_target
    from schedules import facts
    from tests.gpu import scheduled

    f = facts(target)
    yield "gemv", lambda fmt, k, n: scheduled(ops.qmatmul_func(fmt, k, n, f.col_block, **f.gemv_options(fmt, k)),
                                              target), (1, 3)
    yield "gemm", lambda fmt, k, n: scheduled(qmatmul_gemm_func(fmt, k, n, f.col_block), target), (5, 33)
    # CUDA's fp16 decode calls a CUDA intrinsic PoCL cannot run: the same rule for plain OpenCL
    f16_target = parse_target("opencl") if target.kind.name == "cuda" else target
    yield "gemv --act fp16", lambda fmt, k, n: scheduled(ops.qmatmul_f16_func(fmt, k, n, 1, **f.gemv_options(fmt, k)),
                                                         f16_target), (1, 3)


@needs_opencl
@pytest.mark.parametrize("device", ["cuda", "mali"])
@pytest.mark.parametrize("preset", ["int4-g128", "int3-g128", "e0m4-g128", "bcq3-g128", "int8-g32-f16"])
def test_gpu_kernels_compute_each_column_alone(device, preset):
    """What lets the pass run for GPU targets: the CUDA and OpenCL rules' decode GEMVs (fp32
    and fp16 activations) and prefill GEMM (on PoCL, half spelled float) give a column of
    ``x @ [W1 | W2]`` bit for bit as ``x @ W1`` or ``x @ W2`` does (a column's sum order
    follows K alone). Awkward widths: N not a multiple of a block's columns, K not of the group."""
    from qtvm.formats import get_format
    from qtvm.target import parse_target
    from schedules import facts
    from tests.gpu import blocked, run_on_pocl

    target = parse_target("cuda -arch=sm_80" if device == "cuda" else "opencl -device=mali")
    fmt, k, widths = get_format(preset), 300, (37, 70)
    rng = np.random.default_rng(4)
    parts = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
    whole = fmt.quantize(np.concatenate(parts, axis=1))
    for name, make, rows in _gpu_kernels(target):
        if name.endswith("fp16") and not facts(target).f16_activations(fmt, k):  # int3, BCQ: none
            continue
        half = "-f16" in preset or name.endswith("fp16")  # PoCL has no cl_khr_fp16: half spelled float
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            both = run_on_pocl(make(fmt, k, sum(widths)), x, blocked(whole), sum(widths), half_as_float=half)
            apart = np.concatenate([run_on_pocl(make(fmt, k, n), x, blocked(fmt.quantize(w)), n, half_as_float=half)
                                    for n, w in zip(widths, parts)], axis=1)
            np.testing.assert_array_equal(both, apart, err_msg=f"{name} m={m}")


def _outputs(path, bindings):
    from qtvm import runtime
    from tests.frontend.transformers_exports import feeds

    module = runtime.load(path)
    return [module.run(feeds(module.inputs, *b)) for b in bindings]


@pytest.mark.parametrize("quant,act", [("int4-g128", "int8"), ("int3-g128", "fp32"), ("bcq3-g128", "int8")])
def test_llama_kv_export_same_outputs_bit_for_bit(hf_model, tmp_path, quant, act):
    """A transformers LLaMA with a cache (q/k/v and gate/up share inputs): main at several
    (batch, seq, past) and 20 greedy tokens through the in-place step, with and without."""
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    path = hf_model("llama", "dynamo", kv=True)
    built = {c: compile_model(path, tmp_path / f"{c}.so", "host", quant, act, combine=c) for c in (True, False)}
    assert len(built[True].metadata["combined_matmuls"]) == 4  # 2 layers x (q/k/v, gate/up)
    assert any("sharing an input" in n for n in built[True].notes)
    assert "combined_matmuls" not in built[False].metadata
    bindings = [(1, 1, 0), (1, 1, 9), (2, 3, 4), (1, 17, 0), (2, 5, 0)]
    for got, want in zip(_outputs(built[True].path, bindings), _outputs(built[False].path, bindings)):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    prompt = np.array([[3, 141, 59, 26, 53]], np.int64)
    tokens = [runtime.load(built[c].path).generate(prompt, 20) for c in (True, False)]
    np.testing.assert_array_equal(tokens[0], tokens[1])


def test_mixed_precision_declines(tiny_llama_path, tmp_path):
    from qtvm.describe import summary
    from qtvm.pipeline import build_module

    _, meta, _, notes = build_module(tiny_llama_path, "llvm", "mixed-2-4-16")
    assert "combined_matmuls" not in meta and not any("sharing an input" in n for n in notes)
    _, meta, _, _ = build_module(tiny_llama_path, "llvm", "int4-g128")
    assert meta["combined_matmuls"] == [[256, 64, 64], [704, 704], [256, 64, 64], [704, 704]]
    assert meta["quantized_matmuls"] == 15  # the model's matmuls, run as 9 kernels
    assert len(meta["layers"]) and sum(row["count"] for row in meta["layers"]) == 9
    assert "10 matmuls sharing an input as 4 kernels: N = 256+64+64 (x2), 704+704 (x2)" in summary(meta)


def _constant_pointers(mod) -> set[int]:
    found = set()
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.add(e.value.data_ptr())
                                    if isinstance(e, tvm.ir.expr.Constant) and isinstance(e.value, tvm.runtime.Tensor)
                                    else None)
    return found


def test_quantizing_reads_the_combined_weight_and_leaves_no_concat():
    """The combined weight is a concat of the members' constants (joined here, every combined
    weight was a second copy held until the packing ended); the quantizer packs it as the
    joined matrix and nothing of it (the concat, a member's transpose) is left to run."""
    from relay_passes.quantize_weights import quantize_weights

    rng = np.random.default_rng(3)
    mod = _graph(rng)
    new, groups = combine_matmuls(mod)
    assert groups == [[48, 40, 16]]
    fmt = PRESETS["int4-g128"]
    packed, report = quantize_weights(new, fmt, LLVM)
    alone, _ = quantize_weights(mod, fmt, LLVM)
    text = packed.script()
    assert "R.concat(" in text and "R.permute_dims(" not in text  # only the model's own concat of b, c, f
    assert text.count("R.concat(") == mod.script().count("R.concat(")
    assert sorted((layer.k, layer.n) for layer in report.layers) == [(48, 8), (64, 8), (64, 104)]  # f's weight is computed
    for s in (1, 3):
        x = rng.standard_normal((2, s, 64)).astype(np.float32)
        y = rng.standard_normal((s, 64)).astype(np.float32)
        for got, want in zip(_run(packed, x, y), _run(alone, x, y)):
            np.testing.assert_array_equal(got, want)  # columns quantized alone: bit for bit
