"""The OpenCL family (``schedules/opencl.py``): devices from the target, their facts in the
rules, and the kernels the family shares with the GPU rules -- prefill GEMM, LUT-GEMM for
BCQ, mixed-2-4-16's parts and CSR outliers -- run on PoCL with each device's launch shape
against the numpy reference of their format (M = 1, 3, 5 and 67; K not a multiple of the
group; N not a multiple of the column tile)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi

from qtvm import ops
from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.formats.mixed import mixed_matmul_reference, sparse_outlier_arrays, sparse_outlier_func
from qtvm.lut_gemv import lut_gemv_func
from qtvm.ops_gemm import qmatmul_gemm_func
from qtvm.target import parse_target
from schedules import facts, gpu, gpu_gemm, opencl
from tests.gpu import blocked, needs_opencl, rel_err, run_on_pocl, scheduled

MALI, ADRENO = parse_target("opencl -device=mali"), parse_target("opencl -device=adreno")


def test_device_comes_from_the_target():
    assert opencl.device(MALI).name == "mali" and opencl.device(ADRENO).name == "adreno"
    assert opencl.device(parse_target("opencl -device=mali -model=bifrost")).subgroup == 8
    assert opencl.device(parse_target("opencl")) is None and opencl.device(parse_target("cuda -arch=sm_80")) is None
    # TVM's own GPU rules (dlight) and target keys see a GPU with the device's limits
    assert {"opencl", "gpu", "mali"} <= set(MALI.keys) and {"opencl", "gpu", "adreno"} <= set(ADRENO.keys)
    assert int(ADRENO.attrs["max_threads_per_block"]) == 1024
    assert int(MALI.attrs["max_shared_memory_per_block"]) == 32 << 10
    with pytest.raises(QtvmError, match="unknown OpenCL device 'mail'.*-device=mali"):
        parse_target("opencl -device=mail")


def test_rules_read_the_device_row():
    p = gpu.params(MALI)
    assert (p.lanes, p.warps, p.cols, p.shared_bytes, p.max_threads) == (16, 4, 4, 32 << 10, 512)
    assert gpu.params(ADRENO).lanes == 64
    f = facts(ADRENO)
    assert f.family == "opencl" and f.activations == ("fp32", "fp16", "fp16-acc16")
    assert f.f16_accumulate == {"fp16": "float32", "fp16-acc16": "float16"}
    assert f.f16_activations(get_format("int3-g128"), 4096)  # every uniform width has an OpenCL decode
    assert not f.f16_activations(get_format("bcq3-g128"), 4096)
    tiles = gpu_gemm.gemm_tiles({"padded_k": 4096, "values_per_block": 8}, MALI)
    assert (tiles.bm + tiles.bn) * tiles.bk * 4 <= 32 << 10 and max(tiles.threads) <= 512


def quantized(preset: str, k: int, n: int):
    return get_format(preset).quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))


def check_rows(func, qt, rows) -> None:
    """func on PoCL against x @ the format's dequantized weights, one kernel for every M."""
    rng = np.random.default_rng(2)
    for m in rows:
        x = rng.standard_normal((m, qt.k)).astype(np.float32)
        assert rel_err(run_on_pocl(func, x, blocked(qt), qt.n), x.astype(np.float64) @ qt.dequantize()) < 1e-5, m


@needs_opencl
@pytest.mark.parametrize("target,preset,k,n", [(MALI, "e0m4-g128", 300, 70), (ADRENO, "int3-g128", 300, 37),
                                               (MALI, "bcq3-g128", 300, 37)],
                         ids=["mali-e0m4", "adreno-int3", "mali-bcq3"])  # int4, int2: test_oclgrind, mixed below
def test_prefill_gemm_on_opencl(target, preset, k, n):
    """Prefill (M above the decode threshold): gpu_gemm's tiles in the device's local memory."""
    qt = quantized(preset, k, n)
    check_rows(scheduled(qmatmul_gemm_func(qt.fmt, k, n, 1), target), qt, (5, 67))


@needs_opencl
@pytest.mark.parametrize("target,preset,k,n", [(ADRENO, "bcq3-g128", 300, 40), (MALI, "bcq2-g64", 200, 37)],
                         ids=["adreno-bcq3", "mali-bcq2"])
def test_lut_gemv_on_opencl(target, preset, k, n):
    """BCQ decode: LUT-GEMM with its tables in the device's local memory."""
    qt = quantized(preset, k, n)
    check_rows(scheduled(lut_gemv_func(qt.fmt, k, n, 1), target), qt, (1, 3))


@needs_opencl
def test_mixed_matmul_on_opencl():
    """mixed-2-4-16 on Mali: the 4-bit part, the 2-bit part on its stored 4-bit scale codes,
    then the CSR outliers, each the kernel the pass dispatches to for M."""
    k, n = 300, 70
    qt = quantized("mixed-2-4-16", k, n)
    f = facts(MALI)
    parts = qt.fmt.kernel_parts(qt, **f.parts_options)
    rng = np.random.default_rng(1)
    for m in (1, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.zeros((m, n))
        for rows, part in parts.dense:
            func = ops.qmatmul_func(part.fmt, part.k, n, 1, **f.gemv_options(part.fmt, part.k)) \
                if m <= f.gemv_max_rows else qmatmul_gemm_func(part.fmt, part.k, n, 1)
            y += run_on_pocl(scheduled(func, MALI), x[:, rows], blocked(part), n, half_as_float=True)  # fp16 minima
        outliers = scheduled(sparse_outlier_func(parts.sparse, k, n), MALI)
        y += run_on_pocl(outliers, x, sparse_outlier_arrays(parts.sparse), n, half_as_float=True)
        assert rel_err(y, mixed_matmul_reference(x, qt)) < 1e-5


def test_family_is_picked_by_kind():
    from schedules import family

    assert family(MALI) is opencl and family(tvm.target.Target("opencl")) is opencl


@needs_opencl
def test_ops_around_the_kernels_on_opencl(tiny_llama_path):
    """The bundled model's other functions (norms, RoPE, softmax, attention, SwiGLU), scheduled
    by TVM's dlight GPU rules with each device's limits and dlight's own Mali/Adreno configs:
    every function scheduled differently from the CUDA schedule (which
    ``test_gpu_generic.py`` checks) runs on PoCL against the same function unscheduled on the
    CPU, with batch and seq bound to 1 and 67. (dlight's Adreno matmul config made
    source that does not compile: ``opencl.dlight_rules``.)"""
    from qtvm.formats.mixed import SPARSE_ATTR
    from qtvm.pipeline import build_module
    from qtvm.testing.differential import compare_on_opencl
    from schedules import gpu_generic
    from tests.gpu import SM80
    from tests.schedules.test_gpu_generic import _outputs_per_function

    mod, *_ = build_module(tiny_llama_path, MALI, "int4-g128")
    fused = gpu_generic.legalize_and_fuse(mod, MALI)
    seen = {}  # name -> schedules already checked (CUDA's by test_gpu_generic.py)
    for gv, func in gpu_generic.schedule_generic_ops(mod, SM80).functions.items():
        seen[gv.name_hint] = [func.without_attr("target")] if isinstance(func, tvm.tirx.PrimFunc) else []
    checked, failures = [], {}
    for target in (MALI, ADRENO):
        done = opencl.schedule_generic_ops(mod, target)
        outputs = _outputs_per_function(done)
        for gv, func in done.functions.items():
            name = gv.name_hint
            if not isinstance(func, tvm.tirx.PrimFunc) or name not in fused or SPARSE_ATTR in (func.attrs or {}) \
                    or gpu_generic.is_scheduled(fused[name]):
                continue  # qtvm kernels and the row scan are tested on their own
            plain = func.without_attr("target")
            if any(tvm_ffi.structural_equal(plain, other) for other in seen.get(name, [])):
                continue  # a schedule checked already
            seen.setdefault(name, []).append(plain)
            result = compare_on_opencl(func, fused[name], outputs.get(name, 1), dims=(1, 67), name=name)
            checked.append(f"{target.attrs['device']}:{name}")
            if not result.worst <= 2e-6:
                failures[checked[-1]] = result.errors
    print(f"{len(checked)} schedules of Mali/Adreno that differ from CUDA's, checked: {checked}")
    assert checked and not failures, failures


def _qtvm(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_cli_compiles_the_bundled_model_for_adreno_with_fp16_activations(tiny_llama_path, tmp_path):
    """``qtvm compile --target opencl -device=adreno --act fp16``: every kernel scheduled by the
    family's rules, the device source embedded (this TVM wheel has no OpenCL runtime to load
    it; ``benchmarks/compile_presets.py`` compiles every preset for both devices)."""
    out = tmp_path / "m.so"
    proc = _qtvm("compile", tiny_llama_path, "--target", "opencl", "-device=adreno", "--quant", "int4-g128",
                 "--act", "fp16", "-o", out)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert b"as_half2(" in data and b"__kernel" in data  # the fp16 decode, in the embedded OpenCL source


def test_fp16_modes_are_named_per_target():
    """``--act fp16-acc16`` exists for OpenCL only; other targets name the modes they have."""
    from qtvm.target import parse_target as parse

    facts(ADRENO).check_activations("fp16-acc16", "opencl")
    with pytest.raises(QtvmError, match="fp16-acc16 has no kernels for target cuda"):
        facts(parse("cuda -arch=sm_80")).check_activations("fp16-acc16", "cuda")


@pytest.mark.parametrize("device", ["mali", "adreno"])
def test_cli_cross_exports_for_aarch64(tiny_llama_path, tmp_path, device):
    """``--host 'llvm -mtriple=aarch64-linux-gnu'``: the artefact is an AArch64 shared object
    (readelf) holding the OpenCL kernels. Runs where ``qtvm.deploy`` (cross toolchains, --host)
    and Debian's g++-aarch64-linux-gnu are present."""
    import shutil

    import qtvm

    if not (Path(qtvm.__file__).parent / "deploy" / "toolchain.py").is_file():
        pytest.skip("cross export (qtvm.deploy, --host) is on main")
    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("apt-get install g++-aarch64-linux-gnu")
    out = tmp_path / f"{device}.so"
    proc = _qtvm("compile", tiny_llama_path, "--target", "opencl", f"-device={device}", "--host",
                 "llvm -mtriple=aarch64-linux-gnu", "--quant", "e0m4-g128" if device == "mali" else "bcq3-g128",
                 "-o", out)
    assert proc.returncode == 0, proc.stderr
    import subprocess

    header = subprocess.run(["readelf", "-h", str(out)], capture_output=True, text=True, check=True).stdout
    assert "AArch64" in header and "DYN" in header
    assert b"__kernel" in out.read_bytes()
