"""OpenCL decode GEMV (``schedules/opencl_gemv.py``) for Mali and Adreno targets: each
format family's kernel on PoCL against its numpy reference at M = 1 and 3 (one kernel,
symbolic M), K not a multiple of the group (or of the lanes' chunks), N not a multiple
of the columns a work-group covers.

fp16 kernels run with half spelled float (PoCL has no cl_khr_fp16) and the decode's
``as_half2`` read bit-exactly: that checks indexing, guards, the order of the reductions
and the decode bits, not fp16 rounding, whose error is emulated in numpy below."""
from __future__ import annotations

import numpy as np
import pytest

from qtvm import ops
from qtvm.formats import get_format
from qtvm.target import parse_target
from qtvm.testing.opencl import lower
from schedules import facts, opencl_gemv
from tests.gpu import blocked, needs_opencl, rel_err, run_on_pocl, scheduled

MALI, ADRENO = parse_target("opencl -device=mali"), parse_target("opencl -device=adreno")
BIFROST = parse_target("opencl -device=mali -model=bifrost")
DEVICES = {"mali": MALI, "adreno": ADRENO, "bifrost": BIFROST}

# One case per format family and layout, the devices taking turns.
CASES = [("mali", "int4-g128", 300, 37), ("adreno", "int3-g128", 1000, 70), ("bifrost", "int2-g64", 1000, 33),
         ("adreno", "e0m4-g128", 700, 37), ("mali", "int8-g32", 200, 9), ("adreno", "int4-g128-qz", 700, 37),
         ("mali", "int2-g16", 576, 37),  # 36 chunks over 16 lanes: a tail iteration
         ("adreno", "int4-g64-f16", 300, 37)]  # float16 scales and zeros


def quantized(preset: str, k: int, n: int):
    return get_format(preset).quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))


def gemv_func(preset: str, k: int, n: int, target, accumulate: str | None = None):
    fmt, f = get_format(preset), facts(target)
    if accumulate is None:
        return scheduled(ops.qmatmul_func(fmt, k, n, 1, **f.gemv_options(fmt, k)), target)
    return scheduled(ops.qmatmul_f16_func(fmt, k, n, 1, **f.gemv_options(fmt, k), accumulate=accumulate), target)


def check(func, qt, half_as_float: bool = False) -> None:
    rng = np.random.default_rng(1)
    for m in (1, 3):
        x = rng.standard_normal((m, qt.k)).astype(np.float32)
        got = run_on_pocl(func, x, blocked(qt), qt.n, half_as_float=half_as_float)
        assert rel_err(got, x.astype(np.float64) @ qt.dequantize()) < 1e-5, m


@needs_opencl
@pytest.mark.parametrize("device,preset,k,n", CASES)
def test_gemv_matches_reference_on_opencl(device, preset, k, n):
    check(gemv_func(preset, k, n, DEVICES[device]), quantized(preset, k, n), half_as_float="-f16" in preset)


# fp16 activations: fp32 sums (``--act fp16``) and fp16 sums per lane chunk (``fp16-acc16``).
F16_CASES = [("mali", "int4-g128", 300, 37, "float32"), ("adreno", "e0m4-g128", 700, 37, "float32"),
             ("mali", "int3-g128", 1000, 70, "float16"), ("adreno", "int2-g16", 576, 37, "float16"),
             ("bifrost", "int8-g32", 200, 9, "float32")]


@needs_opencl
@pytest.mark.parametrize("device,preset,k,n,accumulate", F16_CASES)
def test_fp16_gemv_indexing_on_opencl(device, preset, k, n, accumulate):
    """The fp16 kernel with its ``qtvm.intrin.opencl`` decode (half spelled float: no rounding,
    so it must equal the exact product)."""
    func = gemv_func(preset, k, n, DEVICES[device], accumulate)
    assert "as_half2(" in _source(func, DEVICES[device])
    check(func, quantized(preset, k, n), half_as_float=True)


def _source(func, target) -> str:
    from tvm.tirx.build import codegen_build

    _, device_mod, device_target = lower(func, target)
    return codegen_build(device_mod, device_target).inspect_source()


def _work_group(func, target) -> tuple[int, int]:
    """(threadIdx.x, threadIdx.y) extents of the lowered kernel."""
    _, device_mod, _ = lower(func, target)
    found = {}

    def walk(stmt):
        if type(stmt).__name__ == "AttrStmt" and stmt.attr_key == "thread_extent" \
                and str(stmt.node.thread_tag).startswith("threadIdx"):
            found[str(stmt.node.thread_tag)] = int(stmt.value)
        for child in (getattr(stmt, "seq", None) or [getattr(stmt, "body", None)]):
            if child is not None and not isinstance(child, (int, float)):
                walk(child)

    for kernel in device_mod.functions.values():
        walk(kernel.body)
    return found.get("threadIdx.x", 1), found.get("threadIdx.y", 1)


def test_launch_shape_follows_the_device():
    """Lanes = the device's subgroup (Mali Valhall 16, Bifrost 8, Adreno 64), K = 4096."""
    shapes = {name: _work_group(gemv_func("int4-g128", 4096, 512, target), target) for name, target in DEVICES.items()}
    assert shapes == {"mali": (16, 4), "adreno": (64, 2), "bifrost": (8, 8)}


def test_loads_are_128_bit():
    """Weights one ``vload4`` of int per lane and column; activations ``vload4`` of float, or on the
    fp16 path eight at a time rounded to a half8; E0M4 decoded by the exponent OR."""
    fp32 = _source(gemv_func("int4-g128", 4096, 4096, MALI), MALI)
    assert "vload4(0, qweight_ptr" in fp32 and "vload4(0, x_ptr" in fp32
    f16 = _source(gemv_func("e0m4-g128", 4096, 4096, MALI, "float32"), MALI)
    assert "convert_half8(vload8(0, x_ptr" in f16 and "vload4(0, qweight_ptr" in f16
    assert "as_half2(" in f16 and "1006648320" in f16  # 0x3C003C00: the exponent of 1.0 in both halves


def test_rule_declines_what_is_not_its_own():
    import tvm

    fmt = get_format("int4-g128")
    assert opencl_gemv.schedule_qmatmul_opencl(ops.qmatmul_func(fmt, 256, 64, 64), MALI) is None  # x86 layout
    assert opencl_gemv.schedule_qmatmul_opencl(ops.qmatmul_func(fmt, 256, 64, 1), tvm.target.Target("llvm")) is None


def emulate_f16_fp32_sums(x: np.ndarray, qt) -> np.ndarray:
    """What the ``--act fp16`` OpenCL kernel computes: x rounded to fp16, exact fp16 x fp16
    products (they fit fp32), fp32 sums; the decoded codes are exact."""
    xh = x.astype(np.float16).astype(np.float64)
    return xh @ qt.dequantize()


def test_fp16_activation_error_is_measured():
    """The numerics of ``--act fp16`` and ``fp16-acc16`` on OpenCL (emulated: no fp16 device
    here), int4-g128, K = 4096, N = 512, against the exact product with the same weights:
    fp32 sums leave only the activation rounding (2^-11); fp16 chunk sums add their own."""
    from tests.schedules.test_gpu_gemv import emulate_f16_gemv

    k, n = 4096, 512
    rng = np.random.default_rng(0)
    qt = get_format("int4-g128").quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.02)
    x = rng.standard_normal((4, k)).astype(np.float32)
    exact = x.astype(np.float64) @ qt.dequantize()
    fp32_sums = rel_err(emulate_f16_fp32_sums(x, qt), exact)
    fp16_sums = rel_err(emulate_f16_gemv(x, qt, facts(MALI).gemv_options(qt.fmt, k)["chunk"]), exact)
    print(f"--act fp16 (fp32 sums): {fp32_sums:.2e}; --act fp16-acc16: {fp16_sums:.2e}")
    assert 1e-5 < fp32_sums < 1e-3 and fp32_sums < fp16_sums < 1e-2


def test_tuning_space_keeps_the_opencl_decode():
    """``qtvm tune``'s GPU design space schedules an OpenCL kernel as this rule does (the device's
    lanes as the analytic knob, the as_half2 decode, vector activation loads)."""
    from schedules.gpu_tune import GpuKnobSpace

    fmt = get_format("int4-g128")
    func = ops.qmatmul_f16_func(fmt, 1024, 128, 1, **facts(MALI).gemv_options(fmt, 1024), accumulate="float32")
    space = GpuKnobSpace.of(func, MALI)
    assert space.analytic["lanes"] == 16
    source = _source(space.schedule(func).mod["main"], MALI)
    assert "as_half2(" in source and "convert_half8(vload8(0, x_ptr" in source
