"""qtvm_run (C++, libtvm_runtime only) runs artefacts: natively here, and the aarch64
build of the same model under qemu-user with the aarch64 TVM runtime from PyPI's
wheels; outputs match the host artefact run by qtvm.runtime."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import pytest

from qtvm.deploy import native, toolchain
from qtvm.errors import QtvmError
from qtvm.pipeline import compile_model
from qtvm.target import parse_target
from tests.conftest import mlp_model
from tests.deploy.cross import AARCH64, CXX, QEMU, SYSROOT, require_tool


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    onnx.save(mlp_model(), str(d / "mlp.onnx"))
    return d


@pytest.fixture(scope="module")
def host_bundle(models):
    art = compile_model(models / "mlp.onnx", models / "mlp_host.so", "host", "int4-g128")
    return art, native.bundle(None, models / "bundle-host")


@pytest.fixture(scope="module")
def arm_bundle(models):
    require_tool(CXX, "g++-aarch64-linux-gnu")
    require_tool(QEMU, "qemu-user")
    art = compile_model(models / "mlp.onnx", models / "mlp_aarch64.so", AARCH64, "int4-g128")
    chain = toolchain.toolchain_for(parse_target(AARCH64))
    return art, native.bundle(chain, models / "bundle-aarch64")


def _run(cmd, cwd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def _check_outputs(prefix, bundle, art, tmp_path):
    from qtvm import runtime  # after the compiler's tvm import (runtime alone would load libtvm_runtime only)

    reference = runtime.load(art.path.with_name("mlp_host.so"))
    rng = np.random.default_rng(0)
    for m in (1, 3, 64, 67):
        x = rng.standard_normal((m, 100)).astype(np.float32)
        np.save(tmp_path / "x.npy", x)
        out = tmp_path / f"out{m}"
        out.mkdir()
        proc = _run([*prefix, str(bundle / "qtvm_run"), str(art.path), f"x={tmp_path / 'x.npy'}", "-o", str(out)],
                    tmp_path)
        assert proc.returncode == 0, proc.stderr
        want = reference.run({"x": x})
        for name, ref in want.items():
            got = np.load(out / f"{name}.npy")
            assert got.shape == ref.shape and got.dtype == ref.dtype
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_qtvm_run_matches_the_python_runtime(host_bundle, tmp_path):
    art, bundle = host_bundle
    assert sorted(p.name for p in bundle.iterdir()) == ["libtvm_ffi.so", "libtvm_runtime.so", "qtvm_run"]
    _check_outputs([], bundle, art, tmp_path)


def test_qtvm_run_bad_input(host_bundle, tmp_path):
    art, bundle = host_bundle
    exe = str(bundle / "qtvm_run")
    np.save(tmp_path / "i.npy", np.zeros((2, 100), np.int64))
    np.save(tmp_path / "f.npy", np.zeros((2, 100), np.float32))
    for args, words in ((["x=" + str(tmp_path / "i.npy")], "dtype <i8, expected float32"),
                        (["y=" + str(tmp_path / "f.npy")], "missing input 'x'"),
                        (["x=" + str(tmp_path / "nope.npy")], "cannot open"),
                        (["x=" + str(tmp_path / "f.npy"), "z=" + str(tmp_path / "f.npy")], "unknown input 'z'"),
                        (["--bogus"], "is not NAME=file.npy")):
        proc = _run([exe, str(art.path), *args], tmp_path)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr
    np.save(tmp_path / "narrow.npy", np.zeros((2, 99), np.float32))
    proc = _run([exe, str(art.path), "x=" + str(tmp_path / "narrow.npy")], tmp_path)
    assert proc.returncode == 2 and "has size 99 on axis 1, expected 100" in proc.stderr, proc.stderr
    proc = _run([exe, str(tmp_path / "missing.so")], tmp_path)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _run([exe, str(art.path), "--metadata"], tmp_path)
    assert proc.returncode == 0 and '"format": "int4-g128"' in proc.stdout


def test_qtvm_run_refuses_an_input_shorter_than_a_convolution_s_window(host_bundle, models, tmp_path):
    """The VM would die of the negative size (std::bad_alloc); qtvm_run names the minimum, as
    qtvm.runtime does."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((2, 1, 10), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], strides=[5])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, "frames"])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(models / "conv.onnx"))
    art = compile_model(models / "conv.onnx", models / "conv.so", "host", "none")
    exe = str(host_bundle[1] / "qtvm_run")
    for seq, ok in ((9, False), (10, True)):
        np.save(tmp_path / "x.npy", np.ones((1, 1, seq), np.float32))
        proc = _run([exe, str(art.path), f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path)], tmp_path)
        if ok:
            assert proc.returncode == 0 and np.load(tmp_path / "y.npy").tolist() == [[[10.0], [10.0]]], proc.stderr
        else:
            assert proc.returncode == 2 and "has size 9 on axis 2 ('seq'), but this model takes seq >= 10" \
                in proc.stderr, proc.stderr


def test_aarch64_artefact_runs_under_qemu(host_bundle, arm_bundle, tmp_path):
    art, bundle = arm_bundle
    assert native.runtime_libs("aarch64").is_dir()
    proc = _run([QEMU, "-L", SYSROOT, str(bundle / "qtvm_run"), str(art.path), "--metadata"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(json.loads(proc.stdout)["target"])["mtriple"] == "aarch64-linux-gnu"
    _check_outputs([QEMU, "-L", SYSROOT], bundle, art, tmp_path)


def test_android_has_no_runtime_wheel():
    chain = toolchain.Toolchain("aarch64-linux-android28", "/ndk/clang++", "android", "aarch64")
    with pytest.raises(QtvmError, match="NDK"):
        native.bundle(chain, "/nonexistent")


def test_tiny_llama_for_aarch64_matches_the_host_build(arm_bundle, tiny_llama_path, tiny_llama_int4, tmp_path):
    """The main job's model (int64 ids, attention, RoPE, packed int4 matmuls), built for
    aarch64 and run under qemu, against the host build through qtvm.runtime; batch x seq
    2 x 16 (prefill kernels) and 1 x 1 (GEMV kernels)."""
    from qtvm import runtime

    _, bundle = arm_bundle
    art = compile_model(tiny_llama_path, tmp_path / "tiny_aarch64.so", AARCH64, "int4-g128")
    reference = runtime.load(tiny_llama_int4[0])
    rng = np.random.default_rng(1)
    for shape in ((2, 16), (1, 1)):
        ids = rng.integers(0, 512, shape).astype(np.int64)
        np.save(tmp_path / "ids.npy", ids)
        proc = _run([QEMU, "-L", SYSROOT, str(bundle / "qtvm_run"), str(art.path),
                     f"input_ids={tmp_path / 'ids.npy'}", "-o", str(tmp_path)], tmp_path)
        assert proc.returncode == 0, proc.stderr
        want = reference.run({"input_ids": ids})["logits"]
        got = np.load(tmp_path / "logits.npy")
        assert got.shape == want.shape == (*shape, 512)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
