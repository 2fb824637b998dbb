"""Which compiler links an artefact: found from the target's host triple, or a
one-line error naming what to install; resolved before any compile work."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qtvm.deploy import toolchain
from qtvm.errors import QtvmError
from qtvm.target import parse_target, split_cli_target, with_host
from tests.deploy.cross import AARCH64, CXX, require_tool


def _target(text: str, host: str | None = None):
    return with_host(parse_target(text), host)


@pytest.fixture
def no_env(monkeypatch):
    for var in (toolchain.CROSS_CC_ENV, "TVM_NDK_CC", *toolchain.NDK_ENV):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_native_targets_need_no_cross_compiler(no_env):
    assert toolchain.toolchain_for(parse_target("host")) is None
    assert toolchain.toolchain_for(parse_target("llvm -mtriple=x86_64-linux-gnu")) is None
    assert toolchain.host_triple(_target("opencl", "llvm -mtriple=aarch64-linux-gnu")) == "aarch64-linux-gnu"


def test_aarch64_linux_uses_debian_cross_gcc(no_env):
    require_tool(CXX, "g++-aarch64-linux-gnu")
    for text, host in ((AARCH64, None), ("opencl -device=adreno", "llvm -mtriple=aarch64-linux-gnu")):
        chain = toolchain.toolchain_for(_target(text, host))
        assert chain.system == "linux" and chain.arch == "aarch64" and chain.cc.endswith(CXX)
        assert chain.elf_machine == "AArch64" and chain.dumpmachine().startswith("aarch64")


def test_missing_linux_cross_compiler_names_the_package(no_env, tmp_path):
    no_env.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(QtvmError) as err:
        toolchain.toolchain_for(parse_target(AARCH64))
    msg = str(err.value)
    assert "aarch64-linux-gnu" in msg and "apt-get install g++-aarch64-linux-gnu" in msg and "--cross-cc" in msg
    assert "\n" not in msg


def test_mali_and_adreno_default_to_an_aarch64_host(no_env, tmp_path):
    for device in ("mali", "adreno"):
        target, note = toolchain.with_default_host(parse_target(f"opencl -device={device}"))
        assert toolchain.host_triple(target) == "aarch64-linux-gnu" and "aarch64-linux-android" in note
    target, note = toolchain.with_default_host(parse_target("opencl"))  # desktop OpenCL: this machine hosts it
    assert target.host is None and note is None
    no_env.setenv("PATH", str(tmp_path))
    with pytest.raises(QtvmError, match="g\\+\\+-aarch64-linux-gnu"):
        toolchain.toolchain_for(toolchain.with_default_host(parse_target("opencl -device=mali"))[0])


def test_android_without_ndk_names_ndk_and_variables(no_env):
    for triple in ("aarch64-linux-android", "aarch64-linux-android29"):
        with pytest.raises(QtvmError) as err:
            toolchain.toolchain_for(_target("opencl -device=adreno", f"llvm -mtriple={triple}"))
        msg = str(err.value)
        assert "Android NDK" in msg and "ANDROID_NDK_HOME" in msg and "TVM_NDK_CC" in msg and "clang++" in msg


def _fake_compiler(path: Path, machine: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = -dumpmachine ]; then echo {machine}; exit 0; fi\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_android_ndk_found_under_android_ndk_home(no_env, tmp_path):
    bindir = tmp_path / "ndk" / toolchain.NDK_BIN
    for api in (24, 29):
        _fake_compiler(bindir / f"aarch64-linux-android{api}-clang++", f"aarch64-unknown-linux-android{api}")
    no_env.setenv("ANDROID_NDK_HOME", str(tmp_path / "ndk"))
    chain = toolchain.toolchain_for(parse_target("llvm -mtriple=aarch64-linux-android"))
    assert chain.system == "android" and chain.cc.endswith("android29-clang++")  # the newest API level
    chain = toolchain.toolchain_for(parse_target("llvm -mtriple=aarch64-linux-android24"))
    assert chain.cc.endswith("android24-clang++")
    no_env.delenv("ANDROID_NDK_HOME")
    no_env.setenv("TVM_NDK_CC", str(bindir / "aarch64-linux-android24-clang++"))
    assert toolchain.toolchain_for(parse_target("llvm -mtriple=aarch64-linux-android")).cc.endswith("24-clang++")


def test_named_compiler_must_exist_and_build_for_the_triple(no_env, tmp_path):
    with pytest.raises(QtvmError, match="not an executable compiler"):
        toolchain.toolchain_for(parse_target(AARCH64), cross_cc=str(tmp_path / "nope"))
    x86 = _fake_compiler(tmp_path / "x86-g++", "x86_64-linux-gnu")
    with pytest.raises(QtvmError, match="builds for x86_64, not for aarch64"):
        toolchain.toolchain_for(parse_target(AARCH64), cross_cc=str(x86))
    with pytest.raises(QtvmError, match="builds for this machine"):
        toolchain.toolchain_for(parse_target("host"), cross_cc=str(x86))
    with pytest.raises(QtvmError, match="Linux and Android"):
        toolchain.toolchain_for(parse_target("llvm -mtriple=aarch64-apple-darwin"))


def test_host_option_parsing():
    assert split_cli_target(["compile", "--target", "opencl", "-device=mali", "--host", "llvm",
                             "-mtriple=aarch64-linux-gnu", "-o", "m.so"]) == \
        ["compile", "--target", "opencl -device=mali", "--host", "llvm -mtriple=aarch64-linux-gnu", "-o", "m.so"]
    with pytest.raises(QtvmError, match="its own host"):
        _target(AARCH64, "llvm -mtriple=aarch64-linux-gnu")
    with pytest.raises(QtvmError, match="llvm"):
        _target("opencl", "opencl")


def test_cli_without_cross_compiler_writes_nothing(tmp_path):
    """The error comes before any compile work and leaves no file behind."""
    from tests.conftest import mlp_model
    import onnx

    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), str(model))
    out = tmp_path / "out" / "m.so"
    out.parent.mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "PYTHONPATH": os.getcwd()}
    for extra in (["--target", "llvm", "-mtriple=aarch64-linux-gnu", "-mattr=+neon"],
                  ["--target", "opencl", "-device=mali"],
                  ["--target", "opencl", "-device=adreno", "--host", "llvm", "-mtriple=aarch64-linux-android"]):
        proc = subprocess.run([sys.executable, "-m", "qtvm.cli", "compile", str(model), *extra, "-o", str(out)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("qtvm: error:") and len(proc.stderr.strip().splitlines()) == 1
        assert ("g++-aarch64-linux-gnu" in proc.stderr) or ("Android NDK" in proc.stderr)
        assert list(out.parent.iterdir()) == []
