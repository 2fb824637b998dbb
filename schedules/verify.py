"""Differential check of a scheduled PrimFunc against the function it was made from.

A schedule rule may only reorder, tile, inline and vectorize: the scheduled function must
compute what the unscheduled one computes, to float rounding, for every binding of its
symbolic dims. :func:`compare` runs both on the same random inputs with each symbolic
dim bound to several values (distinct per dim, so a swapped axis shows) and reports every
output that differs. The rule tests run it over every function the rules schedule in a
corpus of graphs; ``qtvm compile --verify-schedules`` runs it on the user's own model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import tirx

#: Values each symbolic dim is bound to: decode (1), odd small, a tile multiple, a ragged tail.
BINDINGS = (1, 3, 64, 67)
#: Above this many elements in all a binding is skipped (a 4-D attention score at 67^4).
MAX_ELEMENTS = 1 << 24


@dataclass
class Mismatch:
    binding: dict
    buffer: str
    detail: str

    def __str__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.binding.items()) or "static shapes"
        return f"{self.buffer} at {dims}: {self.detail}"


def _buffer(param):
    """The parameter's buffer type (shape, dtype), or None for a scalar parameter."""
    return param.ty if isinstance(param.ty, tvm.tirx.buffer.BufferType) else None


def symbolic_vars(func: tirx.PrimFunc) -> list[tirx.Var]:
    """Scalar parameters and the variables in parameter buffer shapes, first seen first."""
    found: dict[str, tirx.Var] = {}

    def collect(expr):
        if isinstance(expr, tirx.Var):
            found.setdefault(expr.name, expr)
            return
        for name in ("a", "b", "value"):
            sub = getattr(expr, name, None)
            if isinstance(sub, tvm.ir.Expr):
                collect(sub)
        for sub in getattr(expr, "args", None) or ():
            if isinstance(sub, tvm.ir.Expr):
                collect(sub)

    for param in func.params:
        if _buffer(param) is not None:
            for dim in _buffer(param).shape:
                collect(dim)
        else:
            found.setdefault(param.name, param)
    return list(found.values())


def bindings_for(variables, values=BINDINGS, domains: dict | None = None) -> list[dict]:
    """len(values) bindings; dim j of binding i takes values[(i + j) % len(values)], or the
    same position of ``domains[name]`` for a dim whose graph admits only some sizes (a
    reflection pad of 64 needs a sequence longer than 64)."""
    if not variables:
        return [{}]
    domains = domains or {}
    out = []
    for i in range(len(values)):
        binding = {}
        for j, v in enumerate(variables):
            choices = domains.get(v.name, values)
            binding[v.name] = choices[(i + j) % len(choices)]
        out.append(binding)
    return out


def _shape(param, analyzer) -> tuple[int, ...]:
    dims = []
    for d in _buffer(param).shape:
        s = analyzer.simplify(d)
        if not isinstance(s, tirx.IntImm):
            raise ValueError(f"shape {_buffer(param).shape} of {param.name} is not fixed by the binding")
        dims.append(int(s.value))
    return tuple(dims)


def _shapes(func: tirx.PrimFunc, binding: dict) -> dict | None:
    """Buffer shapes under ``binding``, or None where a dim comes out below 1."""
    analyzer = tvm.sym.Analyzer()
    by_name = {v.name: v for v in symbolic_vars(func)}
    for name, value in binding.items():
        analyzer.bind(by_name[name], tirx.const(value, str(by_name[name].ty)))
    shapes = {p.name: _shape(p, analyzer) for p in func.params if _buffer(p) is not None}
    return shapes if all(d >= 1 for s in shapes.values() for d in s) else None


def valid_binding(func: tirx.PrimFunc, binding: dict) -> dict | None:
    """``binding``, or it shifted up by the smallest of 64, 128, ... 1024 that makes every buffer
    dim positive (a length derived as ``(seq - 192) // 128 + 1`` needs seq >= 192); None if none does."""
    for offset in (0, 64, 128, 256, 512, 1024):
        shifted = {k: v + offset for k, v in binding.items()}
        if _shapes(func, shifted) is not None:
            return shifted
    return None


def _divides_by_loaded_int(func: tirx.PrimFunc) -> bool:
    """An integer division or modulo by a value read from a buffer (a zero there traps)."""
    import tvm_ffi

    found = []
    kinds = (tirx.Div, tirx.FloorDiv, tirx.Mod, tirx.FloorMod)

    def has_load(expr) -> bool:
        loads = []
        tvm_ffi.structural_visit(expr, lambda v, vis: loads.append(v) if isinstance(v, tvm.ir.expr.TensorLoad)
                                 else vis.default_visit(v))
        return bool(loads)

    def visit(v, vis):
        if isinstance(v, kinds) and not str(v.ty).startswith("float") and has_load(v.b):
            found.append(v)
        vis.default_visit(v)

    tvm_ffi.structural_visit(func.body, visit)
    return bool(found)


def random_args(func: tirx.PrimFunc, binding: dict, rng: np.random.Generator) -> list | None:
    """One argument per parameter (numpy arrays for buffers, ints for scalars), or None when
    the binding makes the arguments too large or empty. Integer buffers hold 0 and 1 only
    (always valid indices along any axis of length >= 2, and 0 along length 1 when a dim is
    bound to 1), and 1 only where the function divides by them."""
    shapes = _shapes(func, binding)
    if shapes is None or sum(int(np.prod(s)) for s in shapes.values()) > MAX_ELEMENTS:
        return None
    high = 1 if min(binding.values(), default=2) == 1 else 2  # exclusive bound of integer values
    low = 1 if _divides_by_loaded_int(func) else 0  # integer divisors must not be zero
    high = max(high, low + 1)
    args = []
    for p in func.params:
        if _buffer(p) is None:
            args.append(binding[p.name])
            continue
        dtype, shape = str(_buffer(p).dtype), shapes[p.name]
        if dtype == "bool":
            args.append(rng.integers(0, 2, shape).astype(bool))
        elif dtype.startswith(("int", "uint")):
            args.append(rng.integers(low, high, shape).astype(dtype))
        else:
            args.append(rng.standard_normal(shape).astype(dtype))
    return args


def _compile(func: tirx.PrimFunc, target):
    from schedules import compile_func

    return compile_func(func, target)["main"]


def _run(fn, args) -> list[np.ndarray]:
    tensors = [tvm.runtime.tensor(a) if isinstance(a, np.ndarray) else a for a in args]
    fn(*tensors)
    return [t.numpy() if isinstance(a, np.ndarray) else None for t, a in zip(tensors, args)]


def _differs(got: np.ndarray, want: np.ndarray, rtol: float, noise: np.ndarray | None = None) -> str | None:
    """None when ``got`` equals ``want`` to float rounding: within ``rtol`` of the largest
    value, or within 8x the element's own rounding sensitivity ``noise`` (|f(x) - f(x')| for
    x' = x with every input perturbed by an ulp), so an ill-conditioned function of random
    inputs (1 / sqrt of a small mean) is not blamed on the schedule."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype.kind not in "fc":
        bad = got != want
        return f"{int(bad.sum())} of {bad.size} elements differ" if bad.any() else None
    with np.errstate(invalid="ignore"):
        g, w = got.astype(np.float64), want.astype(np.float64)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    if (nan_g != nan_w).any():
        return f"NaN in {int((nan_g != nan_w).sum())} elements where the other has a number"
    finite = np.isfinite(w)
    if (g[~finite & ~nan_w] != w[~finite & ~nan_w]).any():
        return "infinities differ"
    if not finite.any():
        return None
    scale = max(float(np.abs(w[finite]).max()), 1e-30)
    err = np.abs(g - w)
    allowed = rtol * scale
    if noise is not None:
        n = np.abs(noise.astype(np.float64) - w)
        allowed = np.maximum(allowed, 8 * np.where(np.isfinite(n), n, 0))
    bad = finite & (err > allowed)
    if not bad.any():
        return None
    worst = float(err[finite].max()) / scale
    return f"{int(bad.sum())} of {bad.size} elements off, max error {worst:.3g} relative to max |value| {scale:.3g}"


def _perturbed(args, rng):
    """The float inputs moved by about one ulp each (integers and scalars unchanged)."""
    out = []
    for a in args:
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            eps = np.finfo(a.dtype).eps
            a = (a * (1 + eps * rng.uniform(-1, 1, a.shape))).astype(a.dtype)
        out.append(a)
    return out


def compare(func: tirx.PrimFunc, scheduled: tirx.PrimFunc, target, bindings=None, seed: int = 0,
            rtol: float = 1e-5, domains: dict | None = None) -> list[Mismatch]:
    """Every buffer that differs between ``func`` and ``scheduled`` run on the same random
    inputs, for each binding (default :func:`bindings_for` of the symbolic dims, ``domains``
    restricting the sizes of named dims)."""
    target = tvm.target.Target(target) if isinstance(target, (str, dict)) else target
    ref_fn, new_fn = _compile(func, target), _compile(scheduled, target)
    names = [p.name for p in func.params]
    out = []
    for i, binding in enumerate(bindings if bindings is not None else
                                bindings_for(symbolic_vars(func), domains=domains)):
        binding = valid_binding(func, binding)
        if binding is None:
            continue
        rng = np.random.default_rng(seed + i)
        args = random_args(func, binding, rng)
        if args is None:
            continue
        want, got = _run(ref_fn, args), _run(new_fn, args)
        noise = None
        for j, (name, g, w) in enumerate(zip(names, got, want)):
            if g is None or _differs(g, w, rtol) is None:
                continue
            if noise is None:  # only where needed: how much does rounding alone move the result?
                noise = _run(ref_fn, _perturbed(args, rng))
            detail = _differs(g, w, rtol, noise[j])
            if detail:
                out.append(Mismatch(binding, name, detail))
    return out
