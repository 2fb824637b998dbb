"""Relax pass: float16/bfloat16 graphs accumulate in float32.

TVM computes a float16 matmul, softmax or sum in float16 throughout: every partial sum is
rounded to 11 (bfloat16: 8) significant bits, and a 64-term dot product ends up several ulps
off what onnxruntime (float32 accumulation) returns. Accumulating in float16 is a fast path
that changes numerics, so it is not qtvm's default: this pass gives matmuls a float32
``out_dtype`` and runs reductions and normalizations on float32 copies of their inputs,
casting each result back to the graph's type. Elementwise ops keep their type, except the
transcendental ones (``MATH``), also run in float32 (as onnxruntime's CPU kernels do): TVM's
float16 tanh is 0 below |x| = 1.2e-4 (2000 ulps off; Gemma-2's attention softcap divides scores
into that range), gelu and softplus likewise in their tails, and sinh, asin and their kind do not
compile in float16 at all.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

LOW = ("float16", "bfloat16")
#: Ops whose result accumulates over many inputs: computed on float32 copies.
ACCUMULATING = {
    "relax.sum", "relax.mean", "relax.variance", "relax.std", "relax.prod", "relax.cumsum", "relax.cumprod",
    "relax.nn.softmax", "relax.nn.log_softmax", "relax.nn.layer_norm", "relax.nn.group_norm",
    "relax.nn.rms_norm", "relax.nn.batch_norm", "relax.nn.instance_norm", "relax.nn.avg_pool2d",
    "relax.nn.adaptive_avg_pool2d", "relax.nn.avg_pool1d", "relax.nn.avg_pool3d",
}
#: Elementwise math computed on float32 copies (float16 measured: tanh, atanh, gelu, gelu_tanh
#: and softplus up to 2000 ulps off; sigmoid and silu 2 ulps; the hyperbolic and inverse
#: trigonometric functions fail to compile); the others within 1.2 ulps, widened alike.
MATH = {
    "relax.tanh", "relax.atanh", "relax.sinh", "relax.cosh", "relax.asinh", "relax.acosh", "relax.asin",
    "relax.acos", "relax.atan", "relax.sin", "relax.cos", "relax.tan", "relax.exp", "relax.log", "relax.erf",
    "relax.sqrt", "relax.rsqrt", "relax.sigmoid", "relax.power", "relax.nn.gelu", "relax.nn.gelu_tanh",
    "relax.nn.silu", "relax.nn.softplus",
}
#: Index-returning reductions run on a float32 copy of a half precision input (the same
#: indices: widening is exact and keeps the order): TVM's bfloat16 legalization fails on
#: argmax's let-bound running maximum (PhiMoE's bfloat16 router).
ARG_REDUCTIONS = {"relax.argmax", "relax.argmin"}
MATMUL = "relax.matmul"
CONVS = {"relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d", "relax.nn.conv2d_transpose",
         "relax.nn.conv1d_transpose"}


def _dtype(expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


@mutator
class _Upcast(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.changed = 0
        self.wide: dict = {}  # expr -> its float32 copy in the current block (q, k and v share x's)

    def visit_dataflow_block_(self, block):
        return self._in_scope(super().visit_dataflow_block_, block)

    def visit_binding_block_(self, block):
        return self._in_scope(super().visit_binding_block_, block)

    def _in_scope(self, visit, block):
        """A block's copies are its own (an If branch's blocks sit inside an outer one's binding)."""
        outer, self.wide = self.wide, {}
        try:
            return visit(block)
        finally:
            self.wide = outer

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        name, out = call.op.name, _dtype(call)
        if name in ARG_REDUCTIONS and _dtype(call.args[0]) in LOW:
            self.changed += 1
            return relax.Call(call.op, [self._wide(call.args[0]), *call.args[1:]], call.attrs, call.ty_args)
        if out not in LOW:
            return call
        if name == MATMUL:
            self.changed += 1
            a, b = (self._wide(x) for x in call.args[:2])
            return relax.op.astype(self.builder_.emit(relax.op.matmul(a, b, out_dtype="float32")), out)
        explicit = str(getattr(call.attrs, "out_dtype", "") or "")
        if name in ACCUMULATING or name in MATH or (name in CONVS and explicit in ("", "void")):
            self.changed += 1
            args = [self._wide(a) for a in call.args]
            return relax.op.astype(self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args)), out)
        return call

    def _wide(self, expr):
        """``expr`` as float32 if it is a float16/bfloat16 tensor, else as it is."""
        if _dtype(expr) not in LOW:
            return expr
        if expr not in self.wide:
            self.wide[expr] = self.builder_.emit(relax.op.astype(expr, "float32"))
        return self.wide[expr]


def fp32_accumulate(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """(module, number of ops now accumulating in float32); unchanged for float32 graphs."""
    upcast = _Upcast(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            upcast.builder_.update_func(gv, upcast.visit_expr(func))
    return upcast.builder_.get(), upcast.changed
