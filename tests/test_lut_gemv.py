"""The LUT-GEMM kernel for BCQ weights: compute, x86 rule, numerics on awkward shapes."""

import numpy as np
import pytest
import tvm

from qtvm import lut_gemv, ops
from qtvm.errors import QtvmError
from qtvm.formats import UniformFormat, get_format
from qtvm.formats.bcq import BCQFormat, from_uniform
from schedules import family
from schedules.x86_lut import schedule_lut_gemv_x86
from tests.kernels import AVX2 as TARGET
from tests.kernels import NB, compile_scheduled, rel_err, run_blocked



def test_func_carries_kernel_and_format_attrs():
    func = lut_gemv.lut_gemv_func(get_format("bcq3-g128"), 1000, 37, NB)
    assert str(func.attrs[ops.KERNEL_ATTR]) == "lut_gemv"
    desc = func.attrs[ops.FORMAT_ATTR]
    assert str(desc["family"]) == "bcq" and int(desc["planes"]) == 3 and int(desc["mu"]) == 8
    assert int(desc["padded_k"]) == 1024 and int(desc["group"]) == 128
    # Same arguments as qmatmul: x, bits, alpha, bias, y.
    dense = ops.qmatmul_func(get_format("bcq3-g128"), 1000, 37, NB)
    assert [p.name for p in func.params] == [p.name for p in dense.params]


def test_rejects_non_bcq_formats():
    with pytest.raises(QtvmError, match="needs a BCQ format"):
        lut_gemv.lut_gemv_func(get_format("int4-g128"), 256, 8, NB)


def test_rule_only_takes_lut_kernels_on_llvm():
    fmt = get_format("bcq2-g32")
    assert schedule_lut_gemv_x86.__name__ in {r.__name__ for r in family(TARGET).rules()}
    assert schedule_lut_gemv_x86(ops.qmatmul_func(fmt, 64, 8, NB), TARGET) is None
    lut = lut_gemv.lut_gemv_func(fmt, 64, 8, NB)
    assert schedule_lut_gemv_x86(lut, tvm.target.Target({"kind": "c"})) is None
    assert schedule_lut_gemv_x86(lut, TARGET) is not None


def test_numpy_table_reference_matches_dense():
    rng = np.random.default_rng(0)
    qt = get_format("bcq3-g32").quantize(rng.standard_normal((300, 37)).astype(np.float32))
    x = rng.standard_normal((5, 300))
    ref = x @ qt.dequantize().astype(np.float64)
    assert rel_err(lut_gemv.reference(x, qt), ref) < 1e-6  # the dequantized matrix is fp32-rounded


@pytest.mark.parametrize("fmt, k, n", [
    (get_format("bcq3-g128"), 1000, 37), (get_format("bcq2-g32"), 300, 1), (get_format("bcq4-g64"), 1000, 1),
    (get_format("bcq3-g64"), 300, 37),
    (BCQFormat(1, 256), 1000, 5),  # one plane: no plane loop left after compute_at
    (BCQFormat(2, 16), 100, 37),  # half-word groups; an extra all-padding group
    (BCQFormat(3, None), 300, 1),  # one group per column
], ids=lambda v: getattr(v, "name", v))
def test_scheduled_kernel_matches_reference(fmt, k, n):
    rng = np.random.default_rng(k + n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    deq = qt.dequantize().astype(np.float64)
    lib = compile_scheduled(lut_gemv.lut_gemv_func(qt.fmt, k, n, NB), TARGET)  # through the family's rules
    for m in (1, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = run_blocked(lib, x, qt)
        assert rel_err(out, x.astype(np.float64) @ deq) < 1e-5
        assert rel_err(out, lut_gemv.reference(x, qt)) < 1e-5


def test_kernel_on_uniform_weights_converted_to_bcq():
    """int4-g128 weights run through the LUT kernel via the exact BCQ conversion."""
    rng = np.random.default_rng(3)
    uq = UniformFormat(4, 128).quantize(rng.standard_normal((300, 37)).astype(np.float32))
    bq = from_uniform(uq)
    func = schedule_lut_gemv_x86(lut_gemv.lut_gemv_func(bq.fmt, 300, 37, NB), TARGET).mod
    lib = tvm.compile(func, target=TARGET)
    x = rng.standard_normal((17, 300)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((17, 37), np.float32))
    lib["main"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(a) for a in ops.blocked_arrays(bq, NB)], out)
    assert rel_err(out.numpy(), x.astype(np.float64) @ uq.dequantize().astype(np.float64)) < 1e-5


# -- the 16-entry tables (vpermps) ---------------------------------------------------------
from qtvm.hostinfo import host_cpu_flags  # noqa: E402
from schedules.x86_lut import prefer_lut16, schedule_lut16_gemv_x86  # noqa: E402

LUT16_TARGETS = [TARGET] + ([tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})]
                            if "avx512f" in host_cpu_flags() else [])


@pytest.mark.parametrize("target", LUT16_TARGETS, ids=lambda t: str(t.attrs.get("mcpu")))
@pytest.mark.parametrize("fmt, k, n", [
    (get_format("bcq3-g128"), 1000, 37), (get_format("bcq2-g32"), 300, 70), (get_format("bcq4-g64"), 256, 1),
    (BCQFormat(1, 256), 1000, 5), (BCQFormat(3, None), 300, 17),
], ids=lambda v: getattr(v, "name", v))
def test_lut16_kernel_matches_reference(target, fmt, k, n):
    rng = np.random.default_rng(k * n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    func = lut_gemv.lut16_gemv_func(fmt, k, n, NB)
    assert str(func.attrs[ops.KERNEL_ATTR]) == "lut16_gemv" and int(func.attrs[ops.FORMAT_ATTR]["mu"]) == 4
    lib = compile_scheduled(func, target)  # through RULES
    for m in (1, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = run_blocked(lib, x, qt)
        assert rel_err(out, x.astype(np.float64) @ qt.dequantize().astype(np.float64)) < 1e-5


def test_lut16_unscheduled_equals_scheduled():
    """The one-hot form of the lookup (what the rule tensorizes) computes the same values."""
    fmt = get_format("bcq2-g64")
    rng = np.random.default_rng(9)
    qt = fmt.quantize(rng.standard_normal((200, 40)).astype(np.float32))
    func = lut_gemv.lut16_gemv_func(fmt, 200, 40, NB)
    plain = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    x = rng.standard_normal((3, 200)).astype(np.float32)
    np.testing.assert_allclose(run_blocked(plain, x, qt), run_blocked(compile_scheduled(func, TARGET), x, qt),
                               rtol=1e-5, atol=1e-5)


def test_lut16_lookups_are_permutes_in_the_hot_loop():
    """Per 32-row block, plane and 16 columns: 8 permutes (vpermps, which LLVM may spell
    vpermd), 7 shifts, the bit stream's next line prefetched, no gathers or scalar table reads."""
    from collections import Counter

    from qtvm.bench.asm_loops import hot_loop

    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    lib = compile_scheduled(lut_gemv.lut16_gemv_func(get_format("bcq3-g128"), 1024, 256, NB), target)
    asm = lib.mod.inspect_source("asm")
    marker = "vpermd" if "vpermd" in asm else "vpermps"
    mix = Counter(ins.split()[0] for ins in hot_loop(asm, marker))
    steps = mix[marker] / 8
    assert steps >= 1 and mix["vpsrld"] == 7 * steps and mix["prefetcht1"] == steps  # one line per step
    assert not any(op.startswith(("vgather", "vmovss")) for op in mix)


def test_lut16_needs_whole_blocks_and_a_vector_isa():
    assert lut_gemv.supports_lut16(get_format("bcq3-g128"), 1000)
    assert not lut_gemv.supports_lut16(BCQFormat(2, 16), 100)
    assert not lut_gemv.supports_lut16(get_format("int4-g128"), 1000)
    with pytest.raises(QtvmError, match="whole 32-row blocks"):
        lut_gemv.lut16_gemv_func(BCQFormat(2, 16), 100, 8, NB)
    assert prefer_lut16(get_format("bcq3-g128"), 1000, TARGET)
    assert not prefer_lut16(get_format("bcq3-g128"), 1000, tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))
    assert schedule_lut16_gemv_x86(lut_gemv.lut_gemv_func(get_format("bcq2-g32"), 64, 8, NB), TARGET) is None


# -- int8 activations: int16 table pairs (vpermw, AVX-512BW) -------------------------------
from schedules.x86_lut import prefer_lut16_a8  # noqa: E402

AVX512BW = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
HOST_AVX512BW = "avx512bw" in host_cpu_flags()


def _a8_libs(func):
    """The unscheduled kernel everywhere; the scheduled one (vpermw) where this CPU runs it."""
    libs = {"unscheduled": tvm.compile(tvm.IRModule({"main": func}), target=TARGET)}
    if HOST_AVX512BW:
        libs["vpermw"] = compile_scheduled(func, AVX512BW)
    return libs


@pytest.mark.parametrize("fmt, k, n", [
    (get_format("bcq3-g128"), 1000, 37), (get_format("bcq2-g32"), 300, 70), (get_format("bcq4-g64"), 256, 1),
    (BCQFormat(1, 256), 1000, 5), (BCQFormat(3, None), 300, 17), (BCQFormat(2, None), 500, 19),
], ids=lambda v: getattr(v, "name", v))
def test_lut16_a8_kernel_matches_its_reference(fmt, k, n):
    """x rounded to int8 per weight group, times the BCQ weight: exact to fp32 rounding
    against ``reference_a8``, and within the rounding's error of the fp32 product."""
    rng = np.random.default_rng(k + n)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    func = lut_gemv.lut16_a8_gemv_func(fmt, k, n, NB)
    assert str(func.attrs[ops.KERNEL_ATTR]) == "lut16_a8_gemv" and str(func.attrs[ops.FORMAT_ATTR]["activations"]) == "int8"
    for name, lib in _a8_libs(func).items():
        for m in (1, 3):
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = run_blocked(lib, x, qt)
            assert rel_err(out, lut_gemv.reference_a8(x, qt)) < 1e-5, name
            assert rel_err(out, x.astype(np.float64) @ qt.dequantize().astype(np.float64)) < 3e-2, name


def test_lut16_a8_partials_do_not_overflow_at_the_largest_group():
    """Every activation at its group's maximum and every bit set, in a group of 512 (one
    per column): each 16-bit lane sums 64 entries of 4 * 127 = 32512, the most allowed."""
    fmt, k, n = BCQFormat(1, None), lut_gemv.A8_MAX_GROUP, 16
    qt = fmt.quantize(np.ones((k, n), np.float32))
    x = np.full((1, k), 0.5, np.float32)
    for name, lib in _a8_libs(lut_gemv.lut16_a8_gemv_func(fmt, k, n, NB)).items():
        np.testing.assert_allclose(run_blocked(lib, x, qt), lut_gemv.reference_a8(x, qt), rtol=1e-6, err_msg=name)


def test_lut16_a8_declines_long_groups_and_cpus_without_vpermw():
    assert lut_gemv.supports_lut16_a8(get_format("bcq3-g128"), 4096)
    assert lut_gemv.supports_lut16_a8(BCQFormat(3, None), 500)  # one group of 512 rows
    assert not lut_gemv.supports_lut16_a8(BCQFormat(3, None), 1000)  # 1024: 16-bit partials could overflow
    with pytest.raises(QtvmError, match="at most 512 rows"):
        lut_gemv.lut16_a8_gemv_func(BCQFormat(2, None), 4096, 8, NB)
    assert prefer_lut16_a8(get_format("bcq3-g128"), 4096, AVX512BW)
    assert not prefer_lut16_a8(get_format("bcq3-g128"), 4096, TARGET)  # AVX2: no vpermw


def test_lut16_a8_hot_loop_is_vpermw_with_prefetch():
    """Per 32-row block, plane and 16 columns (one prefetch of the bit stream each): 4
    vpermw lookups of two chunks, their 4 indices one vpternlog each; at a group's end a
    few more permutes split the int16 partials' halves. No gathers, no scalar table reads."""
    from collections import Counter

    from qtvm.bench.asm_loops import hot_loop

    lib = compile_scheduled(lut_gemv.lut16_a8_gemv_func(get_format("bcq3-g128"), 1024, 256, NB), AVX512BW)
    mix = Counter(ins.split()[0] for ins in hot_loop(lib.mod.inspect_source("asm"), "vpermw"))
    steps = mix["prefetcht1"]  # (block, plane, 16 columns) steps in the loop
    assert steps >= 4 and mix["vpternlogq"] + mix["vpternlogd"] == 4 * steps
    assert 4 * steps <= mix["vpermw"] < 5 * steps and mix["vpaddw"] >= 4 * steps
    assert not any(op.startswith(("vgather", "vpextr", "movzwl")) for op in mix)


@pytest.mark.parametrize("a8", [False, True], ids=["fp32-tables", "int16-tables"])
def test_lut16_prefetch_distance_is_a_knob(a8):
    """``prefetch_bytes`` (the tuning knob; the target's facts by default) sets how far ahead
    each lookup prefetches the bit stream, 0 none; the results do not change with it (run
    where this CPU has the kernel's ISA: AVX2 for fp32 tables, AVX-512BW for int16)."""
    from collections import Counter

    from qtvm.bench.asm_loops import hot_loop
    from schedules import compile_func
    from schedules.x86_lut import lut_prefetch_bytes, schedule_lut16_a8_gemv_x86, schedule_lut16_gemv_x86

    fmt, k, n = get_format("bcq3-g128"), 1000, 40
    rng = np.random.default_rng(5)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    func = (lut_gemv.lut16_a8_gemv_func if a8 else lut_gemv.lut16_gemv_func)(fmt, k, n, NB)
    rule, target = (schedule_lut16_a8_gemv_x86, AVX512BW) if a8 else (schedule_lut16_gemv_x86, TARGET)
    assert lut_prefetch_bytes(target, a8) == (4096 if a8 else 6144)  # the defaults (measured on Zen 5)
    x = rng.standard_normal((2, k)).astype(np.float32)
    outs = {}
    for nbytes in (None, 0, 8192):
        lib = compile_func(rule(func, target, prefetch_bytes=nbytes).mod["main"], target)
        asm = lib.mod.inspect_source("asm")
        marker = "vpermw" if a8 else ("vpermd" if "vpermd" in asm else "vpermps")
        mix = Counter(ins.split()[0] for ins in hot_loop(asm, marker))
        assert (mix["prefetcht1"] == 0) == (nbytes == 0), nbytes
        if HOST_AVX512BW or not a8:
            outs[nbytes] = run_blocked(lib, x, qt)
    for nbytes in outs:
        np.testing.assert_array_equal(outs[nbytes], outs[None])
        assert rel_err(outs[nbytes], lut_gemv.reference_a8(x, qt) if a8 else
                       x.astype(np.float64) @ qt.dequantize().astype(np.float64)) < 1e-5
