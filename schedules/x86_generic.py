"""CPU schedules for everything around the packed kernels: norms, RoPE, softmax,
attention batch-matmuls, SwiGLU, transposes (LLVM targets only).

TVM 0.27's default CPU pipeline neither fuses these ops nor schedules them: each one
is its own scalar loop nest (165 calls per tiny-LLaMA forward; ``probs @ V`` alone took
0.86 ms per layer at 2 x 64, its reduction walking a strided column).
:func:`schedule_generic_ops` runs before ``tvm.compile``:

1. legalize and fuse with TVM's own CPU passes (LegalizeOps ... FuseOps, FuseTIR), the
   qtvm kernels marked opaque first so fusion never touches them;
2. schedule every fused PrimFunc that is not scheduled yet, by block structure (never
   by name):

   * **injective** (no reduction): inline the chain into the output block, vectorize
     the innermost loop;
   * **batch matmul** (one ``C += A * B`` block whose output's last axis is the last
     index of ``B``): rows and columns zero-padded to whole tiles (``pad_einsum``), then
     per batch slice 4 rows x 1 vector of accumulators in registers over k (x the whole
     row of ``B`` where it is a constant of at most 4 vectors: ``probs @ V``); the
     elementwise epilogue (scale, causal mask) is inlined into the copy-out;
   * **row reductions** (RMSNorm, softmax): every block computed inside the row loop;
     sums and maxima over (provably) whole vectors rfactored over the lanes, elementwise
     blocks vectorized.
   * **column reductions** (mean-pooling over seq: the input's last index is an output
     axis): the reduction loops moved outside the last output loop, which is vectorized
     (4 x 128 x 384 mean: 298 -> 6 us on Zen 5).

3. float32 ``exp``/``sigmoid`` in the scheduled functions become a polynomial (1.2 ulp)
   LLVM can vectorize: on a vector ``llvm.exp`` is one libm call per lane, and exp was
   half of softmax and SwiGLU. ``isnan`` becomes a test on the bits (exact): TVM's
   vectorizer scalarizes a loop holding it.

Every dimension may be symbolic (one module serves every batch and sequence length).
A vectorized split of a symbolic extent leaves a predicate that TVM's vectorizer
scalarizes, so the outer loop carries ``pragma_loop_partition_hint``: LoopPartition
splits off the tail and the main part runs on full vectors.

Attention runs on every thread: the matmul rule's innermost batch loop and the row rule's
first row loop, where constant (the heads), are parallel when the function's work is
symbolic (a key count that grows) or at least ``_PARALLEL_MIN_WORK`` iterations; other
loops stay serial (a launch costs 1-3 us). Decode at 1900 keys, 2 threads, Zen 4: ``q @ K^T``
and ``probs @ V`` 1.7-1.8x, the softmax 1.8x; level at 1 thread.

A block that reads under ``if_then_else`` (concat, pad) gets no producer inlined
(miscompiled so on Zen 4/5 targets: ``_has_guarded_load``). A function no rule fits
(cumsum's hand-written scan), or whose schedule raises, keeps TVM's default loops.
Reshape-pattern functions are left alone: Relax makes them views.
"""
from __future__ import annotations

import functools
import logging

import tvm
from tvm import relax, s_tir, tirx

__all__ = ["schedule_generic_ops", "fuse_generic_ops", "generic_schedules", "schedule_generic_func", "is_scheduled",
           "vectorizable_exp", "vectorizable_isnan"]

_LOG = logging.getLogger(__name__)
_LOAD = tvm.ir.expr.TensorLoad  # TIR's BufferLoad node in 0.27

#: Opaque op pattern (TVM's kOpaque): FuseOps never fuses a function carrying it.
_OPAQUE = 8
#: Rows of the attention matmul's register tile.
_MM_ROWS = 4
#: Its accumulators: half the vector registers (AVX-512 32, AVX2 16), the rest for loads.
_MM_ACCUMULATORS = {16: 16, 8: 8}
#: Row pitch (floats) the padded keys copy of ``q @ K^T`` avoids (``storage_align``: pitch %
#: 512 == one vector). A register tile reads one line from each of the head dim's 64 rows; a
#: pitch of 2 KiB or a multiple puts them in 1-2 of L1's 64 sets, and every row tile re-read
#: them from L2. MHA prefill (12 heads, Zen 4, 1 thread): 2.0x at 1024 and 2048 tokens, 1.14x
#: at 512, level at 100-768; decode 1.05x.
_SKEW_ALIGN = 512
#: Rows of a ``q @ K^T`` slice from which its packed form runs (``_schedule_matmul``):
#: prefill's (decode has 1-8 rows a kv head).
_PACK_MIN_ROWS = 64
#: A constant-shaped function with fewer innermost iterations than this stays serial; an
#: elementwise one of symbolic size runs its parallel nest from this many elements on.
_PARALLEL_MIN_WORK = 1 << 18
#: Calls whose cost is far above a load or an FMA: a producer using one is only inlined
#: where it is computed once per element anyway.
_EXPENSIVE_CALLS = ("exp", "sigmoid", "sqrt", "rsqrt", "log", "tanh", "erf", "pow", "exp2", "log2")


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """qtvm kernels and anything scheduled before carry one of these attributes."""
    attrs = func.attrs or {}
    return "qtvm.kernel" in attrs or bool(attrs.get("tir.is_scheduled", False))


def vector_lanes(target: tvm.target.Target) -> int:
    """fp32 lanes of the target's widest vector (8 when the target is not in the table)."""
    try:
        from schedules.target_facts import cpu_facts

        return int(cpu_facts(target).f32_lanes)
    except Exception:  # unknown mcpu: AVX2 width is a safe middle ground for LLVM
        return 8


def schedule_generic_ops(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Fuse and schedule the non-kernel ops of a Relax module; a no-op unless ``target``
    is LLVM. The result still goes through ``tvm.compile``'s default pipeline (whose
    LegalizeOps then has nothing left to do)."""
    if target.kind.name != "llvm":
        return mod
    mod = fuse_generic_ops(mod, target)
    updates = {gv: f for gv, f in generic_schedules(mod, target).items() if f is not None}
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def fuse_generic_ops(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Legalized and fused with TVM's own CPU passes, the qtvm kernels left alone."""
    mod = _mark_kernels_opaque(mod)
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    with target:
        passes = (relax.backend.cpu_generic.library_dispatch_passes(target)
                  + relax.backend.cpu_generic.legalize_passes(target))
        mod = tvm.transform.Sequential(passes)(mod)
    # FuseTIR drops functions nothing calls, such as the artefact's metadata function.
    present = {gv.name_hint for gv in mod.get_global_vars()}
    for name, func in relax_funcs.items():
        if name not in present:
            mod[name] = func
    from schedules.numerics import exact_reduction_identities

    return exact_reduction_identities(mod)


def generic_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> dict:
    """{GlobalVar: scheduled PrimFunc, or None where no rule fits} for every unscheduled
    PrimFunc of a fused module (reshape-pattern functions excluded: Relax makes them views,
    a schedule would make them copies)."""
    lanes = vector_lanes(target)
    out = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        if _reshape_pattern(func):
            continue
        out[gv] = schedule_generic_func(func, lanes)
    return out


def _reshape_pattern(func: tirx.PrimFunc) -> bool:
    """TVM's HasReshapePattern, False where its index analysis fails an internal check (a
    reshape whose extent is a min/max of symbols, such as DeBERTa's min(seq, 16) relative
    positions): the function is then scheduled as any other, a copy."""
    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except tvm.error.InternalError:
        return False


def _mark_kernels_opaque(mod: tvm.IRModule) -> tvm.IRModule:
    updates = {gv: f.with_attr("op_pattern", _OPAQUE) for gv, f in mod.functions.items()
               if isinstance(f, tirx.PrimFunc) and is_scheduled(f)}
    mod = mod.clone()  # the caller's module stays as it was
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def schedule_generic_func(func: tirx.PrimFunc, lanes: int = 8, fast_exp: bool = True) -> tirx.PrimFunc | None:
    """The scheduled function (marked ``tir.is_scheduled``), or None when no rule fits.
    Where a rule has a second form for large symbolic sizes (prefill's, against decode's:
    ``_schedule_matmul``'s packed keys, ``_parallel_injective``), the function holds both
    loop nests, chosen at run time by the condition the rule gives."""
    scheduled = _scheduled(func, lanes)
    if scheduled is None:
        return None
    variant = {}  # "when": the condition of the second form, set by a rule that has one
    large = _scheduled(func, lanes, variant)
    if large is not None and "when" in variant:
        from qtvm.intrin.x86 import _with_block_body

        # inside the root block: Relax's passes read a PrimFunc's body as one (HasReshapePattern)
        choose = tirx.IfThenElse(variant["when"], _fresh_body(large, func), scheduled.body.block.body)
        scheduled = _with_block_body(scheduled, choose)
    if fast_exp:  # after scheduling, so the inliner still sees exp as expensive
        scheduled = vectorizable_exp(scheduled)
    return scheduled.with_attr("tir.is_scheduled", True)


def _fresh_body(scheduled: tirx.PrimFunc, func: tirx.PrimFunc):
    """``scheduled``'s body with its own loop variables and buffers (a second schedule of
    ``func`` shares some with the first, and one function may define each only once),
    reading and writing ``func``'s parameters."""
    import tvm_ffi

    fresh = s_tir.renew_defs(scheduled)
    params = dict(zip(fresh.params, func.params))  # buffers (variables of a buffer type) and scalars
    for new, old in zip(fresh.params, func.params):
        try:  # a buffer's shape may be the only definition of a size variable
            shapes = list(zip(new.shape, old.shape))
        except AttributeError:  # a scalar
            continue
        params.update((n, o) for n, o in shapes if isinstance(n, tirx.Var))
    return tvm_ffi.structural_map(fresh.body, (tirx.Var, lambda var: params.get(var, var)))


def _scheduled(func: tirx.PrimFunc, lanes: int, variant: dict | None = None) -> tirx.PrimFunc | None:
    sch = s_tir.Schedule(func)
    try:
        if not _apply_rules(sch, lanes, variant):
            return None
    except Exception as err:  # noqa: BLE001 -- TVM raises several kinds; default loops are still correct
        _LOG.debug("x86_generic: no schedule for %s: %s", func.attrs.get("global_symbol") if func.attrs else "?",
                   str(err).splitlines()[-1] if str(err) else type(err).__name__)
        return None
    return vectorizable_isnan(prefetch_marked_loops(sch.mod["main"]))


# --------------------------------------------------------------------------- exp

# Cody-Waite split of ln 2: n * _LN2_HI is exact for |n| <= 128 (9 significant bits).
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375
_LN2_LO = -2.1219444005469057e-4
_EXP_HI = 88.72283935546875   # largest float32 x with exp(x) finite
_EXP_LO = -86.64              # below: 2^n would leave the normal range; result flushed to 0


def _exp_f32(x):
    """exp(x) from float32 arithmetic only, so LLVM vectorizes it (``llvm.exp`` on a vector
    becomes one libm call per lane). Range reduction x = n ln2 + r, |r| <= ln2 / 2, and the
    Taylor polynomial of degree 7 (truncation 6e-9 relative, below float32 rounding);
    2^n built in the exponent bits as 2 * 2^(n-1) so n = 128 stays representable. Exact
    special cases: +inf above the overflow point, 0 below 2^-125, NaN passes through."""
    f32 = "float32"

    def c(v):
        return tirx.const(v, f32)

    xc = tirx.max(tirx.min(x, c(_EXP_HI)), c(_EXP_LO))
    n = tirx.floor(xc * c(_LOG2E) + c(0.5))
    r = xc - n * c(_LN2_HI) - n * c(_LN2_LO)
    p = c(1.0 / 5040)
    for coef in (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + c(coef)
    bits = tirx.shift_left(tirx.Cast("int32", n) + tirx.const(126, "int32"), tirx.const(23, "int32"))
    y = (p * c(2.0)) * tirx.reinterpret(f32, bits)
    y = tirx.Select(x < c(_EXP_LO), c(0.0), y)
    y = tirx.Select(x > c(_EXP_HI), tirx.infinity(f32), y)
    return tirx.Select(_isnan_bits(x), x, y)


#: float dtype -> (the int dtype of its width, all bits but the sign, +inf's bits)
_NAN_BITS = {"float64": ("int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
             "float32": ("int32", 0x7FFFFFFF, 0x7F800000),
             "float16": ("int16", 0x7FFF, 0x7C00)}  # (TVM has no bfloat16 isnan)


def _isnan_bits(x):
    """isnan(x) as an integer test on its bits (magnitude above +inf's): TVM's simplifier
    folds x != x to false, and its vectorizer scalarizes ``tirx.isnan``."""
    int_dtype, magnitude_mask, inf = _NAN_BITS[str(x.ty)]
    magnitude = tirx.reinterpret(int_dtype, x) & tirx.const(magnitude_mask, int_dtype)
    return magnitude > tirx.const(inf, int_dtype)


def vectorizable_isnan(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Rewrite ``isnan`` calls with :func:`_isnan_bits` (the same values). TVM's vectorizer
    scalarized a whole loop holding one: torch's exported attention guards its softmax with
    ``where(isnan(p), 0, p)``, which ran as a compare and a branch per value (a 32 x 1920
    decode softmax 55 -> 33 us, Zen 4)."""
    import tvm_ffi

    def rewrite(call):
        op = call.op
        if (isinstance(op, tvm.ir.Op) and op.name.split(".")[-1] == "isnan" and len(call.args) == 1
                and str(call.args[0].ty) in _NAN_BITS):
            return _isnan_bits(call.args[0])
        return call

    return tvm_ffi.structural_map(func, (tvm.ir.Call, rewrite))


def vectorizable_exp(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Rewrite float32 ``exp`` and ``sigmoid`` calls with :func:`_exp_f32`
    (sigmoid(x) = 1 / (1 + exp(-x)))."""
    import tvm_ffi

    def rewrite(call):
        op = call.op
        if not isinstance(op, tvm.ir.Op) or len(call.args) != 1 or str(call.ty) != "float32":
            return call
        name = op.name.split(".")[-1]
        if name == "exp":
            return _exp_f32(call.args[0])
        if name == "sigmoid":
            one = tirx.const(1.0, "float32")
            return one / (one + _exp_f32(tirx.const(0.0, "float32") - call.args[0]))
        return call

    return tvm_ffi.structural_map(func, (tvm.ir.Call, rewrite))


# --------------------------------------------------------------------------- prefetch

#: Loop annotation (set by a rule, consumed by :func:`prefetch_marked_loops`): prefetch the
#: streamed operand of the block inside this loop this many cache lines ahead along its last axis.
PREFETCH_MARK = "qtvm_prefetch_lines"
#: Lines ahead for ``q @ K^T`` over transposed keys (a tile reads one line of each of the head
#: dim's 64 rows: more streams than the hardware prefetchers follow), into L2 (locality 2).
#: Measured (Zen 4, DRAM-cold, interleaved, 128-1920 keys, against no prefetch): 4 kv heads x
#: 8 rows 1.10-1.24x (1 thread), 1.06-1.15x (2); 32 heads x 1 row (no grouping) 1.15-1.55x and
#: 1.05-1.25x; prefill tiles (64 and 512 rows) 1.01-1.06x. 2 / 3 / 6 lines measured alike.
_QK_PREFETCH_LINES = 4
_PREFETCH_LOCALITY = 2


def prefetch_marked_loops(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Before each loop marked with :data:`PREFETCH_MARK`, a loop over the same range that
    prefetches, per iteration, the line that many lines ahead of what the block inside reads
    of its streamed operand (the read whose last index moves with the block's last spatial
    iterator). A prefetch never faults: an address past the buffer's end is harmless."""
    import tvm_ffi

    params = list(func.params)
    fetches, stack = [], []  # (marked loop's variable, its prefetch loop or None); loops entered

    def plan(loop, visitor):
        if loop.annotations and PREFETCH_MARK in loop.annotations:
            fetches.append((loop.loop_var, _prefetch_before(loop, stack, params)))
        stack.append(loop)
        visitor.default_visit(loop)
        stack.pop()
    tvm_ffi.structural_visit(func.body, [(tirx.For, plan)])

    def with_prefetch(loop):
        if not loop.annotations or PREFETCH_MARK not in loop.annotations:
            return loop
        annotations = {k: v for k, v in loop.annotations.items() if k != PREFETCH_MARK}
        plain = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, loop.body, loop.thread_binding, annotations)
        fetch = next(f for var, f in fetches if var.same_as(loop.loop_var))
        return plain if fetch is None else tirx.SeqStmt([fetch, plain])

    return tvm_ffi.structural_map(func, (tirx.For, with_prefetch))


def _prefetch_before(loop, around: list, params: list):
    """The prefetch loop to put before the marked ``loop`` (inside the loops ``around``), or
    None where its block has no streamed function operand."""
    import tvm_ffi

    inner_vars, realizes = [], []

    def visit(node, visitor):
        if isinstance(node, tirx.For):
            inner_vars.append(node.loop_var)
        else:
            realizes.append(node)
        visitor.default_visit(node)
    tvm_ffi.structural_visit(loop.body, [(tirx.For, visit), (s_tir.stmt.SBlockRealize, visit)])
    if len(realizes) != 1:
        return None
    ahead = tirx.Var(loop.loop_var.name + "_ahead", loop.loop_var.ty)
    first_inner = {v: tirx.const(0, v.ty) for v in inner_vars}
    target = _streamed_load(realizes[0], {**first_inner, loop.loop_var: ahead},
                            int(loop.annotations[PREFETCH_MARK]), params)
    if target is None:
        return None
    fetch = tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", tirx.address_of(target),
                                                tirx.const(0, "int32"), tirx.const(_PREFETCH_LOCALITY, "int32"),
                                                tirx.const(1, "int32")))
    # a loop of its own before the marked one: inside it, LLVM kept the register tile in
    # memory (a store after every FMA, 2.3x the cache-hot time)
    fetches = tirx.For(ahead, loop.min, loop.extent, tirx.ForKind.SERIAL, fetch)
    # only on the first pass of an enclosing loop that reads the same lines again (a prefill's
    # row tiles: later passes find them in cache, and the prefetches cost 0.81x at 512 rows)
    again = [f for f in around if not any(_uses(i, f.loop_var) for i in target.indices)]
    if again:
        first = [tirx.EQ(f.loop_var, f.min) for f in again]
        fetches = tirx.IfThenElse(functools.reduce(tirx.And, first), fetches, None)
    return fetches


def _streamed_load(realize, loops: dict, lines: int, params: list):
    """The streamed operand's element ``lines`` lines ahead (a load, its loop variables
    replaced as ``loops`` says); None where the block has no such read or it reads a buffer
    of the function's own (a padded copy, written just before: in cache)."""
    import tvm_ffi

    block = realize.block
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if not spatial or not isinstance(block.body, tirx.BufferStore):
        return None
    written = [w.source for w in block.writes]
    loads = []
    _walk(block.body.value, lambda e: loads.append(e) if isinstance(e, _LOAD) else None)
    streamed = [ld for ld in loads if not any(ld.source.same_as(w) for w in written)
                and _uses(ld.indices[-1], spatial[-1])]
    if len(streamed) != 1 or not any(streamed[0].source.same_as(p) for p in params):
        return None
    load = streamed[0]
    bound = {iv.var: v for iv, v in zip(block.iter_vars, realize.iter_values)}

    def at(index):
        index = tvm_ffi.structural_map(index, (tirx.Var, lambda v: bound.get(v, v)))
        return tvm_ffi.structural_map(index, (tirx.Var, lambda v: loops.get(v, v)))
    indices = [at(i) for i in load.indices]
    elements = lines * 64 // (tvm.runtime.DataType(load.ty).bits // 8)
    indices[-1] = tvm.sym.Analyzer().simplify(indices[-1] + tirx.const(elements, indices[-1].ty))
    return tirx.BufferLoad(load.source, indices)


# --------------------------------------------------------------------------- analysis

def _iter_kinds(sch, block) -> str:
    """'S'/'R' per block iterator; '?' for anything else (scans, opaque iterators)."""
    kinds = []
    for iv in sch.get(block).iter_vars:
        kinds.append({tirx.IterVar.DataPar: "S", tirx.IterVar.CommReduce: "R"}.get(int(iv.iter_type), "?"))
    return "".join(kinds)


def _const(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _extent(sch, loop):
    return sch.get(loop).extent


def _walk(expr, visit) -> None:
    """Visit every sub-expression (TIR has no Python visitor in 0.27)."""
    visit(expr)
    for field in ("a", "b", "value", "condition", "true_value", "false_value"):
        sub = getattr(expr, field, None)
        if isinstance(sub, tvm.ir.Expr):
            _walk(sub, visit)
    for field in ("args", "indices"):
        for sub in getattr(expr, field, None) or ():
            if isinstance(sub, tvm.ir.Expr):
                _walk(sub, visit)


def _any(expr, pred) -> bool:
    """Whether ``pred`` holds for any sub-expression of ``expr``."""
    found = []
    _walk(expr, lambda e: found.append(True) if pred(e) else None)
    return bool(found)


def _value_has(block, pred) -> bool:
    """Whether ``pred`` holds for any sub-expression of the value ``block`` stores."""
    return isinstance(block.body, tirx.stmt.BufferStore) and _any(block.body.value, pred)


def _call_name(e) -> str | None:
    """The op name of a call to a TIR op (``exp``, ``if_then_else``), else None."""
    return e.op.name.split(".")[-1] if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) else None


def _is_expensive(sch, block) -> bool:
    """Transcendental calls or float division: worth computing once, not per consumer."""
    # float division: tens of cycles per vector
    return _value_has(sch.get(block), lambda e: _call_name(e) in _EXPENSIVE_CALLS or isinstance(e, tirx.Div))


def _write_buffer(sch, block):
    return sch.get(block).writes[0].source


def _domain(sch, block) -> list:
    return [iv.dom.extent for iv in sch.get(block).iter_vars]


def _same(a, b) -> bool:
    return bool(tvm.sym.Analyzer().can_prove_equal(a, b))


def _is_broadcast_into(sch, producer, consumer) -> bool:
    """True when the consumer iterates over more points than the producer writes."""
    shape = list(_write_buffer(sch, producer).shape)
    dom = [d for d, k in zip(_domain(sch, consumer), _iter_kinds(sch, consumer)) if k == "S"]
    if len(shape) != len(dom):
        return True
    return not all(_same(a, b) for a, b in zip(shape, dom))


# --------------------------------------------------------------------------- rules

def _apply_rules(sch: s_tir.Schedule, lanes: int, variant: dict | None = None) -> bool:
    """``variant`` (a dict): only a rule's form for large sizes (``schedule_generic_func``),
    else False."""
    body = sch.mod["main"].body
    if not isinstance(body, s_tir.stmt.SBlockRealize) or body.block.name_hint != "root":
        return False  # hand-written (opaque) loop nests such as cumsum
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    if not blocks:
        return False
    for b in blocks:
        if "?" in _iter_kinds(sch, b) or not _untransformed(sch, b):
            return False  # scans, opaque blocks or already transformed loop nests
    _inline_producers(sch, root)
    blocks = sch.get_child_blocks(root)
    reductions = [b for b in blocks if "R" in _iter_kinds(sch, b)]
    if variant is not None:
        if not reductions:
            return _parallel_injective(sch, blocks, lanes, variant)
        return len(reductions) == 1 and _is_matmul(sch, reductions[0]) and \
            _schedule_matmul(sch, root, reductions[0], lanes, variant)
    if not reductions:
        for b in blocks:
            _schedule_injective(sch, b, lanes)
        return True
    if len(reductions) == 1 and _is_matmul(sch, reductions[0]):
        return _schedule_matmul(sch, root, reductions[0], lanes)
    if len(reductions) == 1 and _is_column_reduction(sch, reductions[0]):
        return _schedule_column_reduction(sch, root, reductions[0], lanes)
    return _schedule_rows(sch, root, reductions, lanes)


def _untransformed(sch, block) -> bool:
    """A loop per iterator, or none at all for a block of unit iterators (a scalar such as
    the past length a KV step reshapes to a 0-d tensor, which TVM writes without a loop)."""
    loops, iters = sch.get_loops(block), sch.get(block).iter_vars
    return len(loops) == len(iters) or not loops and all(_const(iv.dom.extent) == 1 for iv in iters)


def _inline_producers(sch, root) -> None:
    """Inline spatial producers; an expensive one only into a single, same-shaped consumer
    (the row rule computes the others once per row). Until a pass inlines nothing: a
    softmax's normalisation (a division) feeds an isnan test and the select guarding it, so
    it is inlined in the pass after the test went into the select; its full-size intermediate
    (written back to DRAM in prefill) goes: the KV step's softmax over 32 x 1024 x 1024 scores
    1.19x, bit for bit (Zen 4, 1 thread). (Consumers first instead changed RoPE: its concat,
    inlined first, then kept the transpose from being inlined.)"""
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    inlined = True
    while inlined:
        inlined = False
        for block in sch.get_child_blocks(root):
            if sch.get(block).name_hint in outputs or "R" in _iter_kinds(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if not consumers or any(_has_guarded_load(sch.get(c)) for c in consumers):
                continue  # nothing to inline into, or a concat / pad (_has_guarded_load)
            if _is_expensive(sch, block) and (len(consumers) > 1
                                              or any(_is_broadcast_into(sch, block, c) for c in consumers)):
                continue
            try:
                sch.compute_inline(block)
                inlined = True
            except s_tir.ScheduleError:
                pass


def _uses(expr, var) -> bool:
    return _any(expr, lambda e: isinstance(e, tirx.Var) and e.same_as(var))


#: Calls TVM 0.27's LLVM codegen cannot emit on vectors ("unknown intrinsic"): sinh and cosh
#: at every float width, the rest in float16 (checked by compiling each one vectorized).
_SCALAR_ONLY_CALLS = {"sinh": None, "cosh": None, "asin": "float16", "acos": "float16", "atan": "float16",
                      "asinh": "float16", "acosh": "float16", "atanh": "float16", "erf": "float16",
                      "log1p": "float16"}


def _has_scalar_only_call(block) -> bool:
    return _value_has(block, lambda e: _call_name(e) in _SCALAR_ONLY_CALLS
                      and _SCALAR_ONLY_CALLS[_call_name(e)] in (None, str(e.ty)))


def _has_guarded_load(block) -> bool:
    """Whether ``block`` reads a buffer only under an ``if_then_else`` (concat, pad), whose
    other branch's index would be out of bounds. No producer is inlined into such a block:
    with its producers inlined (vectorized by TVM or only by LLVM's loop vectorizer, which
    if-converts it with masked loads), the 3-D RotaryEmbedding's concat computed garbage in
    half its outputs for ``-mcpu=znver4``/``znver5`` (ONNX's test_rotary_embedding_3d_input),
    while skylake-avx512, sapphirerapids and znver3 code was right; with the producers in
    loops of their own it is right on all of them."""
    return _value_has(block, lambda e: _call_name(e) == "if_then_else"
                      and any(_any(branch, lambda x: isinstance(x, _LOAD)) for branch in e.args[1:]))


def _vectorizable(sch, loop) -> bool:
    """A loop may be vectorized only when it is innermost and no reduction iterator of a
    block under it moves with it: a nested (reduction) loop or a reduction along the vector
    lanes turns a vector loop into wrong code, and TVM's vectorize primitive refuses neither.
    (A reduction block whose init is not decomposed yet is fine: vectorize must come first.)
    Blocks calling a math function LLVM has no vector form for stay scalar too, blocks
    choosing between bool loads (``_bool_choice``) and bfloat16 constant stores."""
    node = sch.get(loop)
    body = node.body
    stmts = list(body.seq) if isinstance(body, tirx.stmt.SeqStmt) else [body]
    for stmt in stmts:
        if not isinstance(stmt, s_tir.stmt.SBlockRealize):
            return False
        block = stmt.block
        for iv, value in zip(block.iter_vars, stmt.iter_values):
            if int(iv.iter_type) != tirx.IterVar.DataPar and _uses(value, node.loop_var):
                return False
        if _has_scalar_only_call(block) or _bool_choice(block) or _bfloat16_constant_store(block):
            return False
    return True


def _bfloat16_constant_store(block) -> bool:
    """Whether ``block`` (or its reduction's init, vectorized with it) stores a bfloat16
    constant: vectorized, TVM's bfloat16 storage legalization leaves the broadcast constant
    bfloat16 in a uint16 store and the build fails ("dtype mismatch on BufferStore"; the -inf
    init of a max in PhiMoE's bfloat16 router)."""
    return any(isinstance(store, tirx.stmt.BufferStore) and str(store.buffer.dtype) == "bfloat16"
               and not _any(store.value, lambda e: isinstance(e, _LOAD)) for store in (block.body, block.init))


def _bool_choice(block) -> bool:
    """Whether ``block`` stores a bool chosen by an ``if_then_else``: vectorized, TVM's LLVM
    codegen joins the branches' bool vectors with a phi whose operands are not of its type
    (Funnel's pooled attention mask, a [batch, 3, 5] bool concat of strided slices: LLVM's
    verifier refused the module)."""
    store = block.body
    return (isinstance(store, tirx.stmt.BufferStore) and str(store.buffer.dtype) == "bool"
            and _value_has(block, lambda e: _call_name(e) == "if_then_else" or isinstance(e, tirx.Select)))


def _vectorize(sch, loop) -> None:
    """Vectorize ``loop`` if :func:`_vectorizable`, else leave it serial."""
    if _vectorizable(sch, loop):
        sch.vectorize(loop)


def _vectorize_inner(sch, loop, lanes: int) -> None:
    """Vectorize ``loop`` (the innermost of a spatial nest) on full vectors. A constant
    extent splits by its largest divisor <= ``lanes`` (no tail); a symbolic one gets a
    tail that LoopPartition splits off (on a constant extent that hint made later
    passes mix int32 and int64 constants). Loops :func:`_vectorizable` refuses stay serial."""
    if not _vectorizable(sch, loop):
        return
    extent = _const(_extent(sch, loop))
    if extent is not None:
        width = max(d for d in range(1, min(lanes, extent) + 1) if extent % d == 0)
        if width == extent and extent > 1:
            sch.vectorize(loop)
        elif width > 1:
            sch.vectorize(sch.split(loop, [None, width])[1])
        return
    outer, inner = sch.split(loop, [None, lanes])
    sch.vectorize(inner)
    sch.annotate(outer, "pragma_loop_partition_hint", 1)


def _schedule_injective(sch, block, lanes: int) -> None:
    # Outer loops stay unfused: fusing symbolic extents puts div/mod in every index.
    _vectorize_inner(sch, sch.get_loops(block)[-1], lanes)


def _parallel_injective(sch, blocks, lanes: int, variant: dict) -> bool:
    """The form for many elements of an elementwise function of symbolic size: each block
    as ``_schedule_injective`` with an outer loop parallel (the first of a constant extent
    >= 2, such as the heads, else the innermost symbolic one, such as seq), from
    ``_PARALLEL_MIN_WORK`` elements on (``variant["when"]``): prefill's SwiGLU, RoPE and
    mask add; decode's few elements stay serial, where a parallel launch costs more than
    the work. False for a constant size. The e2e LLaMA at 2 threads (Zen 4, its second vCPU
    adding little bandwidth): prefill 0.966x (1024 tokens), 0.974x (128); decode level."""
    work = None
    for block in blocks:
        *outer, inner = sch.get_loops(block)
        extents = [_extent(sch, loop) for loop in outer]
        if not outer or all(_const(e) is not None for e in extents + [_extent(sch, inner)]):
            return False
        wide = [loop for loop, e in zip(outer, extents) if _const(e) is not None and _const(e) >= 2]
        symbolic = [loop for loop, e in zip(outer, extents) if _const(e) is None]
        size = functools.reduce(lambda a, b: a * b, extents, _extent(sch, inner))
        work = size if work is None else work + size
        pick = (wide or symbolic[-1:] or [None])[0]
        if pick is None:
            return False
        _schedule_injective(sch, block, lanes)
        sch.parallel(pick)
    variant["when"] = work >= _PARALLEL_MIN_WORK
    return True


def _is_matmul(sch, block) -> bool:
    """``C[.., i, j] += A[.., i, k] * B[.., k, j]`` with j the last index of C and B (an
    operand may be widened as it is read: a float16 KV cache)."""
    stmt = sch.get(block)
    kinds = _iter_kinds(sch, block)
    if kinds.count("R") != 1 or not kinds.endswith("R") or len(kinds) < 3:
        return False
    body = stmt.body
    if not isinstance(body, tirx.stmt.BufferStore):
        return False
    value = body.value
    if not (isinstance(value, tirx.Add) and isinstance(value.b, tirx.Mul)):
        return False
    a, b = (e.value if isinstance(e, tirx.Cast) else e for e in (value.b.a, value.b.b))
    if not (isinstance(a, _LOAD) and isinstance(b, _LOAD)):
        return False
    j, k = stmt.iter_vars[-2].var, stmt.iter_vars[-1].var
    return bool(body.indices[-1].same_as(j) and b.indices[-1].same_as(j) and a.indices[-1].same_as(k))


def _schedule_matmul(sch, root, mm, lanes: int, packed: dict | None = None) -> bool:
    """Per batch slice: tiles of 4 rows x 1 vector (or B's whole row: ``_row_vectors``)
    accumulated in registers over k.

    ``packed`` (a dict): the form for many rows of ``q @ K^T`` over transposed keys read in
    place (a symbolic column count of whole tiles: the KV step's 64 x blocks; grouped rows
    or one row a head), or False where it does not apply. Column tiles
    outermost, each tile's slice of B (its head dim's 64 rows) copied once into a
    contiguous panel that every row tile then reads from L1: B's rows are the key count
    apart, and at 512 or 1024 keys (2 or 4 KiB) all of a tile's lines fall in a few L1 sets
    and thrash, so each row tile read them from L2 (Zen 4, 1 thread, 4 kv heads, 1024 rows:
    2.06-2.12x at 1024 and 2048 keys, 1.16x at 512, 0.97-1.03x at 128, 768, 1280, 1920; one
    row a head, 32 heads: 2.1x at 1000-1024 rows over 1024 keys, 1.05x at 128). Decode's few
    rows stream B once from DRAM, where the copy cost 0.51-0.84x: the caller runs this form
    from ``_PACK_MIN_ROWS`` rows on (``packed["when"]``).

    Rows and columns are padded (``pad_einsum``: per-slice zero-padded copies of the
    operands) to whole tiles, so the accumulator tile has a constant shape and SROA keeps
    it in registers; with a predicated split it would be the full [rows, cols] buffer in
    memory and every k step a store-to-load chain. The elementwise epilogue (scale,
    causal mask) is inlined into the copy-out of the valid region. Where the keys are padded
    (a key count not a multiple of the vector: the main graph's ``past + seq``), their copy's
    row pitch is skewed off multiples of 2 KiB instead of packed (``_SKEW_ALIGN``)."""
    n_batch = len(sch.get_loops(mm)) - 3
    *_, rows, cols, _ = [_extent(sch, loop) for loop in sch.get_loops(mm)]
    width = lanes * _row_vectors(cols, lanes)
    whole = _divides(_MM_ROWS, rows) and _divides(width, cols)
    if packed is not None:  # keys read in place (a multiple of the tile's width: the KV step's blocks)
        if _const(cols) is not None or _const(rows) is not None or not _divides(width, cols):
            return False
        packed["when"] = rows >= _PACK_MIN_ROWS
    if whole:  # whole tiles already (GQA rows kv_heads x seq): no padded copies, no copy-out
        producers, crop = [], None
    else:
        sch.pad_einsum(mm, [1] * n_batch + [_MM_ROWS, width, 1])
        producers = sch.get_producers(mm)
        (crop,) = sch.get_consumers(mm)
        keys_copy = _producer_of_columns(sch, mm) if _const(cols) is None else None
        if keys_copy is not None:  # q @ K^T's keys padded: the copy's rows never a multiple of 2 KiB apart
            sch.storage_align(keys_copy, 0, len(sch.get(keys_copy).iter_vars) - 2, _SKEW_ALIGN, lanes)
    for block in sch.get_child_blocks(root):
        if crop is not None and _name(sch, block) not in {_name(sch, b) for b in [mm, crop, *producers]}:
            sch.reverse_compute_inline(block)  # raises for a non-elementwise epilogue
        elif crop is None and _name(sch, block) != _name(sch, mm):
            _vectorize_inner(sch, sch.get_loops(block)[-1], lanes)  # the epilogue stays its own nest
    tile = sch.cache_write(mm, 0, "local")
    *batch, i, j, k = sch.get_loops(mm)
    io, ii = sch.split(i, [None, _MM_ROWS])
    jo, ji = sch.split(j, [None, width])
    sch.reorder(*((jo, io) if packed is not None else (io, jo)), k, ii, ji)
    sch.unroll(ii)
    sch.reverse_compute_at(tile, io if packed is not None else jo, preserve_unit_loops=True)
    *_, t_i, t_j = sch.get_loops(tile)
    sch.unroll(t_i)
    for loop in (t_j, ji):
        _vectorize_vectors(sch, loop, lanes)
    if packed is not None:
        panel = sch.cache_read(mm, _column_operand(sch, mm), "global")
        sch.compute_at(panel, jo)
        _vectorize_vectors(sch, sch.get_loops(panel)[-1], lanes)
    elif _const(cols) is None and _QK_PREFETCH_LINES:  # q @ K^T over transposed keys: B's rows are as many streams
        sch.annotate(k, PREFETCH_MARK, _QK_PREFETCH_LINES)
    if batch:  # before the init is split off: parallel needs whole reduction blocks
        _parallel_if_worth_it(sch, batch[-1], mm)
    init = sch.decompose_reduction(mm, k)
    _vectorize_vectors(sch, sch.get_loops(init)[-1], lanes)
    if batch:  # operand copies per batch slice (the copy-out stays a separate nest: attached
        for pad in producers:  # it gets bounds TVM cannot simplify, and scalar code)
            sch.compute_at(pad, batch[-1], preserve_unit_loops=True)
    for block in [*producers, *([crop] if crop is not None else [])]:
        _vectorize_inner(sch, sch.get_loops(block)[-1], lanes)
    return True


def _producer_of_columns(sch, mm):
    """The block writing the operand ``mm``'s columns walk (B's padded copy), or None."""
    source = sch.get(mm).reads[_column_operand(sch, mm)].source
    blocks = [b for b in sch.get_producers(mm) if sch.get(b).writes[0].source.same_as(source)]
    return blocks[0] if blocks else None


def _column_operand(sch, mm) -> int:
    """Index among ``mm``'s reads of B, the operand its last index walks with the columns."""
    block = sch.get(mm)
    col = block.iter_vars[-2].var  # (*batch, row, column, k)
    for index, region in enumerate(block.reads):
        if region.source.same_as(block.writes[0].source):
            continue
        if _uses(region.region[-1].min, col):
            return index
    raise ValueError("no operand indexed by the columns")


def _row_vectors(cols, lanes: int) -> int:
    """Vectors per tile row: all of B's row where it is a constant of few vectors (the head
    dim of ``probs @ V``), so each k step reads one whole row of B and B is streamed in
    order (DRAM-cold, 4 kv heads x 1920 x 64, Zen 4: 273 -> 147 us; 68 -> 26 us at 512
    positions; cache-hot the same); else 1 (a symbolic width such as ``q @ K^T``'s key
    count measured slower with wider tiles)."""
    width = _const(cols)
    if width is None or width % lanes:
        return 1
    vectors = width // lanes
    return vectors if vectors * _MM_ROWS <= _MM_ACCUMULATORS.get(lanes, 8) else 1


def _vectorize_vectors(sch, loop, lanes: int) -> None:
    """A tile row of one or more whole vectors: the vectors unrolled, each vectorized."""
    extent = _const(_extent(sch, loop))
    if extent is not None and extent > lanes:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    _vectorize(sch, loop)


def _divides(n: int, extent) -> bool:
    """``extent`` is provably a multiple of ``n`` (constant, or such as ``seq * 8``)."""
    from tvm.sym import Analyzer

    return bool(Analyzer().can_prove_equal(tirx.floormod(extent, n), 0))


def _is_column_reduction(sch, block) -> bool:
    """A reduction over leading axes of its input (mean-pooling over seq): iterators spatial
    then reduce, and every input read indexed last by the last spatial iterator, so the
    vector runs along the output and the reduction walks rows."""
    import re

    stmt = sch.get(block)
    kinds = _iter_kinds(sch, block)
    if not re.fullmatch(r"S+R+", kinds) or not isinstance(stmt.body, tirx.stmt.BufferStore):
        return False
    last = stmt.iter_vars[kinds.rindex("S")].var
    out = _write_buffer(sch, block)
    loads = []
    _walk(stmt.body.value, lambda e: loads.append(e) if isinstance(e, _LOAD) else None)
    inputs = [ld for ld in loads if not ld.source.same_as(out)]
    return bool(inputs) and all(ld.indices and ld.indices[-1].same_as(last) for ld in inputs)


def _schedule_column_reduction(sch, root, red, lanes: int) -> bool:
    """Reduction loops outside the last spatial loop, which is vectorized: each step adds a
    contiguous vector of a row into a vector of partial results. Other blocks (the mean's
    divide) keep their own vectorized nests."""
    kinds = _iter_kinds(sch, red)
    loops = sch.get_loops(red)
    p = kinds.count("S")
    spatial, reduce = loops[:p], loops[p:]
    sch.reorder(*spatial[:-1], *reduce, spatial[-1])
    _vectorize_inner(sch, spatial[-1], lanes)
    init = sch.decompose_reduction(red, reduce[0])
    _vectorize_inner(sch, sch.get_loops(init)[-1], lanes)
    for block in sch.get_child_blocks(root):
        if "R" not in _iter_kinds(sch, block) and _name(sch, block) != _name(sch, init):
            _vectorize_inner(sch, sch.get_loops(block)[-1], lanes)
    return True


def _name(sch, block) -> str:
    return sch.get(block).name_hint


def _schedule_rows(sch, root, reductions, lanes: int) -> bool:
    """Everything computed per row: the leading axes every reduction shares with the
    output block (a reduction's other spatial axes must have extent 1)."""
    outputs = sch.get_output_blocks(root)
    if len(outputs) != 1 or "R" in _iter_kinds(sch, outputs[0]):
        return False
    last = outputs[0]
    last_dom = _domain(sch, last)
    rows = len(last_dom)
    for red in reductions:
        kinds = _iter_kinds(sch, red)
        dom = [d for d, kd in zip(_domain(sch, red), kinds) if kd == "S"]
        n = 0
        while n < min(len(dom), len(last_dom)) and _same(dom[n], last_dom[n]):
            n += 1
        if any(_const(d) != 1 for d in dom[n:]):
            return False
        rows = min(rows, n)
    if rows == 0:
        return False
    # rfactor before compute_at: it needs its block to head its loop nest.
    partial = [rf for rf in (rfactor_lanes(sch, red, lanes) for red in reductions) if rf is not None]
    row = sch.get_loops(last)[rows - 1]
    rest = [b for b in sch.get_child_blocks(root) if _name(sch, b) != _name(sch, last)]
    for block in reversed(rest):
        sch.compute_at(block, row, preserve_unit_loops=True)
    row_loop = sch.get(row)
    for block in sch.get_child_blocks(row):
        inner = sch.get_loops(block)[-1]
        if "R" not in _iter_kinds(sch, block) and not sch.get(inner).same_as(row_loop):
            _vectorize_inner(sch, inner, lanes)
    constant_rows = [lp for lp in sch.get_loops(last)[:rows] if _const(_extent(sch, lp)) not in (None, 1)]
    if constant_rows:  # before the partials' inits are split off
        _parallel_if_worth_it(sch, constant_rows[0], last)
    for rf in partial:
        # compute_at rebuilt the nest in iterator order: lanes (rfactor's axis 0) first.
        loops = sch.get_loops(rf)
        lane = loops[[sch.get(lp).same_as(sch.get(row)) for lp in loops].index(True) + 1]
        vectorize_partial(sch, rf, lane, loops[-1])
    return True


def _parallel_if_worth_it(sch, loop, block) -> None:
    """``loop`` (a constant extent > 1: the heads) parallel where ``block``'s loop nest is
    symbolic or at least ``_PARALLEL_MIN_WORK`` iterations. Every block under it writes either
    its own slice of the output or a buffer it alone uses (allocated inside after lowering),
    which ``sch.parallel`` checks too."""
    if _const(_extent(sch, loop)) in (None, 1):
        return
    work = 1
    for lp in sch.get_loops(block):
        extent = _const(_extent(sch, lp))
        if extent is None:
            break
        work *= extent
    else:
        if work < _PARALLEL_MIN_WORK:
            return
    sch.parallel(loop)


def vectorize_partial(sch, rf, lane, red) -> None:
    """An ``rfactor_lanes`` partial block: its reduction loop outside its lane loop, the lanes
    one vector (before the init is split off: vectorize needs a whole reduction block), then
    the init's lanes too."""
    sch.reorder(red, lane)
    _vectorize(sch, lane)
    init = sch.decompose_reduction(rf, red)
    _vectorize(sch, sch.get_loops(init)[-1])


def rfactor_lanes(sch, block, lanes: int):
    """sum or max over a multiple of ``lanes`` -> ``lanes`` vector partial results + one
    horizontal step; returns the partial block, None for other lengths. A symbolic length
    qualifies where it is provably such a multiple (the KV step's softmax over kv_blocks x
    64 keys: its scalar max and sum took 152 us a layer at 1920 keys and 32 heads); other
    symbolic rows stay scalar."""
    body = sch.get(block).body
    if not (isinstance(body, tirx.stmt.BufferStore) and isinstance(body.value, (tirx.Add, tirx.Max))):
        return None
    inner = sch.get_loops(block)[-1]
    extent = _extent(sch, inner)
    known = _const(extent)
    if not _divides(lanes, extent) or (known is not None and known <= lanes):
        return None  # a predicated split: compute_at then drops the rfactor block's predicate
    _, vec = sch.split(inner, [None, lanes])
    return sch.rfactor(vec, 0)
