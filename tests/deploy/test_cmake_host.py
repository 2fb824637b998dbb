"""The C++ host as a CMake project (qtvm/deploy/CMakeLists.txt around qtvm_run.cc): configured
against the installed wheels' headers and libtvm_runtime, built, installed as a bundle, and run on
the bundled tiny LLaMA; its outputs equal the Python runtime's."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qtvm.deploy import native

CMAKE_DIR = native.RUNNER_SOURCE.parent


def _run(cmd, cwd=None):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def cmake_host(tmp_path_factory):
    """(built qtvm_run, installed bundle directory)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is not installed (apt-get install cmake; .ci/run installs it)")
    d = tmp_path_factory.mktemp("cmake")
    proc = _run([cmake, "-S", CMAKE_DIR, "-B", d / "build", f"-DPython_EXECUTABLE={sys.executable}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "libtvm_runtime.so" in proc.stdout and "libtvm_compiler" not in proc.stdout
    proc = _run([cmake, "--build", d / "build"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run([cmake, "--install", d / "build", "--prefix", d / "bundle"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return d / "build" / "qtvm_run", d / "bundle" / "bin"


def test_the_bundle_holds_the_runtime_only(cmake_host):
    _, bundle = cmake_host
    assert sorted(p.name for p in bundle.iterdir()) == ["libtvm_ffi.so", "libtvm_runtime.so", "qtvm_run"]
    deps = _run(["ldd", bundle / "qtvm_run"]).stdout
    assert str(bundle / "libtvm_runtime.so") in deps and str(bundle / "libtvm_ffi.so") in deps
    assert "libtvm_compiler" not in deps and "libpython" not in deps


@pytest.mark.parametrize("which", ["build", "bundle"])
def test_tiny_llama_matches_the_python_runtime(cmake_host, tiny_llama_int4, tmp_path, which):
    """Decode (1 x 1, GEMV kernels), prefill (2 x 16) and an odd shape (3 x 7), in one artefact."""
    from qtvm import runtime

    exe = cmake_host[0] if which == "build" else cmake_host[1] / "qtvm_run"
    art, result = tiny_llama_int4
    proc = _run([exe, art, "--metadata"])
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout)
    assert meta["inputs"] == result.metadata["inputs"] and meta["format"] == "int4-g128"
    reference = runtime.load(art)
    vocab = reference.outputs[0]["shape"][-1]
    rng = np.random.default_rng(3)
    for shape in ((1, 1), (2, 16), (3, 7)):
        ids = rng.integers(0, vocab, shape).astype(np.int64)
        np.save(tmp_path / "ids.npy", ids)
        out = tmp_path / f"out_{shape[0]}x{shape[1]}"
        out.mkdir()
        proc = _run([exe, art, f"input_ids={tmp_path / 'ids.npy'}", "-o", out])
        assert proc.returncode == 0, proc.stderr
        got = np.load(out / "logits.npy")
        want = reference.run({"input_ids": ids})["logits"]
        assert got.shape == want.shape == (*shape, vocab) and got.dtype == want.dtype
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_refuses_an_artefact_for_cpu_features_this_cpu_lacks(cmake_host, tmp_path):
    """The same refusal as qtvm.runtime, one line, exit 2: a flag no CPU has, written into a
    copy of the artefact's metadata (the metadata is a JSON constant inside the file)."""
    import onnx

    from qtvm.pipeline import compile_model
    from tests.conftest import mlp_model

    onnx.save(mlp_model(), str(tmp_path / "mlp.onnx"))
    art = compile_model(tmp_path / "mlp.onnx", tmp_path / "mlp.so", "host", "int4-g128").path
    data = art.read_bytes()
    flags = json.dumps(json.loads(_run([cmake_host[0], art, "--metadata"]).stdout)["required_cpu_flags"])
    assert flags.encode() in data
    fake = json.dumps(["qtvmfake"]).ljust(len(flags))  # same length: the constant's size is unchanged
    patched = tmp_path / "patched.so"
    patched.write_bytes(data.replace(flags.encode(), fake.encode(), 1))
    np.save(tmp_path / "x.npy", np.zeros((2, 100), np.float32))
    proc = _run([cmake_host[0], patched, f"x={tmp_path / 'x.npy'}", "-o", tmp_path])
    assert proc.returncode == 2 and "needs CPU features qtvmfake" in proc.stderr and "--target host" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "y.npy").exists()
