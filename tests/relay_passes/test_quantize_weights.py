"""The Relax pass: constant-weight matmuls become packed kernels, others stay float."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

from qtvm.formats import get_format
from qtvm.frontend.onnx import import_onnx
from qtvm.reference import dequantized_model
from relay_passes.quantize_weights import quantize_weights
from tests.conftest import mlp_model, moe_model

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})


@pytest.mark.parametrize("preset", ["int4-g32", "int4-col", "int3-g64", "int8-g128"])
def test_rewrites_gemm_transb_and_matmul(preset):
    model = mlp_model()
    mod, report = quantize_weights(import_onnx(model), get_format(preset), TARGET)
    assert [(layer.k, layer.n) for layer in report.layers] == [(100, 70), (70, 37)]
    assert report.float_matmuls == 1  # x @ x^T
    kernels = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {name.split("_" + preset.replace("-", "_"))[0] for name in kernels if "qmatmul" in name} == \
        {"qmatmul", "qmatmul_gemm"}  # decode GEMV and prefill GEMM, chosen at run time by M
    ex = tvm.compile(mod, target=TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows in (1, 2, 17):  # both sides of the GEMV/GEMM dispatch
        x = np.random.default_rng(rows).standard_normal((rows, 100)).astype(np.float32)
        y, gram = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
        ref = session.run(None, {"x": x})
        assert np.abs(y - ref[0]).max() / np.abs(ref[0]).max() < 1e-5
        np.testing.assert_allclose(gram, ref[1], rtol=1e-5, atol=1e-4)


def test_same_shape_shares_one_kernel():
    model = mlp_model(k=64, hidden=64, n=64)
    mod, report = quantize_weights(import_onnx(model), get_format("int4-g32"), TARGET)
    assert len(report.layers) == 2
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sorted(kernels) == ["qmatmul_gemm_int4_g32_64x64", "qmatmul_int4_g32_64x64"]


# -- the pass asks the target's facts; GPU targets ------------------------------------------
def test_gpu_target_builds_gpu_kernels_on_padded_columns():
    from qtvm.target import parse_target
    from schedules import facts

    cuda = parse_target("cuda -arch=sm_80")
    mod, report = quantize_weights(import_onnx(mlp_model()), get_format("int4-g32"), cuda)
    prims = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {n.split("_int4")[0] for n in prims} == {"qmatmul", "qmatmul_gemm"}
    for func in prims.values():
        assert "threadIdx.x" in func.script()  # scheduled by the GPU family's rules
        assert int(func.attrs["qtvm.format"]["col_block"]) == facts(cuda).col_block == 1
        assert int(func.attrs["qtvm.format"]["n"]) % facts(cuda).col_pad == 0  # 70 and 37 padded to 128, 64
    assert "R.strided_slice" in mod.script()  # y cut back to N
    assert [(layer.k, layer.n) for layer in report.layers] == [(100, 70), (70, 37)]


def test_format_family_a_target_lacks_is_named_with_the_ones_it_has():
    from qtvm.errors import QtvmError
    from schedules.facts import KernelFacts

    facts = KernelFacts(family="test", col_block=1, gemv_max_rows=1, formats=frozenset({"uniform", "e0m4"}))
    with pytest.raises(QtvmError, match=r"bcq3-g128 \(bcq family\) has no kernels for target cuda yet; "
                                        r"formats built for cuda: uniform, e0m4"):
        facts.check_format(get_format("bcq3-g128"), "cuda")
    with pytest.raises(QtvmError, match="--act fp16 has no kernels for target test"):
        facts.check_activations("fp16", "test")


def test_int8_activations_on_a_gpu_fall_back_with_a_note():
    from qtvm.target import parse_target

    _, report = quantize_weights(import_onnx(mlp_model()), get_format("int4-g32"), parse_target("cuda -arch=sm_90"),
                                 activations="int8")
    assert report.fp32_activation_fallbacks and "cuda" in report.fp32_activation_fallbacks[0]


def test_fp16_activations_on_a_gpu_use_the_fp16_gemv_and_tensor_core_gemm():
    from qtvm.target import parse_target

    def kernels(preset, activations):
        mod, report = quantize_weights(import_onnx(mlp_model()), get_format(preset),
                                       parse_target("cuda -arch=sm_90"), activations=activations)
        names = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
        return {n.split("_" + preset.split("-")[0])[0] for n in names if n.startswith("qmatmul")}, report

    names, report = kernels("int4-g32", "fp16")
    assert names == {"qmatmul_f16", "qmatmul_gemm_f16"} and not report.fp32_activation_fallbacks
    assert kernels("int4-g32", "fp32")[0] == {"qmatmul", "qmatmul_gemm"}  # the exact kernels stay the default
    names, report = kernels("int3-g32", "fp16")  # no fp16 unpack: both kernels stay fp32, reported
    assert names == {"qmatmul", "qmatmul_gemm"}
    assert report.fp32_activation_fallbacks and "no fp16 kernel" in report.fp32_activation_fallbacks[0]


def test_fp16_activations_are_named_where_a_target_has_none():
    from qtvm.errors import QtvmError

    with pytest.raises(QtvmError, match="--act fp16 has no kernels for target llvm; use one of: fp32, int8"):
        quantize_weights(import_onnx(mlp_model()), get_format("int4-g32"), TARGET, activations="fp16")


@pytest.mark.parametrize("preset", ["bcq3-g32", "bcq2-g64"])
def test_bcq_gemv_with_int8_activations_runs_the_int16_table_kernel(preset):
    """With ``--act int8`` on AVX-512BW, BCQ decode matmuls take the int16-table LUT kernel
    and prefill keeps the exact GEMM (noted as an fp32 fallback). Where this CPU runs
    AVX-512: decode within the rounding's error of onnxruntime's dequantized model, prefill
    exact; elsewhere the kernel choice is checked and the AVX2 target keeps fp32 tables."""
    from qtvm.hostinfo import host_cpu_flags

    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    model = mlp_model()

    def kinds(target):
        mod, report = quantize_weights(import_onnx(model), get_format(preset), target, activations="int8")
        return mod, report, {str(f.attrs["qtvm.kernel"]) for _, f in mod.functions_items()
                             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "qtvm.kernel" in f.attrs}

    mod, report, found = kinds(avx512)
    assert found == {"lut16_a8_gemv", "qmatmul_gemm"}
    assert sorted(report.fp32_activation_fallbacks) == [
        f"{preset} with K={k}, prefill only (its decode GEMV is int8)" for k in (100, 70)]
    assert kinds(TARGET)[2] == {"lut16_gemv", "qmatmul_gemm"}
    if "avx512bw" not in host_cpu_flags():
        return
    vm = relax.VirtualMachine(tvm.compile(mod, target=avx512), tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows, tol in ((1, 3e-2), (2, 3e-2), (3, 1e-5), (67, 1e-5)):  # GEMV up to gemv_max_rows
        x = np.random.default_rng(rows).standard_normal((rows, 100)).astype(np.float32)
        y, _ = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
        ref = session.run(None, {"x": x})[0]
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err < tol and (tol < 1e-4 or err > 1e-6), (rows, err)  # the decode rows are rounded


@pytest.mark.parametrize("preset", ["bcq3-g32", "bcq2-g64"])
def test_bcq_gemv_runs_the_lut16_kernel(preset):
    """BCQ decode matmuls take the 16-entry LUT kernel (schedules.x86_lut.prefer_lut16);
    prefill keeps the dequantize-once GEMM; both sides match onnxruntime's dequantized model."""
    model = mlp_model()
    mod, _ = quantize_weights(import_onnx(model), get_format(preset), TARGET)
    kinds = {str(f.attrs["qtvm.kernel"]) for _, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "qtvm.kernel" in f.attrs}
    assert kinds == {"lut16_gemv", "qmatmul_gemm"}
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows in (1, 2, 3, 67):
        x = np.random.default_rng(rows).standard_normal((rows, 100)).astype(np.float32)
        y, _ = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x)))
        ref = session.run(None, {"x": x})[0]
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("preset", ["int4-g128", "int3-g32", "e0m4-g64", "bcq3-g128"])
def test_a_weight_quantized_in_column_blocks_is_the_whole_weight_quantized(preset, monkeypatch):
    """A format's quantize holds 3-15x its input; a weight is quantized a block of columns at a
    time, which must give the arrays of the whole (parts: a weight, a transposed one, joined as
    ``combine_matmuls`` joins them; blocks that split a part and N not a multiple of them)."""
    import relay_passes.quantize_weights as qw

    rng = np.random.default_rng(4)
    k = 200  # not a multiple of any group
    w1 = rng.standard_normal((k, 150)).astype(np.float32)
    w2_t = (3 * rng.standard_normal((77, k))).astype(np.float32)  # [N, K], as Gemm transB stores it
    source = [(tvm.runtime.tensor(w1), False), (tvm.runtime.tensor(w2_t), True)]
    whole = np.concatenate([w1, w2_t.T], axis=1)
    np.testing.assert_array_equal(qw.read_weight(source), whole)
    np.testing.assert_array_equal(qw.read_weight(source, 100, 180), whole[:, 100:180])
    fmt = get_format(preset)
    want = fmt.quantize(whole)
    monkeypatch.setattr(qw, "QUANTIZE_BLOCK_BYTES", 4 * k * 64)  # 64-column blocks: 4 of them
    reads, read = [], qw.read_weight
    monkeypatch.setattr(qw, "read_weight", lambda *args: reads.append(args[1:]) or read(*args))
    got = qw.quantize_source(fmt, source)
    assert reads == [(0, 64), (64, 128), (128, 192), (192, 227)]
    assert (got.k, got.n) == (k, 227) and got.arrays.keys() == want.arrays.keys()
    for name in want.arrays:
        np.testing.assert_array_equal(got.arrays[name], want.arrays[name], err_msg=name)


def test_experts_are_quantized_in_column_blocks_as_whole_weights(monkeypatch):
    """Each expert goes through the same column blocks as a dense weight (an expert of Mixtral
    is 235 MB of float32, and bcq3's quantize holds 15x its input): the packed module computes
    what onnxruntime computes on each expert quantized whole."""
    import relay_passes.quantize_weights as qw

    monkeypatch.setattr(qw, "QUANTIZE_BLOCK_BYTES", 4 * 200 * 64)  # K 200: 64-column blocks
    model = moe_model()
    mod, report = quantize_weights(import_onnx(model), get_format("int4-g32"), TARGET)
    assert report.routed == 2
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format("int4-g32"), experts=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((4, 200)).astype(np.float32)
    ids = np.array([0, 2, 1, 2], np.int64)
    want = session.run(None, {"x": x, "ids": ids})[0]
    y = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids)).numpy()
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_are_read_as_float32(dtype):
    """A half precision model's matmul takes its weight through astype to float32
    (fp32_accumulate): the weight is found through it and read exactly, transposed parts too."""
    from relay_passes.quantize_weights import _weight_source, read_weight

    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the high half (truncated)
    exact = (bits.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else w.astype(np.float16).astype(np.float32)
    tensor = tvm.runtime.empty((40, 48), dtype)  # [N, K]: read through permute_dims
    raw = bits.T.copy() if dtype == "bfloat16" else w.astype(np.float16).T.copy()
    tensor.copyfrom(raw) if dtype == "float16" else tensor._create_view((40, 48), "uint16").copyfrom(raw)
    weight = relax.op.astype(relax.op.permute_dims(relax.const(tensor), [1, 0]), "float32")
    assert _weight_source(weight, lambda v: None) is None  # only where the caller packs it
    source = _weight_source(weight, lambda v: None, widened=True)
    assert source is not None and source[0][1]
    np.testing.assert_array_equal(read_weight(source), exact)
    np.testing.assert_array_equal(read_weight(source, 8, 30), exact[:, 8:30])


# -- mixture-of-experts routed matmuls -------------------------------------------------------
@pytest.mark.parametrize("preset", ["int4-g32", "int3-g64", "bcq3-g32"])
def test_routed_experts_are_packed_and_match_onnxruntime(preset):
    """Each expert's weight packed on its own, one kernel per routed matmul; onnxruntime on the
    experts dequantized agrees at several row counts, ids negative too (ONNX's from the end)."""
    model = moe_model()
    mod, report = quantize_weights(import_onnx(model), get_format(preset), TARGET)
    assert report.routed == 2 and report.float_matmuls == 0
    assert [(layer.k, layer.n, layer.experts) for layer in report.layers] == [(200, 70, 3), (70, 200, 3)]
    kernels = {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert sum(name.startswith("qmatmul_experts") for name in kernels) == 2
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    session = ort.InferenceSession(dequantized_model(model, get_format(preset), experts=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    for rows in (1, 2, 9):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, 200)).astype(np.float32)
        ids = rng.integers(-3, 3, rows).astype(np.int64)
        y = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids)).numpy()
        want = session.run(None, {"x": x, "ids": ids})[0]
        assert np.abs(y - want).max() / np.abs(want).max() < 1e-5, rows


def test_routed_experts_with_int8_activations_run_the_int8_kernel():
    """``--act int8`` on x86: a format with the int8 dot runs each row's int8 GEMV by its
    expert (row i is x_hat[i] @ W_hat[ids[i]]); one without it (bcq3) keeps the fp32 routed
    kernel, named in the fallbacks."""
    from tests.kernels import int8_rounded_reference

    model = moe_model()
    mod, report = quantize_weights(import_onnx(model), get_format("int4-g32"), TARGET, activations="int8")
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum(name.startswith("qmatmul_a8_experts") for name in kernels) == 2 and report.routed == 2
    assert not report.fp32_activation_fallbacks
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    fmt = get_format("int4-g32")
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    experts0 = [fmt.quantize(np.ascontiguousarray(w.T)) for w in weights["w0"]]  # stored [N, K] per expert
    experts1 = [fmt.quantize(w) for w in weights["w1"]]  # stored [K, N]
    rng = np.random.default_rng(4)
    for rows in (1, 5):
        x = rng.standard_normal((rows, 200)).astype(np.float32)
        ids = rng.integers(-3, 3, rows).astype(np.int64)
        h = np.concatenate([int8_rounded_reference(x[i:i + 1], fmt, experts0[ids[i]]) for i in range(rows)])
        h = h.astype(np.float32)
        want = np.concatenate([int8_rounded_reference(h[i:i + 1], fmt, experts1[ids[i]]) for i in range(rows)])
        y = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids)).numpy()
        assert np.abs(y - want).max() / np.abs(want).max() < 1e-4, rows
    _, report = quantize_weights(import_onnx(model), get_format("bcq3-g32"), TARGET, activations="int8")
    assert report.routed == 2 and any("mixture-of-experts" in note and "bcq3-g32" in note
                                      for note in report.fp32_activation_fallbacks)


def test_routed_experts_stay_float_in_a_composite_format():
    """Mixed precision ranks rows per matrix (a kernel of its own per part): the experts stay
    float, counted as float matmuls."""
    _, report = quantize_weights(import_onnx(moe_model()), get_format("mixed-2-4-16"), TARGET)
    assert report.routed == 0 and report.float_matmuls == 2 and not report.layers


@pytest.mark.parametrize("target", ["cuda -arch=sm_80", "opencl -device=mali"])
def test_routed_experts_on_a_gpu_run_the_gpu_layout_on_padded_columns(target):
    """GPU targets: one column a stored block, N padded to the column tile and sliced after,
    the lane chunk of the target's GEMV; the scheduled kernel is tested on PoCL
    (tests/schedules/test_gpu_gemv.py)."""
    from qtvm.target import parse_target
    from schedules import facts

    tgt = parse_target(target)
    mod, report = quantize_weights(import_onnx(moe_model()), get_format("int4-g32"), tgt)
    assert report.routed == 2
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    routed = [f for name, f in kernels.items() if name.startswith("qmatmul_experts")]
    assert len(routed) == 2
    for func in routed:
        desc = func.attrs["qtvm.format"]
        assert "threadIdx.x" in func.script() and int(desc["col_block"]) == 1
        assert int(desc["n"]) % facts(tgt).col_pad == 0 and "chunk" in desc
