"""The ``--act fp16`` prefill GEMM (tensor cores on CUDA): its compute against the numpy
emulation of its rounding on every format (fp16 x, fp16 dequantized weight, fp32 sums;
M = 1, 17, 67; K not a multiple of the group; N not of the 128-column tile), the rule
(TVM's wmma matmul, scheduled for sm_80 and sm_90) through ptxas without spills, and
the pass choosing it only where the format has fp16 kernels. No GPU here: the scheduled
kernel runs in benchmarks/gpu_device_check.py (part ``tc``) on a lent card."""
from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest
import tvm

from qtvm import ops
from qtvm.formats import get_format
from qtvm.ops_gemm import qmatmul_gemm_f16_func
from qtvm.target import parse_target
from schedules import compile_func, facts, gpu, gpu_gemm_tc, schedule_kernel
from tests.gpu import SM80, check_ptxas, needs_nvcc, rel_err

#: the formats with fp16 kernels (``gpu.F16_UNPACKS``), awkward shapes
CASES = [("int4-g128", 300, 37), ("int2-g64", 1000, 33), ("int8-g32", 200, 9), ("int4-g128-qz", 700, 37),
         ("e0m4-g128", 700, 37), ("int4-col", 100, 37)]


def emulate_f16_gemm(x: np.ndarray, qt) -> np.ndarray:
    """What the fp16 GEMM computes: x and the fp32 dequantized weight each rounded to fp16,
    products and sums exact (fp64 here; fp32 on the GPU)."""
    w16 = qt.dequantize().astype(np.float32).astype(np.float16).astype(np.float64)
    return x.astype(np.float16).astype(np.float64) @ w16


@pytest.mark.parametrize("preset,k,n", CASES + [("bcq3-g128", 300, 40), ("int3-g128", 1000, 70)])
def test_compute_matches_its_emulation(preset, k, n):
    """The compute, unscheduled on the CPU: within fp32 rounding of the emulation, and its
    distance from the exact product is the fp16 rounding (about 3e-4 of the largest output)."""
    fmt = get_format(preset)
    qt = fmt.quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))
    lib = compile_func(qmatmul_gemm_f16_func(fmt, k, n, 1), tvm.target.Target("llvm"))
    weights = [tvm.runtime.tensor(a) for a in ops.blocked_arrays(qt, 1)]
    for m in (1, 17, 67):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), *weights, y)
        assert rel_err(y.numpy(), emulate_f16_gemm(x, qt)) < 1e-5
        assert 1e-5 < rel_err(y.numpy(), x.astype(np.float64) @ qt.dequantize()) < 2e-3


def test_rule_is_the_tensor_core_matmul():
    func = schedule_kernel(qmatmul_gemm_f16_func(get_format("int4-g128"), 4096, 11008, 1), SM80)
    text = func.script()
    assert "wmma.matrix_a" in text and "wmma.accumulator" in text and "tvm_mma_sync" in text
    assert gpu_gemm_tc.schedule_qmatmul_gemm_tc(qmatmul_gemm_f16_func(get_format("int4-g128"), 256, 64, 1),
                                               parse_target("opencl")) is None  # CUDA only


def _stacks():
    return inspect.stack(), gpu_gemm_tc.shallow_stack()


def test_shallow_stack_has_what_tvms_parser_reads():
    """TVM 0.27's parser reads each frame (closure variables) and frame 2's source line and
    line number (``is_defined_in_class``); the shallow stack used while TVM's CUDA intrinsics
    are imported must give those exactly (the rule test above tensorizes with them)."""
    full, shallow = _stacks()
    assert len(full) == len(shallow) > gpu_gemm_tc.SHALLOW_SOURCE_FRAMES
    assert [f.frame for f in full] == [f.frame for f in shallow]
    assert [(f.filename, f.lineno, f.function) for f in full] == [(f.filename, f.lineno, f.function) for f in shallow]
    for i in range(gpu_gemm_tc.SHALLOW_SOURCE_FRAMES):
        assert full[i].code_context == shallow[i].code_context and full[i].index == shallow[i].index
    assert shallow[2].code_context and "_stacks()" in shallow[1].code_context[0]
    gpu_gemm_tc.import_tvm_cuda_intrinsics()
    assert gpu_gemm_tc.TVM_CUDA_INTRINSICS in sys.modules and inspect.stack is not gpu_gemm_tc.shallow_stack


def test_tensor_cores_need_cuda_sm70():
    assert gpu_gemm_tc.tensor_cores(SM80) and gpu_gemm_tc.tensor_cores(parse_target("cuda -arch=sm_90"))
    assert not gpu_gemm_tc.tensor_cores(parse_target("opencl"))
    assert not gpu_gemm_tc.tensor_cores(tvm.target.Target({"kind": "cuda", "arch": "sm_61"}))
    assert facts(SM80).f16_gemm and not facts(parse_target("opencl")).f16_gemm


@needs_nvcc
def test_tensor_core_gemm_fits_without_spills():
    """Every format with fp16 kernels, N padded as the pass pads it, and int4 at a LLaMA
    shape, for sm_80 and sm_90 (int3's inlined 3-word decode spilled 8-56 bytes under the
    wmma rule's 128-register budget: int3 keeps fp32, as its GEMV does)."""
    funcs = {f"tc_{p.replace('-', '_')}_{k}": schedule_kernel(qmatmul_gemm_f16_func(
        get_format(p), k, -(-n // gpu.COL_PAD) * gpu.COL_PAD, 1), SM80) for p, k, n in CASES}
    funcs["tc_int4_g128_big"] = schedule_kernel(qmatmul_gemm_f16_func(get_format("int4-g128"), 4096, 11008, 1),
                                                SM80)
    check_ptxas(funcs)


def test_f16_gemm_formats_are_the_f16_gemv_formats():
    """The pass runs the fp16 GEMM exactly where the fp16 GEMV runs: int3 has no fp16 unpack
    (and would spill here), BCQ neither."""
    for preset, k, _ in CASES:
        fmt = get_format(preset)
        assert facts(SM80).f16_activations(fmt, k), preset
    for preset in ("int3-g128", "bcq3-g128"):
        assert not facts(SM80).f16_activations(get_format(preset), 1024)
