"""Relax pass: index ops that cannot read out of bounds.

TVM's ONNX import lowers Gather to ``take(mode="fast")``, which reads memory
at any index it is given: a token id past the vocabulary segfaults the
process. ``mode="wrap"`` gives identical results for valid indices (including
ONNX's negative ones) and a wrong-but-safe row for invalid ones.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

TAKE = tvm.ir.Op.get("relax.take")


@mutator
class _SafeTake(PyExprMutator):
    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op != TAKE or call.attrs.mode != "fast":
            return call
        axis = call.attrs.axis
        return relax.op.take(call.args[0], call.args[1], None if axis is None else int(axis), mode="wrap")


def safe_gather(mod: tvm.IRModule) -> tvm.IRModule:
    rewriter = _SafeTake(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    return rewriter.builder_.get()
