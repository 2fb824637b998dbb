"""Relax pass: each If branch that computes something becomes a function of its own.

TVM 0.27's memory planner (``StaticPlanBlockMemory``) keeps one pool of free storages per
function: a storage first allocated inside a branch and released there is handed to an
allocation after the If, which then reads a storage the other branch never allocated (and
that the branch's own ``kill_object`` may have dropped): the VM segfaults in
``StorageObj::AllocTensor`` on either path. A function is planned with a pool of its own, so
a branch whose body is one call to its own function cannot lend storage outside the If.

The function takes the branch's free variables, shape variables bound outside included (TVM's
``free_vars`` lists them; they are passed as values). A branch is left as it is where it binds
nothing, where a shape variable would still be free in its function, or where it makes an
impure call.
"""
from __future__ import annotations

import re

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

_BRANCH_NAME = re.compile(r"_if\d+_(then|else)$")


def is_branch_function(name: str) -> bool:
    """Whether the function ``name`` is a branch this pass made (a trace of calls skips them)."""
    return bool(_BRANCH_NAME.search(name))


@mutator
class _Outliner(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.owner = ""
        self.count = 0

    def visit_if_(self, op):
        node = super().visit_if_(op)  # nested Ifs first: an inner branch is outlined inside its function
        then, other = self._outlined(node.true_branch, "then"), self._outlined(node.false_branch, "else")
        if then.same_as(node.true_branch) and other.same_as(node.false_branch):
            return node
        return relax.If(node.cond, then, other, node.span)

    def _outlined(self, branch, which: str):
        if not isinstance(branch, relax.SeqExpr) or not any(len(b.bindings) for b in branch.blocks):
            return branch
        inputs = list(relax.analysis.free_vars(branch))
        func = relax.Function(inputs, branch, branch.ty)
        if relax.analysis.free_symbolic_vars(func) or relax.analysis.contains_impure_call(branch):
            return branch
        self.count += 1
        gv = self.builder_.add_func(relax.utils.copy_with_new_vars(func), f"{self.owner}_if{self.count}_{which}")
        out = relax.Var(f"{which}_out", branch.ty)
        return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(out, relax.Call(gv, inputs))])], out)


def outline_branches(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """(module, number of branches made functions); unchanged where no If computes anything."""
    outliner = _Outliner(mod)
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            outliner.owner = gv.name_hint
            outliner.builder_.update_func(gv, outliner.visit_expr(func))
    if not outliner.count:
        return mod, 0
    return outliner.builder_.get(), outliner.count
