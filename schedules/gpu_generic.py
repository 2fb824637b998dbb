"""GPU schedules for everything around the packed kernels (norms, RoPE, softmax,
attention matmuls, SwiGLU, embedding gathers), CUDA and OpenCL targets.

:func:`schedule_generic_ops` runs before ``tvm.compile``:

1. the qtvm kernels are marked opaque (fusion never touches them); a cumsum along the last
   axis becomes ``row_cumsum`` (TVM's GPU scan relies on warp lockstep); then TVM's own GPU
   passes legalize and fuse the rest (library dispatch, LegalizeOps, FuseOps, FuseTIR);
   float max/min reductions then start from -inf/+inf (``schedules/numerics.py``, as on x86);
2. the mixed format's CSR outlier functions get their rule (``gpu_sparse``);
3. every other fused PrimFunc is scheduled by TVM's dlight GPU rules (``tvm.s_tir.dlight``:
   Matmul, GEMV, Reduction, GeneralReduction, Fallback; RMSNorm ahead of them), the same
   rules TVM's default CUDA pipeline applies.

Each rule's result was checked differentially on the bundled model: every scheduled
function run on PoCL (``qtvm.testing.opencl``) against the unscheduled function compiled
for the CPU, with the symbolic dims bound to 1, 3, 64 and 67
(``tests/schedules/test_gpu_generic.py``). A rule found wrong goes into ``EXCLUDED`` and
that structure gets a rule of its own here.

The functions come out marked ``tirx.is_scheduled``, so ``tvm.compile``'s own pipeline
(which runs the same legalize/fuse/dlight passes again) leaves them alone.
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx

from qtvm.formats.mixed import SPARSE_ATTR

_OPAQUE = 8  # relax OpPatternKind.kOpaque


#: TVM 0.27 spells the "already scheduled" mark ``tirx.is_scheduled`` (dlight and the GPU
#: pipeline read it); qtvm's kernels also carry the older ``tir.is_scheduled``.
SCHEDULED = "tirx.is_scheduled"


def is_scheduled(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs or {}
    return "qtvm.kernel" in attrs or any(bool(attrs.get(key, False)) for key in (SCHEDULED, "tir.is_scheduled"))


def binds_threads(func: tirx.PrimFunc) -> bool:
    """Whether any block of ``func`` sits under a loop bound to a GPU thread or block."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    pending = list(sch.get_child_blocks(sch.get_sblock("root")))
    while pending:
        block = pending.pop()
        if any(sch.get(loop).kind == tirx.ForKind.THREAD_BINDING for loop in sch.get_loops(block)):
            return True
        pending.extend(sch.get_child_blocks(block))
    return False


def _unmark_unbound(mod: tvm.IRModule) -> tvm.IRModule:
    """Functions marked scheduled that are no qtvm kernel and bind no thread (the
    importer's ``qtvm_shape_values*``, scheduled for the CPU by construction) lose the
    mark, so dlight binds them: on a GPU target an unbound function would run its loops
    on the host, writing device memory through a device pointer."""
    updates = {}
    for gv, func in mod.functions.items():
        if (isinstance(func, tirx.PrimFunc) and is_scheduled(func) and "qtvm.kernel" not in (func.attrs or {})
                and SPARSE_ATTR not in (func.attrs or {}) and not binds_threads(func)):
            updates[gv] = func.without_attr(SCHEDULED).without_attr("tir.is_scheduled")
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def dlight_rules() -> list:
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.RMSNorm(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def row_cumsum(in_dtype: str, out_dtype: str, threads: int = 64) -> tirx.PrimFunc:
    """cumsum along the last axis of [outer, n]: one thread per row, a sequential scan.
    Replaces TVM's GPU scan (``gpu_2d_continuous_cumsum``), whose in-warp steps read
    and write shared memory with no barrier between them (correct only while a warp runs
    in lockstep, and wrong on PoCL, where it could not be checked). The bundled models
    scan positions, [batch, seq]: a few rows, each microseconds long."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def func(var_a: T.handle, var_out: T.handle):
        T.func_attr({SCHEDULED: True, "tirx.noalias": True})
        outer, n = T.int64(), T.int64()
        A = T.match_buffer(var_a, (outer, n), in_dtype)
        Out = T.match_buffer(var_out, (outer, n), out_dtype)
        for bx in T.thread_binding((outer + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("scan"):
                    T.reads(A[bx * threads + tx, 0:n])
                    T.writes(Out[bx * threads + tx, 0:n])
                    acc = T.sblock_alloc_buffer((1,), out_dtype, scope="local")
                    if bx * threads + tx < outer:
                        acc[0] = T.cast(0, out_dtype)
                        for j in range(n):
                            acc[0] = acc[0] + T.cast(A[bx * threads + tx, j], out_dtype)
                            Out[bx * threads + tx, j] = acc[0]

    return func


def _rows_cumsum(mod: tvm.IRModule) -> tvm.IRModule:
    """Every inclusive cumsum along the last axis -> reshape, ``row_cumsum``, reshape."""
    from tvm.relax.expr_functor import PyExprMutator, mutator

    cumsum = tvm.ir.Op.get("relax.cumsum")

    @mutator
    class _Rewriter(PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if call.op != cumsum or call.attrs.exclusive or call.ty.shape is None or call.attrs.axis is None:
                return call
            shape = list(call.ty.shape.values)
            if int(call.attrs.axis) not in (-1, len(shape) - 1):
                return call
            outer = tirx.const(1, "int64")
            for dim in shape[:-1]:
                outer = outer * dim
            x = call.args[0]
            in_dtype, out_dtype = str(x.ty.dtype), str(call.ty.dtype)
            gv = self.builder_.add_func(row_cumsum(in_dtype, out_dtype), f"row_cumsum_{in_dtype}_{out_dtype}")
            rows = self.builder_.emit(relax.op.reshape(x, relax.ShapeExpr([outer, shape[-1]])))
            out = self.builder_.emit(relax.op.call_tir(gv, relax.Tuple([rows]),
                                                       relax.TensorType([outer, shape[-1]], out_dtype)))
            return relax.op.reshape(out, relax.ShapeExpr(shape))

    rewriter = _Rewriter(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            new = rewriter.visit_expr(func)
            if not new.same_as(func):
                rewriter.builder_.update_func(gv, new)
    return rewriter.builder_.get()


def _without_empty_concat_operands(mod: tvm.IRModule) -> tvm.IRModule:
    """Concat operands of static extent 0 on the axis dropped (a concat left with one operand is
    that operand), and the bindings that made them with it: Phi-3's rotary concatenates an empty
    pass-through slice, whose zero-extent copy loop dlight's fallback rule fuses, and TVM's
    Fuse divides by the extent. The same values: an empty operand adds nothing."""
    from tvm.relax.expr_functor import PyExprMutator, mutator

    concat = tvm.ir.Op.get("relax.concat")

    def empty(field, axis: int) -> bool:
        ty = field.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
            return False
        extent = ty.shape.values[axis]
        return isinstance(extent, tirx.IntImm) and extent.value == 0

    @mutator
    class _Dropper(PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if call.op != concat or not isinstance(call.args[0], relax.Tuple) or call.attrs.axis is None:
                return call
            fields = list(call.args[0].fields)
            kept = [f for f in fields if not empty(f, int(call.attrs.axis))]
            if not kept or len(kept) == len(fields):
                return call
            return kept[0] if len(kept) == 1 else relax.op.concat(kept, int(call.attrs.axis))

    dropper = _Dropper(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            new = dropper.visit_expr(func)
            if not new.same_as(func):
                dropper.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
    return dropper.builder_.get()


def legalize_and_fuse(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """TVM's GPU legalization and fusion, with the qtvm kernels opaque; Relax functions
    nothing calls (the artefact's metadata function) are kept."""
    from tvm.relax.backend import gpu_generic

    marked = {gv: f.with_attrs({"op_pattern": _OPAQUE, **({SCHEDULED: True} if is_scheduled(f) else {})})
              for gv, f in mod.functions.items()
              if isinstance(f, tirx.PrimFunc) and (is_scheduled(f) or SPARSE_ATTR in (f.attrs or {}))}
    mod = mod.clone()
    for gv, func in marked.items():
        mod[gv] = func
    mod = _without_empty_concat_operands(_rows_cumsum(mod))
    relax_funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    passes = gpu_generic.library_dispatch_passes(target) + [
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        mod = tvm.transform.Sequential(passes)(mod)
    present = {gv.name_hint for gv in mod.get_global_vars()}
    for name, func in relax_funcs.items():
        if name not in present:
            mod[name] = func
    from schedules.numerics import exact_reduction_identities

    return exact_reduction_identities(mod)  # max/min from -inf/+inf, as ONNX (schedules/numerics.py)


def schedule_generic_ops(mod: tvm.IRModule, target: tvm.target.Target, rules: list | None = None) -> tvm.IRModule:
    """Fuse and schedule the non-kernel ops of a Relax module for a GPU target."""
    from tvm.s_tir import dlight as dl

    from schedules.gpu_sparse import schedule_outliers_gpu

    if target.kind.name not in ("cuda", "opencl"):
        return mod
    mod = legalize_and_fuse(mod, target)
    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and SPARSE_ATTR in (func.attrs or {}) and not is_scheduled(func):
            updates[gv] = schedule_outliers_gpu(func, target).mod["main"].with_attr(SCHEDULED, True)
    for gv, func in updates.items():
        mod[gv] = func
    mod = _unmark_unbound(mod)
    with target:
        mod = dl.ApplyDefaultSchedule(*(rules if rules is not None else dlight_rules()))(mod)
    return mod
