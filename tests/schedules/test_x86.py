"""The int8-activation GEMV rule's knobs: every setting the tuner may pick computes
x_hat @ W_hat exactly, and the hot loop issues the instructions it is meant to."""
from __future__ import annotations

import re
import numpy as np
import pytest
import tvm
from tvm import s_tir

from qtvm import ops
from qtvm.bench.asm_loops import block_mix
from qtvm.formats import get_format
from qtvm.intrin import x86 as intrin
from schedules import x86
from tests.kernels import ISA_TARGETS, NB, RUNNABLE, int8_rounded_reference, rel_err, run_a8

KNOBS = [
    {"streams": 2},  # two column blocks per task (N = 200: the second task's last block is partial)
    {"tile_cols": 16},  # four 16-column passes over each group's rows
    {"tile_cols": 32, "prefetch": (0, 0)},  # no software prefetch
    {"prefetch": (2048, 3)},  # another prefetch distance and level
]


CASES = [("int4-g128", 1000, knobs) for knobs in KNOBS] + [("int3-g64", 300, KNOBS[0]), ("int2-g32", 200, KNOBS[1]),
                                                         ("int4-g64", 1000, {"fold_groups": 2}),  # 16 groups
                                                         ("int2-g64", 250, {"fold_groups": 4}),  # 4 groups, K padded
                                                         ("int3-g128", 1000, {"fold_groups": 2})]  # 8 groups, K padded
ISAS = sorted({"avx2", RUNNABLE[-1]})  # AVX2 and the widest ISA this host runs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("preset,k,knobs", CASES,
                         ids=[f"{p}-" + "-".join(f"{n}{v}" for n, v in kn.items()) for p, _, kn in CASES])
def test_gemv_knobs_compute_the_rounded_product(isa, knobs, preset, k):
    fmt = get_format(preset)
    rng = np.random.default_rng(k)
    qt = fmt.quantize(rng.standard_normal((k, 200)).astype(np.float32))
    target = ISA_TARGETS[isa]
    sch = x86.schedule_qmatmul_a8_x86(ops.qmatmul_a8_func(fmt, k, 200, NB), target, **knobs)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)
    for m in (1, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        got, _ = run_a8(target, fmt, qt, x, lib=lib)
        assert rel_err(got, int8_rounded_reference(x, fmt, qt)) < 1e-5


def test_knobs_that_do_not_fit_the_shape_are_refused():
    fmt = get_format("int4-g128")
    func = ops.qmatmul_a8_func(fmt, 256, 150, NB)  # 3 column blocks
    with pytest.raises(ValueError, match="tile_cols"):
        x86.schedule_qmatmul_a8_x86(func, ISA_TARGETS["avx2"], tile_cols=24)
    with pytest.raises(ValueError, match="streams"):
        x86.schedule_qmatmul_a8_x86(func, ISA_TARGETS["avx2"], streams=2)


def test_prefetch_bytes_become_rows_of_the_blocked_array():
    assert x86.prefetch_rows((6144, 2), 64) == (24, 2)  # 256-byte rows
    assert x86.prefetch_rows((4096, 3), 16) == (64, 3)
    assert x86.prefetch_rows((0, 3), 64) == (0, 0)
    assert intrin.intrin_name(4, "avx2", (24, 2)) == intrin.intrin_name(4, "avx2")  # the default
    assert intrin.intrin_name(4, "avx2", (0, 0)).endswith("_nopf")


def test_pass_width_comes_from_the_target_facts():
    """Zen 5 measured 16-column passes faster (``target_facts``); other CPUs keep whole rows,
    and a measured width that does not divide the task's columns falls back to them."""
    from qtvm.target import parse_target

    assert x86.a8_tile_cols(parse_target("llvm -mcpu=znver5"), 64) == 16
    assert x86.a8_tile_cols(parse_target("llvm -mcpu=znver5"), 8) == 8
    assert x86.a8_tile_cols(parse_target("llvm -mcpu=skylake-avx512"), 64) == 64
    assert x86.a8_tile_cols(parse_target("llvm -mcpu=znver3"), 64) == 64


def test_default_schedule_on_zen5_is_the_16_column_pass_knob():
    """No knobs on a znver5 target = the explicit tile_cols=16 schedule; on another CPU = whole rows."""
    from qtvm.target import parse_target

    func = ops.qmatmul_a8_func(get_format("int4-g128"), 1000, 200, NB)
    zen5, skx = parse_target("llvm -mcpu=znver5"), parse_target("llvm -mcpu=skylake-avx512")
    script = lambda t, **kn: x86.schedule_qmatmul_a8_x86(func, t, **kn).mod.script()  # noqa: E731
    assert script(zen5) == script(zen5, tile_cols=16) != script(zen5, tile_cols=64)
    assert script(skx) == script(skx, tile_cols=64) != script(skx, tile_cols=16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("preset", ["int4-g64", "int2-g32", "int4-g128"])
def test_folding_groups_later_gives_the_same_bits(isa, preset):
    """Folding two groups' partials at once (the default for groups of 64 on Zen 4, of 128 on the
    Intel Xeon VM LLVM names rocketlake) is the same arithmetic in the same order as folding each
    group: the outputs are equal bit for bit."""
    fmt, k, n = get_format(preset), 1000, 200
    rng = np.random.default_rng(7)
    qt = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32))
    target, func = ISA_TARGETS[isa], ops.qmatmul_a8_func(fmt, k, n, NB)
    x = rng.standard_normal((2, k)).astype(np.float32)
    outs = []
    for fold in (1, 2):
        sch = x86.schedule_qmatmul_a8_x86(func, target, fold_groups=fold)
        outs.append(run_a8(target, fmt, qt, x, lib=tvm.compile(tvm.IRModule({"main": sch.mod["main"]}),
                                                                target=target))[0])
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("preset,fold", [("int4-g64", 2), ("int2-g64", 4), ("int3-g64", 2)])
def test_a_fold_runs_its_blocks_as_one_loop(preset, fold):
    """A fold's blocks are one loop of fold x blocks-per-group steps (Zen 4 streamed groups of
    64 1.03-1.2x faster so than with each group's two blocks unrolled into one body)."""
    from qtvm.target import parse_target

    func = ops.qmatmul_a8_func(get_format(preset), 1024, 128, NB)
    sch = x86.schedule_qmatmul_a8_x86(func, parse_target("llvm -mcpu=znver4"), fold_groups=fold)
    per_group = int(func.attrs[ops.FORMAT_ATTR]["group"]) // ops.ACT_BLOCK
    fused = re.findall(r"for \w+_fused in range\((\d+)\):", sch.mod.script())
    assert fused == [str(fold * per_group)]


def test_fold_comes_from_the_target_facts_and_must_divide_the_groups():
    from qtvm.target import parse_target

    zen4, skx = parse_target("llvm -mcpu=znver4"), parse_target("llvm -mcpu=skylake-avx512")
    desc = lambda preset, k: ops.qmatmul_a8_func(get_format(preset), k, 64, NB).attrs[ops.FORMAT_ATTR]  # noqa: E731
    assert x86.a8_fold_groups(zen4, desc("int4-g64", 4096)) == 2 and x86.a8_fold_groups(zen4, desc("int2-g64", 100)) == 2
    assert x86.a8_fold_groups(zen4, desc("int4-g64", 192)) == 1  # 3 groups
    assert x86.a8_fold_groups(zen4, desc("int4-g128", 4096)) == 1 and x86.a8_fold_groups(zen4, desc("int4-g32", 4096)) == 1
    assert x86.a8_fold_groups(skx, desc("int4-g64", 4096)) == 1  # no measured row
    rkl = parse_target("llvm -mcpu=rocketlake")  # folds groups of 128 only
    assert x86.a8_fold_groups(rkl, desc("int4-g128", 4096)) == 2 and x86.a8_fold_groups(rkl, desc("int3-g128", 1000)) == 2
    assert x86.a8_fold_groups(rkl, desc("int4-g64", 4096)) == 1
    assert x86.a8_fold_groups(rkl, desc("int4-g128", 384)) == 1  # 3 groups
    func = ops.qmatmul_a8_func(get_format("int4-g64"), 192, 64, NB)
    with pytest.raises(ValueError, match="fold_groups"):
        x86.schedule_qmatmul_a8_x86(func, zen4, fold_groups=2)
    with pytest.raises(ValueError, match="fold_groups"):
        x86.schedule_qmatmul_a8_x86(ops.qmatmul_a8_func(get_format("int4-g64"), 256, 64, NB), zen4, fold_groups=2,
                                    tile_cols=16)


def _mix(preset: str, isa: str, **knobs):
    func = ops.qmatmul_a8_func(get_format(preset), 4096, 256, NB)
    sch = x86.schedule_qmatmul_a8_x86(func, ISA_TARGETS[isa], **knobs)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=ISA_TARGETS[isa])
    return block_mix(lib.mod.inspect_source("asm"), isa)


@pytest.mark.parametrize("isa", ["avx512vnni", "avxvnni"])
def test_vnni_int4_block_masks_in_place(isa):
    """Per 32-value block of a column vector: 8 vpdpbusd, 8 masks, no per-unit shift
    (the high nibbles' dot is shifted back once), no stores: with 16 ymm a 16-column pass."""
    m = _mix("int4-g128", isa, tile_cols=16 if isa == "avxvnni" else None)
    assert m.blocks >= 1
    assert m.count("vpdpbusd") == 8
    assert m.count("vpand") == 8
    assert m.count("vpsrld") == 0 and m.count("vpsrad") == 1
    assert m.count("vmovdqu") == 0  # the int32 dots stay in registers
    assert m.per_block <= 36


@pytest.mark.parametrize("isa", ["avx512bw", "avx2"])
def test_maddubs_block_sums_in_int16(isa):
    """One vpmaddwd per block (not per unit): the 8 unit products are summed in int16."""
    m = _mix("int4-g128", isa, tile_cols=16 if isa == "avx2" else None)
    assert m.count("vpmaddubsw") == 8
    assert m.count("vpmaddwd") == 1
    assert m.count("vpaddw") == 7


def test_int3_vnni_block_masks_six_units_and_merges_two():
    """int3 per block on VNNI: units 0-5 one mask each (3-5 in place, one shift back per
    block), units 6 and 7 two shifts, a mask and a ternary op each (the old layout: 28
    unpack instructions per block, 12 of them shifts)."""
    m = _mix("int3-g128", "avx512vnni")
    assert m.count("vpdpbusd") == 8
    assert m.count("vpand") == 8 and m.count("vpternlog") == 2
    assert m.count("vpsrld", "vpslld") == 4 and m.count("vpsrad") == 1
    assert m.per_block <= 40


@pytest.mark.parametrize("preset,fields", [("int2-g64", 6), ("int3-g128", 2)])
def test_gfni_moves_each_field_down_with_one_affine_op(preset, fields):
    """With GFNI, the 2/3-bit fields above bit 0 (int2: 6 per block; int3: units 6 and 7's
    low bits) are one vgf2p8affineqb each instead of a shift and a mask; without, none."""
    func = ops.qmatmul_a8_func(get_format(preset), 4096, 256, NB)
    gfni, plain = ISA_TARGETS["avx512vnni_gfni"], ISA_TARGETS["avx512vnni"]
    assert x86.unpack_gfni(gfni) and not x86.unpack_gfni(plain)
    mixes = {}
    for name, target in (("gfni", gfni), ("plain", plain)):
        sch = x86.schedule_qmatmul_a8_x86(func, target)
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)
        mixes[name] = block_mix(lib.mod.inspect_source("asm"), "avx512vnni")
    assert mixes["gfni"].count("vgf2p8affineqb") == fields and mixes["plain"].count("vgf2p8affineqb") == 0
    assert mixes["gfni"].count("vpsrld") == mixes["plain"].count("vpsrld") - fields
    assert mixes["gfni"].per_block <= mixes["plain"].per_block - fields + 0.5


def test_gfni_variants_are_named_and_replayed():
    """A tuning record names the GFNI variant it tensorized with; replay registers it (as the
    prefetch variants), and widths without fields above bit 0 (int4) have no such variant.
    The prefill tile has none (measured slower) and its rule does not ask for one."""
    assert intrin.intrin_name(2, "avx512vnni", gfni=True) == "qtvm_dot_u2s8_i32x16_avx512vnni_gfni"
    assert intrin.intrin_name(4, "avx512vnni", gfni=True) == intrin.intrin_name(4, "avx512vnni")
    name = intrin.intrin_name(3, "avxvnni", (0, 0), gfni=True)
    assert name.endswith("_avxvnni_gfni_nopf")
    assert intrin._VARIANT.fullmatch(name) and intrin._VARIANT.fullmatch("qtvm_dot_u3s8_i32x16_avx2_gfni_pf16l3")
    func = ops.qmatmul_a8_gemm_func(get_format("int2-g64"), 4096, 256, NB, intrin.ROW_TILE)
    trace = x86.schedule_qmatmul_a8_gemm_x86(func, ISA_TARGETS["avx512vnni_gfni"]).trace.as_python()
    tensorized = [line for line in trace if "tensorize" in line]
    assert tensorized and "qtvm_gemm_u2s8" in tensorized[0] and "gfni" not in tensorized[0]
    intrin.register_variants('{"trace": "qtvm_dot_u3s8_i32x16_avx512bw_gfni_pf40l3"}')
    assert s_tir.TensorIntrin.get("qtvm_dot_u3s8_i32x16_avx512bw_gfni_pf40l3") is not None


def test_prefill_prefetch_comes_from_the_target_facts():
    """Zen 5's prefill kernel runs without software prefetch (measured); the GEMV keeps it,
    and other CPUs keep it in both."""
    from qtvm.intrin.x86 import ROW_TILE
    from qtvm.target import parse_target

    zen5, skx = parse_target("llvm -mcpu=znver5"), parse_target("llvm -mcpu=skylake-avx512")
    assert x86.a8_prefetch(zen5, prefill=True) == (0, 0)
    assert x86.a8_prefetch(zen5) == (6144, 3)
    assert x86.a8_prefetch(skx, prefill=True) == x86.a8_prefetch(skx) != (0, 0)
    func = ops.qmatmul_a8_gemm_func(get_format("int4-g128"), 1000, 200, NB, ROW_TILE)
    script = lambda t, **kn: x86.schedule_qmatmul_a8_gemm_x86(func, t, **kn).mod.script()  # noqa: E731
    assert script(zen5) == script(zen5, prefetch=(0, 0)) != script(zen5, prefetch=(4096, 3))


def test_zen4_streams_with_a_short_prefetch_into_l2():
    """Zen 4's measured row: the int8 GEMV prefetches 2 KiB ahead into L2 (prefetcht1) in
    whole-block passes, its prefill kernel and nothing else changes."""
    from qtvm.target import parse_target
    from schedules.x86_lut import lut_prefetch_bytes

    zen4 = parse_target("llvm -mcpu=znver4")
    assert x86.a8_prefetch(zen4) == (2048, 2) and x86.a8_prefetch(zen4, prefill=True) == (0, 0)
    assert x86.a8_tile_cols(zen4, 64) == 64
    assert lut_prefetch_bytes(zen4, a8=True) == 2048
    func = ops.qmatmul_a8_func(get_format("int4-g128"), 1000, 200, NB)
    trace = x86.schedule_qmatmul_a8_x86(func, zen4).trace.as_python()
    tensorized = [line for line in trace if "tensorize" in line]
    rows = x86.prefetch_rows((2048, 2), NB)[0]
    assert tensorized and f"_pf{rows}l2" in tensorized[0]


def test_zen5_nibble_tables_stream_without_prefetch():
    """Zen 5's measured row: the int8 nibble-table BCQ GEMV issues no software prefetch (its
    own fact), while the int16 tables keep the 4 KiB default; a CPU without a measurement of
    the nibble kernel (Zen 4) gives it the int16 tables' distance."""
    from qtvm import bcq_a8_gemv
    from qtvm.target import parse_target
    from schedules.x86_bcq import schedule_bcq_a8_gemv_x86
    from schedules.x86_lut import lut_prefetch_bytes

    zen5, zen4 = parse_target("llvm -mcpu=znver5"), parse_target("llvm -mcpu=znver4")
    assert (lut_prefetch_bytes(zen5, a8=True), lut_prefetch_bytes(zen5, a8=True, nibble=True)) == (4096, 0)
    assert lut_prefetch_bytes(zen4, a8=True, nibble=True) == lut_prefetch_bytes(zen4, a8=True) == 2048
    func = bcq_a8_gemv.bcq_a8_gemv_func(get_format("bcq3-g128"), 1000, 200, NB)
    trace = lambda t, **kn: [ln for ln in schedule_bcq_a8_gemv_x86(func, t, **kn).trace.as_python()  # noqa: E731
                             if "tensorize" in ln]
    assert trace(zen5) == trace(zen5, prefetch_bytes=0) != trace(zen5, prefetch_bytes=4096)
    assert trace(zen4) == trace(zen4, prefetch_bytes=2048)


def _quantized_activations(lib, fmt, x, k, row_tile):
    kp, groups = fmt.padded_k(k), fmt.padded_k(k) // fmt.group_size_for(k)
    mp = -(-x.shape[0] // row_tile) * row_tile
    outs = [tvm.runtime.tensor(np.full(s, 99, d)) for s, d in  # padding rows must be written too
            (((mp, kp), np.int8), ((mp, kp // ops.ACT_BLOCK), np.float32), ((mp, groups), np.float32))]
    lib["main"](tvm.runtime.tensor(x), *outs)
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("preset,k,m,row_tile", [("int4-g128", 1000, 1, 1), ("int4-g128", 4096, 3, 4),
                                                 ("int3-g64", 300, 2, 1), ("int2-g32", 200, 5, 4)])
def test_activation_quantizer_vectorized_writes_the_rounding_numpy_does(isa, preset, k, m, row_tile):
    """Per 32-value block: scale = max|x| / 127, codes round(x * (127 / max|x|)) clipped to
    +-127 in the values' order, 0 for an all-zero block;
    group sums of the rounded values. The scheduled kernel (vector partials, a reduction tree)
    writes what the unscheduled loops write, bit for bit, K not a multiple of the group."""
    from schedules import compile_func, compile_kernel

    fmt, target = get_format(preset), ISA_TARGETS[isa]
    rng = np.random.default_rng(k + m)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 300.0], size=(m, 1))).astype(np.float32)
    x[:, 32:64] = 0  # an all-zero block
    func = ops.quantize_activations_func(fmt, k, row_tile)
    got = _quantized_activations(compile_kernel(func, target), fmt, x, k, row_tile)
    plain = _quantized_activations(compile_func(func, target), fmt, x, k, row_tile)
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b)

    xq, xd, xs = got
    kp = fmt.padded_k(k)
    blocks = np.zeros((xq.shape[0], kp), np.float32)
    blocks[:m, :k] = x
    blocks = blocks.reshape(xq.shape[0], -1, ops.ACT_BLOCK)
    amax = np.abs(blocks).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    codes = np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(xq.reshape(codes.shape), codes)
    np.testing.assert_array_equal(xd, amax / np.float32(127))
    per_group = fmt.group_size_for(k) // ops.ACT_BLOCK
    sums = (xd * codes.sum(-1)).reshape(xq.shape[0], -1, per_group).sum(-1)
    np.testing.assert_allclose(xs, sums, rtol=1e-6, atol=1e-30)
    assert (xq[m:] == 0).all() and (xd[m:] == 0).all()  # the row tile's padding rows


def _stores(loop: list[str]) -> list[str]:
    """Instructions of an AT&T-syntax loop body that write memory (destination last)."""
    return [ins for ins in loop if ins.split()[0] not in ("cmpq", "prefetcht0", "prefetcht1", "prefetcht2")
            and "(" in ins.rsplit(",", 1)[-1]]


@pytest.mark.parametrize("preset", ["int4-g128", "int3-g128", "int2-g64"])
@pytest.mark.parametrize("isa,marker", [("avx512vnni", "vpdpbusd"), ("avx512bw", "vpmaddubsw"), ("avx2", "vpmaddubsw")])
def test_prefill_tile_keeps_its_sums_in_registers(preset, isa, marker):
    """One loop does a block's dots, their conversion and the group partial's FMA, with few
    stores (spills) per dot: the tile's int32 dots and float partials live in registers
    (``x86.prefill_tile_cols``). A 64-column tile stored and reloaded them every block: 48-61
    stores per 128 VNNI dots, and on AVX2 / AVX-512BW a loop of its own for the conversion;
    now 0-4 per 64 (VNNI), 7-10 per 64 (AVX-512BW), 2 per 32 (AVX2)."""
    from qtvm.bench.asm_loops import hot_loop

    func = ops.qmatmul_a8_gemm_func(get_format(preset), 1024, 256, NB, intrin.ROW_TILE)
    target = ISA_TARGETS[isa]
    asm = tvm.compile(x86.schedule_qmatmul_a8_gemm_x86(func, target).mod, target=target).mod.inspect_source("asm")
    loop = hot_loop(asm, marker)
    assert {"vcvtdq2ps", "vfmadd231ps"} <= {ins.split()[0] for ins in loop}
    dots = sum(ins.split()[0] == marker for ins in loop)
    assert len(_stores(loop)) <= dots // 4, _stores(loop)[:4]
