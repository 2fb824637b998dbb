"""`qtvm check`: the mean-pooling graph that the old generic rule miscompiled, a 1x1 Conv +
Sigmoid, and a deliberate mismatch, through the real CLI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtvm.check import check, default_bindings, parse_shape
from qtvm.errors import QtvmError


def _pool_model(seed: int) -> onnx.ModelProto:
    """x[batch, seq, 200] -> ReduceMean over seq (keepdims 0) -> Gemm: a sentence embedding head."""
    w = np.random.default_rng(seed).standard_normal((16, 200)).astype(np.float32)
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Gemm", ["m", "w"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 200])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _conv_model() -> onnx.ModelProto:
    w = np.random.default_rng(1).standard_normal((8, 8, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Sigmoid", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 4])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("make,quant", [(_pool_model, "none"), (_pool_model, "int4-g32"), (_conv_model, "none")])
def test_right_artefacts_pass(tmp_path, make, quant):
    model = tmp_path / "m.onnx"
    onnx.save(make(0) if make is _pool_model else make(), str(model))
    art = tmp_path / "m.so"
    assert _cli("compile", model, "--quant", quant, "-o", art).returncode == 0
    run = _cli("check", model, art, "--shape", "batch=1,seq=1", "--shape", "batch=2,seq=67",
               "--shape", "batch=3,seq=64")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK:" in run.stdout and run.stderr == ""
    assert run.stdout.count("\n") >= 4  # header, one row per binding, footer


def test_mismatch_exits_1(tmp_path):
    """An artefact checked against a model with other weights: the own error is large."""
    a, b, art = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "a.so"
    onnx.save(_pool_model(0), str(a))
    onnx.save(_pool_model(1), str(b))
    assert _cli("compile", a, "--quant", "none", "-o", art).returncode == 0
    run = _cli("check", b, art)
    assert run.returncode == 1 and "MISMATCH" in run.stdout and "above tolerance" in run.stdout


def test_bad_input_is_one_line(tmp_path):
    run = _cli("check", tmp_path / "missing.onnx", tmp_path / "missing.so")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "does not exist" in run.stderr
    with pytest.raises(QtvmError, match="name=size"):
        parse_shape("batch:2")


def test_default_bindings_differ_per_dim():
    assert default_bindings(["batch", "seq"]) == [{"batch": 1, "seq": 3}, {"batch": 3, "seq": 17},
                                                  {"batch": 17, "seq": 1}]


def test_given_inputs(tmp_path, tiny_llama_int4, tiny_llama_path):
    report = check(tiny_llama_path, tiny_llama_int4[0], feeds={"input_ids": np.array([[1, 2, 3]], np.int64)})
    assert report.ok and len(report.rows) == 1 and report.rows[0].shape == (1, 3, 512)
    assert 1e-2 < report.rows[0].err_vs_float and report.rows[0].err_own < 1e-5


def test_kv_cache_export_dims_follow_from_symbols(hf_model, hf_compiled):
    """A KV-cache export's mask is [batch, past + seq]: its size follows from the symbols
    (qtvm check binds batch, seq and past)."""
    result = hf_compiled("llama", "legacy", "none", kv=True)
    report = check(hf_model("llama", "legacy", kv=True), result.path)
    assert report.ok
    assert {tuple(sorted(r.binding.items())) for r in report.rows} == {
        (("batch", 1), ("past", 17), ("seq", 3)), (("batch", 3), ("past", 1), ("seq", 17)),
        (("batch", 17), ("past", 3), ("seq", 1))}
