"""Schedule rule for the LUT GEMV (``qtvm.lut_gemv``) on LLVM CPU targets.

The tables (256 floats per 8 activations) are built once per row of x, at the
root, parallel over chunks and vectorised over the 256 entries. The matmul
part is parallel over column blocks; per block and row, for each group, each
packed word (plane t, column j) is loaded once and its 4 bytes index 4
consecutive tables, accumulating into partial[t, j] (the byte loop unrolled so
the shifts are constants; 8 columns unrolled for instruction-level
parallelism); then the group's alphas and bias fold the partials into the
output accumulator. The reads stay scalar: TVM lowers a vectorised load with
a data-dependent index lane by lane (vpextrq/vinsertps), which measured ~1.8x
slower than scalar reads here.
"""
from __future__ import annotations

import tvm
from tvm import s_tir

from qtvm import lut_gemv, ops
from schedules import claim_chunks
from schedules.x86 import tile_columns_then_groups


READ_UNROLL = 8  # columns whose table reads are unrolled together


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> bool:
    return (target.kind.name == "llvm" and func.attrs is not None
            and str(func.attrs.get(ops.KERNEL_ATTR, "")) == lut_gemv.KERNEL)


def schedule_lut_gemv_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    if not applies(func, target):
        return None
    desc = func.attrs[ops.FORMAT_ATTR]
    nb = int(desc["col_block"])
    chunks_per_word = 32 // int(desc["mu"])
    sch = s_tir.Schedule(func)

    # Tables: root, parallel over chunks, the 256 entries as vector lanes.
    lut = sch.get_sblock(lut_gemv.BLOCK_LUT)
    _, c, p, j = sch.get_loops(lut)
    sch.reorder(c, j, p)
    sch.parallel(c)
    sch.vectorize(p)
    sch.decompose_reduction(lut, j)

    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    part = sch.get_sblock(lut_gemv.BLOCK_PARTIAL)
    acc_g, acc_j = tile_columns_then_groups(sch, desc, nb)
    sch.compute_at(part, acc_g)
    sch.set_scope(part, 0, "local")
    loops = sch.get_loops(part)
    pj, pc = loops[-2:]
    planes = [loops[-3]] if int(desc["planes"]) > 1 else []  # compute_at drops a unit plane loop
    cpg = int(desc["group"]) // int(desc["mu"])
    unroll = chunks_per_word if cpg % chunks_per_word == 0 else 1
    co, ci = sch.split(pc, [None, unroll])
    pjo, pji = sch.split(pj, [None, READ_UNROLL])
    sch.reorder(co, *planes, pjo, pji, ci)  # one word load feeds its 4 table reads
    sch.unroll(pji)
    sch.unroll(ci)
    sch.decompose_reduction(part, co)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(acc, acc_g)
    sch.vectorize(sch.get_loops(out)[-1])
    claim_chunks.mark_output_loop(sch, ops.BLOCK_OUT)
    return sch


def lut16_isa(target: tvm.target.Target) -> str:
    """The vpermps width the 16-entry LUT kernel uses on ``target`` ("" = none)."""
    from tvm.target import codegen

    with target:
        if bool(codegen.llvm_cpu_has_features("avx512f", target)):
            return "avx512"
        if bool(codegen.llvm_cpu_has_features("avx2", target)):
            return "avx2"
    return ""


def _tables_at_root(sch: s_tir.Schedule, block: str = lut_gemv.BLOCK_LUT) -> None:
    """The LUT stage of a 16-entry kernel: parallel over 32-row blocks, the 16 entries as
    vector lanes, its 4-activation sum unrolled around them."""
    lut = sch.get_sblock(block)
    _, b, *tables, p, j = sch.get_loops(lut)
    sch.reorder(b, *tables, j, p)
    sch.parallel(b)
    sch.vectorize(p)
    sch.decompose_reduction(lut, j)


def _lookups(sch: s_tir.Schedule, desc, intrin_name: str, halves: bool, unroll=0,
             partial: str = lut_gemv.BLOCK_PARTIAL, inner: int = 2) -> s_tir.Schedule:
    """Parallel over column blocks; per group, block and plane, ``intrin_name`` replaces the
    16-column lookup nest of the partials (kept in registers: stack allocas), walking the
    bit stream in storage order; then alphas and bias fold them into the output accumulator.
    ``halves``: the partials have a (column, half) axis after the column (int16 tables).
    ``unroll``: pragma_auto_unroll_max_step of each group's lookups (0: loops). ``partial``: the
    partials' block (the nibble-table kernel, ``schedules.x86_bcq``, names its own); ``inner``:
    its reduction loops inside one 32-row block (the intrinsic's, after the 16 columns)."""
    from qtvm.intrin import x86_lut as intrin

    acc_g, _ = tile_columns_then_groups(sch, desc, int(desc["col_block"]), scope="global")
    part = sch.get_sblock(partial)
    sch.compute_at(part, acc_g)
    loops = sch.get_loops(part)
    inner_loops = loops[-inner:]  # e.g. chunk (or chunk pair) and table entry
    pb = [loops[-inner - 1]] if int(desc["group"]) // 32 > 1 else []  # compute_at drops unit block and plane loops
    outer = loops[: len(loops) - inner - len(pb)]
    half = [outer[-1]] if halves else []
    pj = outer[-1 - len(half)]
    plane = [outer[-2 - len(half)]] if int(desc["planes"]) > 1 else []
    jo, ji = sch.split(pj, [None, intrin.COLS])
    sch.reorder(*pb, *plane, jo, ji, *half, *inner_loops)
    sch.decompose_reduction(part, (pb + plane + [jo])[0])
    sch.tensorize(ji, intrin_name)
    if not (isinstance(unroll, int) and unroll == 0):
        sch.annotate((pb + plane + [jo])[0], "pragma_auto_unroll_max_step", unroll)
        sch.annotate((pb + plane + [jo])[0], "pragma_unroll_explicit", 1)
    sch.vectorize(sch.get_loops(sch.get_sblock(ops.BLOCK_ACC))[-1])
    sch.decompose_reduction(sch.get_sblock(ops.BLOCK_ACC), acc_g)
    sch.vectorize(sch.get_loops(sch.get_sblock(ops.BLOCK_OUT))[-1])
    claim_chunks.mark_output_loop(sch, ops.BLOCK_OUT)
    return sch


def lut_prefetch_bytes(target: tvm.target.Target, a8: bool, nibble: bool = False) -> int:
    """How far ahead the LUT GEMV prefetches its bit stream (fp32 tables, int16 with ``a8``,
    the int8 nibble tables with ``nibble``): the target's facts (a measured row, else the
    defaults measured on Zen 5; the nibble tables take the int16 tables' unless measured:
    on Zen 5 they stream fastest with none)."""
    from schedules.target_facts import schedule_facts

    facts = schedule_facts(target)
    if nibble and facts.bcq_a8_prefetch_bytes is not None:
        return int(facts.bcq_a8_prefetch_bytes)
    return int(facts.lut_a8_prefetch_bytes if a8 else facts.lut_prefetch_bytes)


def schedule_lut16_gemv_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs) -> s_tir.Schedule | None:
    """The 16-entry LUT GEMV (``qtvm.lut_gemv.lut16_gemv_func``): tables at the root, then one
    TensorIntrin per (block, plane, 16 columns) looks up the 8 nibbles (``qtvm.intrin.x86_lut``).
    ``knobs``: see ``apply_lut16_x86`` (none: the target's facts)."""
    if (target.kind.name != "llvm" or func.attrs is None
            or str(func.attrs.get(ops.KERNEL_ATTR, "")) != lut_gemv.KERNEL16 or not lut16_isa(target)):
        return None
    sch = s_tir.Schedule(func)
    apply_lut16_x86(sch, target, **knobs)
    return sch


def lut16_a8_isa(target: tvm.target.Target) -> bool:
    """Whether ``target`` has vpermw (AVX-512BW), the int16 table lookup."""
    from tvm.target import codegen

    with target:
        return bool(codegen.llvm_cpu_has_features("avx512bw", target))


def schedule_lut16_a8_gemv_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs
                               ) -> s_tir.Schedule | None:
    """The int8-activation LUT GEMV (``qtvm.lut_gemv.lut16_a8_gemv_func``): x's group maxima and
    its int8 rounding at the root (parallel, vectorised), the int16 table pairs as the fp32
    tables; then one TensorIntrin per (block, plane, 16 columns) adds 4 vpermw lookups into the
    plane's 32 int16 partials (``qtvm.intrin.x86_lut.register_a8``). ``knobs``: as
    ``schedule_lut16_gemv_x86``'s."""
    if (target.kind.name != "llvm" or func.attrs is None
            or str(func.attrs.get(ops.KERNEL_ATTR, "")) != lut_gemv.KERNEL16_A8 or not lut16_a8_isa(target)):
        return None
    sch = s_tir.Schedule(func)
    apply_lut16_x86(sch, target, **knobs)
    return sch


def round_x_at_root(sch: s_tir.Schedule) -> None:
    """x's per-group rounding (``qtvm.lut_gemv.round_x_per_group``: stages "amax", "xq") at
    the root: group maxima parallel over groups, the int8 values parallel and vectorised."""
    amax = sch.get_sblock("amax")
    sch.parallel(sch.get_loops(amax)[1])
    xq = sch.get_sblock("xq")
    ko, ki = sch.split(sch.get_loops(xq)[1], [None, 64])
    sch.parallel(ko)
    sch.vectorize(ki)


# -- tuning hook (schedules/tune_lut.py) ----------------------------------------------------
#   prefetch_bytes: how far ahead each lookup prefetches its bit stream's line (0: none;
#                   None: the target's facts); it names the TensorIntrin variant
#   unroll:         pragma_auto_unroll_max_step of each group's lookups (an int or a sampled
#                   ExprRV; 0: loops, the analytic choice)
def apply_lut16_x86(sch: s_tir.Schedule, target: tvm.target.Target, *, prefetch_bytes: int | None = None,
                    unroll=0) -> None:
    """Schedule ``sch`` (an unscheduled lut16 or lut16_a8 GEMV) for ``target``."""
    from qtvm.intrin import x86_lut as intrin

    func = sch.mod["main"]
    a8 = str(func.attrs[ops.KERNEL_ATTR]) == lut_gemv.KERNEL16_A8
    if prefetch_bytes is None:
        prefetch_bytes = lut_prefetch_bytes(target, a8)
    words = int(prefetch_bytes) // 4
    if a8:
        round_x_at_root(sch)
    _tables_at_root(sch)
    name = intrin.register_a8(words) if a8 else intrin.intrin_name(lut16_isa(target), words)
    _lookups(sch, func.attrs[ops.FORMAT_ATTR], name, halves=a8, unroll=unroll)


def prefer_lut16(fmt, k: int, target: tvm.target.Target) -> bool:
    """Whether a decode-sized (GEMV) BCQ matmul should run the 16-entry LUT kernel rather
    than the dequantizing fp32 GEMV: per plane and 16 columns a lookup covers 4 rows with a
    shift, a vpermps and an add (AVX2: two vpermps and a blend more), where the dense kernel
    spends about as many instructions on every row; the tables cost K/4 x 16 sums per row
    of x, shared by all N columns. Measured (bcq3-g128, 1024x1024, one thread, Zen 5): 3.1x
    faster on AVX-512, 2.7x on AVX2; Zen 4 (4096^2 to 11008 x 4096): 2.1-3.1x. Larger M keeps
    the dequantize-once GEMM."""
    return target.kind.name == "llvm" and lut_gemv.supports_lut16(fmt, k) and bool(lut16_isa(target))


def prefer_lut16_a8(fmt, k: int, target: tvm.target.Target) -> bool:
    """Whether a decode-sized BCQ matmul with ``--act int8`` runs the int16-table LUT kernel
    (AVX-512BW): half the lookups of the fp32 tables and half their size. Measured (bcq3-g128,
    Zen 5): 1.75x the fp32 kernel's cache-hot throughput; weights DRAM-cold, one thread
    level, level and 1.48x on the LLaMA shapes 4096^2, 4096x11008, 11008x4096 (two threads
    level, 1.09x, 1.2x): not slower on any shape measured, and ahead where the fp32 kernel's
    cold rate drops (K = 6144, 11008, 22016)."""
    return target.kind.name == "llvm" and lut_gemv.supports_lut16_a8(fmt, k) and lut16_a8_isa(target)
