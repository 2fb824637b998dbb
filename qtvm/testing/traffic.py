"""Memory traffic of a scheduled GPU kernel, counted from the kernel TVM lowers for OpenCL.

    traffic = kernel_traffic(scheduled_func, {"qweight", "scales", "zeros"}, m=1)
    traffic.loaded["qweight"]   # bytes its load instructions read in one call
    traffic.fetched["qweight"]  # bytes of distinct addresses each work-group reads, summed
                                # over the work-groups: what reaches past a work-group's L1

The lowered device kernels are interpreted: every work-group and work-item of the launch
(``dims`` binds the symbolic dims), every loop iteration, each global load's addresses
(a vector load counts all its lanes). Guards and addresses that read memory (CSR indices)
are evaluated on the arrays' contents; a guard on other memory counts both sides. Subtrees without a load of the named
arrays are skipped, so activation-heavy loops (LUT tables) cost nothing to walk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

from qtvm.errors import QtvmError
from qtvm.testing.opencl import _evaluate, lower

_EXPR_FIELDS = ("a", "b", "value", "condition", "true_value", "false_value", "base", "args", "indices", "vectors",
                "body")


@dataclass
class Traffic:
    loaded: dict = field(default_factory=dict)   # array -> bytes read by load instructions
    fetched: dict = field(default_factory=dict)  # array -> distinct bytes per work-group, summed


def kernel_traffic(func: tirx.PrimFunc, arrays: dict, target=None, **dims) -> Traffic:
    """The traffic of ``arrays`` (buffer name -> its flat contents, or None) for one call of
    ``func``; contents are needed where addresses depend on them (CSR indices)."""
    _, device_mod, _ = lower(func, target)
    walk = _Walk(dict(arrays))
    for kernel in device_mod.functions.values():
        env = {p: dims[p.name] for p in kernel.params if p.name in dims}
        walk.groups.clear()
        walk.stmt(kernel.body, env, ())
        for touched in walk.groups.values():
            for name, _, size in touched:
                walk.traffic.fetched[name] = walk.traffic.fetched.get(name, 0) + size
    return walk.traffic


def _is_load(expr) -> bool:
    return type(expr).__name__ in ("BufferLoad", "TensorLoad")  # 0.27 names a buffer load TensorLoad


def _load_name(expr) -> str:
    return (expr.buffer if hasattr(expr, "buffer") else expr.source).name


def _children(expr):
    for name in _EXPR_FIELDS:
        child = getattr(expr, name, None)
        for c in (child if isinstance(child, (list, tuple, tvm_ffi.Array)) else [child]):
            if isinstance(c, tvm.ir.expr.Expr):
                yield c


class _Walk:
    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.read = lambda name, index: self.arrays[name].reshape(-1)[index]
        self.traffic = Traffic()
        self.groups: dict[tuple, set] = {}
        self._has: dict = {}

    def has_loads(self, node) -> bool:
        """Whether a statement or expression loads one of the arrays (memoized)."""
        key = node.__hash__()
        if key not in self._has:
            if _is_load(node) and _load_name(node) in self.arrays:
                found = True
            elif type(node).__name__ == "SeqStmt":
                found = any(self.has_loads(s) for s in node.seq)
            else:
                parts = [getattr(node, f, None) for f in ("then_case", "else_case", "value", "condition", "indices",
                                                          "body")]
                found = any(self.has_loads(p) for p in parts if isinstance(p, (tvm.ir.expr.Expr, tirx.Stmt))) \
                    or any(self.has_loads(c) for p in parts if isinstance(p, tvm_ffi.Array) for c in p) \
                    or (isinstance(node, tvm.ir.expr.Expr) and any(self.has_loads(c) for c in _children(node)))
            self._has[key] = found
        return self._has[key]

    def loads(self, expr, env, group) -> None:
        if _is_load(expr) and _load_name(expr) in self.arrays:
            name = _load_name(expr)
            dtype = tvm.DataType(str(expr.ty if hasattr(expr, "ty") else expr.dtype))
            index = expr.indices[-1]
            if type(index).__name__ == "Ramp":
                base, stride = _evaluate(index.base, env, self.read), _evaluate(index.stride, env, self.read)
                elements = [base + i * stride for i in range(dtype.lanes)]
            else:
                elements = [_evaluate(index, env, self.read)]
            size = dtype.bits // 8
            self.traffic.loaded[name] = self.traffic.loaded.get(name, 0) + len(elements) * size
            self.groups.setdefault(group, set()).update((name, e, size) for e in elements)
        for child in _children(expr):
            self.loads(child, env, group)

    def stmt(self, stmt, env, group) -> None:
        if not self.has_loads(stmt):
            return
        kind = type(stmt).__name__
        if kind == "SeqStmt":
            for s in stmt.seq:
                self.stmt(s, env, group)
        elif kind == "AttrStmt" and stmt.attr_key == "thread_extent":
            var = stmt.node.var
            for value in range(_evaluate(stmt.value, env, self.read)):
                inner = dict(env)
                inner[var] = value
                tag = str(stmt.node.thread_tag)
                self.stmt(stmt.body, inner, group + ((tag, value),) if tag.startswith("blockIdx") else group)
        elif kind == "For":
            start = _evaluate(stmt.min, env, self.read)
            for value in range(start, start + _evaluate(stmt.extent, env, self.read)):
                inner = dict(env)
                inner[stmt.loop_var] = value
                self.stmt(stmt.body, inner, group)
        elif kind == "IfThenElse":
            self.loads(stmt.condition, env, group)
            try:
                taken = [stmt.then_case] if _evaluate(stmt.condition, env, self.read) else [stmt.else_case]
            except (QtvmError, KeyError):  # a guard on memory not given: both sides count
                taken = [stmt.then_case, stmt.else_case]
            for s in taken:
                if s is not None:
                    self.stmt(s, env, group)
        elif kind in ("Bind", "LetStmt"):
            self.loads(stmt.value, env, group)
            try:
                env[stmt.var] = _evaluate(stmt.value, env, self.read)
            except (QtvmError, KeyError):
                pass  # a value read from memory: indices never depend on it in these kernels
            if getattr(stmt, "body", None) is not None:
                self.stmt(stmt.body, env, group)
        elif kind == "BufferStore":
            self.loads(stmt.value, env, group)
            for index in stmt.indices:
                self.loads(index, env, group)
        elif kind == "Evaluate":
            self.loads(stmt.value, env, group)
        elif getattr(stmt, "body", None) is not None:  # other attributes, allocations, asserts
            self.stmt(stmt.body, env, group)
