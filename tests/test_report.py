"""qtvm.report / `qtvm quantize-report` on the bundled tiny LLaMA and small hand-made graphs."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.reference import dequantized_model
from qtvm.report import (DEFAULT_PRESETS, FormatSummary, Report, add_report_parser, collect_layer_inputs,
                         constant_weights, prepare_inputs, quantize_report, report_command)
from tests.conftest import mlp_model

PRESETS = ["int2-g64", "int4-g128", "int8-g128"]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path):
    return onnx.load(str(tiny_llama_path))


@pytest.fixture(scope="module")
def tiny_feeds():
    rng = np.random.default_rng(7)
    return {"input_ids": rng.integers(0, 512, (2, 12)).astype(np.int64)}


@pytest.fixture(scope="module")
def tiny_report(tiny_llama_path, tiny_feeds):
    return quantize_report(tiny_llama_path, PRESETS, inputs=tiny_feeds, keep_outputs=True)


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# -- what is reported -------------------------------------------------------------------------
def test_weights_are_those_reference_replaces(tiny_model, tiny_report):
    from qtvm.frontend.onnx import weight_sources

    expected = {src.name for src in weight_sources(tiny_model)}
    assert {w.init_name for w in constant_weights(tiny_model)} == expected
    assert tiny_report.weights == len(expected) == 15  # 2 layers x 7 projections + lm_head
    for p in PRESETS:
        assert {r.weight for r in tiny_report.layer_errors(p)} == expected
    assert tiny_report.weight_count == sum(int(np.prod(i.dims)) for i in tiny_model.graph.initializer
                                           if i.name in expected)


def test_bits_per_weight_match_the_stored_arrays(tiny_model, tiny_report):
    """Recomputed from the uniform layout: int32 code words + fp32 scales + fp32 zeros per group."""
    for row in tiny_report.layers:
        fmt = get_format(row.preset)
        kp = -(-row.k // fmt.group_size) * fmt.group_size  # K padded to whole groups (32 | group here)
        words = kp * fmt.bits // 32
        groups = kp // fmt.group_size
        expected = (words * 4 + groups * 4 + groups * 4) * 8 / row.k  # bytes per column -> bits per weight
        assert row.bits_per_weight == pytest.approx(expected, rel=1e-12), row
    # K = 704 (down_proj) pads to 768 at group 128: 4 * 768 / 704 + 64 * 6 / 704 bits.
    down = [r for r in tiny_report.layer_errors("int4-g128") if r.k == 704]
    assert down and down[0].bits_per_weight == pytest.approx(4.909090909, rel=1e-9)
    for s in tiny_report.summary:
        rows = tiny_report.layer_errors(s.preset)
        total = sum(r.bits_per_weight * r.k * r.n for r in rows)
        assert s.bits_per_weight == pytest.approx(total / tiny_report.weight_count, rel=1e-12)


def test_layer_errors_match_reference_dequantized_model(tiny_model, tiny_report):
    """Per-layer numbers recomputed from qtvm.reference.dequantized_model's weights."""
    fmt = get_format("int4-g128")
    deq = {t.name: numpy_helper.to_array(t) for t in dequantized_model(tiny_model, fmt).graph.initializer}
    orig = {t.name: numpy_helper.to_array(t) for t in tiny_model.graph.initializer}
    for row in tiny_report.layer_errors("int4-g128"):
        w, q = orig[row.weight].astype(np.float64), deq[row.weight].astype(np.float64)
        d = np.abs(w - q)
        assert row.max_abs_err == pytest.approx(d.max(), rel=1e-12)
        assert row.mean_abs_err == pytest.approx(d.mean(), rel=1e-9)
        assert row.rel_fro_err == pytest.approx(np.linalg.norm(w - q) / np.linalg.norm(w), rel=1e-9)
    abs_sum = sum(np.abs(orig[r.weight].astype(np.float64) - deq[r.weight]).sum()
                  for r in tiny_report.layer_errors("int4-g128"))
    assert tiny_report.format_summary("int4-g128").mean_abs_err == pytest.approx(abs_sum / tiny_report.weight_count)


def test_output_errors_match_onnxruntime_on_reference_model(tiny_model, tiny_feeds, tiny_report):
    ref = ort_run(tiny_model, tiny_feeds)[0].astype(np.float64)
    got = ort_run(dequantized_model(tiny_model, get_format("int4-g128")), tiny_feeds)[0].astype(np.float64)
    np.testing.assert_allclose(tiny_report.outputs["int4-g128"]["logits"], got, rtol=0, atol=1e-6)
    o = tiny_report.format_summary("int4-g128").outputs[0]
    assert o.name == "logits"
    assert o.max_abs_err == pytest.approx(np.abs(ref - got).max(), rel=1e-6)
    assert o.rel_max_err == pytest.approx(np.abs(ref - got).max() / np.abs(ref).max(), rel=1e-6)
    rows_r, rows_g = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cos = (rows_r * rows_g).sum(1) / np.linalg.norm(rows_r, axis=1) / np.linalg.norm(rows_g, axis=1)
    assert cos.size == 2 * 12
    assert o.cos_mean == pytest.approx(cos.mean(), abs=1e-9) and o.cos_min == pytest.approx(cos.min(), abs=1e-9)
    flat = ref.ravel() @ got.ravel() / np.linalg.norm(ref) / np.linalg.norm(got)
    assert o.cos_flat == pytest.approx(flat, abs=1e-9)


def test_errors_ordered_by_bits(tiny_report):
    s = {p: tiny_report.format_summary(p) for p in PRESETS}
    for a, b in (("int2-g64", "int4-g128"), ("int4-g128", "int8-g128")):
        assert s[a].mean_rel_fro_err > 2 * s[b].mean_rel_fro_err
        assert s[a].mean_abs_err > s[b].mean_abs_err
        assert s[a].outputs[0].max_abs_err > s[b].outputs[0].max_abs_err
        assert s[a].outputs[0].cos_mean < s[b].outputs[0].cos_mean
        assert s[a].bits_per_weight < s[b].bits_per_weight
    by_layer = {p: {r.weight: r.rel_fro_err for r in tiny_report.layer_errors(p)} for p in PRESETS}
    for w in by_layer["int4-g128"]:
        assert by_layer["int2-g64"][w] > by_layer["int4-g128"][w] > by_layer["int8-g128"][w]
    # Rough magnitudes of round-to-nearest on Gaussian weights (a sanity check on the scale).
    assert 0.3 < s["int2-g64"].mean_rel_fro_err < 0.6
    assert 0.05 < s["int4-g128"].mean_rel_fro_err < 0.15
    assert s["int8-g128"].mean_rel_fro_err < 0.01
    assert s["int8-g128"].outputs[0].cos_min > 0.999


def test_tables_name_every_layer_and_preset(tiny_report):
    table = tiny_report.layer_table()
    assert len(table.splitlines()) == 2 + 15 * len(PRESETS)
    assert "/layers.1/mlp/down_proj/MatMul" in table and "704x256" in table
    summary = tiny_report.summary_table()
    for p in PRESETS:
        assert p in summary
    md = tiny_report.summary_table(markdown=True)
    assert md.splitlines()[0].startswith("| format |") and len(md.splitlines()) == 2 + len(PRESETS)


# -- JSON --------------------------------------------------------------------------------------
def test_json_is_complete_strict_and_atomic(tiny_report, tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    tiny_report.write_json(out)
    data = json.loads(out.read_text())
    assert data["presets"] == PRESETS and len(data["layers"]) == 15 * len(PRESETS)
    assert "outputs" not in data  # the arrays stay in memory only
    assert data["summary"][1]["outputs"][0]["name"] == "logits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temp file left

    # A failure while replacing leaves the previous report untouched and no temp file behind.
    before = out.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        tiny_report.write_json(out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_json_writes_non_finite_as_null(tmp_path):
    r = Report("m", ["int4-g128"], 1, 1, {}, "same as inputs")
    r.summary.append(FormatSummary("int4-g128", False, 4.5, float("nan"), float("inf"), 0.0, [], 0.0))
    data = json.loads(r.write_json(tmp_path / "r.json").read_text())
    assert data["summary"][0]["mean_rel_fro_err"] is None and data["summary"][0]["mean_abs_err"] is None


def test_json_bad_path(tiny_report, tmp_path):
    with pytest.raises(QtvmError, match="does not exist"):
        tiny_report.write_json(tmp_path / "nope" / "r.json")
    with pytest.raises(QtvmError, match="is a directory"):
        tiny_report.write_json(tmp_path)


# -- calibration ----------------------------------------------------------------------------------
def test_layer_inputs_match_torch(tiny_model, tiny_feeds):
    """The activations added as graph outputs are the inputs torch's Linear layers see."""
    from qtvm.models.tiny_llama import build_torch_model

    weights = constant_weights(tiny_model)
    _, acts = collect_layer_inputs(tiny_model, tiny_feeds, weights)
    model = build_torch_model()
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__(name, args[0].detach()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.from_numpy(tiny_feeds["input_ids"]))
    for h in hooks:
        h.remove()
    assert len(seen) == len(weights) == 15
    for w in weights:
        module = w.nodes[0].strip("/").rsplit("/", 1)[0].replace("/", ".")  # /layers.0/attn/q_proj/MatMul
        x = seen[module].numpy().reshape(-1, w.k)
        assert acts[w.init_name].shape == (2 * 12, w.k)
        np.testing.assert_allclose(acts[w.init_name], x, rtol=1e-4, atol=1e-5)


def test_calibrated_formats(tiny_llama_path, tiny_feeds):
    # Calibrated and judged on the same inputs: GPTQ fits these activations, so it must beat
    # round-to-nearest clearly -- which only happens if each layer got its own inputs.
    r = quantize_report(tiny_llama_path, ["int4-g128", "gptq:int4-g128", "mixed-2-4-16"], tiny_feeds)
    assert r.calibration_inputs == "same as inputs"
    rtn, gptq, mixed = (r.format_summary(p) for p in r.presets)
    assert not rtn.calibrated and gptq.calibrated and mixed.calibrated
    assert gptq.bits_per_weight == rtn.bits_per_weight
    assert gptq.outputs[0].max_abs_err < 0.5 * rtn.outputs[0].max_abs_err
    assert gptq.outputs[0].cos_mean > rtn.outputs[0].cos_mean
    assert 2.8 < mixed.bits_per_weight < 4.0
    assert gptq.mean_rel_fro_err > rtn.mean_rel_fro_err  # GPTQ trades weight error for output error


def test_synthetic_inputs(tiny_model, mlp_path):
    feeds, desc = prepare_inputs(tiny_model, None, seed=3)
    assert feeds["input_ids"].shape == (2, 16) and feeds["input_ids"].dtype == np.int64
    assert feeds["input_ids"].max() < 512 and "random ids < 512" in desc["input_ids"]["source"]
    feeds, desc = prepare_inputs(onnx.load(str(mlp_path)), None)
    assert feeds["x"].shape == (2, 100) and feeds["x"].dtype == np.float32
    # Both synthetic: calibration uses another seed, so calibrated rows are judged out of sample.
    r = quantize_report(mlp_path, ["int4-g128", "gptq:int4-g128"])
    assert r.calibration_inputs != "same as inputs"
    assert r.calibration_inputs["x"]["shape"] == [2, 100]


def test_kv_export_and_merged_decoder(hf_model):
    """A KV export's synthetic mask is as long as its dim expression says (past + seq; it was
    given the same size as every other dim, and onnxruntime failed), and a merged decoder is
    reported on the branch --bind chooses (its matmuls are inside the If), the given model
    left as it was."""
    from tests.frontend.transformers_exports import merged_decoder

    kv = onnx.load(str(hf_model("llama", "legacy", kv=True)))
    feeds, _ = prepare_inputs(kv, None)
    assert feeds["input_ids"].shape == (2, 16) and feeds["attention_mask"].shape == (2, 32)
    assert feeds["past_key_values.0.key"].shape[:3] == (2, 2, 16)
    merged = merged_decoder(kv)
    with pytest.raises(QtvmError, match="no MatMul/Gemm with a constant"):
        quantize_report(merged, ["int4-g32"])
    r = quantize_report(merged, ["int4-g32"], binds={"use_cache_branch": "1"})
    assert r.weights == quantize_report(kv, ["int4-g32"]).weights > 0
    assert r.inputs["attention_mask"]["shape"] == [2, 32] and "use_cache_branch" not in r.inputs
    assert merged.graph.node[0].op_type == "If" and merged.graph.input[-1].name == "use_cache_branch"


# -- Gemm with transB, bad input ---------------------------------------------------------------
def test_gemm_trans_b(mlp_path):
    model = onnx.load(str(mlp_path))
    r = quantize_report(model, ["int4-g32"], inputs={"x": np.ones((3, 100), np.float32)})
    rows = {row.weight: row for row in r.layer_errors("int4-g32")}
    assert set(rows) == {"w1", "w2"}  # the computed x @ x^T is not a weight
    assert (rows["w1"].k, rows["w1"].n) == (100, 70) and (rows["w2"].k, rows["w2"].n) == (70, 37)
    deq = {t.name: numpy_helper.to_array(t) for t in dequantized_model(model, get_format("int4-g32")).graph.initializer}
    w1 = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1")).astype(np.float64)
    assert rows["w1"].max_abs_err == pytest.approx(np.abs(w1 - deq["w1"]).max(), rel=1e-12)
    assert [o.name for o in r.summary[0].outputs] == ["y", "gram"]
    assert r.summary[0].outputs[1].max_abs_err == 0.0  # gram = x x^T involves no weight


def test_unknown_presets_listed(mlp_path):
    with pytest.raises(QtvmError) as e:
        quantize_report(mlp_path, ["int4-g128", "int5-g128", "fp4"])
    msg = str(e.value)
    assert "'int5-g128'" in msg and "'fp4'" in msg and "int4-g128" in msg and "e0m4-g128" in msg
    assert "\n" not in msg
    with pytest.raises(QtvmError, match="uniform formats only"):
        quantize_report(mlp_path, ["gptq:bcq3-g128"])
    with pytest.raises(QtvmError, match="no formats"):
        quantize_report(mlp_path, [" ", ""])


def test_bad_model_files(tmp_path):
    with pytest.raises(QtvmError, match="does not exist"):
        quantize_report(tmp_path / "missing.onnx", ["int4-g128"])
    bad = tmp_path / "bad.onnx"
    bad.write_text("not a model\n" * 20)
    with pytest.raises(QtvmError, match="not a readable ONNX model"):
        quantize_report(bad, ["int4-g128"])


def _no_weight_model(constant_node: bool) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "b"], ["y"], name="mm")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    if constant_node:
        nodes.insert(0, helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(
            np.ones((4, 3), np.float32), "c")))
    else:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 3]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_no_constant_weights():
    with pytest.raises(QtvmError, match="no MatMul/Gemm with a constant"):
        quantize_report(_no_weight_model(False), ["int4-g128"])
    # a Constant node's weight is quantized by the compiler, so it is reported (it was this error)
    assert quantize_report(_no_weight_model(True), ["int4-g128"]).weights == 1


def test_nan_weight_names_the_tensor():
    model = mlp_model()
    w2 = next(t for t in model.graph.initializer if t.name == "w2")
    arr = numpy_helper.to_array(w2).copy()
    arr[3, 5] = np.nan
    w2.CopyFrom(numpy_helper.from_array(arr, "w2"))
    with pytest.raises(QtvmError, match=r"weight 'w2' of fc2 contains 1 NaN/Inf values"):
        quantize_report(model, ["int4-g128"])


def test_bad_inputs(tiny_model):
    with pytest.raises(QtvmError, match="unknown \\['ids'\\], missing \\['input_ids'\\]"):
        quantize_report(tiny_model, ["int4-g128"], inputs={"ids": np.zeros((1, 4), np.int64)})
    with pytest.raises(QtvmError, match="has 1 dims but the model expects 2"):
        quantize_report(tiny_model, ["int4-g128"], inputs={"input_ids": np.zeros(4, np.int64)})


# -- command line -------------------------------------------------------------------------------
def run_report(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.report", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_cli_subprocess(tiny_llama_path, tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(20, dtype=np.int64).reshape(2, 10))
    out = tmp_path / "report.json"
    proc = run_report(tiny_llama_path, "--formats", "int4-g128,int8-g128", "--input", f"input_ids={ids}",
                      "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "/layers.0/attn/q_proj/MatMul" in proc.stdout  # the per-layer table
    assert "cos mean" in proc.stdout and "int8-g128" in proc.stdout
    assert "input_ids [2, 10] int64 (given)" in proc.stdout
    data = json.loads(out.read_text())
    assert data["presets"] == ["int4-g128", "int8-g128"] and data["inputs"]["input_ids"]["source"] == "given"
    assert len(data["layers"]) == 30


@pytest.mark.parametrize("case", ["preset", "missing", "json_dir", "input"])
def test_cli_errors(tiny_llama_path, tmp_path, case):
    args = {"preset": [tiny_llama_path, "--formats", "int4-g128,int9-g128"],
            "missing": [tmp_path / "none.onnx"],
            "json_dir": [tiny_llama_path, "--json", tmp_path / "no" / "r.json"],
            "input": [tiny_llama_path, "--input", "input_ids=nothing.npy"]}[case]
    proc = run_report(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qtvm: error:") and "Traceback" not in err, err
    needle = {"preset": "'int9-g128'", "missing": "does not exist", "json_dir": "does not exist",
              "input": "does not exist"}[case]
    assert needle in err


def test_parser_wiring(tiny_llama_path, capsys):
    """add_report_parser plugs into any CLI's subparsers; fn is report_command."""
    parser = argparse.ArgumentParser(prog="qtvm")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["quantize-report", str(tiny_llama_path), "--formats", "int8-g128", "--summary-only"])
    assert args.fn is report_command and args.formats == "int8-g128" and args.json is None
    assert parser.parse_args(["quantize-report", "m.onnx"]).formats == ",".join(DEFAULT_PRESETS)
    assert report_command(args) == 0
    out = capsys.readouterr().out
    assert "int8-g128" in out and "/layers.0/attn/q_proj/MatMul" not in out  # --summary-only


def test_weights_behind_a_transpose_or_in_constants_are_reported_as_compiled():
    """A dynamo export's tied lm_head is MatMul(x, Transpose(W)) and some exporters store weights as
    Constant nodes: the compiler quantizes both, and the report left them float (GPT-2 dynamo: 8 of
    its 9 weights), so its output errors were not the artefact's. Its quantized model now equals the
    reference's (``dequantized_model``, the compiler's rule), whose tied embedding table stays float
    (the report had replaced the table in place: the Gather read quantized rows)."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((48, 64)).astype(np.float32)  # stored [N, K], read through a Transpose
    c = rng.standard_normal((64, 40)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w1t"], ["h"], name="tied"),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c)),
             helper.make_node("MatMul", ["x", "c"], ["y2"], name="const"),
             helper.make_node("Gather", ["w1", "ids"], ["emb"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64]),
                                           helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h", "y2", "emb")],
                              [numpy_helper.from_array(w1, "w1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    weights = {w.init_name: w for w in constant_weights(model)}
    assert sorted(weights) == ["c", "w1"] and weights["w1"].trans_b
    assert (weights["w1"].k, weights["w1"].n, weights["c"].k, weights["c"].n) == (64, 48, 64, 40)
    feeds = {"x": rng.standard_normal((3, 64)).astype(np.float32), "ids": np.array([0, 5, 47])}
    report = quantize_report(model, ["int4-g32"], inputs=feeds, keep_outputs=True)
    assert report.weights == 2
    want = dict(zip(("h", "y2", "emb"), ort_run(dequantized_model(model, get_format("int4-g32")), feeds)))
    got = report.outputs["int4-g32"]
    for name in ("h", "y2"):
        assert np.allclose(got[name], want[name], rtol=1e-5, atol=1e-5), name
        assert not np.allclose(got[name], report.outputs["float"][name], rtol=1e-3, atol=1e-3), name
    assert np.array_equal(got["emb"], want["emb"]) and np.array_equal(got["emb"], w1[[0, 5, 47]])  # the table: float


def test_mixture_of_experts_weights_are_reported_as_the_compiler_packs_them():
    """A model of routed experts only (it was "nothing to quantize"): each routed W[E] is a row,
    every expert through the format in the orientation the compiler packs (the row's error is
    the experts' together, checked here against numpy), the model's output error is onnxruntime's
    with them dequantized; a composite format leaves them float (32 bits, no error), as compiling does."""
    from tests.conftest import moe_model

    model = moe_model()
    report = quantize_report(model, ["int4-g32", "mixed-2-4-16"], keep_outputs=True)
    assert report.weights == 6 and report.weight_count == 2 * 3 * 200 * 70
    rows = {(r.preset, r.weight): r for r in report.layers}
    w0 = numpy_helper.to_array(model.graph.initializer[0])  # [E, N, K]
    fmt = get_format("int4-g32")
    diffs = [fmt.quantize(np.ascontiguousarray(w.T)).dequantize() - w.T for w in w0]
    want = np.sqrt(sum((d.astype(np.float64) ** 2).sum() for d in diffs) / (w0.astype(np.float64) ** 2).sum())
    row = rows["int4-g32", "w0"]
    assert (row.k, row.n) == (200, 70) and "3 experts" in row.node
    assert row.rel_fro_err == pytest.approx(want, rel=1e-6) and 4 < row.bits_per_weight < 8
    assert rows["mixed-2-4-16", "w0"].bits_per_weight == 32 and rows["mixed-2-4-16", "w1"].rel_fro_err == 0
    packed, kept = report.format_summary("int4-g32"), report.format_summary("mixed-2-4-16")
    assert 0.9 < packed.outputs[0].cos_mean < 0.9999 and kept.outputs[0].rel_max_err == 0


def _half_mlp(kind: str) -> onnx.ModelProto:
    """The test MLP in half precision as users make one: onnxruntime's float16 converter (inputs
    and outputs float16, or kept float32 with Casts it appends after their readers), or bfloat16."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from qtvm.frontend.onnx import sort_nodes

    if kind != "bfloat16":
        model = convert_float_to_float16(mlp_model(), keep_io_types=kind == "float16 keep_io_types")
        sort_nodes(model.graph)  # as load_onnx does
        return model
    model = mlp_model()
    for v in [*model.graph.input, *model.graph.output]:
        v.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        t.CopyFrom(helper.make_tensor(t.name, TensorProto.BFLOAT16, a.shape, a.flatten().tolist()))
    return model


@pytest.mark.parametrize("kind", ["float16", "float16 keep_io_types", "bfloat16"])
def test_half_precision_models_are_reported(kind):
    """A float16 or bfloat16 model (the compiler packs its weights) was "nothing to quantize"; a
    bfloat16 one's synthetic inputs were all ones (numpy does not count bfloat16 as floating), and
    onnxruntime cannot run it: it runs in float32 rounded to bfloat16 as it goes, as `qtvm check`
    does. Each weight's row is its half values through the format; GPTQ calibrates on the layer
    inputs read in their half type."""
    model = _half_mlp(kind)
    report = quantize_report(model, ["int4-g32", "gptq:int4-g32"], keep_outputs=True)
    rows = {(r.preset, r.weight): r for r in report.layers}
    assert report.weights == 2 and set(rows) == {(p, w) for p in ("int4-g32", "gptq:int4-g32") for w in ("w1", "w2")}
    w2 = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2")).astype(np.float32)
    diff = get_format("int4-g32").quantize(w2).dequantize() - w2
    assert rows["int4-g32", "w2"].max_abs_err == pytest.approx(np.abs(diff).max(), rel=1e-6)
    assert report.inputs["x"]["source"] == "synthetic: standard normal"
    x = prepare_inputs(model, None)[0]["x"]
    assert len(np.unique(x.astype(np.float32))) > 100
    for preset in ("int4-g32", "gptq:int4-g32"):
        y = report.format_summary(preset).outputs[0]
        assert y.name == "y" and 0.98 < y.cos_mean < 0.9999
    ref = mlp_model()
    want = ort_run(ref, {"x": x.astype(np.float32)})[0]  # the float32 model on the same inputs
    got = np.asarray(report.outputs["float"]["y"], np.float32)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
