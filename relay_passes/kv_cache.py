"""A decoding step over an in-place KV cache, derived from a past_key_values export.

An export with a KV cache (``past_key_values.*`` inputs ``[batch, heads, past, dim]``,
``present.*`` outputs ``[batch, heads, past + seq, dim]``) appends the new keys and values
with ``Concat(past, new)``: run as exported, every token copies the whole cache (the
concat, and the caller feeding the presents back in). This pass adds a second entry
function, ``qtvm_kv_step``, built from ``main`` after the weight passes:

* each cache input becomes a buffer ``[batch, heads, kv_length, dim]`` that the caller
  owns; ``Concat(past, new)`` becomes an in-place write of ``new`` at rows
  ``[past, past + seq)`` (``call_tir_inplace``), and the attention reads the buffer
  itself; the present outputs are dropped (the buffers are the cache);
* the total length ``past + seq`` becomes ``kv_length`` = 64 x ``kv_blocks`` (a symbol
  of its own: kernels know it is a multiple of 64), wherever it occurs: shapes, ranges, and values the graph computes from the symbols (a flattened
  mask's row stride). The caller rounds it up to a multiple of 64 (attention shapes then
  change once every 64 tokens) and passes a mask that is zero on the padding, so padded
  keys get probability exactly 0 (the causal mask, built from key positions up to
  ``kv_length``, excludes them too). ``past`` alone (the position of the first new token:
  RoPE, position ids) stays the true past length; both come in a shape input. An export
  that takes ``position_ids`` (optimum's layout) keeps it as an input of the step, which
  the caller fills as transformers' generate does (``qtvm.generate.positions_from_mask``);
* the exported attention (``repeat_kv``: each KV head repeated for its query heads, keys
  transposed, ``q @ k^T``, ``p @ v``) becomes matmuls of q and p grouped per KV head against
  the cache itself, keys stored transposed (``_attention``): no per-token copy of the cache;
* the function carries ``tir_var_upper_bound`` for its symbols, so Relax plans its memory
  once, for the largest batch and length, instead of per call;
* ``cache_dtype="float16"`` (``qtvm compile --kv-cache fp16``, a numerics option like
  llama.cpp's and MLC-LLM's half-precision caches): float32 caches are held in float16, new
  rows rounded once as they are written and widened inside the attention matmuls, so decode
  reads half the bytes per past token; the compile measures and reports the step's error
  against ``main``.

A query position that is itself padding (a left-padded prompt) has every key masked: its
output means nothing in either function (main spreads it over ``past + seq`` keys, the
step over ``kv_length``, where the model uses a finite mask value), and no real token
ever attends to it.

Shapes must come out in terms of ``kv_length`` (a ``past`` left in any shape declines),
and ``qtvm.pipeline`` runs the step against ``main`` on random inputs before the artefact
is written. A model the rewrite does not fit keeps ``main`` only, with a note saying why.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from qtvm.frontend.importer import VALUES_ATTR, ZERO_ATTR, expr_symbols, shape_values_func

STEP_FUNC = "qtvm_kv_step"
BLOCKS = "kv_blocks"  # the step's length in 64-token blocks: keys the attention sees = 64 * kv_blocks
PAST = "kv_past"  # the step's past length (rows already in the cache); both come in a shape input
PAD = 64

_CONCAT = tvm.ir.Op.get("relax.concat")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_OP = {name: tvm.ir.Op.get(f"relax.{name}")
       for name in ("expand_dims", "broadcast_to", "reshape", "permute_dims", "multiply", "matmul")}
BHLD, BHDL = "bhld", "bhdl"  # cache layouts: [batch, heads, length, dim], and keys transposed
_LEAVES = (relax.GlobalVar, tvm.ir.Op, relax.ExternFunc, tvm.ir.expr.GenericConst)


class Decline(Exception):
    """The model does not fit the rewrite; the message says why (it becomes a compile note)."""


def add_kv_step(mod: tvm.IRModule, max_length: int, max_batch: int, cache_dtype: str | None = None):
    """(module, step description for the metadata, note). The module gains ``qtvm_kv_step``
    when ``main`` is a KV-cache export the rewrite fits; otherwise it is returned unchanged
    with None and a note (no note when the model has no KV cache at all). ``cache_dtype``:
    "float16" holds float32 caches in half precision (None: the model's own dtype)."""
    main = mod["main"]
    zero = json.loads(str((main.attrs or {}).get(ZERO_ATTR, "[]")))
    if not zero:
        return mod, None, None
    try:
        builder = _Builder(mod, main, zero[0] if len(zero) == 1 else None, max_length, max_batch, cache_dtype)
        return (*builder.build(), None)
    except Decline as e:
        return mod, None, f"no in-place KV-cache step ({e}): generation feeds the presents back (copies per token)"


def capacity(max_length: int) -> int:
    """The cache buffers' length: the maximum rounded up to whole padding steps."""
    return -(-max_length // PAD) * PAD


def write_func(heads, dim, dtype: str, transposed: bool = False, new_dtype: str | None = None) -> tirx.PrimFunc:
    """``cache[b, h, past + s, d] = new[b, h, s, d]`` in place (the cache is argument 0);
    ``transposed``: ``cache_t[b, h, d, past + s]``, keys kept transposed; ``new_dtype``
    (default ``dtype``): the new rows' dtype, cast to the cache's as they are written."""
    new_dtype = new_dtype or dtype

    @T.prim_func(private=True, s_tir=True)
    def write(var_cache: T.handle, var_new: T.handle, past: T.int64):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})
        b, n, s = T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (b, heads, dim, n) if transposed else (b, heads, n, dim), dtype)
        new = T.match_buffer(var_new, (b, heads, s, dim), new_dtype)
        for i0, i1, i2, i3 in T.grid(b, heads, s, dim):
            with T.sblock("write"):
                v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                if transposed:
                    cache[v0, v1, v3, past + v2] = T.Cast(dtype, new[v0, v1, v2, v3])
                else:
                    cache[v0, v1, past + v2, v3] = T.Cast(dtype, new[v0, v1, v2, v3])

    return write


def _shape(ty):
    if isinstance(ty, relax.TensorType) and ty.shape is not None and hasattr(ty.shape, "values"):
        return list(ty.shape.values)
    return None


def _symbols(e) -> list:
    return list(tirx.analysis.undefined_vars(e)) if tvm.ir.is_prim_expr(e) else []


@dataclass
class _Attention:
    """How one cache feeds the attention, as transformers exports it (``repeat_kv`` then
    ``q @ k^T`` or ``p @ v``): the bindings from the appended cache to the matmul operand
    (all replaced), the matmul, its other operand, the key scale, heads per KV head."""

    kind: str  # "k" (scores = q @ k^T) or "v" (out = p @ v)
    chain: list  # binding vars of main made redundant
    matmul: relax.Var
    other: relax.Expr  # q or p
    rep: int
    scale: relax.Expr | None = None


def _attention(main, appends, analyzer) -> dict:
    """{append var: _Attention} for the appended caches whose uses are exactly the exported
    attention: [expand_dims(2), broadcast_to, reshape] (grouped-query heads), then for keys a
    transpose of the last two axes (or dynamo's reshape, permute, reshape) and an optional
    scalar multiply, and the matmul taking it as its second operand. The rewrite then
    multiplies q (or p) grouped by KV head, [b, kv_head, rep * seq, .], by the cache itself
    (keys kept transposed), with no copy of the cache. Others are left as they are."""
    bindings = {b.var: b for block in main.body.blocks for b in block.bindings}
    output = main.body.body
    users: dict = {}
    for var, b in bindings.items():
        if var.same_as(output):
            continue
        for used in relax.analysis.free_vars(b.value):
            users.setdefault(used, []).append(b)

    def only_user(var, op):
        got = users.get(var, [])
        if len(got) == 1 and isinstance(got[0].value, relax.Call) and got[0].value.op.same_as(op) \
                and got[0].value.args[0].same_as(var):
            return got[0]
        return None

    def dims(var):
        return _shape(var.ty) or []

    def same(a, b):
        return len(a) == len(b) and all(analyzer.can_prove_equal(x, y) for x, y in zip(a, b))

    plans = {}
    for append in appends:
        batch, kv_heads, length, dim = dims(append)
        chain, cur, rep = [], append, 1
        e = only_user(cur, _OP["expand_dims"])
        if e is not None:
            b = only_user(e.var, _OP["broadcast_to"])
            r = only_user(b.var, _OP["reshape"]) if b is not None else None
            bdims = dims(b.var) if b is not None else []
            if r is None or len(bdims) != 5 or not isinstance(bdims[2], tirx.IntImm) or \
                    not same(dims(e.var), [batch, kv_heads, 1, length, dim]) or \
                    not same(bdims, [batch, kv_heads, bdims[2], length, dim]) or \
                    not same(dims(r.var), [batch, kv_heads * bdims[2], length, dim]):
                continue
            rep, chain, cur = int(bdims[2]), [e.var, b.var, r.var], r.var
        heads = kv_heads * rep
        mm = [u for u in users.get(cur, []) if isinstance(u.value, relax.Call) and u.value.op.same_as(_OP["matmul"])]
        if len(users.get(cur, [])) == 1 and mm and mm[0].value.args[1].same_as(cur):  # p @ v
            p = mm[0].value.args[0]
            if same(dims(mm[0].var), [batch, heads, dims(mm[0].var)[2], dim]) and \
                    same(dims(p)[-1:], [length]):
                plans[append] = _Attention("v", chain, mm[0].var, p, rep)
            continue
        t = only_user(cur, _OP["permute_dims"])
        if t is not None and [int(a) for a in t.value.attrs.axes] == [0, 1, 3, 2]:
            kchain = [t.var]
        else:
            r1 = only_user(cur, _OP["reshape"])
            t = only_user(r1.var, _OP["permute_dims"]) if r1 is not None else None
            r2 = only_user(t.var, _OP["reshape"]) if t is not None else None
            if r2 is None or [int(a) for a in t.value.attrs.axes] != [0, 2, 1] or \
                    not same(dims(r1.var), [batch * heads, length, dim]):
                continue
            kchain = [r1.var, t.var, r2.var]
        if not same(dims(kchain[-1]), [batch, heads, dim, length]):
            continue
        cur, scale = kchain[-1], None
        m = only_user(cur, _OP["multiply"])
        if m is not None:
            c = m.value.args[1]
            if not isinstance(c, tvm.ir.expr.GenericConst) or int(np.prod(c.value.shape)) != 1 or \
                    not same(dims(m.var), [batch, heads, dim, length]):
                continue
            kchain, cur, scale = kchain + [m.var], m.var, c
        mm = [u for u in users.get(cur, []) if isinstance(u.value, relax.Call) and u.value.op.same_as(_OP["matmul"])]
        if len(users.get(cur, [])) != 1 or not mm or not mm[0].value.args[1].same_as(cur):
            continue
        q = mm[0].value.args[0]
        if same(dims(q)[:2] + dims(q)[3:], [batch, heads, dim]):
            plans[append] = _Attention("k", chain + kchain, mm[0].var, q, rep, scale)
    return plans


class _Builder:
    def __init__(self, mod, main, past_name, max_length: int, max_batch: int, cache_dtype: str | None = None):
        self.mod, self.main = mod, main
        self.cache_dtype = cache_dtype
        self.max_length, self.max_batch = max_length, max_batch
        self.analyzer = tvm.sym.Analyzer()
        self.symbols = {}
        for p in main.params:
            for d in _shape(p.ty) or []:
                for v in _symbols(d):
                    self.symbols.setdefault(v.name, v)
        if past_name not in self.symbols:
            raise Decline("no single past-length symbol among the inputs")
        self.past = self.symbols[past_name]
        self.blocks = tirx.Var(BLOCKS, "int64")
        self.length = self.blocks * PAD  # a multiple of 64 by construction: kernels need no tails for it
        self.new_past = tirx.Var(PAST, "int64")
        self.tir_map: list[tuple] = []  # (old var, new expression)
        self.relax_map: dict = {}
        self.written: dict = {}  # append var -> the cache after its write, where held in another dtype
        self.values_funcs: dict = {}
        self.seq = None

    # -- expressions -------------------------------------------------------------------
    def sub(self, e):
        """``e`` over the step's symbols: ``past + seq`` -> ``kv_length`` wherever it occurs
        as a sum, ``past`` alone -> the past input, the other symbols renamed."""
        if isinstance(e, (int, tirx.IntImm)) or not tvm.ir.is_prim_expr(e) or not _symbols(e):
            return e
        if str(e.ty).startswith("int") and not isinstance(e, tirx.Var) and \
                self.analyzer.can_prove_equal(e, self.past + self.seq):
            return self.length
        if isinstance(e, tirx.Var):
            if e.same_as(self.past):
                return self.new_past
            for old, new in self.tir_map:
                if e.same_as(old):
                    return new
            raise Decline(f"symbol '{e.name}' is not one of the inputs'")
        binary = {tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
                  tirx.FloorDiv: tirx.floordiv, tirx.FloorMod: tirx.floormod, tirx.Min: tirx.min,
                  tirx.Max: tirx.max, tirx.EQ: lambda a, b: a == b, tirx.NE: lambda a, b: a != b,
                  tirx.LT: lambda a, b: a < b, tirx.LE: lambda a, b: a <= b, tirx.GT: lambda a, b: a > b,
                  tirx.GE: lambda a, b: a >= b}
        for cls, make in binary.items():
            if type(e) is cls:
                return make(self.sub(e.a), self.sub(e.b))
        if isinstance(e, tirx.Cast):
            return tirx.Cast(str(e.ty), self.sub(e.value))
        if isinstance(e, tirx.Select):
            return tirx.Select(self.sub(e.condition), self.sub(e.true_value), self.sub(e.false_value))
        raise Decline(f"shape expression '{e}' ({type(e).__name__})")

    def sub_type(self, ty):
        if isinstance(ty, relax.TensorType):
            shape = _shape(ty)
            return ty if shape is None else relax.TensorType([self.sub(d) for d in shape], ty.dtype)
        if isinstance(ty, relax.TupleType):
            return relax.TupleType([self.sub_type(f) for f in ty.fields])
        if isinstance(ty, relax.ShapeType) and ty.values is not None:
            return relax.ShapeType([self.sub(v) for v in ty.values])
        return ty

    def mutate(self, e):
        if tvm.ir.is_prim_expr(e):
            return self.sub(e)
        if isinstance(e, relax.Var):
            if e not in self.relax_map:
                raise Decline(f"'{e.name}' is used other than by the concat that appends to it")
            return self.relax_map[e]
        if isinstance(e, _LEAVES):
            return e
        if isinstance(e, relax.ShapeExpr):
            return relax.ShapeExpr([self.sub(v) for v in e.values])
        if isinstance(e, relax.Tuple):
            return relax.Tuple([self.mutate(f) for f in e.fields])
        if isinstance(e, relax.TupleGetItem):
            return relax.TupleGetItem(self.mutate(e.tuple_value), e.index)
        if isinstance(e, relax.Call):
            if e.op.same_as(_CALL_TIR) and VALUES_ATTR in (self.mod[e.args[0]].attrs or {}):
                return self._values(e)
            return relax.Call(e.op, [self.mutate(a) for a in e.args], e.attrs,
                              [self.sub_type(s) for s in e.ty_args])
        raise Decline(f"unexpected {type(e).__name__} in main")

    def _values(self, call):
        """A shape-values call (the importer's tensors of symbol expressions), recomputed
        from the substituted expressions."""
        func = self.mod[call.args[0]]
        args = list(call.args[1].fields)
        scalars = list(func.params[:len(args)])
        if not all(isinstance(a, tirx.Var) and a.same_as(p) for a, p in zip(args, scalars)):
            raise Decline("a shape-values function called with other than its own symbols")
        exprs = [self.sub(e) for e in func.attrs[VALUES_ATTR]]
        key = tuple(str(e) for e in exprs)
        symbols = expr_symbols(exprs)
        if key not in self.values_funcs:
            self.values_funcs[key] = self.bb.add_func(shape_values_func(exprs, symbols), "qtvm_kv_values")
        return relax.call_tir(self.values_funcs[key], relax.Tuple(symbols), relax.TensorType([len(exprs)], "int64"))

    # -- structure -----------------------------------------------------------------------
    def _caches(self):
        """Cache params (a dim that is ``past``) and the axis of ``past`` in them."""
        caches, axes = [], set()
        for p in self.main.params:
            shape = _shape(p.ty) or []
            hits = [i for i, d in enumerate(shape) if isinstance(d, tirx.Var) and d.same_as(self.past)]
            if hits:
                if len(hits) != 1 or len(shape) != 4:
                    raise Decline(f"'{p.name}' has past length on more than one axis or rank {len(shape)}")
                caches.append(p)
                axes.add(hits[0])
        if not caches or len(axes) != 1:
            raise Decline("the past inputs do not share one past axis")
        return caches, axes.pop()

    def _appends(self, caches, axis):
        """{concat binding var: (cache param, new values)} and the single-input concats
        (copies of a cache input, as the legacy exporter writes them) in the chains."""
        bindings = [b for block in self.main.body.blocks for b in block.bindings]
        aliases, appends = {}, {}
        for b in bindings:
            v = b.value
            if not (isinstance(v, relax.Call) and v.op.same_as(_CONCAT)):
                continue
            fields = list(v.args[0].fields)
            cat_axis = int(v.attrs.axis) % 4 if v.attrs.axis is not None else None
            first = aliases.get(fields[0], fields[0])
            if not any(first.same_as(c) for c in caches):
                continue
            if cat_axis != axis:
                raise Decline(f"'{first.name}' is concatenated along axis {cat_axis}, not its past axis {axis}")
            if len(fields) == 1:
                aliases[b.var] = first
            elif len(fields) == 2:
                appends[b.var] = (first, fields[1])
            else:
                raise Decline(f"'{first.name}' is concatenated with {len(fields) - 1} tensors")
        used = [c for c, _ in appends.values()]
        if sorted(c.name for c in used) != sorted(c.name for c in caches):
            raise Decline("not every past input is appended to exactly once")
        return appends, aliases

    def build(self):
        main = self.main
        if not isinstance(main.body, relax.SeqExpr) or not all(
                isinstance(b, relax.DataflowBlock) for b in main.body.blocks):
            raise Decline("main is not one dataflow region")
        caches, axis = self._caches()
        appends, aliases = self._appends(caches, axis)
        some = next(iter(appends))
        total = _shape(some.ty)[axis]
        seq = [v for v in _symbols(total - self.past) if not v.same_as(self.past)]
        if len(seq) != 1 or not self.analyzer.can_prove_equal(total, self.past + seq[0]):
            raise Decline(f"the appended length is {total}, not past + seq")
        self.seq = seq[0]
        mask = None
        for p in main.params:
            shape = _shape(p.ty)
            if p in caches or shape is None or len(shape) != 2:
                continue
            last = shape[1]
            others = [v for q in main.params if not q.same_as(p) for d in (_shape(q.ty) or []) for v in _symbols(d)]
            own = isinstance(last, tirx.Var) and not last.same_as(self.seq) and not any(last.same_as(v) for v in others)
            if own or (not isinstance(last, int) and self.analyzer.can_prove_equal(last, self.past + self.seq)):
                if mask is not None:
                    raise Decline(f"two inputs could be the attention mask ('{mask.name}', '{p.name}')")
                mask = p
                if own:
                    self.tir_map.append((last, self.length))
        if mask is None:
            raise Decline("no attention-mask input of length past + seq")
        rest = [p for p in main.params if not any(p.same_as(c) for c in caches + [mask])]
        positions = [p for p in rest if "position" in p.name] if len(rest) == 2 else []
        rest = [p for p in rest if not positions or not p.same_as(positions[0])]
        if len(rest) != 1 or any(len(_shape(p.ty) or []) != 2 or not str(p.ty.dtype).startswith("int")
                                 for p in rest + positions[:1]):
            raise Decline(f"inputs besides the caches and the mask are {[p.name for p in rest + positions]}, not "
                          "token ids (and position ids) alone")
        ids = rest[0]
        for name, v in self.symbols.items():
            if not v.same_as(self.past) and not any(v.same_as(old) for old, _ in self.tir_map):
                self.tir_map.append((v, tirx.Var(name, "int64")))
        self.plans = _attention(main, appends, self.analyzer) if axis == 2 else {}
        transposed = {appends[a][0] for a, plan in self.plans.items() if plan.kind == "k"}
        self.matmuls = {plan.matmul: (a, plan) for a, plan in self.plans.items()}
        self.skipped = {v for plan in self.plans.values() for v in plan.chain}
        params, cache_params = [], {}
        for p in main.params:
            shape = _shape(p.ty)
            if p in caches:
                dims = [self.length if i == axis else self.sub(d) for i, d in enumerate(shape)]
                if p in transposed:
                    dims = [dims[0], dims[1], dims[3], dims[2]]
            else:
                dims = [self.sub(d) for d in shape] if shape is not None else None
            dtype = self._held_dtype(p.ty.dtype) if p in caches else p.ty.dtype
            params.append(relax.Var(p.name, relax.TensorType(dims, dtype) if dims is not None else p.ty))
            if p in caches:  # reachable only through the append it feeds (any other use declines)
                cache_params[p] = params[-1]
            else:
                self.relax_map[p] = params[-1]
        past_param = relax.Var("lengths", relax.ShapeType([self.new_past, self.blocks]))
        self.bb = bb = relax.BlockBuilder(self.mod)
        try:
            self._emit(bb, [*params, past_param], caches, appends, aliases, cache_params)
        except BaseException:
            bb._end_block()  # the block the failed scope left open (else TVM warns on stderr)
            raise
        mod = bb.get()
        func = relax.analysis.remove_all_unused(mod[STEP_FUNC])
        self._check(func)
        batch = [d for d in _shape(params[main.params.index(caches[0])].ty)[:1] if isinstance(d, tirx.Var)]
        bounds = {v.name: self.max_length for _, v in self.tir_map if isinstance(v, tirx.Var)}
        bounds.update({BLOCKS: capacity(self.max_length) // PAD, PAST: self.max_length})
        if batch:
            bounds[batch[0].name] = self.max_batch
        mod[STEP_FUNC] = func.with_attrs({"global_symbol": STEP_FUNC, "num_input": len(params) + 1,
                                          "tir_var_upper_bound": bounds, "tir_non_negative_var": [PAST]})
        index = {p.name: i for i, p in enumerate(main.params)}  # the metadata names inputs as ONNX does
        info = {"function": STEP_FUNC, "caches": [index[c.name] for c in caches], "mask": index[mask.name],
                "layouts": [BHDL if c in transposed else BHLD for c in caches],
                "cache_dtype": str(cache_params[caches[0]].ty.dtype),
                "fused_attention": sum(1 for plan in self.plans.values()),
                "ids": index[ids.name], "positions": index[positions[0].name] if positions else None,
                "axis": axis, "pad": PAD, "max_length": self.max_length,
                "max_batch": self.max_batch, "batch": batch[0].name if batch else None, "seq": self.seq.name}
        return mod, info

    def _emit(self, bb, params, caches, appends, aliases, cache_params):
        main, output_var, writes, out = self.main, self.main.body.body, {}, None
        with bb.function(STEP_FUNC, params=params, pure=True):
            with bb.dataflow():
                for block in main.body.blocks:
                    for b in block.bindings:
                        if b.var in aliases or b.var in self.skipped:
                            continue
                        if b.var in appends:
                            cache, new = appends[b.var]
                            plan = self.plans.get(b.var)
                            written = self._write(bb, cache_params[cache], self.mutate(new), writes,
                                                  plan is not None and plan.kind == "k")
                            if written.ty.dtype != b.var.ty.dtype:  # read widened by the grouped matmul;
                                self.written[b.var] = written  # a widened copy for other readers
                                written = bb.emit(relax.op.astype(written, b.var.ty.dtype))
                            self.relax_map[b.var] = written
                        elif b.var in self.matmuls:
                            self.relax_map[b.var] = self._grouped_matmul(bb, b.var, *self.matmuls[b.var])
                        elif b.var.same_as(output_var):
                            kept = [f for f in b.value.fields if f not in appends]
                            if not isinstance(b.value, relax.Tuple) or len(kept) != len(b.value.fields) - len(caches):
                                raise Decline("the presents are not outputs of main as they are")
                            value = self.mutate(kept[0] if len(kept) == 1 else relax.Tuple(kept))
                            out = bb.emit_output(value)
                        elif isinstance(b, relax.MatchCast):
                            self.relax_map[b.var] = bb.match_cast(self.mutate(b.value), self.sub_type(b.ty))
                        else:
                            self.relax_map[b.var] = bb.emit(self.mutate(b.value))
            bb.emit_func_output(out)

    def _write(self, bb, cache, new, writes, transposed: bool = False):
        shape = _shape(cache.ty)
        heads, dim = (int(shape[1]), int(shape[2])) if transposed else (int(shape[1]), int(shape[3]))
        key = (heads, dim, cache.ty.dtype, transposed, new.ty.dtype)
        if key not in writes:
            writes[key] = bb.add_func(write_func(*key), "qtvm_kv_write")
        return bb.emit(relax.call_tir_inplace(writes[key], relax.Tuple([cache, new, self.new_past]), 0, cache.ty))

    def _grouped_matmul(self, bb, var, append, plan):
        """The attention matmul on the cache itself: the other operand ([b, heads, seq, x])
        viewed as [b, kv_heads, rep * seq, x] (head h = kv_head * rep + r), times the cache
        ([b, kv_heads, dim, L] keys, [b, kv_heads, L, dim] values), viewed back."""
        cache = self.written.get(append, self.relax_map[append])
        other = self.mutate(plan.other)
        if plan.scale is not None:  # k * s moves to q: the scores differ by float rounding only
            other = bb.emit(relax.op.multiply(other, plan.scale))
        batch, heads, seq, last = _shape(other.ty)
        kv_heads = _shape(cache.ty)[1]
        grouped = bb.emit(relax.op.reshape(other, relax.ShapeExpr([batch, kv_heads, seq * plan.rep, last])))
        product = bb.emit(relax.op.matmul(grouped, cache, out_dtype=str(other.ty.dtype)))  # a half cache widened
        return bb.emit(relax.op.reshape(product, relax.ShapeExpr([batch, heads, seq, _shape(product.ty)[-1]])))

    def _held_dtype(self, dtype) -> str:
        """The dtype a cache of ``dtype`` is held in: float16 asked for and the model's float32."""
        return self.cache_dtype if self.cache_dtype and str(dtype) == "float32" else str(dtype)

    def _check(self, func):
        """No shape may still depend on the past length alone (it means something of the
        attention was not re-expressed in kv_length)."""
        for block in func.body.blocks:
            for b in block.bindings:
                for d in _tensor_dims(b.var.ty):
                    if any(v.same_as(self.new_past) for v in _symbols(d)):
                        raise Decline(f"'{b.var.name}' has a dimension {d} of the past length")


def _tensor_dims(ty) -> list:
    if isinstance(ty, relax.TupleType):
        return [d for f in ty.fields for d in _tensor_dims(f)]
    return _shape(ty) or []
