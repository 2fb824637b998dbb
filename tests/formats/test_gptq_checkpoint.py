"""AutoGPTQ-layout checkpoints: layout facts, v1/v2 zero points, and the full round trip
qtvm GPTQ -> safetensors -> qtvm compile model.onnx --gptq -> same numbers as the dequantized reference."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.formats import UniformFormat
from qtvm.formats.gptq import gptq_quantize
from qtvm.formats.gptq_checkpoint import GptqCheckpoint, autogptq_tensors, write_autogptq
from qtvm.frontend.quantized import lower_quantized
from qtvm.safetensors import load_safetensors


def test_qweight_and_qzeros_bits_follow_autogptq():
    """Written independently of the packer: AutoGPTQ's pack ORs code j of a word at bit b*j
    (K for qweight, N for qzeros) and stores zero - 1 in v1."""
    k, n = 16, 8
    codes = (np.arange(k * n).reshape(k, n) * 7) % 16
    zeros = np.array([[1, 2, 3, 4, 5, 6, 7, 15]], np.float32)
    qt = _uniform_tensor(codes, np.full((1, n), 0.5, np.float32), zeros, group=None)
    t = autogptq_tensors("l", qt)
    words = t["l.qweight"].view(np.uint32)
    assert words.shape == (2, 8) and t["l.qzeros"].shape == (1, 1)
    for kk in range(k):
        for nn in range(n):
            assert (words[kk // 8, nn] >> (4 * (kk % 8))) & 15 == codes[kk, nn]
    zword = int(t["l.qzeros"].view(np.uint32)[0, 0])
    assert [(zword >> (4 * j)) & 15 for j in range(8)] == [z - 1 for z in zeros[0].astype(int)]
    assert t["l.scales"].dtype == np.float16 and t["l.g_idx"].tolist() == [0] * k
    v2 = int(autogptq_tensors("l", qt, "gptq_v2")["l.qzeros"].view(np.uint32)[0, 0])
    assert [(v2 >> (4 * j)) & 15 for j in range(8)] == zeros[0].astype(int).tolist()


def _uniform_tensor(codes, scales, zeros, group):
    from qtvm.formats.base import QuantizedTensor

    fmt = UniformFormat(4, group)
    k, n = codes.shape
    full = np.zeros((fmt.padded_k(k), n), np.uint32)
    full[:k] = codes
    return QuantizedTensor(fmt, k, n, {"qweight": fmt.pack(full), "scales": scales, "zeros": zeros})


def test_v1_refuses_zero_point_zero():
    qt = _uniform_tensor(np.zeros((8, 8), int), np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32), None)
    with pytest.raises(QtvmError, match="layer 'dense' has zero points of 0.*gptq_v2"):
        autogptq_tensors("dense", qt)
    autogptq_tensors("dense", qt, "gptq_v2")


@pytest.mark.parametrize("bits,group,act_order,k,n", [
    (4, 32, True, 96, 40), (4, 64, False, 200, 24), (3, 32, True, 128, 32), (8, 16, False, 48, 12),
    (2, 32, True, 64, 16), (4, None, False, 72, 8)], ids=str)
def test_round_trip_through_the_reader(tmp_path, bits, group, act_order, k, n):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((4 * k, k)).astype(np.float32)
    qt = gptq_quantize(w, x, UniformFormat(bits, group), act_order=act_order)
    qt = _no_zero_zeros(qt)
    path = write_autogptq(tmp_path / "c.safetensors", {"model.layers.0.fc": qt})
    layer = GptqCheckpoint(path).layer("model.layers.0.fc", k, n)
    assert layer.bits == bits and layer.group_size == group
    ref = qt.dequantize().astype(np.float64)
    got = layer.dequantize_reference()
    # float16 scales: one rounding of each scale (relative 2^-11), nothing else
    assert np.abs(got - ref).max() <= 2 ** -10 * np.abs(ref).max()
    kernel_qt, perm = layer.for_matmul()
    assert (perm is None) == (not act_order)
    xs = rng.standard_normal((3, k))
    lhs = (xs[:, perm] if perm is not None else xs) @ kernel_qt.dequantize().astype(np.float64)
    assert np.abs(lhs - xs @ got).max() <= 1e-5 * np.abs(xs @ got).max()


def _no_zero_zeros(qt):
    """v1 cannot store zero point 0; GPTQ on random weights practically never yields one."""
    assert qt.arrays["zeros"].min() >= 1
    return qt


# -- the round trip through the compiler -----------------------------------------------------------------
def gptq_mlp(k=96, hidden=64, n=40, seed=0):
    """x -> Gemm(transB, node /layers.0/up/Gemm, weight 'onnx::Gemm_7') -> Relu -> MatMul('down.weight')."""
    rng = np.random.default_rng(seed)
    w_up = rng.standard_normal((hidden, k)).astype(np.float32) * 0.1
    w_down = rng.standard_normal((hidden, n)).astype(np.float32) * 0.1
    nodes = [helper.make_node("Gemm", ["x", "onnx::Gemm_7"], ["h"], name="/layers.0/up/Gemm", transB=1),
             helper.make_node("Relu", ["h"], ["hr"], name="/layers.0/act/Relu"),
             helper.make_node("MatMul", ["hr", "model.down.weight"], ["y"], name="/down/MatMul")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
                              [numpy_helper.from_array(w_up, "onnx::Gemm_7"),
                               numpy_helper.from_array(w_down, "model.down.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), w_up.T, w_down


def with_weights(model, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in weights:
            init.CopyFrom(numpy_helper.from_array(weights[init.name].astype(np.float32), init.name))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The MLP, GPTQ-quantized by qtvm (act-order on the Gemm, plain on the MatMul) in AutoGPTQ's layout."""
    tmp = tmp_path_factory.mktemp("gptq")
    model, w_up, w_down = gptq_mlp()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, 96)).astype(np.float32) * rng.uniform(0.2, 3.0, 96).astype(np.float32)
    h = np.maximum(x @ w_up, 0)
    up = _no_zero_zeros(gptq_quantize(w_up, x, UniformFormat(4, 32), act_order=True))
    down = _no_zero_zeros(gptq_quantize(w_down, h, UniformFormat(4, 16)))
    path = write_autogptq(tmp / "model.safetensors",
                          {"model.layers.0.up": up, "model.down": down},
                          extra={"model.embed.weight": np.zeros((4, 4), np.float32)})
    onnx.save(model, str(tmp / "model.onnx"))
    return tmp, model, path


def test_compiled_with_checkpoint_equals_dequantized_reference(checkpoint):
    from qtvm import runtime
    from qtvm.pipeline import compile_model

    tmp, model, path = checkpoint
    result = compile_model(tmp / "model.onnx", tmp / "q.so", "llvm -mcpu=znver3", "none", gptq=path)
    assert result.metadata["prequantized"] == "GPTQ int4-g16-f16 x1, GPTQ int4-g32-f16 x1"  # float16 scales, kept
    assert any("1 float tensors ignored" in n for n in result.notes)
    ck = GptqCheckpoint(path)
    up = ck.layer("model.layers.0.up", 96, 64).dequantize_reference()
    down = ck.layer("model.down", 64, 40).dequantize_reference()
    deq = with_weights(model, {"onnx::Gemm_7": up.T, "model.down.weight": down})
    session = ort.InferenceSession(deq.SerializeToString(), providers=["CPUExecutionProvider"])
    module = runtime.load(result.path)
    for b in (1, 3, 64, 67):
        x = np.random.default_rng(b).standard_normal((b, 96))
        got = module.run({"x": x.astype(np.float32)})["y"]
        ref = np.maximum(x @ up, 0) @ down
        assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
        want = session.run(None, {"x": x.astype(np.float32)})[0]
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_v2_checkpoint_reads_the_same(checkpoint, tmp_path):
    _, model, path = checkpoint
    tensors = load_safetensors(path)
    v1 = GptqCheckpoint(path)
    up = v1.layer("model.layers.0.up", 96, 64)
    for name in [n for n in tensors if n.endswith(".qzeros")]:  # v1 -> v2: add 1 to every packed zero
        codes = np.stack([(tensors[name].view(np.uint32) >> (4 * j)) & 15 for j in range(8)], -1) + 1
        tensors[name] = (codes.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(-1).astype(
            np.uint32).view(np.int32)
    from qtvm.safetensors import save_safetensors

    save_safetensors(tmp_path / "v2.safetensors", tensors, {"checkpoint_format": "gptq_v2"})
    v2 = GptqCheckpoint(tmp_path / "v2.safetensors").layer("model.layers.0.up", 96, 64)
    np.testing.assert_array_equal(v2.zeros, up.zeros)
    np.testing.assert_array_equal(v2.codes, up.codes)


def _broken_checkpoint(checkpoint, tmp_path, edit):
    from qtvm.safetensors import save_safetensors

    _, _, path = checkpoint
    tensors = load_safetensors(path)
    edit(tensors)
    return save_safetensors(tmp_path / "bad.safetensors", tensors, {"checkpoint_format": "gptq"})


def test_mismatches_are_all_named_with_shapes(checkpoint, tmp_path):
    _, model, _ = checkpoint

    def edit(t):
        t["model.down.scales"] = t["model.down.scales"][:, :20]  # wrong N
        t["model.layers.7.gate.qweight"] = np.zeros((12, 64), np.int32)  # matches nothing
        t["model.layers.7.gate.qzeros"] = np.zeros((3, 8), np.int32)
        t["model.layers.7.gate.scales"] = np.zeros((3, 64), np.float16)

    bad = _broken_checkpoint(checkpoint, tmp_path, edit)
    with pytest.raises(QtvmError) as e:
        lower_quantized(model, GptqCheckpoint(bad))
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.down: qweight [8, 40] qzeros [4, 5] scales [4, 20] g_idx [64] do not fit K=64, N=40" in msg
    assert "of ONNX weight 'model.down.weight' [64, 40]" in msg
    assert "model.layers.7.gate (qweight [12, 64] qzeros [3, 8] scales [3, 64]) matches no MatMul/Gemm weight" in msg


def test_missing_tensors_are_named(checkpoint, tmp_path):
    bad = _broken_checkpoint(checkpoint, tmp_path, lambda t: (t.pop("model.down.qzeros"),
                                                               t.pop("model.layers.0.up.scales")))
    with pytest.raises(QtvmError, match="lacks model.down.qzeros, model.layers.0.up.scales"):
        GptqCheckpoint(bad)


def test_name_rule_exact_then_suffix():
    from qtvm.formats.gptq_checkpoint import _match

    candidates = {"onnx::Gemm_7": {"onnx::Gemm_7", "layers.0.up"}, "model.down.weight": {"model.down"},
                  "w": {"w", "layers.1.up"}}
    got = _match(["model.layers.0.up", "model.down", "up", "layers.1.up"], candidates)
    assert got == {"model.layers.0.up": ["onnx::Gemm_7"], "model.down": ["model.down.weight"],
                   "up": ["onnx::Gemm_7", "w"], "layers.1.up": ["w"]}
