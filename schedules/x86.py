"""Schedule rule for quantized matmuls on LLVM CPU targets (AVX2 / AVX-512).

Parallel over column blocks; per block and row: for each group, the unpacked
codes of ``lanes`` columns are FMA'd into a register accumulator (K unrolled
over one packed word so every shift is a constant), then the group's scale and
offset fold the partial into the output accumulator.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from qtvm import ops
from schedules import claim_chunks


def applies(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> bool:
    return target.kind.name == "llvm" and func.attrs is not None and ops.KERNEL_ATTR in func.attrs


def col_block(target: tvm.target.Target) -> int:
    """Columns per contiguous weight block: 4 ymm or 2 zmm accumulators' worth."""
    return 64


# -- the x86 family (schedules/__init__.py picks it for llvm targets) ----------------------
GEMV_MAX_ROWS = 2  # above this, unpacking a tile once beats re-unpacking per row (measured M = 3)


def facts(target: tvm.target.Target):
    from qtvm.intrin.x86 import ROW_TILE
    from schedules.facts import KernelFacts
    from schedules.x86_bcq import prefer_bcq_a8
    from schedules.x86_lut import prefer_lut16, prefer_lut16_a8

    return KernelFacts(family="x86", col_block=col_block(target), gemv_max_rows=GEMV_MAX_ROWS,
                       row_tile=ROW_TILE, int8_activations=bool(dot_isa(target)), activations=("fp32", "int8"),
                       lut16_gemv=lambda fmt, k: prefer_lut16(fmt, k, target),
                       lut16_a8_gemv=lambda fmt, k: prefer_lut16_a8(fmt, k, target),
                       bcq_a8_gemv=lambda fmt, k: prefer_bcq_a8(fmt, k, target), routed_experts=True,
                       routed_int8=True)


def rules() -> list:
    from schedules import x86_bcq, x86_dense, x86_gemm, x86_lut

    return [schedule_qmatmul_x86, schedule_qmatmul_experts_x86, schedule_qmatmul_a8_x86,
            schedule_qmatmul_a8_experts_x86, schedule_qmatmul_a8_gemm_x86,
            schedule_quantize_activations_x86, schedule_sparse_outliers_x86, x86_gemm.schedule_qmatmul_gemm_x86,
            x86_lut.schedule_lut_gemv_x86, x86_dense.schedule_dense_x86, x86_lut.schedule_lut16_gemv_x86,
            x86_lut.schedule_lut16_a8_gemv_x86, x86_bcq.schedule_bcq_a8_gemv_x86]


def tir_pipeline(target: tvm.target.Target) -> str:
    """TVM's TIR pipeline, then the rewrite of the parallel loops the rules marked for
    claiming (``schedules/claim_chunks.py``)."""
    return claim_chunks.register_pipeline()


def schedule_generic_ops(mod, target: tvm.target.Target):
    from schedules.x86_generic import schedule_generic_ops as generic

    return generic(mod, target)


def schedule_qmatmul_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, *, tile_cols=None, unroll=None,
                         local_partials: bool = True, parallel: bool = True) -> s_tir.Schedule | None:
    """The hand schedule; the keyword knobs (defaults = the hand schedule) are for the tuner."""
    if not applies(func, target) or func.attrs[ops.KERNEL_ATTR] != "qmatmul":
        return None
    sch = s_tir.Schedule(func)
    apply_qmatmul_x86(sch, func.attrs[ops.FORMAT_ATTR], tile_cols=tile_cols, unroll=unroll,
                      local_partials=local_partials, parallel=parallel)
    return sch


def schedule_qmatmul_experts_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """A mixture of experts' routed matmul: each row is a GEMV by its own expert's weight, so the
    hand GEMV schedule with the rows outside its parallel column loop (``rows_outer``)."""
    if not applies(func, target) or func.attrs[ops.KERNEL_ATTR] != "qmatmul_experts":
        return None
    sch = s_tir.Schedule(func)
    apply_qmatmul_x86(sch, func.attrs[ops.FORMAT_ATTR])
    return sch


def tile_columns_then_groups(sch: s_tir.Schedule, desc, tile: int, parallel: bool = True, scope: str = "local",
                             rows_outer: bool = False):
    """The common skeleton of the x86 rules: parallel over column tiles of the output,
    then per row a register accumulator over the tile, fed group by group.
    ``scope`` "global" keeps a small accumulator on the stack (LLVM registers); "local"
    makes it a TVMBackendAllocWorkspace buffer. ``rows_outer``: rows in turn, each parallel
    over its column tiles, for rows that each read weights of their own (routed experts): the
    threads then stream one matrix's blocks in order, not one block of each row's matrix in
    turn (one parallel launch per row). Returns (acc_group_loop, acc_column_loop)."""
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    i, j = sch.get_loops(out)
    jo, ji = sch.split(j, [None, tile])
    if not rows_outer:
        sch.reorder(jo, i, ji)
    if parallel:
        sch.parallel(jo)
    sch.compute_at(acc, jo if rows_outer else i)
    if scope != "global":
        sch.set_scope(acc, 0, scope)
    if int(desc["padded_k"]) == int(desc["group"]):
        sch.add_unit_loop(acc)  # one group: compute_at dropped the unit group loop
    acc_j, acc_g = sch.get_loops(acc)[-2:]
    sch.reorder(acc_g, acc_j)
    return acc_g, acc_j


# -- tuning hook (schedules/tune.py) -------------------------------------------------------
# ``tile_cols`` / ``unroll`` may be ints or ExprRVs sampled by MetaSchedule.
#   tile_cols: columns of one register tile (divides col_block): the partial's column loop is
#              split and its K loops run inside each tile; None = one tile of col_block (no split).
#   unroll:    K values per unrolled step (default: one run of packed words, so shifts are constant).
#   local_partials: partial sums in "local" scope; parallel: parallel over column blocks.
def apply_qmatmul_x86(sch: s_tir.Schedule, desc, *, tile_cols=None, unroll=None,
                      local_partials: bool = True, parallel: bool = True) -> None:
    nb = int(desc["col_block"])
    unroll = _unpack_unroll(desc) if unroll is None else unroll
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    parts = [sch.get_sblock(ops.partial_block(t)) for t in range(int(desc["terms"]))]
    acc_g, acc_j = tile_columns_then_groups(sch, desc, nb, parallel, rows_outer="experts" in desc)
    for part in parts:
        sch.compute_at(part, acc_g)
        if local_partials:
            sch.set_scope(part, 0, "local")
        part_j, part_k = sch.get_loops(part)[-2:]
        ko, ki = sch.split(part_k, [None, unroll])
        if tile_cols is None:
            sch.reorder(ko, ki, part_j)
        else:
            jt, part_j = sch.split(part_j, [None, tile_cols])
            sch.reorder(jt, ko, ki, part_j)
        sch.unroll(ki)
        sch.vectorize(part_j)
        sch.decompose_reduction(part, ko)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(acc, acc_g)
    sch.vectorize(sch.get_loops(out)[-1])
    claim_chunks.mark_output_loop(sch, ops.BLOCK_OUT)


def _unpack_unroll(desc) -> int:
    """Unroll K over one run of packed words so shifts become constants."""
    values = int(desc.get("values_per_block", 8))
    group = int(desc["group"])
    return values if group % values == 0 else 1


# Column blocks one thread reads at once (independent DRAM streams). 2, 4 and 8
# measured no better than 1 on the development VM, where the noise was larger
# than any difference; kept as a knob for the tuner.
A8_STREAMS = 1


def dot_isa(target: tvm.target.Target) -> str:
    """The widest byte-dot instruction set the target has."""
    from tvm.target import codegen

    with target:
        has = lambda feature: bool(codegen.llvm_cpu_has_features(feature, target))  # noqa: E731
        if has("avx512vnni"):
            return "avx512vnni"
        if has("avx512bw"):
            return "avx512bw"
        if has("avxvnni"):
            return "avxvnni"
        if has("avx2"):
            return "avx2"
    return ""


def unpack_gfni(target: tvm.target.Target) -> bool:
    """Whether the int8 GEMV unpacks 2/3-bit fields with ``vgf2p8affineqb`` (one GF(2)
    affine op per field instead of a shift and a mask): where the target has GFNI (Ice Lake
    and later Intel, Zen 4/5; Alder Lake's on ymm). int2 cache-hot on Emerald Rapids: 34 ->
    44 GB/s; int3: 44 -> 49."""
    from tvm.target import codegen

    with target:
        return bool(codegen.llvm_cpu_has_features("gfni", target))


def _a8_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target, kind: str):
    """(isa, format description, schedule) for an int8-activation kernel of ``kind``, or None."""
    if not applies(func, target) or func.attrs[ops.KERNEL_ATTR] != kind:
        return None
    isa = dot_isa(target)
    return (isa, func.attrs[ops.FORMAT_ATTR], s_tir.Schedule(func)) if isa else None


def _a8_groups_and_dots(sch: s_tir.Schedule, desc, acc, acc_g, acc_j, tile_cols: int, tiled: bool,
                        scope: str = "local", gpart_at=None, folded: bool = False):
    """The part both int8 rules share: per group (``acc_g``, or the column-tile loop
    ``gpart_at`` inside it) the group partial over its 32-value blocks, per block the int32
    dot of ``tile_cols`` columns (x the row tile when ``tiled``); returns the loop to
    tensorize and the group's block loop. ``scope``: of the dot and group partial (see ``tile_columns_then_groups``).
    ``folded``: ``acc_g`` steps over several groups (``a8_fold_groups``); their partials are zeroed
    together before the first (zeroed per group, the fold ran 1.05x faster, not 1.28x, on Zen 4),
    and their blocks run as one loop (the returned block loop)."""
    gpart, dot = sch.get_sblock(ops.BLOCK_GPART), sch.get_sblock(ops.BLOCK_DOT)
    sch.compute_at(gpart, acc_g if gpart_at is None else gpart_at)
    if scope != "global":
        sch.set_scope(gpart, 0, scope)
    if int(desc["group"]) == ops.ACT_BLOCK:
        sch.add_unit_loop(gpart)
    loops = sch.get_loops(gpart)
    *gp_rows, gp_j, gp_b = loops[-3 if tiled else -2:]
    gp_init_at = loops[-4 if tiled else -3] if folded else gp_b
    sch.reorder(gp_b, *gp_rows, gp_j)
    sch.compute_at(dot, gp_b)
    if scope != "global":
        sch.set_scope(dot, 0, scope)
    *dot_rows, dot_j, dot_k = sch.get_loops(dot)[-3 if tiled else -2:]
    vec, lane = sch.split(dot_j, [None, tile_cols])
    sch.reorder(vec, *dot_rows, lane, dot_k)
    dot_init = sch.decompose_reduction(dot, vec)
    sch.vectorize(sch.get_loops(dot_init)[-1])
    sch.vectorize(gp_j)
    sch.vectorize(acc_j)
    sch.decompose_reduction(gpart, gp_init_at)
    sch.decompose_reduction(acc, acc_g)
    if folded:  # one rolled loop over the fold's blocks, as groups of 128 run (see ``a8_fold_groups``)
        gp_b = sch.fuse(gp_init_at, gp_b)
    return (dot_rows[0] if tiled else lane), gp_b


def schedule_qmatmul_a8_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs) -> s_tir.Schedule | None:
    """int8-activation GEMV: the dot of one 32-value block with a 16-column line is one
    TensorIntrin (``qtvm.intrin.x86``, accumulators in registers); per block the int32
    dot is scaled into the group partial, per group the scale/offset fold it into the
    output.  ``knobs``: see ``apply_qmatmul_a8_x86`` (none: the analytic schedule)."""
    started = _a8_schedule(func, target, "qmatmul_a8")
    if started is None:
        return None
    sch = started[2]
    apply_qmatmul_a8_x86(sch, target, **knobs)
    return sch


# -- tuning hook (schedules/tune_a8.py) ---------------------------------------------------
# Knobs (None / 0 = the analytic choice); ``tile_cols`` and ``unroll`` may be ExprRVs that
# MetaSchedule samples, the others change the loop nest or the TensorIntrin and are ints:
#   streams:   column blocks per parallel task (divides the blocks)
#   tile_cols: columns per pass over a group's rows (a multiple of 16 dividing the task's
#              columns); default: the target's facts (``a8_tile_cols``), else all of them:
#              one pass reads whole rows, one contiguous stream, which measured faster from
#              DRAM than narrower register-resident passes on the Intel Xeon VM, even where
#              AVX2 spills (Zen 5 measured 16-column passes faster)
#   prefetch:  (bytes ahead, llvm.prefetch locality) of each step's prefetch, (0, 0) none
#   unroll:    pragma_auto_unroll_max_step of each group's block loop (0: a loop)
#   fold_groups: groups whose partials are folded into the accumulators at once (divides the
#              groups; whole-row passes); default: ``a8_fold_groups``
def apply_qmatmul_a8_x86(sch: s_tir.Schedule, target: tvm.target.Target, *, streams: int | None = None,
                         tile_cols=None, prefetch: tuple[int, int] | None = None, unroll=0,
                         fold_groups: int | None = None) -> None:
    from qtvm.intrin import x86 as intrin

    func = sch.mod["main"]
    isa, desc = dot_isa(target), func.attrs[ops.FORMAT_ATTR]
    nb, bits = int(desc["col_block"]), int(desc["bits"])
    streams = A8_STREAMS if streams is None else int(streams)
    cols = nb * streams
    prefetch = a8_prefetch(target) if prefetch is None else prefetch
    tile_cols = a8_tile_cols(target, cols) if tile_cols is None else tile_cols
    nblk = -(-int(desc["n"]) // nb)
    if streams < 1 or nblk % streams:
        raise ValueError(f"streams={streams} must divide the {nblk} column blocks")
    if isinstance(tile_cols, int) and (tile_cols % intrin.STEP_COLS or cols % tile_cols):
        raise ValueError(f"tile_cols={tile_cols} must be a multiple of {intrin.STEP_COLS} dividing {cols}")
    acc_g, acc_j = tile_columns_then_groups(sch, desc, cols, scope="global", rows_outer="experts" in desc)
    tile_loop = None
    if tile_cols is not None and not (isinstance(tile_cols, int) and tile_cols == cols):
        # column tiles inside each group: the group's rows stay one contiguous stream
        tile_loop, acc_j = sch.split(acc_j, [None, tile_cols])
    if fold_groups is None:
        fold_groups = a8_fold_groups(target, desc) if tile_loop is None else 1
    if fold_groups > 1:  # the partials of ``fold_groups`` groups, then one fold of them into the accumulators
        if tile_loop is not None or group_count(desc) % fold_groups:
            raise ValueError(f"fold_groups={fold_groups} must divide the groups, in whole-row passes")
        acc_g, _ = sch.split(acc_g, [None, fold_groups])
    loop, blocks = _a8_groups_and_dots(sch, desc, sch.get_sblock(ops.BLOCK_ACC), acc_g, acc_j, intrin.STEP_COLS,
                                       False, scope="global", gpart_at=tile_loop, folded=fold_groups > 1)
    sch.tensorize(loop, intrin.intrin_name(bits, isa, prefetch_rows(prefetch, nb), unpack_gfni(target)))
    _unroll(sch, blocks, unroll)
    sch.vectorize(sch.get_loops(sch.get_sblock(ops.BLOCK_OUT))[-1])
    schedule_quantizer(sch, target)  # serial, before the launch (see qmatmul_a8_func)
    claim_chunks.mark_output_loop(sch, ops.BLOCK_OUT)


def schedule_qmatmul_a8_experts_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """A mixture of experts' routed matmul with int8 activations: the int8 GEMV schedule by
    one expert's weight (``qmatmul_a8_expert_func``), rows outside its parallel column loop,
    then each row's expert bound inside the row loop (``route_rows``)."""
    started = _a8_schedule(func, target, "qmatmul_a8_experts")
    if started is None:
        return None
    sch = started[2]
    apply_qmatmul_a8_x86(sch, target)
    return route_rows(sch)


def route_rows(sch: s_tir.Schedule) -> s_tir.Schedule:
    """``qmatmul_a8_expert_func``'s scalar ``expert`` parameter becomes ``ids[i] mod E``, bound
    at the top of the output's row loop ``i`` (outermost: ``rows_outer``), which every block
    reading the weights sits in. Done after tensorize: the TensorIntrin matches a block whose
    weight index is a plain variable, not one whose index reads ``ids``."""
    func = sch.mod["main"]
    row = sch.get(sch.get_loops(sch.get_sblock(ops.BLOCK_OUT))[0])
    x, ids, expert, *rest = func.params
    realize = func.body
    block = realize.block
    stmts = list(block.body) if isinstance(block.body, tirx.SeqStmt) else [block.body]
    at = [n for n, stmt in enumerate(stmts) if stmt.same_as(row)]
    if len(at) != 1:
        raise ValueError("the routed kernel's row loop is not a top-level loop of its schedule")
    experts = tirx.const(int(func.attrs[ops.FORMAT_ATTR]["experts"]), "int64")
    bind = tirx.LetStmt(expert, tirx.floormod(tirx.BufferLoad(ids, [row.loop_var]), experts))
    stmts[at[0]] = tirx.For(row.loop_var, row.min, row.extent, row.kind, tirx.SeqStmt([bind, row.body]),
                            row.thread_binding, row.annotations)
    body = s_tir.SBlockRealize(realize.iter_values, realize.predicate, s_tir.SBlock(
        block.iter_vars, block.reads, block.writes, block.name_hint, tirx.SeqStmt(stmts), block.init,
        block.alloc_buffers, block.match_buffers, block.annotations))
    if any(v.same_as(expert) for v in tirx.analysis.undefined_vars(body)):  # a weight read outside the row loop
        raise ValueError("the routed kernel reads the weights outside its row loop")
    return s_tir.Schedule(tirx.PrimFunc([x, ids, *rest], body, func.ret_type, func.attrs))


def _unroll(sch: s_tir.Schedule, loop, steps) -> None:
    """Ask LLVM-side unrolling of ``loop`` (steps: an int or a sampled ExprRV; int 0 = leave it)."""
    if isinstance(steps, int) and steps == 0:
        return
    sch.annotate(loop, "pragma_auto_unroll_max_step", steps)
    sch.annotate(loop, "pragma_unroll_explicit", 1)


def a8_prefetch(target: tvm.target.Target, prefill: bool = False) -> tuple[int, int]:
    """(bytes ahead, locality) of the weight prefetch: the target's facts (``target_facts``:
    a measured row of its table, else the default), overridden by tuning. ``prefill``: for
    the row-tiled prefill kernel, (0, 0) where the facts say it runs faster without."""
    from schedules.target_facts import schedule_facts

    facts = schedule_facts(target)
    if prefill and not facts.prefill_prefetch:
        return 0, 0
    return facts.prefetch_bytes, facts.prefetch_locality


def a8_tile_cols(target: tvm.target.Target, cols: int) -> int:
    """Columns per pass of the int8 GEMV over a group's rows: the target's measured fact
    where it has one and it divides ``cols``, else ``cols`` (whole rows, one pass)."""
    from schedules.target_facts import schedule_facts

    pass_cols = schedule_facts(target).a8_pass_cols
    return pass_cols if pass_cols and cols % pass_cols == 0 else cols


def a8_fold_groups(target: tvm.target.Target, desc) -> int:
    """Groups whose partials the int8 GEMV folds into its accumulators at once: 2 where the
    target's measured ``a8_fold_group`` is this kernel's group and the groups are even, else 1.
    Zen 4 streamed groups of 64 1.2-1.4x faster so, the Intel Xeon VM (LLVM: rocketlake) groups
    of 128 1.02-1.08x at 4096 x 11008 (``target_facts``), with the same arithmetic in the same
    order; folding four groups, or two of another size, ran slower on both, so a row names one
    size. Zen 4 also gained 1.03-1.2x with the fold's blocks in one
    rolled loop (LLVM unrolls a group's two blocks into one body; a rolled loop of one block a
    step is how groups of 128 stream). The ``fold_groups`` knob still tunes any fold."""
    from schedules.target_facts import schedule_facts

    if int(desc["group"]) != schedule_facts(target).a8_fold_group or group_count(desc) % 2:
        return 1
    return 2


def group_count(desc) -> int:
    return int(desc["padded_k"]) // int(desc["group"])


def prefetch_rows(prefetch: tuple[int, int], nb: int) -> tuple[int, int]:
    """(bytes ahead, locality) -> (rows of the column-blocked array ahead, locality)."""
    nbytes, locality = (int(v) for v in prefetch)
    return (0, 0) if nbytes <= 0 else (-(-nbytes // (4 * nb)), locality)


def schedule_qmatmul_a8_gemm_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target, **knobs
                                 ) -> s_tir.Schedule | None:
    """Prefill with int8 activations: per column block and tile of ``row_tile`` rows, each
    32-weight block is unpacked once and dotted with every row of the tile (one TensorIntrin
    call); M is symbolic, its tail rows are zero padding that ``y`` never stores.
    ``knobs``: ``prefetch`` and ``unroll`` as the GEMV's (``apply_qmatmul_a8_gemm_x86``)."""
    from qtvm.intrin import x86 as intrin

    started = _a8_schedule(func, target, "qmatmul_a8_gemm")
    if started is None or int(started[1]["row_tile"]) != intrin.ROW_TILE:
        return None
    sch = started[2]
    apply_qmatmul_a8_gemm_x86(sch, target, **knobs)
    return sch


def apply_qmatmul_a8_gemm_x86(sch: s_tir.Schedule, target: tvm.target.Target, *,
                              prefetch: tuple[int, int] | None = None, unroll=0) -> None:
    from qtvm.intrin import x86 as intrin

    isa, desc = dot_isa(target), sch.mod["main"].attrs[ops.FORMAT_ATTR]
    nb, bits, rows = int(desc["col_block"]), int(desc["bits"]), int(desc["row_tile"])
    out, acc = sch.get_sblock(ops.BLOCK_OUT), sch.get_sblock(ops.BLOCK_ACC)
    i, j = sch.get_loops(out)
    tile_cols = prefill_tile_cols(isa, nb)
    jo, ji = sch.split(j, [None, tile_cols])
    io, ii = sch.split(i, [None, rows])
    sch.reorder(jo, io, ii, ji)
    sch.parallel(jo)
    sch.vectorize(ji)
    sch.compute_at(acc, io)
    if int(desc["padded_k"]) == int(desc["group"]):
        sch.add_unit_loop(acc)
    acc_r, acc_j, acc_g = sch.get_loops(acc)[-3:]
    sch.reorder(acc_g, acc_r, acc_j)
    loop, blocks = _a8_groups_and_dots(sch, desc, acc, acc_g, acc_j, intrin.tile_cols(isa), True, scope="global")
    prefetch = a8_prefetch(target, prefill=True) if prefetch is None else prefetch
    sch.tensorize(loop, intrin.tile_intrin_name(bits, isa, prefetch_rows(prefetch, nb)))  # no GFNI: see there
    _unroll(sch, blocks, unroll)
    claim_chunks.mark(sch, jo)


def prefill_tile_cols(isa: str, nb: int) -> int:
    """Output columns of one prefill tile: one intrinsic call's. The tile's int32 dots,
    float group partials and accumulators (4 rows x 32 columns x 4 bytes each on AVX-512)
    are then stack arrays under TVM's 1024-byte limit, which LLVM keeps in registers; a
    64-column block's are workspace buffers, stored and reloaded every 32-value block.
    Measured (Zen 4, 1 thread, int4-g128, M = 16-256, cache-hot, interleaved): VNNI 32
    columns 1.6-1.7x the 64-column block (339-372 GOPS against 200-230; ``vpdpbusd`` peak
    ~465); a 4 x 1 tile (16 columns) tied at M = 256 and ran slower at M <= 64; AVX-512BW 1.48x;
    AVX2 (8 columns) 1.15-1.75x, and steady across processes where the block's rate moved
    between 110 and 170 GOPS."""
    from qtvm.intrin import x86 as intrin

    cols = intrin.tile_cols(isa)
    return cols if nb % cols == 0 else nb


QUANT_TREE = 4  # the second level of the per-block reductions: lanes -> 4 -> 1


def schedule_quantize_activations_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """The prefill kernel's activation rounding (M x K elementwise work, small next to the
    matmul), parallel over rows in its row-tiled form (``schedule_quantizer``)."""
    if not applies(func, target) or func.attrs[ops.KERNEL_ATTR] != "quantize_activations":
        return None
    sch = s_tir.Schedule(func)
    schedule_quantizer(sch, target, parallel=int(func.attrs[ops.FORMAT_ATTR].get("row_tile", 1)) > 1)
    return sch


def schedule_quantizer(sch: s_tir.Schedule, target: tvm.target.Target, parallel: bool = False):
    """The stages of ``ops._quantize_stages`` in one pass per 32-value block: its |x| max and
    code sum as vector partials reduced by a short tree (a 16-step scalar chain per block was
    the critical path), its codes one vector op per step (int4 at K = 4096 on Zen 4: 4.1 ->
    2.2 us; the same bits: max and integer sums do not depend on their order). ``parallel``:
    over rows (the prefill form); the GEMV's M <= 2 rows run serial, as a parallel launch
    there cost more than the work (2.7 -> 5.5 us at 2 threads, K = 4096)."""
    from schedules.x86_generic import rfactor_lanes, vector_lanes, vectorize_partial

    lanes = min(vector_lanes(target), ops.ACT_BLOCK)
    # per block reduction: lanes of vector partials, then a tree of QUANT_TREE-wide partials
    partials = {name: [rf for rf in (rfactor_lanes(sch, sch.get_sblock(name), width) for width in (lanes, QUANT_TREE))
                       if rf is not None] for name in ("amax", "bsum")}
    row, block = sch.get_loops(sch.get_sblock("amax"))[:2]
    for rf in reversed(partials["amax"]):
        sch.compute_at(rf, block)
    consumers = [sch.get_sblock(name) for name in ("inv", "xd", "xq")] + partials["bsum"] + [sch.get_sblock("bsum")]
    for consumer in consumers:
        sch.reverse_compute_at(consumer, block)
    if parallel:  # before the partials' inits are split off (a loop over them is not parallel)
        sch.parallel(row)
    for rf in partials["amax"] + partials["bsum"]:
        vectorize_partial(sch, rf, *sch.get_loops(rf)[-2:])
    sch.vectorize(sch.get_loops(sch.get_sblock("xq"))[-1])


SPARSE_COLS = 64  # output columns per parallel task of the outlier kernel


def schedule_sparse_outliers_x86(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """mixed-2-4-16's CSR outlier term y[m, n] = sum_j values[j] * x[m, indices[j]]: parallel
    over tasks of ``SPARSE_COLS`` columns, per row and column its (short) list of outliers
    summed in a register (1 thread, 4096 x 4096 at 0.2%: 20.1 -> 18.2 us; a column-inner
    order measured 2x slower). Gathers stay scalar: a column holds a handful of outliers."""
    from qtvm.formats.mixed import SPARSE_KERNEL

    if not applies(func, target) or str(func.attrs[ops.KERNEL_ATTR]) != SPARSE_KERNEL:
        return None
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("outliers")
    i, j, r = sch.get_loops(block)
    jo, ji = sch.split(j, [None, SPARSE_COLS])
    sch.reorder(jo, i, ji, r)
    sch.parallel(jo)
    sch.decompose_reduction(block, r)  # the sum in a register, one store per output
    return sch
