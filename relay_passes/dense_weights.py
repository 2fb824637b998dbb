"""Relax pass for ``--quant none``: matmuls by constant float32 weights -> a scheduled kernel.

Without it the float model's weight matmuls are left to TVM's default loops (5-17x
slower than onnxruntime's fp32 run on the transformers models). Every
``relax.matmul(x, W)`` with W a 2-D float32 constant (directly or through
``permute_dims``, as for the quantizer) becomes ``reshape -> call_tir(dense) -> reshape``
with W stored in column blocks (``qtvm.ops_dense``), scheduled by the target's rule
(``schedules/x86_dense.py``). Targets without a rule keep the plain matmul, and so do
weights smaller than the rule's ``MIN_WEIGHTS`` (the generic matmul schedule is faster there).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from qtvm.ops_dense import dense_func, dense_weight
from relay_passes.quantize_weights import MATMUL, OPAQUE, _constant_weight


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, target: tvm.target.Target, nb: int, min_weights: int):
        super().__init__(mod)
        self.target, self.nb, self.min_weights = target, nb, min_weights
        self.kernels: dict[tuple, tvm.ir.GlobalVar] = {}
        self.rewritten = 0

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op != MATMUL:
            return call
        w = _constant_weight(call.args[1], self.lookup_binding)
        x = call.args[0]
        if w is None or x.ty.dtype != "float32" or x.ty.ndim < 1 or x.ty.shape is None or w.size < self.min_weights:
            return call
        k, n = w.shape
        lead = list(x.ty.shape.values)[:-1]
        rows = tvm.tirx.const(1, "int64")
        for d in lead:
            rows = rows * d
        x2 = self.builder_.emit(relax.op.reshape(x, relax.ShapeExpr([rows, k])))
        y2 = self.builder_.emit(relax.op.call_tir(self._kernel(k, n), relax.Tuple([x2, relax.const(dense_weight(w, self.nb))]),
                                                  relax.TensorType([rows, n], "float32")))
        self.rewritten += 1
        return relax.op.reshape(y2, relax.ShapeExpr([*lead, n]))

    def _kernel(self, k: int, n: int) -> tvm.ir.GlobalVar:
        from schedules import schedule_kernel

        if (k, n) not in self.kernels:
            name = f"dense_{k}x{n}"
            func = schedule_kernel(dense_func(k, n, self.nb), self.target)
            func = func.with_attrs({"tir.is_scheduled": True, "op_pattern": OPAQUE, "global_symbol": name})
            self.kernels[(k, n)] = self.builder_.add_func(func, name)
        return self.kernels[(k, n)]


def dense_weights(mod: tvm.IRModule, target: tvm.target.Target,
                  min_weights: int | None = None) -> tuple[tvm.IRModule, int]:
    """(module, number of matmuls rewritten); the module unchanged where the target has no rule.
    ``min_weights``: the smallest K x N rewritten (default: the rule's ``MIN_WEIGHTS``)."""
    from schedules import FAMILIES, column_block
    from schedules.x86_dense import MIN_WEIGHTS, schedule_dense_x86

    if target.kind.name not in FAMILIES:  # no qtvm rules at all (the C target, ...)
        return mod, 0
    if schedule_dense_x86(dense_func(16, 16, column_block(target)), target) is None:
        return mod, 0
    rewriter = _Rewriter(mod, target, column_block(target), MIN_WEIGHTS if min_weights is None else min_weights)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get(), rewriter.rewritten
