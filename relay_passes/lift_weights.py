"""The weights out of the VM's constants and into parameters of the functions that read them.

TVM's VM executable keeps constants in its serialized bytes: loading an artefact copies the
embedded module out of the library, then every constant out of that copy (~4x the weights at
the peak: 3.85 GB to load a 913 MB artefact), and the library's pages stay resident beside
the copies (2.2x afterwards). Lifted, the weights are a blob of their own in the library
(``qtvm.deploy.weights``) that the runtime copies once, onto huge pages, and passes to each
entry point: ~1x at the peak and after.

The pass runs last, on the lowered functions the VM's code generator reads (after the shape
checks are inserted: the runtime builds the weights from the artefact's own table, so
checking each at every call would only cost time). A function that reads a weight, or calls
one that does, takes it as a trailing parameter ``qtvm_w<index>``; callers pass theirs on.
Equal tensors are one weight (the same tensor used by several functions, and tensors made
apart with the same values, as the VM's constant pool merged them: 15 MB of one 1.1B model's
zero points). The metadata function keeps its constant: it is called without weights.
"""
from __future__ import annotations

import hashlib

import tvm
from tvm import relax
from tvm.ir.expr import Constant

from qtvm.deploy.weights import PARAM_PREFIX, storable, tensor_bytes, tensor_nbytes

#: Constants smaller than this stay constants (shapes, indices, small tables).
MIN_BYTES = 1 << 12
_UPDATE_TYPE = tvm.get_global_func("relax.UpdateType")


def _tensor_of(expr):
    """The tensor a constant holds (None for other expressions, scalar immediates among them)."""
    value = getattr(expr, "value", None) if isinstance(expr, Constant) else None
    return value if isinstance(value, tvm.runtime.Tensor) else None


def _large_constants(func: relax.Function, min_bytes: int) -> list:
    """The tensors of ``func``'s constants of at least ``min_bytes``."""
    found: list = []

    def visit(expr):
        data = _tensor_of(expr)
        if data is not None and tensor_nbytes(data) >= min_bytes and storable(str(data.dtype)):
            found.append(data)

    relax.analysis.post_order_visit(func.body, visit)
    return found


def _content_key(data) -> tuple:
    """Dtype, shape and a digest of the bytes: one weight for tensors that hold the same values."""
    digest = hashlib.blake2b(memoryview(tensor_bytes(data)), digest_size=16).digest()
    return str(data.dtype), tuple(int(d) for d in data.shape), digest


def _callees(func: relax.Function) -> set[str]:
    """Names of the Relax functions ``func`` calls (the pipeline's calls by GlobalVar)."""
    names: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar):
            names.add(expr.op.name_hint)

    relax.analysis.post_order_visit(func.body, visit)
    return names


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    """Constants -> the parameters that hold their weights; a call to a function that takes
    weights passes it those it takes, from the caller's own parameters."""

    def __init__(self, mod: tvm.IRModule, params: dict[int, relax.Var], index: dict[int, int],
                 takes: dict[str, list[int]]):
        super().__init__(mod)
        self.params, self.index = params, index  # weight -> this function's parameter; data pointer -> weight
        self.takes = takes
        self.gvs = {gv.name_hint: gv for gv in mod.get_global_vars()}

    def visit_generic_const_(self, op: Constant) -> relax.Expr:
        data = _tensor_of(op)
        i = None if data is None else self.index.get(data.data_ptr())
        return op if i is None or i not in self.params else self.params[i]

    def visit_call_(self, op: relax.Call) -> relax.Expr:
        if isinstance(op.op, tvm.ir.GlobalVar) and op.op.name_hint in self.takes:
            args = [self.visit_expr(a) for a in op.args]
            passed = [self.params[i] for i in self.takes[op.op.name_hint]]
            return relax.Call(self.gvs[op.op.name_hint], [*args, *passed], op.attrs, op.ty_args, op.span)
        return super().visit_call_(op)


def lift_weights(mod: tvm.IRModule, keep: tuple[str, ...] = (), min_bytes: int = MIN_BYTES):
    """``mod`` with its large constants lifted, and the weights (TVM tensors) indexed as the
    parameters name them; ``mod`` and [] where there are none, or where a function in ``keep``
    (the metadata, which a reader calls without weights: its constants stay) calls one that
    uses them. A function takes the weights it or a function it calls uses, as trailing
    parameters ``PARAM_PREFIX<index>`` in index order."""
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    weights: list = []
    index: dict[int, int] = {}  # a tensor's data pointer -> its weight index
    by_content: dict[tuple, int] = {}
    takes: dict[str, set[int]] = {}
    for name, func in funcs.items():
        if name in keep:  # its constants stay; it must not call a function that takes weights
            continue
        for data in _large_constants(func, min_bytes):
            key = data.data_ptr()
            if key not in index:
                same = _content_key(data)  # equal tensors made apart (every layer's zero points)
                if same not in by_content:
                    by_content[same] = len(weights)
                    weights.append(data)
                index[key] = by_content[same]
            takes.setdefault(name, set()).add(index[key])
    if not weights:
        return mod, []
    callees = {name: _callees(func) & set(funcs) for name, func in funcs.items()}
    while True:  # a caller takes what its callees take
        grown = False
        for name, called in callees.items():
            need = set().union(*(takes.get(c, set()) for c in called)) - takes.get(name, set())
            if need:
                takes.setdefault(name, set()).update(need)
                grown = True
        if not grown:
            break
    if set(takes) & set(keep):
        return mod, []
    order = {name: sorted(taken) for name, taken in takes.items()}
    params = {name: {i: relax.Var(f"{PARAM_PREFIX}{i}", relax.TensorType(weights[i].shape, str(weights[i].dtype)))
                     for i in taken} for name, taken in order.items()}
    entries = {}
    for gv, func in mod.functions.items():  # signatures first (new GlobalVars: a var's type is set once)
        if gv.name_hint in order:
            extra = [params[gv.name_hint][i] for i in order[gv.name_hint]]
            gv, func = tvm.ir.GlobalVar(gv.name_hint), relax.Function(
                [*func.params, *extra], func.body, func.ret_ty, func.is_pure, func.attrs, func.span)
            _UPDATE_TYPE(gv, func.ty)  # what calls to it are typed by
        entries[gv] = func
    out = tvm.IRModule(entries, attrs=mod.attrs)
    for name in sorted(order):
        func = out[name]
        body = _Replace(out, params[name], index, order).visit_expr(func.body)
        out[name] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return out, weights
