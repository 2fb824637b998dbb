"""CUDA artefacts on a machine without a GPU: compiled and exported with nvcc (device code
embedded), inspected, and refused at run time with a clear message. With a GPU, the
artefact runs and matches the CPU artefact (skipped here: no GPU, never counted as a pass)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from qtvm import cuda
from qtvm.errors import QtvmError
from tests.gpu import needs_nvcc

FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")


def qtvm(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_stub_exports_every_driver_call():
    source = cuda.stub_source(list(cuda.DRIVER_SYMBOLS))
    for name in cuda.DRIVER_SYMBOLS:
        assert f" {name}(" in source
    assert "return 100;" in source  # CUDA_ERROR_NO_DEVICE


def test_stub_is_built_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cuda.stub_path()
    assert path.name == "libcuda.so.1" and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert cuda.stub_path() == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == ["libcuda.so.1"]  # no temporary left


@pytest.fixture(scope="module")
def cuda_artefact(tiny_llama_path, tmp_path_factory):
    """mixed-2-4-16 (every kernel kind: GEMV, GEMM, outliers) for sm_90, through the API."""
    if not cuda.nvcc_available():
        pytest.skip("no nvcc (CUDA toolkit)")
    from qtvm.pipeline import compile_model

    return compile_model(tiny_llama_path, tmp_path_factory.mktemp("cuda") / "tiny.so", "cuda -arch=sm_90",
                         "mixed-2-4-16")


def test_artefact_embeds_device_code_and_says_which_gpu(cuda_artefact):
    data = cuda_artefact.path.read_bytes()
    assert FATBIN_MAGIC in data and b"sm_90" in data  # nvcc's fatbin, not CUDA source
    assert b"__global__" not in data
    meta = cuda_artefact.metadata
    assert (meta["device"], meta["required_gpu_arch"], meta["quantized_matmuls"]) == ("cuda", "sm_90", 15)


def test_inspect_and_run_without_a_gpu(cuda_artefact, tmp_path, capfd):
    from qtvm.cli import main

    capfd.readouterr()
    assert main(["inspect", "--json", str(cuda_artefact.path)]) == 0
    assert json.loads(capfd.readouterr().out)["required_gpu_arch"] == "sm_90"
    assert main(["inspect", str(cuda_artefact.path)]) == 0
    assert "needs an NVIDIA GPU of architecture sm_90 or newer" in capfd.readouterr().out
    ids = tmp_path / "ids.npy"  # running: the thin runtime in a process of its own
    np.save(ids, np.zeros((1, 3), np.int64))
    proc = qtvm("run", cuda_artefact.path, "--input", f"input_ids={ids}")
    if cuda.driver_loadable():
        pytest.skip("this machine has an NVIDIA driver: the GPU test below covers running")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no CUDA device is present" in proc.stderr


def test_cuda_artefact_on_the_gpu_matches_the_cpu_artefact(cuda_artefact, tiny_llama_path, tmp_path):
    from qtvm import runtime

    module = runtime.load(cuda_artefact.path)
    if cuda.device_arch() is None:
        pytest.skip("no CUDA device on this machine (the CUDA kernels were only compiled and checked with "
                    "ptxas; their TIR ran on PoCL)")
    from qtvm.pipeline import compile_model

    cpu = runtime.load(compile_model(tiny_llama_path, tmp_path / "cpu.so", "host", "mixed-2-4-16").path)
    for batch, seq in ((1, 1), (2, 3), (1, 67)):
        ids = np.random.default_rng(seq).integers(0, 512, (batch, seq)).astype(np.int64)
        got, want = module.run({"input_ids": ids})["logits"], cpu.run({"input_ids": ids})["logits"]
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@needs_nvcc
def test_cli_compiles_for_sm80(mlp_path, tmp_path):
    """The CLI path (unquoted target) on the small MLP; the bundled model is compiled above."""
    out = tmp_path / "m.so"
    proc = qtvm("compile", mlp_path, "--target", "cuda", "-arch=sm_80", "--quant", "int4-g32", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "sm_80" in proc.stdout and out.is_file()
    assert FATBIN_MAGIC in out.read_bytes() and b"sm_80" in out.read_bytes()


@pytest.mark.parametrize("target,needle", [("cuda", "needs its GPU architecture"),
                                           ("cuda -arch=sm_70", "unsupported CUDA architecture 'sm_70'")])
def test_bad_cuda_targets(tmp_path, mlp_path, capfd, target, needle):
    from qtvm.cli import main

    out = tmp_path / "m.so"
    capfd.readouterr()
    assert main(["compile", str(mlp_path), "--target", *target.split(), "-o", str(out)]) == 2
    err = capfd.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_runtime_refuses_an_older_gpu(monkeypatch, tmp_path):
    from qtvm import runtime

    monkeypatch.setattr(cuda, "device_arch", lambda index=0: "sm_80")
    with pytest.raises(QtvmError, match="built for sm_90 and this GPU is sm_80; recompile with --target cuda "
                                        "-arch=sm_80"):
        runtime._check_cuda_arch(tmp_path / "m.so", {"required_gpu_arch": "sm_90"}, missing_ok=False)
    monkeypatch.setattr(cuda, "device_arch", lambda index=0: "sm_90")
    runtime._check_cuda_arch(tmp_path / "m.so", {"required_gpu_arch": "sm_80"}, missing_ok=False)  # newer is fine


@needs_nvcc
def test_lut_gemv_that_ptxas_fails_at_level_10_compiles(tmp_path):
    """ptxas 13.0 gives up on this LUT-GEMM GEMV (the bundled model's bcq3 shape) at TVM's
    register-usage level 10 (C7600); compile_cuda builds it at ptxas' default level."""
    import tvm

    from qtvm import lut_gemv
    from qtvm.formats import get_format
    from qtvm.target import parse_target
    from schedules import gpu_lut

    target = parse_target("cuda -arch=sm_90")
    func = gpu_lut.schedule_lut_gemv_gpu(lut_gemv.lut_gemv_func(get_format("bcq3-g128"), 256, 64, 1), target)
    cuda.compile_cuda(tvm.IRModule({"main": func.mod["main"]}), target, relax_pipeline=None).export_library(
        str(tmp_path / "lut.so"))
    data = (tmp_path / "lut.so").read_bytes()
    assert FATBIN_MAGIC in data and b"sm_90" in data


def test_compile_cuda_retries_only_ptxas_register_failures(monkeypatch):
    import tvm

    levels = []

    def fake_compile(mod, target, **kwargs):
        import os

        levels.append(os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL"))
        if len(levels) == 1:
            raise RuntimeError(f"nvcc: ptxas fatal : (C7600) Register allocation failed ({mod})")
        return "built"

    monkeypatch.setattr(cuda, "nvcc_available", lambda: True)
    monkeypatch.setattr(tvm, "compile", fake_compile)
    monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL", raising=False)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert cuda.compile_cuda("m", target) == "built" and levels == [None, cuda.PTXAS_FALLBACK_REG_LEVEL]
    levels.clear()
    monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", "10")  # the user's own level: the error stands
    with pytest.raises(RuntimeError, match="C7600"):
        cuda.compile_cuda("m", target)
    monkeypatch.setattr(tvm, "compile", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other error")))
    monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL")
    with pytest.raises(RuntimeError, match="other error"):
        cuda.compile_cuda("m", target)


def test_sm_number_reads_every_compute_capability_name():
    assert [cuda.sm_number(a) for a in ("sm_80", "sm_90a", "sm_100", "sm_61")] == [80, 90, 100, 61]
    assert [cuda.sm_number(a) for a in ("", "cuda", "sm_", "sm_x")] == [-1, -1, -1, -1]
