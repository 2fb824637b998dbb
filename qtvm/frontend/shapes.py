"""Symbolic shape values: the "shape computing operators" of an ONNX graph, folded at import.

Exporters compute sizes at run time: ``Shape -> Gather -> Unsqueeze -> Concat ->
Reshape``, ``ConstantOfShape`` of a computed shape, ``Range(0, seq)``, ``Expand`` to a
shape read off another tensor. TVM's importer turns many of those into tensors of
unknown content, and every shape downstream of them into a fresh symbol unrelated to
``seq`` (or into no shape at all). Here every small integer tensor whose content
follows from the input symbols is evaluated at compile time instead, element by
element, as a TIR expression over those symbols (Transformer-Lite's symbolic-expression
shape derivation): ``Shape(x)[1]`` *is* ``seq``, ``seq * 4 // 4`` simplifies back to it,
and nothing of the shape subgraph runs per call. A value is tracked when it has at most
``MAX_ELEMENTS`` elements and each element is an int, bool, float (numeric only) or an
int64/bool TIR expression.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

import tvm
from tvm import tirx
from tvm.sym import Analyzer, ConstIntBound

from qtvm import dims as dimexpr

MAX_ELEMENTS = 64  # shape tensors are rank-sized; anything larger is data
BIG = 1 << 62  # slice ends at or past this mean "to the end" (exporters use INT64_MAX)


def is_symbolic(x) -> bool:
    return tvm.ir.is_prim_expr(x) and not isinstance(x, tirx.IntImm)


class Symbols:
    """The graph's dimension symbols (int64 TIR vars, each >= ``minimum``) and the analyzer
    that simplifies and compares expressions over them."""

    def __init__(self, minimum: int = 0, pins: dict[str, int] | None = None):
        self.minimum = minimum
        self.pins = dict(pins or {})  # dim names read as constants (``importer.PinDims``)
        self.vars: dict[str, tirx.Var] = {}
        self.limits: dict[str, int] = {}  # symbol or dim expression -> largest value the model accepts
        self.minimums: dict[str, int] = {}  # symbol -> smallest value the model accepts (``at_least``)
        self._constraints: list = []  # entered analyzer constraint scopes (``limit`` of an expression)
        self.analyzer = Analyzer()

    def limit(self, dim, bound: int) -> None:
        """Assume ``dim <= bound`` from here on (a model's position table length): ``dim`` a
        symbol or an expression of symbols (``past + seq``, the keys a causal-mask table is
        sliced to). The artefact's metadata carries it, keyed by its dim text, so the runtime
        refuses larger inputs. For an expression the analyzer is given the constraint itself
        (it then simplifies ``min(past + seq, 256)``) and each symbol's bound that follows from
        the others' minimums (``past <= 255`` with ``seq >= 1``). Nothing is recorded where
        ``dim <= bound`` already follows (``min(seq, 1) <= 256``)."""
        dim = self.norm(dim)
        if self.prove(tirx.LE(self.expr(dim), self.expr(bound))):
            return
        for v in [] if isinstance(dim, tirx.Var) else _vars_of(dim):  # seq + 39 <= 79 is seq <= 40
            shift = self.norm(self.expr(dim) - v)
            if not is_symbolic(shift):
                return self.limit(v, bound - shift)
        key = self.text(dim)
        terms = key.split(" + ")
        if len(terms) > 1 and all(t.isidentifier() for t in terms):  # a sum of symbols: one order
            key = " + ".join(sorted(terms))
        self.limits[key] = min(self.limits.get(key, bound), bound)
        if isinstance(dim, tirx.Var):
            low = self.analyzer.const_int_bound(dim).min_value
            self.analyzer.update(dim, ConstIntBound(low, self.limits[key]), override=True)
            return
        self._constraints.append(self.analyzer.constraint_scope(tirx.LE(dim, self.expr(bound))))
        self._constraints[-1].__enter__()  # for the rest of the import
        for v in _vars_of(dim):
            rest = self.norm(dim - v)
            if any(u.same_as(v) for u in _vars_of(rest)):  # not v + (terms without v)
                continue
            low = self.analyzer.const_int_bound(self.expr(rest)).min_value
            if low > ConstIntBound.NEG_INF:
                now = self.analyzer.const_int_bound(v)
                self.analyzer.update(v, ConstIntBound(now.min_value, min(now.max_value, bound - low)), override=True)

    def enforceable(self, dim) -> bool:
        """Whether a ``limit`` on ``dim`` is one the runtime can check: its key is a symbol or
        ``qtvm.dims`` syntax (``seq // 10 + 4998``; not ``seq % 7`` or ``min(...)``), which
        the runtime evaluates on the input sizes."""
        dim = self.norm(dim)
        return isinstance(dim, tirx.Var) or dimexpr.parse(self.text(dim)) is not None

    def at_least(self, dim, low: int) -> None:
        """Assume ``dim >= low`` from here on, where the model is only valid so (a convolution's
        output length over ``seq`` is at least 1). Only for a dim that grows with its one symbol
        (``(seq - 400) // 320 + 1``): the symbol's smallest value that satisfies it is recorded
        (the artefact's metadata carries it, so the runtime refuses smaller inputs). Any other
        dim is left as it is: nothing is assumed that the analyzer could not reverse."""
        dim = self.norm(dim)
        if not is_symbolic(dim) or self.prove(tirx.GE(dim, self.expr(low))):
            return
        found = _vars_of(dim)
        if len(found) != 1 or not _grows_with(dim, found[0]):
            return
        v = found[0]
        bound = self.analyzer.const_int_bound(v)

        def holds(x: int) -> bool:
            at = Analyzer()
            at.bind(v, tirx.IntImm("int64", x))
            return int(at.simplify(dim)) >= low

        lo, hi = bound.min_value, max(bound.min_value, 1)
        while not holds(hi):  # doubling, then bisection: holds is monotone in x
            if hi > BIG >> 20 or hi >= bound.max_value:
                return
            lo, hi = hi, min(2 * hi, bound.max_value)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
        self.analyzer.update(v, ConstIntBound(hi, bound.max_value), override=True)
        self.minimums[v.name] = max(self.minimums.get(v.name, hi), hi)

    def var(self, name: str) -> tirx.Var:
        if name not in self.vars:
            v = tirx.Var(name, "int64")
            self.analyzer.update(v, ConstIntBound(self.minimum, ConstIntBound.POS_INF))
            self.vars[name] = v
        return self.vars[name]

    def dim(self, text: str):
        """An ONNX dim_param (a symbol or an expression such as ``past + seq``) as an int64 expression."""
        value = dimexpr.evaluate(text, {**self.vars, **self.pins}, self.var)
        return self.norm(value)

    def norm(self, x):
        """Simplified: a Python int/bool when constant, else a TIR expression."""
        if isinstance(x, (bool, np.bool_)):
            return bool(x)
        if isinstance(x, (int, np.integer)):
            return int(x)
        if isinstance(x, (float, np.floating)):
            return float(x)
        x = self.analyzer.simplify(x)
        if isinstance(x, tirx.IntImm):
            return bool(x.value) if str(x.ty) == "bool" else int(x.value)
        settled = self._settle(x)
        return x if settled.same_as(x) else self.norm(settled)

    _ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod)

    def _settle(self, x):
        """``x`` with each min/max whose order the analyzer proves replaced by that operand: its
        simplifier leaves min(seq, seq - seq % -8) (a slice back to seq of a length padded to a
        multiple of 8) although it proves seq - seq % -8 >= seq."""
        if isinstance(x, (tirx.Min, tirx.Max)):
            a, b = self._settle(x.a), self._settle(x.b)
            if self.prove(a <= b):
                return a if isinstance(x, tirx.Min) else b
            if self.prove(b <= a):
                return b if isinstance(x, tirx.Min) else a
            return x if a.same_as(x.a) and b.same_as(x.b) else type(x)(a, b)
        if not isinstance(x, self._ARITH):
            return x
        a, b = self._settle(x.a), self._settle(x.b)
        return x if a.same_as(x.a) and b.same_as(x.b) else type(x)(a, b)

    def expr(self, x):
        """int/bool -> IntImm (int64 or bool), TIR expressions as they are."""
        if isinstance(x, (bool, np.bool_)):
            return tirx.IntImm("bool", int(x))
        if isinstance(x, (int, np.integer)):
            return tirx.IntImm("int64", int(x))
        return x

    def equal(self, a, b) -> bool:
        a, b = self.norm(a), self.norm(b)
        if not is_symbolic(a) and not is_symbolic(b):
            return a == b
        if self.analyzer.can_prove_equal(self.expr(a), self.expr(b)):
            return True
        if _polynomial(a) == _polynomial(b):  # TVM's simplifier does not distribute a * (b + c)
            return True
        return self._periodic(self.expr(a) - self.expr(b), "zero")

    def is_one(self, a) -> bool:
        return self.equal(a, 1)

    def prove(self, cond) -> bool:
        cond = self.norm(cond)
        if isinstance(cond, bool) or self.analyzer.can_prove(cond):
            return bool(cond)
        sides = {tirx.GE: (0, 1), tirx.LE: (1, 0), tirx.GT: (0, 1), tirx.LT: (1, 0)}.get(type(cond))
        if sides is None:
            return False
        big, small = (cond.a, cond.b)[sides[0]], (cond.a, cond.b)[sides[1]]
        strict = isinstance(cond, (tirx.GT, tirx.LT))
        return self._periodic(big - small - (1 if strict else 0), "non-negative")

    def _periodic(self, f, claim: str) -> bool:
        """Whether f (an expression of one symbol s) is non-negative, or zero, for every s the
        model accepts, where TVM's analyzer cannot tell: frame counts of strided layers (SEW's
        seq // 10 - (seq - 10) // 20 * 2 - 1, a pad that is 0 or 1). f built from s, integer
        constants, +, -, products by constants, floor division and modulo by positive
        constants (truncating division of a non-negative numerator) and min/max of operands
        that grow alike is quasi-linear: f(s + L) = f(s) + C for a period L that every divisor
        chain divides. So f >= 0 for all s >= lo iff C >= 0 and f >= 0 on [lo, lo + L); f == 0
        iff C == 0 and f == 0 there. An exact proof by enumeration, not a sample."""
        found = _quasi_linear(self.analyzer.simplify(f))
        if found is None:
            return False
        evaluate, var, period = found
        if var is None or period > _MAX_PERIOD:
            return False
        low = self.analyzer.const_int_bound(var).min_value
        lo = max(int(low), 0)
        try:
            values = [evaluate(lo + i) for i in range(period + 1)]
        except _NotQuasiLinear:
            return False
        step = values[-1] - values[0]
        if claim == "zero":
            return step == 0 and not any(values)
        return step >= 0 and min(values) >= 0

    def text(self, x) -> str:
        return dim_text(self.norm(x))

    def dims_text(self, dims) -> str:
        return "[" + ", ".join(self.text(d) for d in dims) + "]" if dims is not None else "[unknown]"

    def broadcast(self, a: list, b: list):
        """Multidirectional (numpy) broadcast of two dim lists; None at a position whose
        dims cannot be related (neither provably 1 nor provably equal)."""
        n = max(len(a), len(b))
        a = [1] * (n - len(a)) + list(a)
        b = [1] * (n - len(b)) + list(b)
        out = []
        for x, y in zip(a, b):
            if self.equal(x, y) or self.is_one(y):
                out.append(self.norm(x))
            elif self.is_one(x):
                out.append(self.norm(y))
            else:
                out.append(None)
        return out


def _vars_of(e) -> list:
    """The symbols in expression ``e``, each once."""
    return list({v.name: v for v in tirx.analysis.undefined_vars(e)}.values()) if is_symbolic(e) else []


def dim_text(e) -> str:
    """A dim in the dim_param syntax of ``qtvm.dims`` (``past + seq``, ``seq * 2``);
    anything else in TVM's own notation."""
    if isinstance(e, (bool, int)):
        return str(int(e))
    if isinstance(e, tirx.IntImm):
        return str(e.value)
    if isinstance(e, tirx.Var):
        return e.name
    binary = {tirx.Add: " + ", tirx.Sub: " - ", tirx.Mul: " * ", tirx.FloorDiv: " // "}
    for kind, sep in binary.items():
        if isinstance(e, kind):
            a, b = dim_text(e.a), dim_text(e.b)
            if kind is not tirx.Add:  # operands of lower precedence get parentheses
                low = (tirx.Add, tirx.Sub) if kind is not tirx.Sub else ()
                a = f"({a})" if isinstance(e.a, low) else a
                b = f"({b})" if isinstance(e.b, (tirx.Add, tirx.Sub, *((tirx.Mul, tirx.FloorDiv)
                                                                       if kind is tirx.FloorDiv else ()))) else b
            return a + sep + b
    if isinstance(e, (tirx.Min, tirx.Max)):
        return f"{type(e).__name__.lower()}({dim_text(e.a)}, {dim_text(e.b)})"
    return str(e)


def _grows_with(e, v) -> bool:
    """Whether ``e`` is non-decreasing in ``v``, by its form: sums, differences with a
    constant, products and floor divisions by positive constants, min and max of such."""
    if isinstance(e, tirx.IntImm) or isinstance(e, tirx.Var) and e.same_as(v):
        return True
    if isinstance(e, (tirx.Add, tirx.Min, tirx.Max)):
        return _grows_with(e.a, v) and _grows_with(e.b, v)
    if isinstance(e, tirx.Sub):
        return _grows_with(e.a, v) and isinstance(e.b, tirx.IntImm)
    if isinstance(e, (tirx.Mul, tirx.FloorDiv)):
        return _grows_with(e.a, v) and isinstance(e.b, tirx.IntImm) and e.b.value > 0
    return False


_MAX_PERIOD = 1 << 12  # enumeration cost bound: SEW's frames need 400, wav2vec2's 320


class _NotQuasiLinear(Exception):
    """A truncating division's numerator turned negative, or min/max operands grow apart."""


def _quasi_linear(e):
    """(evaluate, symbol, period) for an expression of at most one symbol built from the forms
    ``Symbols._periodic`` names (evaluate: Python int -> int, exact), else None."""
    symbols: dict = {}  # name -> Var
    divisors: list[int] = []

    def build(x):
        if isinstance(x, (int, bool)):
            return lambda s, v=int(x): v
        if isinstance(x, tirx.IntImm):
            return lambda s, v=int(x.value): v
        if isinstance(x, tirx.Var):
            symbols[x.name] = x
            return lambda s: s
        if isinstance(x, (tirx.Add, tirx.Sub)):
            a, b = build(x.a), build(x.b)
            if a is None or b is None:
                return None
            return (lambda s: a(s) + b(s)) if isinstance(x, tirx.Add) else (lambda s: a(s) - b(s))
        if isinstance(x, tirx.Mul):
            if isinstance(x.b, tirx.IntImm):
                a, c = build(x.a), int(x.b.value)
            elif isinstance(x.a, tirx.IntImm):
                a, c = build(x.b), int(x.a.value)
            else:
                return None
            return None if a is None else (lambda s: a(s) * c)
        if isinstance(x, (tirx.FloorDiv, tirx.FloorMod, tirx.Div)) and isinstance(x.b, tirx.IntImm) \
                and int(x.b.value) > 0:
            a, d = build(x.a), int(x.b.value)
            if a is None:
                return None
            divisors.append(d)
            if isinstance(x, tirx.FloorMod):
                return lambda s: a(s) % d
            if isinstance(x, tirx.FloorDiv):
                return lambda s: a(s) // d
            numerators.append(a)  # truncation towards zero is floor division only from 0 up
            return lambda s: a(s) // d
        if isinstance(x, (tirx.Min, tirx.Max)):
            a, b = build(x.a), build(x.b)
            if a is None or b is None:
                return None
            pick = min if isinstance(x, tirx.Min) else max
            operands.append((a, b))
            return lambda s: pick(a(s), b(s))
        return None

    operands: list = []
    numerators: list = []
    evaluate = build(e)
    if evaluate is None or len(symbols) > 1:
        return None
    period = 1
    for d in divisors:
        period *= d
        if period > _MAX_PERIOD:
            return None
    var = next(iter(symbols.values()), None)

    def checked(s):
        for a, b in operands:  # min/max of operands that grow alike stays quasi-linear
            if a(s + period) - a(s) != b(s + period) - b(s):
                raise _NotQuasiLinear
        for a in numerators:  # >= 0 on a period and not decreasing: >= 0 from lo on
            if a(s) < 0 or a(s + period) < a(s):
                raise _NotQuasiLinear
        return evaluate(s)
    return checked, var, period


def _polynomial(e) -> dict:
    """``e`` expanded into {monomial: coefficient}, a monomial being the sorted tuple of
    its factors (variables by name; anything but + - * is one opaque factor)."""
    if isinstance(e, (bool, int)):
        return {(): int(e)} if e else {}
    if isinstance(e, tirx.IntImm):
        return {(): int(e.value)} if e.value else {}
    if isinstance(e, (tirx.Add, tirx.Sub)):
        out = dict(_polynomial(e.a))
        sign = 1 if isinstance(e, tirx.Add) else -1
        for m, c in _polynomial(e.b).items():
            out[m] = out.get(m, 0) + sign * c
        return {m: c for m, c in out.items() if c}
    if isinstance(e, tirx.Mul):
        out: dict = {}
        for ma, ca in _polynomial(e.a).items():
            for mb, cb in _polynomial(e.b).items():
                m = tuple(sorted(ma + mb))
                out[m] = out.get(m, 0) + ca * cb
        return {m: c for m, c in out.items() if c}
    name = e.name if isinstance(e, tirx.Var) else str(e)
    return {(name,): 1}


@dataclass
class Known:
    """A tensor whose every element is known at compile time (ints, bools, floats or
    TIR expressions over the dimension symbols), with its ONNX-side numpy dtype."""

    values: np.ndarray  # dtype=object
    dtype: np.dtype

    @property
    def symbolic(self) -> bool:
        return any(is_symbolic(v) for v in self.values.flat)

    def numpy(self) -> np.ndarray:
        assert not self.symbolic
        return np.array(self.values.tolist(), dtype=self.dtype).reshape(self.values.shape)

    def ints(self) -> list:
        """The values as a flat list (shapes, axes, starts...)."""
        return list(self.values.flat)


def objects(items: list) -> np.ndarray:
    """A 1-D object array of ``items`` (numpy must not look inside TIR expressions)."""
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def known_from_numpy(array: np.ndarray) -> Known | None:
    if array.size > MAX_ELEMENTS or array.dtype.kind not in "biuf":
        return None
    values = np.empty(array.shape, dtype=object)
    for idx in np.ndindex(array.shape):
        values[idx] = array[idx].item()
    return Known(values, array.dtype)


def constant_array(attrs: dict) -> np.ndarray:
    """The value of an ONNX Constant node from its (parsed) attributes."""
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    if "value_float" in attrs:
        return np.array(attrs["value_float"], dtype=np.float32)
    if "value_floats" in attrs:
        return np.array(attrs["value_floats"], dtype=np.float32)
    if "value_int" in attrs:
        return np.array(attrs["value_int"], dtype=np.int64)
    if "value_ints" in attrs:
        return np.array(attrs["value_ints"], dtype=np.int64)
    raise ValueError(f"Constant with attributes {sorted(attrs)} is not supported")


# ----------------------------------------------------------------------------------
# Evaluation of one node on known values


class _Skip(Exception):
    """This node's output is not a trackable value (too big, float symbolic, ...)."""


def _elementwise(fn, *arrays) -> np.ndarray:
    arrays = np.broadcast_arrays(*arrays)
    out = np.empty(arrays[0].shape, dtype=object)
    for idx in np.ndindex(out.shape):
        out[idx] = fn(*(a[idx] for a in arrays))
    return out


def _array(x) -> np.ndarray:
    """numpy returns a bare element where a 0-d result is meant."""
    if isinstance(x, np.ndarray):
        return x
    out = np.empty((), dtype=object)
    out[()] = x
    return out


def _int_of(np_dtype) -> bool:
    return np.dtype(np_dtype).kind in "iu"


class Folder:
    """Evaluates shape-computing nodes on Known inputs. ``fold`` returns the outputs' Known
    values, or None when the node has to be converted as data."""

    def __init__(self, symbols: Symbols):
        self.sym = symbols

    def fold(self, op: str, attrs: dict, inputs: list, shape_of) -> list[Known] | None:
        """``inputs``: Known or None per ONNX input (None also for absent optional inputs);
        ``shape_of(i)``: the dims of input i (for Shape/Size on data tensors) or None."""
        method = getattr(self, f"_{op}", None)
        if method is None:
            return None
        try:
            out = method(attrs, inputs, shape_of)
        except _Skip:
            return None
        outs = out if isinstance(out, list) else [out]
        for k in outs:
            if k is None or k.values.size > MAX_ELEMENTS:
                return None
        return outs

    # -- helpers ---------------------------------------------------------------
    def _need(self, inputs, *idx) -> list[Known]:
        got = [inputs[i] if i < len(inputs) else None for i in idx]
        if any(k is None for k in got):
            raise _Skip
        return got

    def _numeric(self, k: Known | None) -> np.ndarray | None:
        if k is None:
            return None
        if k.symbolic:
            raise _Skip
        return k.numpy()

    def _make(self, values: np.ndarray, dtype) -> Known:
        out = np.empty(values.shape, dtype=object)
        for idx in np.ndindex(values.shape):
            out[idx] = self.sym.norm(values[idx])
        if np.dtype(dtype).kind == "f" and any(is_symbolic(v) for v in out.flat):
            raise _Skip
        return Known(out, np.dtype(dtype))

    def _binary(self, inputs, num, sym, out_dtype=None) -> Known:
        a, b = self._need(inputs, 0, 1)
        dtype = np.dtype(out_dtype) if out_dtype is not None else a.dtype
        if not a.symbolic and not b.symbolic:
            return self._make(np.asarray(num(a.numpy(), b.numpy())).astype(dtype), dtype)
        if not (_int_of(a.dtype) or a.dtype == np.bool_):
            raise _Skip
        e = self.sym.expr
        return self._make(_elementwise(lambda x, y: sym(e(x), e(y)), a.values, b.values), dtype)

    # -- shape sources -----------------------------------------------------------
    def _Shape(self, attrs, inputs, shape_of):
        dims = list(inputs[0].values.shape) if inputs[0] is not None else shape_of(0)
        if dims is None:
            raise _Skip
        n = len(dims)
        start, end = attrs.get("start", 0), attrs.get("end", n)
        start, end = (start + n if start < 0 else start), (end + n if end < 0 else end)
        return self._make(objects(dims[max(0, min(start, n)):max(0, min(end, n))]), np.int64)

    def _Size(self, attrs, inputs, shape_of):
        dims = list(inputs[0].values.shape) if inputs[0] is not None else shape_of(0)
        if dims is None:
            raise _Skip
        total = 1
        for d in dims:
            total = total * self.sym.expr(d) if is_symbolic(d) or is_symbolic(total) else total * d
        return self._make(objects([total]).reshape(()), np.int64)

    def _Constant(self, attrs, inputs, shape_of):
        k = known_from_numpy(constant_array(attrs))
        if k is None:
            raise _Skip
        return k

    def _ConstantOfShape(self, attrs, inputs, shape_of):
        shape = self._numeric(self._need(inputs, 0)[0])
        if "value" in attrs:
            fill = numpy_helper.to_array(attrs["value"]).reshape(-1)[0]
        else:
            fill = np.float32(0)
        if int(np.prod(shape)) > MAX_ELEMENTS:
            raise _Skip
        return self._make(np.full([int(s) for s in shape], fill, dtype=fill.dtype), fill.dtype)

    def _Range(self, attrs, inputs, shape_of):
        start, limit, delta = (self._numeric(k) for k in self._need(inputs, 0, 1, 2))
        count = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
        if count > MAX_ELEMENTS:
            raise _Skip
        values = start + np.arange(count, dtype=start.dtype) * delta
        return self._make(values.astype(start.dtype), start.dtype)

    # -- data movement -------------------------------------------------------------
    def _Identity(self, attrs, inputs, shape_of):
        return self._need(inputs, 0)[0]

    def _Cast(self, attrs, inputs, shape_of):
        (a,) = self._need(inputs, 0)
        to = onnx.helper.tensor_dtype_to_np_dtype(attrs["to"])
        return self._cast(a, to)

    def _CastLike(self, attrs, inputs, shape_of):
        a, like = self._need(inputs, 0, 1)
        return self._cast(a, like.dtype)

    def _cast(self, a: Known, to) -> Known:
        to = np.dtype(to)
        if not a.symbolic:
            return self._make(a.numpy().astype(to), to)
        if _int_of(to) and (_int_of(a.dtype) or a.dtype == np.bool_):
            return self._make(_elementwise(lambda x: tirx.Cast("int64", self.sym.expr(x)), a.values), to)
        if to == np.bool_ and _int_of(a.dtype):
            return self._make(_elementwise(lambda x: tirx.NE(self.sym.expr(x), self.sym.expr(0)), a.values), to)
        raise _Skip

    def _Gather(self, attrs, inputs, shape_of):
        data, idx = self._need(inputs, 0, 1)
        idx = self._numeric(idx)
        return Known(_array(np.take(data.values, idx, axis=attrs.get("axis", 0))), data.dtype)

    def _axes(self, attrs, inputs, i) -> list[int] | None:
        if "axes" in attrs:
            return list(attrs["axes"])
        k = inputs[i] if i < len(inputs) else None
        return None if k is None else [int(v) for v in self._numeric(k).reshape(-1)]

    def _Unsqueeze(self, attrs, inputs, shape_of):
        (data,) = self._need(inputs, 0)
        axes = self._axes(attrs, inputs, 1)
        rank = data.values.ndim + len(axes)
        values = data.values
        for ax in sorted(a + rank if a < 0 else a for a in axes):
            values = np.expand_dims(values, ax)
        return Known(values, data.dtype)

    def _Squeeze(self, attrs, inputs, shape_of):
        (data,) = self._need(inputs, 0)
        axes = self._axes(attrs, inputs, 1)
        values = data.values
        axes = [i for i, s in enumerate(values.shape) if s == 1] if axes is None else axes
        return Known(np.squeeze(values, tuple(a % values.ndim for a in axes)), data.dtype)

    def _Transpose(self, attrs, inputs, shape_of):
        (data,) = self._need(inputs, 0)
        perm = attrs.get("perm")
        return Known(np.transpose(data.values, None if perm is None else [int(a) for a in perm]), data.dtype)

    def _OneHot(self, attrs, inputs, shape_of):
        """Legacy exports of ``repeat_interleave`` build Tile's repeats with it (MoE routing)."""
        indices, depth, values = self._need(inputs, 0, 1, 2)
        indices, depth = self._numeric(indices), int(self._numeric(depth).reshape(-1)[0])
        if values.values.size != 2 or indices.size * depth > MAX_ELEMENTS:
            raise _Skip
        idx = indices.astype(np.int64)
        idx = np.where(idx < 0, idx + depth, idx)  # -depth..-1 count from the end; others match nothing
        hot = idx[..., None] == np.arange(depth)
        axis = attrs.get("axis", -1)
        axis = axis + hot.ndim if axis < 0 else axis
        off, on = values.values.reshape(-1)
        out = np.empty(hot.shape, dtype=object)
        for i in np.ndindex(hot.shape):
            out[i] = on if hot[i] else off
        return Known(np.moveaxis(out, -1, axis), values.dtype)

    def _Reshape(self, attrs, inputs, shape_of):
        data, shape = self._need(inputs, 0, 1)
        shape = [int(s) for s in self._numeric(shape)]
        if not attrs.get("allowzero", 0):
            shape = [data.values.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return Known(data.values.reshape(shape), data.dtype)

    def _Flatten(self, attrs, inputs, shape_of):
        (data,) = self._need(inputs, 0)
        axis = attrs.get("axis", 1)
        axis = axis + data.values.ndim if axis < 0 else axis
        lead = int(np.prod(data.values.shape[:axis]))
        return Known(data.values.reshape(lead, -1), data.dtype)

    def _Concat(self, attrs, inputs, shape_of):
        parts = self._need(inputs, *range(len(inputs)))
        return Known(np.concatenate([p.values for p in parts], axis=attrs["axis"]), parts[0].dtype)

    def _Slice(self, attrs, inputs, shape_of):
        data, starts, ends = self._need(inputs, 0, 1, 2)
        starts, ends = self._numeric(starts), self._numeric(ends)
        axes = self._numeric(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else range(len(starts))
        steps = self._numeric(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
        index = [slice(None)] * data.values.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            index[int(a)] = slice(int(s), int(e), int(st))
        return Known(data.values[tuple(index)], data.dtype)

    def _Expand(self, attrs, inputs, shape_of):
        data, shape = self._need(inputs, 0, 1)
        shape = [int(s) for s in self._numeric(shape)]
        target = np.broadcast_shapes(data.values.shape, tuple(shape))
        return Known(np.array(np.broadcast_to(data.values, target)), data.dtype)

    def _Tile(self, attrs, inputs, shape_of):
        data, reps = self._need(inputs, 0, 1)
        return Known(np.tile(data.values, [int(r) for r in self._numeric(reps)]), data.dtype)

    def _Split(self, attrs, inputs, shape_of):
        (data,) = self._need(inputs, 0)
        axis = attrs.get("axis", 0)
        sizes = attrs.get("split")
        if sizes is None and len(inputs) > 1 and inputs[1] is not None:
            sizes = [int(s) for s in self._numeric(inputs[1])]
        if sizes is None:
            raise _Skip  # even split: the number of outputs is not known here
        cuts = np.cumsum(sizes)[:-1]
        return [Known(part, data.dtype) for part in np.split(data.values, cuts, axis=axis)]

    # -- arithmetic ----------------------------------------------------------------
    def _Add(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.add, lambda x, y: x + y)

    def _Sub(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.subtract, lambda x, y: x - y)

    def _Mul(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.multiply, lambda x, y: x * y)

    def _Div(self, attrs, inputs, shape_of):
        a = self._need(inputs, 0)[0]
        if _int_of(a.dtype):  # ONNX integer Div truncates toward zero (as C does)
            def trunc_div(x, y):
                return (np.abs(x) // np.abs(y)) * np.sign(x) * np.sign(y)
            return self._binary(inputs, trunc_div, self._truncating(tirx.truncdiv, tirx.floordiv))
        return self._binary(inputs, np.divide, None)

    def _truncating(self, trunc, floor):
        """``trunc`` as ``floor`` where both operands are provably non-negative, the divisor
        positive: the analyzer relates floor divisions (conv output lengths) but leaves
        ``T.Div(seq, 10)`` apart from ``seq // 10`` even for seq >= 0."""
        def op(x, y):
            zero = tirx.IntImm("int64", 0)
            same = self.sym.prove(tirx.GE(x, zero)) and self.sym.prove(tirx.GT(y, zero))
            return (floor if same else trunc)(x, y)
        return op

    def _Mod(self, attrs, inputs, shape_of):
        if attrs.get("fmod", 0):
            return self._binary(inputs, np.fmod, self._truncating(tirx.truncmod, tirx.floormod))
        return self._binary(inputs, np.mod, tirx.floormod)

    def _float_unary(self, inputs, fn) -> Known:
        """Numbers only: shapes computed in float (MobileViT's legacy export: ceil(h / 2) * 2 patches)."""
        (a,) = self._need(inputs, 0)
        return self._make(fn(self._numeric(a)).astype(a.dtype), a.dtype)

    def _Ceil(self, attrs, inputs, shape_of):
        return self._float_unary(inputs, np.ceil)

    def _Floor(self, attrs, inputs, shape_of):
        return self._float_unary(inputs, np.floor)

    def _Sqrt(self, attrs, inputs, shape_of):
        return self._float_unary(inputs, np.sqrt)

    def _Pow(self, attrs, inputs, shape_of):
        """Numbers only (DINOv2's legacy export: int(16.0 ** 0.5) patches a side, a Reshape's shape)."""
        a, b = self._need(inputs, 0, 1)
        base, exponent = self._numeric(a), self._numeric(b)
        if _int_of(a.dtype) and (np.asarray(exponent) < 0).any():
            raise _Skip  # an integer to a negative power: numpy refuses, ONNX leaves it open
        return self._make(np.power(base, exponent).astype(a.dtype), a.dtype)

    def _Neg(self, attrs, inputs, shape_of):
        (a,) = self._need(inputs, 0)
        return self._make(_elementwise(lambda x: -x, a.values), a.dtype)

    def _Abs(self, attrs, inputs, shape_of):
        (a,) = self._need(inputs, 0)
        return self._make(_elementwise(lambda x: tirx.abs(x) if is_symbolic(x) else abs(x), a.values), a.dtype)

    def _minmax(self, inputs, num, sym):
        parts = self._need(inputs, *range(len(inputs)))
        out = parts[0]
        for p in parts[1:]:
            out = self._binary([out, p], num, sym)
        return out

    def _Max(self, attrs, inputs, shape_of):
        return self._minmax(inputs, np.maximum, tirx.max)

    def _Min(self, attrs, inputs, shape_of):
        return self._minmax(inputs, np.minimum, tirx.min)

    def _Equal(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.equal, tirx.EQ, np.bool_)

    def _Less(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.less, tirx.LT, np.bool_)

    def _LessOrEqual(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.less_equal, tirx.LE, np.bool_)

    def _Greater(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.greater, tirx.GT, np.bool_)

    def _GreaterOrEqual(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.greater_equal, tirx.GE, np.bool_)

    def _And(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.logical_and, tirx.And, np.bool_)

    def _Or(self, attrs, inputs, shape_of):
        return self._binary(inputs, np.logical_or, tirx.Or, np.bool_)

    def _Not(self, attrs, inputs, shape_of):
        (a,) = self._need(inputs, 0)
        return self._make(_elementwise(lambda x: tirx.Not(x) if is_symbolic(x) else not x, a.values), np.bool_)

    def _Where(self, attrs, inputs, shape_of):
        c, a, b = self._need(inputs, 0, 1, 2)
        if not (c.symbolic or a.symbolic or b.symbolic):
            return self._make(np.where(c.numpy(), a.numpy(), b.numpy()), a.dtype)
        if not _int_of(a.dtype):
            raise _Skip
        e = self.sym.expr

        def pick(cond, x, y):
            cond = self.sym.norm(cond)
            if isinstance(cond, bool):
                return x if cond else y
            return tirx.Select(cond, e(x), e(y))
        return self._make(_elementwise(pick, c.values, a.values, b.values), a.dtype)

    def _reduce(self, attrs, inputs, combine):
        (data,) = self._need(inputs, 0)
        axes = self._axes(attrs, inputs, 1)
        keep = attrs.get("keepdims", 1)
        values = data.values
        axes = list(range(values.ndim)) if not axes else [a % values.ndim for a in axes]
        for ax in sorted(axes, reverse=True):
            moved = np.moveaxis(values, ax, 0)
            acc = moved[0].copy() if moved.shape[0] else None
            if acc is None:
                raise _Skip
            for i in range(1, moved.shape[0]):
                acc = _elementwise(combine, acc, moved[i])
            values = np.expand_dims(acc, ax) if keep else acc
        return self._make(np.asarray(values, dtype=object), data.dtype)

    def _ReduceProd(self, attrs, inputs, shape_of):
        return self._reduce(attrs, inputs, lambda x, y: self.sym.expr(x) * self.sym.expr(y))

    def _ReduceSum(self, attrs, inputs, shape_of):
        return self._reduce(attrs, inputs, lambda x, y: self.sym.expr(x) + self.sym.expr(y))
