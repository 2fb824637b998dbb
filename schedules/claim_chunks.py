"""Parallel loops whose chunks the CPU threads claim as they go (LLVM targets).

TVM's parallel loop gives task t of T the fixed iterations [t*ceil(E/T), (t+1)*ceil(E/T)):
a worker that starts late (woken from sleep, its core lent to another process for a while)
or runs slower (a hybrid CPU's E-core) holds the whole call while the others wait. With
claiming, the others take over what it has not started. (TVM's pool still joins every task:
a worker that does not run at all before the others finish still delays the call until it
starts, only no longer by its share of the work.) A rule marks a
parallel loop whose iterations are idempotent chunks (``mark``: checked on the schedule),
and the ``ClaimChunks`` pass, run after TVM's lowering, rewrites it: each task starts at
the first chunk of its own range and walks every chunk once, running those whose claim flag
(one int32 per chunk, per call) it finds clear, after setting it. A flag is set only by a
task that then runs the chunk, and every task reads every flag once, so none is skipped.
TIR has neither atomics nor volatile accesses on the CPU (TVM dropped ``volatile_scope``):
the flags are plain loads and stores, which the compiler may only make staler (it cannot see
the other threads), never invent; a stale clear flag, or two tasks testing the same flag in
the same few cycles, means a chunk runs twice, which the idempotence check makes harmless.

Cost: the flags' reset (E + 1 stores) and, per task, one read of every flag (E int32: a few
cache lines, some written by other cores). Measured level with the fixed split on a 2-vCPU Zen 5
(docs/bench_gemv_zen5.md); not measured on many cores, where that walk's misses grow with E.

``PIPELINE`` names TVM's default TIR pipeline followed by this pass (``tir_pipeline=`` of
``tvm.compile``); where a build uses TVM's own pipeline the mark is ignored and the split
stays static.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

ANNOTATION = "qtvm.claim_chunks"
PIPELINE = "qtvm_claim_chunks"


# -- on the schedule: the check and the mark ------------------------------------------------
def mark(sch: s_tir.Schedule, loop) -> bool:
    """Mark ``loop`` (a LoopRV; call after the rule's last primitive) for claiming if it is
    parallel and its iterations are idempotent: every buffer a block under it writes is
    either one no block under it reads (nor reduces into): each output written once per
    chunk from private values; or an intermediate whose every access lies inside the loop
    (allocated per iteration after lowering). Returns whether it marked; otherwise the split stays static."""
    if sch.get(loop).kind != tirx.ForKind.PARALLEL or not _idempotent_chunks(sch, loop):
        return False
    sch.annotate(loop, ANNOTATION, 1)
    return True


def mark_output_loop(sch: s_tir.Schedule, block_name: str) -> bool:
    """``mark`` the outermost loop of the block ``block_name`` (a rule's output block)."""
    return mark(sch, sch.get_loops(sch.get_sblock(block_name))[0])


def _idempotent_chunks(sch: s_tir.Schedule, loop) -> bool:
    inside = _stmts_under(sch, loop)
    blocks = [sch.get(b) for b in _blocks_under(sch, loop)]
    # a reduction block reads what it writes (its init, then the sum), whatever its reads say
    read = [r.source for b in blocks for r in b.reads] + [
        w.source for b in blocks if _reduces(b) for w in b.writes]
    func = sch.mod["main"]
    lca = dict(s_tir.analysis.detect_buffer_access_lca(func).items())
    for buf in (w.source for b in blocks for w in b.writes):
        at = next((at for b, at in lca.items() if b.same_as(buf)), None)
        private = (at is not None and any(at.same_as(s) for s in inside)
                   and not any(p.same_as(buf) for p in func.params))  # a parameter outlives the loop
        if not private and any(r.same_as(buf) for r in read):
            return False
    return True


def _reduces(block) -> bool:
    return block.init is not None or any(v.iter_type == tirx.IterVar.CommReduce for v in block.iter_vars)


def _blocks_under(sch: s_tir.Schedule, loop) -> list:
    out, todo = [], list(sch.get_child_blocks(loop))
    while todo:
        block = todo.pop()
        out.append(block)
        todo.extend(sch.get_child_blocks(block))
    return out


def _stmts_under(sch: s_tir.Schedule, loop) -> list:
    """The loop itself and every loop and block nested in it."""
    top = sch.get(loop)
    stmts = [top]
    for block in _blocks_under(sch, loop):
        stmts.append(sch.get(block))
        loops = [sch.get(l) for l in sch.get_loops(block)]
        at = next(i for i, l in enumerate(loops) if l.same_as(top))
        stmts.extend(loops[at + 1:])
    return stmts


# -- after lowering: the rewrite -----------------------------------------------------------
def _claimed(loop: tirx.For) -> tirx.Stmt:
    """for c in parallel(E): body(c)   ->
         claims[0..E] = 0
         for t in parallel(E):                      # task k's first t: its own range's start
           if claims[E] == 0:                       # E: "every chunk claimed" (a shortcut)
             for step in range(E):
               c = (t + step) mod E
               if claims[c] == 0: claims[c] = 1; body(c)
             claims[E] = 1"""
    chunk, extent, dtype = loop.loop_var, int(loop.extent), str(loop.extent.ty.dtype)
    const = lambda v: tirx.IntImm(dtype, v)  # noqa: E731
    claims = tirx.decl_buffer((extent + 1,), "int32", name="chunk_claims")
    flag = lambda i: tirx.BufferLoad(claims, [i])  # noqa: E731
    setf = lambda i, v: tirx.BufferStore(claims, tirx.IntImm("int32", v), [i])  # noqa: E731
    zero = tirx.IntImm("int32", 0)
    task, step, s = (tirx.Var(n, dtype) for n in (f"{chunk.name}_task", "claim_step", "claim_init"))
    walk = tirx.For(step, const(0), const(extent), tirx.ForKind.SERIAL, tirx.SeqStmt([
        tirx.Bind(chunk, tirx.FloorMod(task + step, const(extent))),
        tirx.IfThenElse(tirx.EQ(flag(chunk), zero), tirx.SeqStmt([setf(chunk, 1), loop.body]), None)]))
    per_task = tirx.IfThenElse(tirx.EQ(flag(const(extent)), zero), tirx.SeqStmt([walk, setf(const(extent), 1)]), None)
    return tirx.SeqStmt([
        tirx.AllocBuffer(claims),
        tirx.For(s, const(0), const(extent + 1), tirx.ForKind.SERIAL, setf(s, 0)),
        tirx.For(task, const(0), const(extent), tirx.ForKind.PARALLEL, per_task)])


def _rewrite(stmt: tirx.Stmt) -> tirx.Stmt:
    """The marked loops of ``stmt`` rewritten; only the statement kinds that lowering leaves
    around a kernel's loops are descended (a mark elsewhere stays a static split)."""
    if isinstance(stmt, tirx.For):
        if (ANNOTATION in stmt.annotations and stmt.kind == tirx.ForKind.PARALLEL
                and isinstance(stmt.extent, tirx.IntImm) and isinstance(stmt.min, tirx.IntImm)
                and int(stmt.min) == 0 and int(stmt.extent) > 1):
            return _claimed(stmt)
        body = _rewrite(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations,
            stmt.step, stmt.span)
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_rewrite(s) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(seq, stmt.seq)) else tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.AttrStmt):
        body = _rewrite(stmt.body)
        return stmt if body.same_as(stmt.body) else tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if isinstance(stmt, tirx.IfThenElse):
        then = _rewrite(stmt.then_case)
        other = None if stmt.else_case is None else _rewrite(stmt.else_case)
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then, other)
    return stmt


@tirx.transform.prim_func_pass(opt_level=0, name="qtvm.ClaimChunks")
def ClaimChunks(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:  # noqa: N802 (a pass, named as TVM's)
    body = _rewrite(func.body)
    return func if body.same_as(func.body) else func.with_body(body)


def register_pipeline() -> str:
    """Register ``PIPELINE`` (TVM's default TIR pipeline, then ClaimChunks) once; returns its name."""
    from tvm.tirx import compilation_pipeline as pipelines

    if PIPELINE not in pipelines.PIPELINE_MAP:
        def claim_pipeline(**kwargs):
            lower, finalize_host, finalize_device = pipelines.get_tir_pipeline("default", **kwargs)
            return tvm.transform.Sequential([lower, ClaimChunks]), finalize_host, finalize_device

        pipelines.PIPELINE_MAP[PIPELINE] = claim_pipeline
    return PIPELINE
