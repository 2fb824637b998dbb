"""Every bad input through the real CLI: exit 2, one line, no traceback, no output file."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import mlp_model


def qtvm(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("qtvm: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)


def unsupported_model(path):
    nodes = [helper.make_node("Det", ["x"], ["d"], name="det"),
             helper.make_node("Bernoulli", ["x"], ["b"], name="bern"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("FusedMatMul", ["x"], ["q"], name="mnb", domain="com.microsoft")]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [3, 3]) for o in "dbrq"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    onnx.save(model, str(path))


@pytest.mark.parametrize("case", ["missing", "not_onnx", "truncated", "unsupported", "directory"])
def test_bad_model_files(tmp_path, case):
    model = tmp_path / "m.onnx"
    if case == "not_onnx":
        model.write_text("this is a text file, not a model\n" * 10)
    elif case == "truncated":
        data = mlp_model().SerializeToString()
        model.write_bytes(data[: len(data) // 2])
    elif case == "unsupported":
        unsupported_model(model)
    elif case == "directory":
        model = tmp_path
    out = tmp_path / "out.so"
    proc = qtvm("compile", model, "--target", "llvm", "-o", out)
    needles = {"missing": ["does not exist"], "not_onnx": ["not a readable ONNX model"],
               "truncated": ["not a readable ONNX model"], "directory": ["is a directory"],
               "unsupported": ["unsupported ONNX ops", "Bernoulli", "Det", "com.microsoft.FusedMatMul"]}[case]
    assert_clean_error(proc, *needles)
    assert "Relu" not in proc.stderr  # only the unsupported ones are named
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


@pytest.mark.parametrize("args,needle", [
    (["--quant", "int5-g7"], "unknown quant preset 'int5-g7'"),
    (["--target", "llvm", "-mcpu=notacpu"], "does not know the CPU 'notacpu'"),
    (["--target", "tpu"], "unknown target kind 'tpu'"),
    (["--target", "llvm -foo=1"], "invalid target"),
    (["--dim", "seq"], "--dim 'seq' is not NAME=EXPRESSION"),
    (["--dim", "past=seq + 1"], "--dim names 'past', which no input dim is called"),
    (["--kv-cache", "fp16", "--no-kv-step"], "--kv-cache fp16 with --no-kv-step"),
])
def test_bad_options(mlp_path, tmp_path, args, needle):
    out = tmp_path / "out.so"
    proc = qtvm("compile", mlp_path, *args, "-o", out)
    assert_clean_error(proc, needle)
    assert not out.exists()


def test_unwritable_output(mlp_path):
    """/proc refuses new files even to root, unlike permission bits."""
    assert_clean_error(qtvm("compile", mlp_path, "-o", "/proc/qtvm_out.so"), "is not writable")


def test_output_directory_missing(mlp_path, tmp_path):
    out = tmp_path / "nope" / "out.so"
    assert_clean_error(qtvm("compile", mlp_path, "-o", out), "does not exist")
    assert not out.parent.exists()


def test_output_path_unwritable(mlp_path, tmp_path):
    """Root ignores permission bits, so make the path unwritable by being a file's child."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_clean_error(qtvm("compile", mlp_path, "-o", blocker / "out.so"), "does not exist")


def test_compile_and_run_unquoted_target(mlp_path, tmp_path):
    out = tmp_path / "mlp.so"
    proc = qtvm("compile", mlp_path, "--target", "llvm", "-mcpu=znver2", "-mattr=+avx2,+fma", "--quant", "int4-g32",
                "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "quantized 2 matmuls to int4-g32 (fp32 activations)" in proc.stdout
    assert "left in float: 1 MatMul/Gemm whose weight is not a constant (gram)" in proc.stdout
    assert '"mcpu":"znver2"' in proc.stdout and out.is_file()
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    run = qtvm("run", out, "--input", f"x={tmp_path / 'x.npy'}", "--save", tmp_path / "y.npz")
    assert run.returncode == 0, run.stderr
    assert "y: shape [3, 37] float32" in run.stdout and "gram: shape [3, 3]" in run.stdout
    saved = np.load(tmp_path / "y.npz")
    assert saved["y"].shape == (3, 37)
    np.testing.assert_allclose(saved["gram"], x @ x.T, rtol=1e-5, atol=1e-4)


def test_run_bad_inputs(mlp_path, tmp_path):
    out = tmp_path / "mlp.so"
    assert qtvm("compile", mlp_path, "--target", "llvm", "-o", out).returncode == 0
    np.save(tmp_path / "x64.npy", np.zeros((2, 100), np.float64))
    np.save(tmp_path / "xk.npy", np.zeros((2, 99), np.float32))
    assert_clean_error(qtvm("run", out, "--input", f"x={tmp_path / 'x64.npy'}"), "dtype float64, expected float32")
    assert_clean_error(qtvm("run", out, "--input", f"x={tmp_path / 'xk.npy'}"), "size 99 on axis 1, expected 100")
    assert_clean_error(qtvm("run", out, "--input", f"z={tmp_path / 'xk.npy'}"), "missing x; unknown z")
    assert_clean_error(qtvm("run", out, "--input", f"x={tmp_path / 'none.npy'}"), "does not exist")
    assert_clean_error(qtvm("run", tmp_path / "none.so"), "does not exist")
    (tmp_path / "junk.so").write_text("junk")
    assert_clean_error(qtvm("run", tmp_path / "junk.so"), "not a loadable qtvm artefact")


def test_formats_lists_presets():
    proc = qtvm("formats")
    assert proc.returncode == 0
    for preset in ("int4-g128", "int3-g128", "int2-g64", "int8-g128", "int4-col"):
        assert preset in proc.stdout


def test_compile_with_empty_tuning_db_warns_and_uses_analytic(mlp_path, tmp_path):
    (tmp_path / "db").mkdir()
    out = tmp_path / "mlp.so"
    proc = qtvm("compile", mlp_path, "--target", "host", "--db", tmp_path / "db", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "warning: tuning database" in proc.stdout and "using analytic schedules" in proc.stdout
    assert out.is_file()


def test_run_command_never_loads_the_compiler(tmp_path):
    """Building the CLI parser (all subcommands) must not import tvm."""
    import textwrap

    code = textwrap.dedent("""
        import sys, qtvm.cli
        qtvm.cli.build_parser()
        print("tvm imported:", "tvm" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "tvm imported: False", proc.stderr


# -- quantized ONNX and GPTQ checkpoints ------------------------------------------------------------
def test_quantized_onnx_through_the_cli(tmp_path):
    from tests.quantized_models import ort_matmul_nbits

    onnx.save(ort_matmul_nbits(mlp_model(), 4, 32, False), str(tmp_path / "q.onnx"))
    proc = qtvm("compile", tmp_path / "q.onnx", "--target", "llvm", "-mcpu=znver3", "-o", tmp_path / "q.so")
    assert proc.returncode == 0, proc.stderr
    assert ("packed 2 matmuls: 1 quantized in the model or checkpoint (MatMulNBits int4-g32-qz x1), 1 to int4-g128 "
            "(fp32 activations)") in proc.stdout


def test_unsupported_matmul_nbits_bits_through_the_cli(tmp_path):
    from tests.quantized_models import matmul_nbits_layer, model_of

    node, inits, _ = matmul_nbits_layer("mnb", "x", "y", 64, 8, 4, 32)
    next(a for a in node.attribute if a.name == "bits").i = 3
    onnx.save(model_of([(node, inits, None)], [("x", ["batch", 64])], [("y", ["batch", 8])]), str(tmp_path / "m.onnx"))
    out = tmp_path / "m.so"
    assert_clean_error(qtvm("compile", tmp_path / "m.onnx", "-o", out), "MatMulNBits 'mnb' has bits=3",
                       "2, 4 and 8-bit")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


@pytest.fixture
def gptq_files(tmp_path):
    """mlp_model's fc2 ([70, 37] MatMul weight 'w2'), GPTQ-quantized by qtvm into an AutoGPTQ checkpoint.
    K = 70 and N = 37 are not whole 4-bit words: the writer pads them, the reader accepts it."""
    from qtvm.formats import UniformFormat
    from qtvm.formats.gptq import gptq_quantize
    from qtvm.formats.gptq_checkpoint import write_autogptq

    model = mlp_model()
    onnx.save(model, str(tmp_path / "mlp.onnx"))
    w2 = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2"))
    x = np.random.default_rng(0).standard_normal((256, 70)).astype(np.float32)
    qt = gptq_quantize(w2, x, UniformFormat(4, 32), act_order=True)
    return tmp_path, lambda tensors=None: write_autogptq(tmp_path / "ck.safetensors", {"w2": qt},
                                                         extra=tensors or {})


def test_gptq_checkpoint_through_the_cli(gptq_files):
    tmp, write = gptq_files
    proc = qtvm("compile", tmp / "mlp.onnx", "--gptq", write(), "--quant", "none", "-o", tmp / "g.so")
    assert proc.returncode == 0, proc.stderr
    assert "1 quantized in the model or checkpoint (GPTQ int4-g32-f16 x1), 0 to -" in proc.stdout


def test_gptq_mismatch_through_the_cli(gptq_files):
    from qtvm.safetensors import load_safetensors, save_safetensors

    tmp, write = gptq_files
    tensors = load_safetensors(write())
    tensors["w1.qweight"] = np.zeros((11, 70), np.int32)  # fc1 is [70, 100] (Gemm transB): K=100 has no 11-row packing
    tensors["w1.qzeros"] = np.zeros((4, 9), np.int32)
    tensors["w1.scales"] = np.zeros((4, 70), np.float16)
    tensors["lm_head.qweight"] = np.zeros((4, 4), np.int32)
    tensors["lm_head.qzeros"] = np.zeros((1, 1), np.int32)
    tensors["lm_head.scales"] = np.zeros((1, 4), np.float16)
    save_safetensors(tmp / "bad.safetensors", tensors)
    out = tmp / "g.so"
    proc = qtvm("compile", tmp / "mlp.onnx", "--gptq", tmp / "bad.safetensors", "-o", out)
    assert_clean_error(proc, "does not fit the model", "w1: qweight [11, 70] qzeros [4, 9] scales [4, 70] do not "
                       "fit K=100, N=70 of ONNX weight 'w1' [70, 100]",
                       "lm_head (qweight [4, 4] qzeros [1, 1] scales [1, 4]) matches no MatMul/Gemm weight")
    assert not out.exists()
    del tensors["w1.scales"]
    save_safetensors(tmp / "bad.safetensors", tensors)
    assert_clean_error(qtvm("compile", tmp / "mlp.onnx", "--gptq", tmp / "bad.safetensors", "-o", out),
                       "lacks w1.scales")
    assert_clean_error(qtvm("compile", tmp / "mlp.onnx", "--gptq", tmp / "none.safetensors", "-o", out),
                       "does not exist")


def test_unrelated_symbolic_dims_one_line_nothing_of_tvm(tmp_path):
    """An import failure: exit 2, qtvm's own sentence naming the node, tensors and dims;
    nothing of TVM's (no 'BlockBuilder destroyed' warning, no 'Error converting operator')."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "m"], ["y"], name="add_mask")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"]),
                                           helper.make_tensor_value_info("m", TensorProto.FLOAT, ["batch", "total"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(model))
    out = tmp_path / "out.so"
    proc = qtvm("compile", model, "--quant", "none", "-o", out)
    assert_clean_error(proc, "Add node 'add_mask'", "'r' [batch, seq] (axis -1: seq)",
                       "'m' [batch, total] (axis -1: total)", "cannot be related")
    assert proc.stdout == ""
    assert not out.exists()


def test_control_flow_the_importer_cannot_convert_is_one_line(hf_model, tmp_path):
    """TVM converts If branches itself (no symbolic shape folding): a merged decoder fails there,
    and the error names the If's input and the fix (--bind it), with nothing of TVM's after it
    (its BlockBuilder's 'destroyed with remaining blocks' warning came out at exit); bound, it
    compiles and checks. A branch whose shape TVM cannot infer fails at its code generator: one
    line too (was 'internal error')."""
    from tests.frontend.transformers_exports import merged_decoder

    merged = tmp_path / "merged.onnx"
    onnx.save(merged_decoder(onnx.load(str(hf_model("llama", "legacy", kv=True)))), str(merged))
    out = tmp_path / "out.so"
    assert_clean_error(qtvm("compile", merged, "--quant", "none", "-o", out),
                       "TVM's ONNX importer failed on this graph with control flow", "--bind use_cache_branch=1")
    assert not out.exists()
    bound = tmp_path / "bound.so"
    proc = qtvm("compile", merged, "--quant", "int4-g32", "--bind", "use_cache_branch=1", "-o", bound)
    assert proc.returncode == 0 and "1 If nodes on bound inputs replaced by the branch taken" in proc.stdout, proc
    proc = qtvm("check", merged, bound)
    assert proc.returncode == 0 and "OK: the artefact computes what the model does" in proc.stdout, proc
    assert_clean_error(qtvm("compile", merged, "--bind", "use_cache_branch", "-o", out), "is not NAME=VALUE")
    vi = helper.make_tensor_value_info
    one = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")
    then = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                              helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
                              helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
                              helper.make_node("Expand", ["one", "n1"], ["o"]),
                              helper.make_node("Mul", ["x", "o"], ["t"])], "then", [],
                             [vi("t", TensorProto.FLOAT, ["batch", "seq"])],
                             [one, onnx.numpy_helper.from_array(np.array(0, np.int64), "i0"),
                              onnx.numpy_helper.from_array(np.array([0], np.int64), "ax")])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [vi("e", TensorProto.FLOAT, ["batch", "seq"])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
                              [vi("x", TensorProto.FLOAT, ["batch", "seq"]), vi("c", TensorProto.BOOL, [])],
                              [vi("y", TensorProto.FLOAT, ["batch", "seq"])])
    model = tmp_path / "expand.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(model))
    assert_clean_error(qtvm("compile", model, "--quant", "none", "-o", out), "without a kernel",
                       "R.multiply", "--bind that input")
    assert not out.exists()
