"""A KV step that returns the logits of each sequence's last position only.

Generation needs the next token's logits, not the prompt's: over a 1024-token prompt the
step's LM head is a [1024, hidden] x [hidden, vocab] product and a [1024, vocab] output
(16% of the e2e LLaMA's prefill multiply-adds, 28% of Qwen2.5-0.5B's, whose 1024 rows of
logits are 622 MB). ``add_last_logits`` derives ``qtvm_kv_step_last`` from the step: the
hidden state is sliced to the last position before the chain of row-wise ops that ends in
the output (reshapes that keep the last axis, qtvm's packed-matmul dispatch, a matmul by a
constant, elementwise ops whose other operand is a constant), and the chain runs on that
one row. Each row of that chain is computed from its own row alone, so the logits are the
step's last row up to the kernels' summation order (one row runs the GEMV, a prompt the
prefill kernel). A step whose output is not such a chain gets no second function
(``qtvm.generate`` then slices the full logits).
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from relay_passes.kv_cache import _shape  # the step's own helper: a tensor type's dims, or None
from relay_passes.quantize_weights import DISPATCH_PREFIX

LAST_FUNC = "qtvm_kv_step_last"

_OPS = {name: tvm.ir.Op.get(f"relax.{name}") for name in ("reshape", "matmul", "astype")}
#: Elementwise ops a logits chain may hold (softcap: divide, tanh, multiply; a bias: add).
_ELEMENTWISE = {tvm.ir.Op.get(f"relax.{name}") for name in (
    "add", "subtract", "multiply", "divide", "tanh", "sigmoid", "negative", "exp", "clip")}


class Decline(Exception):
    """The step's output is not a row-wise chain from a [batch, seq, hidden] state."""


def add_last_logits(mod: tvm.IRModule, step: str, seq: str) -> tuple[tvm.IRModule, str | None]:
    """``mod`` with ``LAST_FUNC`` added next to ``step`` (whose sequence symbol is named
    ``seq``), and None; or ``mod`` unchanged and why not."""
    try:
        func = _last_step(mod, relax.utils.copy_with_new_vars(mod[step]), seq)
    except Decline as why:
        return mod, str(why)
    mod = mod.clone()
    mod[LAST_FUNC] = func.with_attr("global_symbol", LAST_FUNC)
    return mod, None


def _is_const(e) -> bool:
    return isinstance(e, tvm.ir.expr.GenericConst)


def _row_input(call):
    """The tensor a row-wise call reads row by row, or None where the call is not one."""
    if not isinstance(call, relax.Call):
        return None
    op, args = call.op, list(call.args)
    if isinstance(op, relax.GlobalVar):  # qtvm's packed matmul: [m, k] -> [m, n], rows apart
        return args[0] if op.name_hint.startswith(DISPATCH_PREFIX) and len(args) == 1 else None
    if op.same_as(_OPS["reshape"]):
        before, after = _shape(args[0].ty), _shape(call.ty)
        keeps_last = before and after and tvm.sym.Analyzer().can_prove_equal(before[-1], after[-1])
        return args[0] if keeps_last else None
    if op.same_as(_OPS["astype"]):
        return args[0]
    if op.same_as(_OPS["matmul"]):
        weight = args[1]
        return args[0] if _is_const(weight) and len(_shape(weight.ty) or []) == 2 else None
    if op in _ELEMENTWISE:
        tensors = [a for a in args if not _is_const(a)]
        consts = [a for a in args if _is_const(a)]
        dims = [_shape(c.ty) for c in consts]  # [] for a scalar (a softcap's 30.0)
        per_column = all(d is not None and len(d) <= 1 for d in dims)
        return tensors[0] if len(tensors) == 1 and per_column else None
    return None


def _last_step(mod, func: relax.Function, seq_name: str) -> relax.Function:
    body = func.body
    if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1:
        raise Decline("the step is not one dataflow block")
    logits = _shape(body.body.ty)
    if logits is None or len(logits) != 3 or not isinstance(logits[1], tirx.Var) or logits[1].name != seq_name:
        raise Decline("the logits are not [batch, seq, vocab]")
    values = relax.analysis.get_var2val(func)
    chain, var, matmuls = [], body.body, 0
    while True:
        value = values.get(var)
        if isinstance(value, relax.Var):  # the output alias
            chain.append(var)
            var = value
            continue
        row = _row_input(value)
        if row is None or not isinstance(row, relax.Var):
            break
        matmuls += isinstance(value.op, relax.GlobalVar) or value.op.same_as(_OPS["matmul"])
        chain.append(var)
        var = row
    state = _shape(var.ty)
    if not matmuls or state is None or len(state) != 3 or not isinstance(state[1], tirx.Var) \
            or state[1].name != seq_name:
        raise Decline("the logits are not a row-wise product of a [batch, seq, hidden] state")
    seq = state[1]
    uses = relax.analysis.udchain(body.blocks[0])
    if any(len(uses.get(v, [])) > 1 for v in chain[1:]):
        raise Decline("a value of the logits chain has another user")
    one = tirx.IntImm(seq.ty.dtype, 1)

    def at_one(e):
        return tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(e, (tirx.Var, lambda v: one if v.same_as(seq) else v)))

    bb = relax.BlockBuilder(mod)
    chained = set(chain)
    new_bindings = [b for b in body.blocks[0].bindings if b.var not in chained]
    remap = {}

    def add(name, value):
        value = bb.normalize(value)
        v = relax.DataflowVar(name, value.ty)
        new_bindings.append(relax.VarBinding(v, value))
        return v

    last = add("last_row", relax.op.strided_slice(var, [1], [seq - 1], [seq], assume_inbound=True))
    remap[var] = last
    for v in reversed(chain):
        value = values[v]
        if isinstance(value, relax.Var):
            remap[v] = remap[value]
            continue
        args = [remap.get(a, a) if isinstance(a, relax.Var) else a for a in value.args]
        if value.op.same_as(_OPS["reshape"]):
            args[1] = relax.ShapeExpr([at_one(d) for d in _shape(value.ty)])
        remap[v] = add(f"{v.name}_last", relax.Call(value.op, args, value.attrs, value.ty_args))
    out = remap[chain[0]]
    result = relax.Var("logits_last", out.ty)
    new_bindings.append(relax.VarBinding(result, out))
    new_body = relax.SeqExpr([relax.DataflowBlock(new_bindings)], result)
    return relax.Function(func.params, new_body, result.ty, func.is_pure, func.attrs)
