"""Relax pass: matmuls that share an input become one matmul by the concatenated weight.

A decoder layer multiplies one normed activation by q, k and v (and another by gate and
up): separate GEMVs of 256..5632 columns each, every one a kernel call with its own
activation quantization, pipeline ramp and thread wake-up. ``x @ [W1 | W2 | W3]`` sliced
back into three is one call streaming all three weights (measured on Zen 4, int4-g128
int8 GEMV, 1 thread, DRAM-cold: q+k+v at K = 2048 126 us against 98 + 19 + 19; gate+up
479 us against 2 x 264).

On a GPU the gain is the kernel's own: a 4096-deep int4 GEMV streams a few MB in a few
microseconds, too short to fill the card (H200, CUDA graphs: q+k+v of LLaMA-7B 15.9 us against
3 x 7.3, gate+up 25.8 against 2 x 14.9; GQA at hidden 2048 4.7 against 3.9 + 2 x 3.3), and the
decode step, bound by the host's launches, makes fewer of them.

It is exact only where quantizing ``[W1 | W2]`` gives ``[quantize(W1) | quantize(W2)]``
column for column (``QuantFormat.columns_independent``) and the kernels compute each
column alone, as every x86 GEMV and prefill kernel and the CUDA and OpenCL rules' GEMVs
and GEMMs do (a column's sum order follows K alone): the combined outputs are the separate
ones bit for bit (``tests/relay_passes/test_combine_matmuls.py``: whole models on x86, the
GPU kernels on PoCL). Where either is not known the caller does not run this pass.

Combined: ``v_i = matmul(x, W_i)`` bindings of one dataflow block with the same ``x``
(float32) and 2-D float32 constant weights ``W_i`` (directly or through
``permute_dims(W, [1, 0])``, as ONNX Gemm transB imports) of the same K. The combined
matmul and the slices sit where the first member was; each member's variable becomes its
slice (``strided_slice`` on the last axis, which FuseOps fuses into its consumers). The combined
weight is a ``concat`` of the members' constants, not a new constant: the quantizer, which runs
next, reads it when it packs it (``quantize_weights._weight_source``), one group at a time
(joined here, every combined weight of a model was a second copy held to the end of the packing).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes.quantize_weights import MATMUL, _weight_source, weight_columns, weight_rows


def _plain_matmul(call) -> bool:
    out = getattr(call.attrs, "out_dtype", None)
    return out is None or str(out) in ("", "void", "float32")


def _groups(block: relax.DataflowBlock, lookup) -> list[list[tuple[relax.Var, list]]]:
    """[[(var, weight source), ...] per shared input, >= 2 members, in binding order]; no weight
    is read (the combined weight is a concat the quantizer reads when it packs it)."""
    by_input: dict = {}
    for binding in block.bindings:
        value = getattr(binding, "value", None)
        if not (isinstance(value, relax.Call) and value.op == MATMUL and _plain_matmul(value)):
            continue
        x = value.args[0]
        ty = getattr(x, "ty", None)
        if not isinstance(x, relax.Var) or not isinstance(ty, relax.TensorType) or ty.dtype != "float32" \
                or ty.ndim < 1:
            continue
        source = _weight_source(value.args[1], lookup, widened=True)
        if source is None:
            continue
        by_input.setdefault((x, weight_rows(source)), []).append((binding.var, source))
    return [members for members in by_input.values() if len(members) >= 2]


def _weight_expr(source) -> relax.Expr:
    """The weight a ``_weight_source`` describes, rebuilt from its constants (a later member's
    own bindings come after the combined matmul)."""
    parts = [_part(t, transposed) for t, transposed in source]
    return parts[0] if len(parts) == 1 else relax.op.concat(parts, axis=1)


def _part(tensor, transposed: bool) -> relax.Expr:
    part = relax.op.permute_dims(relax.const(tensor), [1, 0]) if transposed else relax.const(tensor)
    return part if str(tensor.dtype) == "float32" else relax.op.astype(part, "float32")  # a half precision model


@mutator
class _Combiner(PyExprMutator):
    def __init__(self, mod, bound: dict):
        super().__init__(mod)
        self.bound = bound
        self.first: dict = {}  # first member's var -> its group
        self.rest: set = set()  # later members' vars: their bindings are dropped
        self.combined: list[list[int]] = []  # the N of each member, per group

    def visit_dataflow_block_(self, block):
        for members in _groups(block, self.bound.get):
            self.first[members[0][0]] = members
            self.rest.update(var for var, _ in members[1:])
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding):
        if binding.var in self.rest:
            return
        members = self.first.get(binding.var)
        if members is None:
            super().visit_var_binding_(binding)
            return
        x = self.visit_expr(binding.value.args[0])
        weight = relax.op.concat([_weight_expr(source) for _, source in members], axis=1)
        y = self.builder_.emit(relax.op.matmul(x, self.builder_.emit(weight)))
        axis, begin = x.ty.ndim - 1, 0  # the output's last axis (x is at least 1-D)
        widths = [weight_columns(source) for _, source in members]
        for (var, _), n in zip(members, widths):
            part = relax.op.strided_slice(y, axes=[axis], begin=[begin], end=[begin + n])
            begin += n
            new = self.builder_.emit(part) if isinstance(var, relax.DataflowVar) else self.builder_.emit_output(part)
            self.set_var_remap(var, new)
        self.combined.append(widths)


def combine_matmuls(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[list[int]]]:
    """Returns the module and, per combined group, its members' output widths."""
    combined: list[list[int]] = []
    out = mod
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        combiner = _Combiner(out, relax.analysis.get_var2val(func))
        new = combiner.visit_expr(func)
        if combiner.combined:  # a Gemm's permute_dims of a combined weight is left unused
            combiner.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
            out = combiner.builder_.get()
            combined += combiner.combined
    return out, combined
