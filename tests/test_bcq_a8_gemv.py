"""The int8 nibble-table BCQ GEMV (``qtvm.bcq_a8_gemv``, AVX-512 VBMI + VNNI): numerics on
awkward shapes against a float64 reference built from the format's own planes, the asm of
its hot loop, the choice of kernel, and an ONNX model through compile + ``qtvm check``."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from qtvm import bcq_a8_gemv, lut_gemv, ops
from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.formats.bcq import BCQFormat
from qtvm.hostinfo import host_cpu_flags
from schedules import compile_kernel, family
from schedules.x86_bcq import bcq_a8_isa, prefer_bcq_a8, schedule_bcq_a8_gemv_x86
from tests.kernels import NB, rel_err

HOST_VNNI = {"avx512bw", "avx512vbmi", "avx512_vnni"} <= host_cpu_flags()
NO_VNNI = "this CPU lacks AVX-512 VBMI + VNNI: the kernel cannot run here"
# A target this host runs where it has the ISA (the oldest CPU with both), and the CPUs the
# kernel is built for.
HOST = tvm.target.Target({"kind": "llvm", "mcpu": "icelake-server"})
VNNI_TARGETS = {name: tvm.target.Target({"kind": "llvm", "mcpu": name})
                for name in ("icelake-server", "znver5", "emeraldrapids")}


def _reference(x: np.ndarray, qt) -> np.ndarray:
    """y = x_hat @ W in float64, independent of the kernel's formula: x rounded per weight
    group as the kernel rounds (fp32 max |x| and 127 / max, round half to even, clip), W
    summed from the format's unpacked sign planes, alphas and bias."""
    fmt = qt.fmt
    q, kp, gs = fmt.bits, fmt.padded_k(qt.k), fmt.group_size_for(qt.k)
    xp = np.zeros((x.shape[0], kp), np.float32)
    xp[:, : qt.k] = x
    groups = xp.reshape(x.shape[0], -1, gs)
    amax = np.abs(groups).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    xq = np.clip(np.round(groups * inv), -127, 127).astype(np.float64)
    x_hat = (xq * (amax.astype(np.float64) / 127)).reshape(x.shape[0], kp)
    signs = np.where(fmt.unpack(qt.arrays["bits"], kp), 1.0, -1.0)  # [q, kp, N]
    alpha = qt.arrays["alpha"].astype(np.float64).reshape(kp // gs, q, qt.n)
    w = np.repeat(qt.arrays["bias"].astype(np.float64), gs, axis=0)
    for t in range(q):
        w += np.repeat(alpha[:, t], gs, axis=0) * signs[t]
    return x_hat @ w


def _run(lib, x: np.ndarray, qt) -> np.ndarray:
    out = tvm.runtime.tensor(np.full((x.shape[0], qt.n), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(x, np.float32)),
                *[tvm.runtime.tensor(a) for a in ops.blocked_arrays(qt, NB)], out)
    return out.numpy()


def test_numpy_nibble_tables_match_the_dequantized_product():
    """The algorithm itself (xq = 16 xh + xl, int8 tables of +-sums of 4, the stored words'
    nibbles as indices) in numpy equals x_hat @ W, also where x is large at the clip."""
    rng = np.random.default_rng(4)
    for name, k, n in (("bcq3-g128", 1000, 37), ("bcq2-g32", 300, 5), ("bcq4-g64", 256, 16)):
        qt = get_format(name).quantize(rng.standard_normal((k, n)).astype(np.float32))
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[1] = np.sign(x[1]) * 3.0  # every xq at +-127: xh = 7 / -8, xl = 15 / 1
        assert rel_err(bcq_a8_gemv.reference(x, qt), _reference(x, qt)) < 1e-9


def test_reference_matches_the_int16_kernels_reference():
    rng = np.random.default_rng(2)
    qt = get_format("bcq3-g128").quantize(rng.standard_normal((1000, 37)).astype(np.float32))
    x = rng.standard_normal((2, 1000)).astype(np.float32)
    assert rel_err(_reference(x, qt), lut_gemv.reference_a8(x, qt)) < 1e-6  # W there is fp32-rounded


CASES = [
    (get_format("bcq3-g128"), 1000, 37),  # K not a multiple of the group, N not of 16
    (get_format("bcq2-g32"), 300, 70),
    (get_format("bcq4-g64"), 1000, 1),
    (get_format("bcq4-g128"), 256, 70),
    (get_format("bcq2-g128"), 1000, 130),  # three column blocks, the last one 2 columns
    (BCQFormat(1, 256), 1000, 5),  # one plane: compute_at leaves no plane loop
    (BCQFormat(3, None), 500, 17),  # one group per column (512 rows)
]


@pytest.mark.parametrize("fmt, k, n", CASES, ids=lambda v: getattr(v, "name", v))
def test_unscheduled_compute_matches_reference(fmt, k, n):
    """The TE compute itself (any x86 host): what the rule must reproduce."""
    rng = np.random.default_rng(k * 7 + n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    lib = tvm.compile(tvm.IRModule({"main": bcq_a8_gemv.bcq_a8_gemv_func(fmt, k, n, NB)}),
                      target=tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))
    x = rng.standard_normal((2, k)).astype(np.float32)
    assert rel_err(_run(lib, x, qt), _reference(x, qt)) < 1e-5


@pytest.mark.skipif(not HOST_VNNI, reason=NO_VNNI)
@pytest.mark.parametrize("fmt, k, n", CASES, ids=lambda v: getattr(v, "name", v))
def test_kernel_matches_reference_on_this_cpu(fmt, k, n):
    """The scheduled kernel (vpermb + vpdpbusd) run here: float-exact against the
    float64 reference at M = 1, 2 (decode) and 5 (any M is correct), and no NaN left in y."""
    rng = np.random.default_rng(k + n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    func = bcq_a8_gemv.bcq_a8_gemv_func(fmt, k, n, NB)
    assert str(func.attrs[ops.KERNEL_ATTR]) == "bcq_a8_gemv"
    lib = compile_kernel(func, HOST)  # through the x86 family's rules
    for m in (1, 2, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, : min(k, 40)] *= 50  # one large group maximum: small values round to 0
        out = _run(lib, x, qt)
        assert rel_err(out, _reference(x, qt)) < 1e-5, m
        # and it did round: not the fp32-activation product
        assert rel_err(out, x.astype(np.float64) @ qt.dequantize().astype(np.float64)) > 1e-5


@pytest.mark.skipif(not HOST_VNNI, reason=NO_VNNI)
def test_extreme_values_stay_exact():
    """Every bit set, or every bit clear, and every activation at its group's maximum
    (xq = 127: xh = 7, xl = 15, table entries +-60 and +-28, or -127: xh = -8, xl = 1): the
    int32 sums are +-127 * 512 per plane, exactly."""
    from qtvm.formats.base import QuantizedTensor

    fmt, k, n = BCQFormat(2, None), 500, 16  # one 512-row group
    lib = compile_kernel(bcq_a8_gemv.bcq_a8_gemv_func(fmt, k, n, NB), HOST)
    for bit in (True, False):
        planes = np.full((2, fmt.padded_k(k), n), bit)
        qt = QuantizedTensor(fmt, k, n, {"bits": fmt.pack(planes), "alpha": np.ones((2, n), np.float32),
                                         "bias": np.full((1, n), 0.5, np.float32)})
        for value in (0.25, -0.25):
            x = np.full((1, k), value, np.float32)
            want = _reference(x, qt)
            assert abs(want[0, 0]) > 100  # 500 * 0.25 * (+-2 + 0.5)
            np.testing.assert_allclose(_run(lib, x, qt), want, rtol=1e-6)


@pytest.mark.parametrize("mcpu", list(VNNI_TARGETS))
def test_hot_loop_is_vpermb_and_vpdpbusd(mcpu):
    """Compiled for each VBMI + VNNI CPU (no need to run it): per (block, plane, 16 columns)
    step one shift, 4 vpermb lookups, 2 byte adds of the halves and 2 vpdpbusd dots, 2 index
    vpternlog, and one prefetch where the CPU's facts give the kernel a distance (Zen 5: none);
    no masks, gathers or scalar byte loads."""
    from qtvm.bench.asm_loops import hot_loop
    from schedules.x86_lut import lut_prefetch_bytes

    target = VNNI_TARGETS[mcpu]
    lib = compile_kernel(bcq_a8_gemv.bcq_a8_gemv_func(get_format("bcq3-g128"), 1024, 256, NB), target)
    loop = hot_loop(lib.mod.inspect_source("asm"), "vpdpbusd")
    mix = Counter(ins.split()[0] for ins in loop)
    steps = mix["vpsrld"]
    assert steps >= 1 and mix["vpdpbusd"] == 2 * steps and mix["vpermb"] == 4 * steps, mix
    assert mix["prefetcht1"] == (steps if lut_prefetch_bytes(target, a8=True, nibble=True) else 0), mix
    assert mix["vpaddb"] == 2 * steps and "vpaddd" not in mix, mix
    assert mix["vpternlogd"] + mix["vpternlogq"] == 2 * steps, mix
    assert not any(op.startswith(("kmov", "vpermw", "vgather", "vpextr", "movzbl", "movsbl")) for op in mix), mix
    assert all("%zmm" in ins for ins in loop if ins.startswith(("vpermb", "vpdpbusd")))


def test_rule_and_choice_need_vbmi_and_vnni():
    fmt = get_format("bcq3-g128")
    func = bcq_a8_gemv.bcq_a8_gemv_func(fmt, 4096, 64, NB)
    assert schedule_bcq_a8_gemv_x86.__name__ in {r.__name__ for r in family(HOST).rules()}
    for target in VNNI_TARGETS.values():
        assert bcq_a8_isa(target) and prefer_bcq_a8(fmt, 4096, target)
        assert family(target).facts(target).bcq_a8_gemv(fmt, 4096)
    # AVX-512BW without VNNI; VNNI without VBMI (Cascade Lake); AVX2 (+ AVX-VNNI)
    for mcpu in ("skylake-avx512", "cascadelake", "znver3", "alderlake"):
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
        assert not prefer_bcq_a8(fmt, 4096, target) and schedule_bcq_a8_gemv_x86(func, target) is None
    assert not prefer_bcq_a8(get_format("int4-g128"), 4096, HOST)
    assert not prefer_bcq_a8(BCQFormat(3, None), 1000, HOST)  # 1024-row group: the int16 kernel's limit too
    assert schedule_bcq_a8_gemv_x86(lut_gemv.lut16_a8_gemv_func(fmt, 4096, 64, NB), HOST) is None
    with pytest.raises(QtvmError, match="needs a BCQ format"):
        bcq_a8_gemv.bcq_a8_gemv_func(get_format("int4-g128"), 256, 8, NB)


def test_rounding_is_the_int16_kernels_per_group():
    """Both BCQ int8 kernels round per weight group for decode rows only, so ``qtvm check``'s
    reference (``int8_rounding``) is the same whichever the target runs."""
    fmt = get_format("bcq3-g128")
    for target in (HOST, tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})):
        rounding = family(target).facts(target).int8_rounding(fmt, 1000)
        assert rounding.block == 128 and rounding.max_rows == 2


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(not HOST_VNNI, reason=NO_VNNI)
def test_onnx_matmul_compiles_to_the_kernel_and_checks(tmp_path):
    """An ONNX MatMul (K = 1000, N = 70) compiled --quant bcq3-g128 --act int8 for this CPU:
    its decode GEMV is this kernel (the prefill branch keeps the fp32 GEMM), and ``qtvm check``
    passes at decode and prefill bindings (its reference rounds decode rows per group)."""
    w = np.random.default_rng(0).standard_normal((1000, 70)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "one",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 1000])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 70])],
                              [numpy_helper.from_array(w, "w")])
    model, art = tmp_path / "one.onnx", tmp_path / "one.so"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    built = _cli("compile", model, "--quant", "bcq3-g128", "--act", "int8", "-o", art)
    assert built.returncode == 0, built.stderr
    blob = art.read_bytes()
    assert b"bcq_a8_gemv_bcq3_g128" in blob and b"lut16_a8_gemv" not in blob
    run = _cli("check", model, art, "--shape", "batch=1,seq=1", "--shape", "batch=1,seq=2",
               "--shape", "batch=3,seq=5")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK:" in run.stdout and "rounded to int8 as the kernels round them" in run.stdout
