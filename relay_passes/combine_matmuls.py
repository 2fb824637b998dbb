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
slice (``strided_slice`` on the last axis, which FuseOps fuses into its consumers).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes.quantize_weights import MATMUL, _weight_source, read_weight


def _plain_matmul(call) -> bool:
    out = getattr(call.attrs, "out_dtype", None)
    return out is None or str(out) in ("", "void", "float32")


def _groups(block: relax.DataflowBlock, lookup) -> list[list[tuple[relax.Var, np.ndarray]]]:
    """[[(var, weight [K, N]), ...] per shared input, >= 2 members, in binding order]."""
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
        source = _weight_source(value.args[1], lookup)
        if source is None:
            continue
        k = int(source[0].shape[1 if source[1] else 0])
        by_input.setdefault((x, k), []).append((binding.var, source))
    # read only the weights that are combined: holding every one would double the model
    return [[(var, read_weight(source)) for var, source in members]
            for members in by_input.values() if len(members) >= 2]


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
        weight = np.concatenate([w for _, w in members], axis=1)
        y = self.builder_.emit(relax.op.matmul(x, relax.const(weight)))
        axis, begin = x.ty.ndim - 1, 0  # the output's last axis (x is at least 1-D)
        for var, w in members:
            part = relax.op.strided_slice(y, axes=[axis], begin=[begin], end=[begin + w.shape[1]])
            begin += w.shape[1]
            new = self.builder_.emit(part) if isinstance(var, relax.DataflowVar) else self.builder_.emit_output(part)
            self.set_var_remap(var, new)
        self.combined.append([w.shape[1] for _, w in members])


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
