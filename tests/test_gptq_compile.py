"""`qtvm compile --quant gptq:<preset> --calib FILE`: GPTQ codes in the artefact."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.formats.gptq import gptq_quantize
from qtvm.pipeline import compile_model

K, H, N = 160, 96, 48  # K not a multiple of the group (64)


def _mlp(path):
    """x @ W1 -> Relu -> Gemm(transB) with W2 stored [N, H]."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((K, H)) * 0.1).astype(np.float32)
    w2t = (rng.standard_normal((N, H)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2", transB=1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2t, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    return w1, np.ascontiguousarray(w2t.T)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq")
    w1, w2 = _mlp(d / "mlp.onnx")
    # Correlated calibration activations (where GPTQ differs from round-to-nearest).
    rng = np.random.default_rng(1)
    calib = (rng.standard_normal((96, 8)) @ rng.standard_normal((8, K)) + 0.1 * rng.standard_normal((96, K)))
    np.save(d / "calib.npy", calib.astype(np.float32))
    return d, w1, w2, calib.astype(np.float32)


def _run(path, x):
    import qtvm.runtime

    return qtvm.runtime.load(str(path)).run({"x": x})["y"]


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_artefact_runs_the_gptq_codes(setup, act):
    d, w1, w2, calib = setup
    fmt = get_format("int4-g64")
    out = d / f"mlp_{act}.so"
    result = compile_model(d / "mlp.onnx", out, "host", "gptq:int4-g64", act, calib=d / "calib.npy")
    assert any("GPTQ (int4-g64) on 2 weights" in n for n in result.notes), result.notes
    # The reference: GPTQ on the same float-model activations, dequantized.
    q1 = gptq_quantize(w1, calib, fmt).dequantize().astype(np.float64)
    h = np.maximum(calib.astype(np.float64) @ w1, 0)
    q2 = gptq_quantize(w2, h.astype(np.float32), fmt).dequantize().astype(np.float64)
    for m in (1, 3, 64, 67):
        x = calib[:m] if m <= len(calib) else np.tile(calib, (2, 1))[:m]
        want = np.maximum(x.astype(np.float64) @ q1, 0) @ q2
        got = _run(out, x)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < (1e-5 if act == "fp32" else 3e-2), (m, err)


@pytest.mark.parametrize("act", ["fp32", "int8"])
def test_check_holds_gptq_artefacts_to_their_checkpoint(setup, act, tmp_path):
    """`qtvm check` on a GPTQ artefact compares with the model on the checkpoint's weights (it
    compared with the float model and called the GPTQ error a miscompile): --calib repeats the
    calibration, --gptq names a checkpoint; without them, one line saying which to pass; another
    calibration's checkpoint is a mismatch, so the reference does hold the checkpoint's weights."""
    from qtvm.check import check
    from qtvm.gptq_compile import write_calibrated_checkpoint

    d, *_ = setup
    out = tmp_path / "mlp.so"
    compile_model(d / "mlp.onnx", out, "host", "gptq:int4-g64", act, calib=d / "calib.npy")
    with pytest.raises(QtvmError, match="pass --calib FILE"):
        check(d / "mlp.onnx", out)
    report = check(d / "mlp.onnx", out, calib=d / "calib.npy")
    assert report.ok and "GPTQ checkpoint's" in report.reference, (report.reference, report.rows)
    model = onnx.load(str(d / "mlp.onnx"))
    write_calibrated_checkpoint(model, "gptq:int4-g64", d / "calib.npy", tmp_path / "ckpt.safetensors")
    ckpt_out = tmp_path / "ckpt.so"
    compile_model(d / "mlp.onnx", ckpt_out, "host", "none", act, gptq=tmp_path / "ckpt.safetensors")
    with pytest.raises(QtvmError, match="pass --gptq CKPT"):
        check(d / "mlp.onnx", ckpt_out)
    assert check(d / "mlp.onnx", ckpt_out, gptq=tmp_path / "ckpt.safetensors").ok
    np.save(tmp_path / "other.npy", np.random.default_rng(7).standard_normal((96, K)).astype(np.float32))
    write_calibrated_checkpoint(model, "gptq:int4-g64", tmp_path / "other.npy", tmp_path / "other.safetensors")
    assert not check(d / "mlp.onnx", ckpt_out, gptq=tmp_path / "other.safetensors").ok
    with pytest.raises(QtvmError, match="no GPTQ weights"):
        check(d / "mlp.onnx", compile_model(d / "mlp.onnx", tmp_path / "rtn.so", "host", "int4-g64").path,
              gptq=tmp_path / "ckpt.safetensors")


def test_gptq_beats_round_to_nearest_on_its_calibration_data(setup):
    d, w1, w2, calib = setup
    compile_model(d / "mlp.onnx", d / "g.so", "host", "gptq:int4-g64", calib=d / "calib.npy")
    compile_model(d / "mlp.onnx", d / "r.so", "host", "int4-g64")
    want = np.maximum(calib.astype(np.float64) @ w1, 0) @ w2
    err_g = np.linalg.norm(_run(d / "g.so", calib) - want)
    err_r = np.linalg.norm(_run(d / "r.so", calib) - want)
    assert err_g < err_r


def test_calibration_errors(setup, tmp_path):
    d, *_ = setup
    model = d / "mlp.onnx"
    with pytest.raises(QtvmError, match="needs calibration"):
        compile_model(model, tmp_path / "a.so", "host", "gptq:int4-g64")
    with pytest.raises(QtvmError, match="only used by --quant gptq"):
        compile_model(model, tmp_path / "a.so", "host", "int4-g64", calib=d / "calib.npy")
    with pytest.raises(QtvmError, match="uniform formats only"):
        compile_model(model, tmp_path / "a.so", "host", "gptq:bcq3-g128", calib=d / "calib.npy")
    with pytest.raises(QtvmError, match="does not exist"):
        compile_model(model, tmp_path / "a.so", "host", "gptq:int4-g64", calib=tmp_path / "none.npz")
    np.savez(tmp_path / "wrong.npz", y=np.zeros((2, K), np.float32))
    with pytest.raises(QtvmError, match="unknown"):
        compile_model(model, tmp_path / "a.so", "host", "gptq:int4-g64", calib=tmp_path / "wrong.npz")
    assert not (tmp_path / "a.so").exists()


def test_cli_takes_calib(setup, tmp_path, capsys):
    from qtvm.cli import main

    d, *_ = setup
    code = main(["compile", str(d / "mlp.onnx"), "--quant", "gptq:int4-g64", "--calib", str(d / "calib.npy"),
                 "-o", str(tmp_path / "m.so")])
    assert code == 0 and "GPTQ (int4-g64)" in capsys.readouterr().out
    assert main(["compile", str(d / "mlp.onnx"), "--quant", "gptq:int4-g64", "-o", str(tmp_path / "n.so")]) == 2


def test_merged_decoder_calibrated_on_the_bound_branch(hf_model, tmp_path):
    """--bind reaches the calibration run: a merged decoder's weights (read inside its If) are
    GPTQ-quantized on the branch the compile keeps, every one of them."""
    from qtvm.frontend.bind import bind_inputs
    from qtvm.gptq_compile import CalibratedCheckpoint
    from qtvm.report import constant_weights, prepare_inputs
    from tests.frontend.transformers_exports import merged_decoder

    merged = merged_decoder(onnx.load(str(hf_model("llama", "legacy", kv=True))))
    path = tmp_path / "merged.onnx"
    onnx.save(merged, str(path))
    bound = onnx.ModelProto()
    bound.CopyFrom(merged)
    bind_inputs(bound, {"use_cache_branch": "1"})
    np.savez(tmp_path / "calib.npz", **prepare_inputs(bound, None)[0])
    with CalibratedCheckpoint(path, "gptq:int4-g32", tmp_path / "calib.npz", {"use_cache_branch": "1"}) as ckpt:
        inits = {t.name for t in bound.graph.initializer}
        weights = [w for w in constant_weights(bound) if w.init_name in inits]
        assert len(weights) == 15 and ckpt.notes[0].startswith("GPTQ (int4-g32) on 15 weights")


def test_tied_lm_head_behind_a_transpose_is_gptq_quantized(tmp_path):
    """A dynamo export's tied lm_head reads the embedding table through a Transpose: GPTQ now
    quantizes it too (it was left to the preset), the embedding Gather keeps the float table,
    and the artefact equals numpy's GPTQ of the table's transpose on the calibration rows;
    weights named '*.weight' match their layers (the calibrated checkpoint named them in full
    and matched none)."""
    import qtvm.runtime

    vocab, hidden = 50, 80  # K = 80: not a multiple of the group (64)
    rng = np.random.default_rng(3)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "ids"], ["h"], name="embed"),
         helper.make_node("Transpose", ["embed.weight"], ["head"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "head"], ["logits"], name="lm_head")],
        "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])],
        [numpy_helper.from_array(table, "embed.weight")])
    model = tmp_path / "tied.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(model))
    ids = rng.integers(0, vocab, (4, 24)).astype(np.int64)
    np.save(tmp_path / "calib.npy", ids)
    out = tmp_path / "tied.so"
    result = compile_model(model, out, "host", "gptq:int4-g64", calib=tmp_path / "calib.npy")
    assert any("GPTQ (int4-g64) on 1 weights" in n for n in result.notes), result.notes
    assert result.metadata["prequantized_matmuls"] == 1
    q = gptq_quantize(np.ascontiguousarray(table.T), table[ids.reshape(-1)], get_format("int4-g64")).dequantize()
    for batch, seq in ((1, 1), (2, 7)):
        x = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
        want = table[x].astype(np.float64) @ q.astype(np.float64)
        got = qtvm.runtime.load(str(out)).run({"ids": x})["logits"]
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
