"""`qtvm inspect` (human summary and --json) and `qtvm --version`, through the real CLI process."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import onnx
import pytest

from qtvm.describe import summary, target_text
from tests.conftest import mlp_model


def qtvm(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def mlp_artefact(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    onnx.save(mlp_model(), str(d / "mlp.onnx"))
    proc = qtvm("compile", d / "mlp.onnx", "--target", "llvm", "-mcpu=x86-64-v3", "--quant", "int4-g128",
                "-o", d / "mlp.so")
    assert proc.returncode == 0, proc.stderr
    return d / "mlp.so"


def test_version():
    proc = qtvm("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"qtvm {importlib.metadata.version('qtvm')} (apache-tvm "
                                   f"{importlib.metadata.version('apache-tvm')}, apache-tvm-ffi "
                                   f"{importlib.metadata.version('apache-tvm-ffi')})")


def test_inspect_summary(mlp_artefact):
    proc = qtvm("inspect", mlp_artefact)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in proc.stdout.splitlines() if ":" in line and not line.startswith(" ")}
    assert lines["target"] == "llvm -mcpu=x86-64-v3"
    assert lines["CPU flags"] == "avx2, fma"  # x86-64-v3 needs these and no AVX-512
    assert lines["signature"] == "main(x: float32[batch, 100]) -> y: float32[batch, 37], gram: float32[batch, batch]"
    assert lines["symbolic dims"].startswith("batch")
    assert lines["weights"].startswith("2 packed matmuls") and "fp32 activations" in lines["weights"]
    size = mlp_artefact.stat().st_size
    assert lines["artefact"] == f"{mlp_artefact} ({size / 1e6:.2f} MB)"
    table = proc.stdout.split("layers:\n", 1)[1].splitlines()
    assert table[0].split() == ["format", "K", "x", "N", "bits/w", "count"]
    # K = 100 padded to 128 for g128: (4 + 64/128) * 128 / 100 = 5.76 bits per weight from the stored bytes.
    assert table[1].split() == ["int4-g128", "100", "x", "70", "5.760", "1"]
    assert table[2].split()[:4] == ["int4-g128", "70", "x", "37"]


def test_inspect_json_is_the_metadata(mlp_artefact):
    from qtvm import runtime

    proc = qtvm("inspect", "--json", mlp_artefact)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout)
    assert meta == runtime.load(mlp_artefact).metadata
    assert [(r["format"], r["k"], r["n"], r["count"]) for r in meta["layers"]] == [("int4-g128", 100, 70, 1),
                                                                                 ("int4-g128", 70, 37, 1)]


def test_summary_shows_gpu_arch_and_keys_it_does_not_know():
    meta = {"format": "int4-g128", "target": json.dumps({"kind": "cuda", "arch": "sm_80", "keys": ["cuda", "gpu"],
                                                           "host": {"kind": "llvm", "mcpu": "znver3"}}),
            "required_cpu_flags": [], "inputs": [{"name": "x", "dtype": "float32", "shape": ["m", 64]}],
            "outputs": [{"name": "y", "dtype": "float32", "shape": ["m", 8]}], "gpu_arch": "sm_80",
            "kernel_count": 3}
    text = summary(meta)
    assert "GPU arch:" in text and text.split("GPU arch:", 1)[1].split("\n")[0].strip() == "sm_80"
    assert "target:" in text and "cuda -arch=sm_80 (host: llvm -mcpu=znver3)" in text
    assert "kernel_count:" in text and text.rstrip().endswith("3")
    assert "main(x: float32[m, 64]) -> y: float32[m, 8]" in text


def test_summary_shows_the_kv_step():
    meta = {"format": "none", "target": json.dumps({"kind": "llvm"}), "required_cpu_flags": [],
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", 8]}],
            "kv_step": {"function": "qtvm_kv_step", "max_length": 2048, "max_batch": 2, "pad": 64}}
    line = next(t for t in summary(meta).splitlines() if t.startswith("generation:"))
    assert line.split(":", 1)[1].strip() == ("in-place KV cache (qtvm_kv_step): up to 2048 tokens, batch <= 2, "
                                             "attention length padded to 64")
    meta["kv_step"]["cache_dtype"] = "float16"  # --kv-cache fp16
    line = next(t for t in summary(meta).splitlines() if t.startswith("generation:"))
    assert line.endswith("attention length padded to 64, caches held in float16"), line
    del meta["kv_step"]
    assert "generation" not in summary(meta) and "kv_step" not in summary(meta)


def test_target_text_reads_what_users_type():
    assert target_text('{"kind":"llvm","tag":"","keys":["cpu"],"mcpu":"znver3","mattr":["+avx2","+fma"]}') == \
        "llvm -mcpu=znver3 -mattr=+avx2,+fma"
    assert target_text("not json") == "not json"


@pytest.mark.parametrize("case", ["missing", "not_elf"])
def test_inspect_bad_files(tmp_path, case):
    path = tmp_path / "x.so"
    if case == "not_elf":
        path.write_text("hello\n")
    proc = qtvm("inspect", path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("does not exist" if case == "missing" else "not a qtvm artefact") in proc.stderr
    assert "qtvm compile" in proc.stderr  # the fix is named


def test_symbolic_dims_show_a_limit_on_a_sum():
    """A limit on past + seq (a causal-mask table's length) where no input is sized past + seq."""
    meta = {"inputs": [{"name": "x", "dtype": "int64", "shape": ["batch", "seq"]},
                       {"name": "k", "dtype": "float32", "shape": ["batch", 4, "past", 16]}],
            "outputs": [], "dim_limits": {"past + seq": 256}, "may_be_zero": ["past"]}
    assert "symbolic dims: batch, past >= 0, seq, past + seq <= 256\n" in summary(meta)


def test_summary_shows_bound_inputs():
    meta = {"format": "none", "target": json.dumps({"kind": "llvm"}), "required_cpu_flags": [],
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", 8]}],
            "bound_inputs": {"use_cache_branch": "1"}}
    line = next(t for t in summary(meta).splitlines() if t.startswith("bound inputs:"))
    assert line.split(":", 1)[1].strip() == "use_cache_branch=1 (fixed at compile time by --bind; not inputs of main)"
    assert "bound_inputs" not in summary(meta)
