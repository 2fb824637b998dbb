"""`qtvm bench gemv --target cuda`: on a machine without a GPU it stops before measuring and
says so (exit 2, one line); with a GPU it prints bandwidth, qtvm and torch rows (skipped here)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest


def qtvm(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_without_a_gpu_nothing_is_measured(tmp_path, capfd):
    from qtvm.cli import main
    from qtvm.cuda import device_arch, load_cuda_runtime

    load_cuda_runtime()
    if device_arch() is not None:
        pytest.skip("this machine has a CUDA device")
    capfd.readouterr()
    assert main(["bench", "gemv", "--target", "cuda", "--shapes", "256x256", "--json", str(tmp_path / "b.json")]) == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "no CUDA device is present" in err and "nothing was measured" in err
    assert not (tmp_path / "b.json").exists()


def test_bad_activation_mode_on_a_gpu(capfd):
    from qtvm.cli import main

    capfd.readouterr()
    assert main(["bench", "gemv", "--target", "cuda", "--act", "int4"]) == 2
    assert "--act on a GPU takes fp32 and/or fp16" in capfd.readouterr().err


def test_on_a_gpu(tmp_path):
    from qtvm.cuda import device_arch, load_cuda_runtime

    load_cuda_runtime()
    if device_arch() is None:
        pytest.skip("no CUDA device on this machine: the GPU bench was not run")
    out = tmp_path / "b.json"
    proc = qtvm("bench", "gemv", "--target", "cuda", "--shapes", "4096x11008", "--formats", "int4-g128",
                "--act", "fp32,fp16", "--rounds", "3", "--json", out)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} >= {"qtvm int4-g128 fp32", "qtvm int4-g128 fp16"}


@pytest.mark.parametrize("preset", ["int3-g128", "bcq3-g128"])
def test_formats_without_an_fp16_kernel_are_not_timed_under_that_label(preset):
    """The fp16 column must time an fp16-activation kernel; these formats have none (before,
    the fp32 kernel was timed and labelled fp16). Decided before anything touches a device."""
    from qtvm.bench.gpu_gemv import _qtvm_kernel
    from qtvm.target import parse_target

    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    target = parse_target("cuda -arch=sm_90")
    assert _qtvm_kernel(preset, 256, 128, target, "fp16", w, 50 << 20) is None
