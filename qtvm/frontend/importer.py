"""ONNX graph -> Relax ``main``, node by node, with symbolic shape values folded on the way.

The node loop is qtvm's own; the conversion of each data op is TVM's (its ONNX
converters, reached through ``ONNXGraphImporter._convert_operator``), except for
the ops in ``qtvm.frontend.converters.CONVERTERS``. Before a node is converted, the
folder (``qtvm.frontend.shapes``) tries to evaluate it on known values: if it can,
the node is folded away (no Relax binding at all) and its outputs are known values,
which later nodes read as shapes, axes, starts, limits, or, where a data op needs
them as a tensor, as a constant or a tensor computed from the symbols at run time.
Anything that goes wrong becomes a ``QtvmError`` naming the node and the shapes
of its inputs.
"""
from __future__ import annotations

import gc
import json
import os
import re

import numpy as np
import onnx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, get_type, onnx_input

from qtvm import dims as dimexpr
from qtvm.errors import QtvmError
from qtvm.frontend.onnx import MappedWeights, tensor_array
from qtvm.frontend.shapes import Folder, Known, Symbols, constant_array, dim_text, is_symbolic, known_from_numpy

CONTROL_FLOW = ("If", "Loop", "Scan")
OPAQUE = 8  # relax OpPatternKind.kOpaque: FuseOps leaves the function alone
LIMITS_ATTR = "qtvm.dim_limits"  # {symbol: largest accepted value}, JSON
OUTPUT_DIMS_ATTR = "qtvm.output_dims"  # [[dim, ...] per output], dims as ints or expression text, JSON
MINIMUMS_ATTR = "qtvm.dim_minimums"  # {symbol: smallest accepted value}, JSON
#: ops whose spatial output dims must be >= 1: their inputs' smallest sizes follow
WINDOWED = frozenset({"Conv", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool"})
ZERO_ATTR = "qtvm.may_be_zero"  # symbols that may be bound to 0 (a KV cache's past length), JSON
PINS_ATTR = "qtvm.pinned_dims"  # {input dim name: the constant a converter proved it is}, JSON
VALUES_ATTR = "qtvm.values"  # on a shape-values PrimFunc: the expressions it computes, over its scalar params


class PinDims(Exception):
    """Raised by a converter that finds an input dim named as a symbol to be one constant
    (onnxruntime-genai names a KV cache's head size ``kv_cache_dim``; GroupQueryAttention
    fixes it): the import restarts with those names read as the constants, so the inputs,
    the metadata and every binding a caller picks carry the constant."""

    def __init__(self, pins: dict[str, int]):
        super().__init__(pins)
        self.pins = pins


class ImportFailure(Exception):
    """Raised by converters for a node they recognise as unconvertible; carries the sentence."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def expr_symbols(exprs) -> list:
    """The dimension symbols ``exprs`` use, sorted by name (the scalar parameters of
    :func:`shape_values_func`)."""
    found = {v.name: v for e in exprs if tvm.ir.is_prim_expr(e) for v in tirx.analysis.undefined_vars(e)}
    return [v for _, v in sorted(found.items())]


def shape_values_func(exprs: list, symbols: list) -> tirx.PrimFunc:
    """PrimFunc(*symbols, values[len(exprs)]) writing ``exprs``: opaque to fusion, marked
    scheduled, carrying ``exprs`` (VALUES_ATTR) so later passes can rebuild it; no global_symbol."""
    from tvm import te

    def element(i):
        out = exprs[-1]
        for j in range(len(exprs) - 2, -1, -1):
            out = tirx.Select(i == j, exprs[j], out)
        return out

    values = te.compute((len(exprs),), element, name="values")
    return te.create_prim_func([*symbols, values]).without_attr("global_symbol").with_attrs(
        {"op_pattern": OPAQUE, "tir.is_scheduled": True, VALUES_ATTR: exprs})


class Importer(ONNXGraphImporter):
    """TVM's importer state (``bb``, ``_nodes``, ``_convert_operator``) with qtvm's node loop."""

    def __init__(self, model: onnx.ModelProto, positive: bool = False, pins: dict[str, int] | None = None):
        super().__init__({}, "float32", keep_params_in_input=False, sanitize=False)
        self.model = model
        self.pins = dict(pins or {})
        self.sym = Symbols(minimum=1 if positive else 0, pins=self.pins)
        self.folder = Folder(self.sym)
        self.known: dict[str, Known] = {}
        # tensor -> exclusive upper bound of its values, all >= 0 (positions Range(past, past + seq):
        # past + seq), carried through ops that only move or widen values (``_carry_index_top``)
        self.index_tops: dict[str, tirx.PrimExpr] = {}
        self._value_funcs: dict[tuple, tvm.ir.GlobalVar] = {}
        self.mapped = MappedWeights()
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)

    def _parse_array(self, tensor_proto: onnx.TensorProto):
        """An initializer as TVM's tensor: a view of its external file where it has one and can
        (``MappedWeights``), else read from it (``load_onnx(lazy=True)``: the proto holds no copy)."""
        mapped = self.mapped.array(tensor_proto)
        if mapped is not None:
            return tvm.runtime.from_dlpack(mapped)
        return tvm.runtime.tensor(tensor_array(tensor_proto).reshape(tuple(tensor_proto.dims)))

    # -- lookups used by converters ------------------------------------------------
    def known_input(self, node: onnx.NodeProto, i: int) -> Known | None:
        name = node.input[i] if i < len(node.input) else ""
        return self.known.get(name) if name else None

    def expr(self, name: str) -> relax.Expr:
        """The Relax value of tensor ``name``; a known value is materialized once."""
        if name not in self._nodes:
            if name not in self.known:
                raise ImportFailure(f"tensor '{name}' is used before any node produces it")
            self._nodes[name] = self._materialize(self.known[name])
        return self._nodes[name]

    def dims(self, name: str) -> list | None:
        """Dims of tensor ``name`` (ints and TIR expressions), None if its shape is unknown."""
        if name in self.known:
            return list(self.known[name].values.shape)
        value = self._nodes.get(name)
        ty = getattr(value, "ty", None) if value is not None else None
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            return None
        return [self.sym.norm(d) for d in ty.shape.values]

    def describe(self, name: str) -> str:
        return f"'{name}' {self.sym.dims_text(self.dims(name))}" if name else "(absent)"

    def tvm_convert(self, node: onnx.NodeProto, attrs: dict, replace: dict | None = None):
        """TVM's converter for ``node``, with known inputs materialized (``replace``: input
        index -> the expression to hand it instead)."""
        inputs = onnx_input()
        for i, name in enumerate(node.input):
            inputs.append((replace or {}).get(i, self.expr(name) if name else None))
        attrs = dict(attrs)
        attrs["tvm_custom"] = {"name": node.name, "num_outputs": len(node.output)}
        return self._convert_operator(node.op_type, inputs, attrs, self.opset)

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.bb.emit(expr) if not isinstance(expr, (relax.Var, tvm.ir.expr.Constant)) else expr

    def ensure_shape(self, expr: relax.Expr, dims: list) -> relax.Expr:
        """``expr`` with exactly ``dims`` in its type: re-attached by a match_cast where
        TVM's inference lost or could not simplify them."""
        ty = expr.ty
        current = None if ty.shape is None else [self.sym.norm(d) for d in ty.shape.values]
        if current is not None and len(current) == len(dims) and all(
                self.sym.equal(a, b) for a, b in zip(current, dims)):
            return expr
        target = relax.TensorType([self.sym.expr(d) for d in dims], ty.dtype)
        return self.bb.match_cast(self.emit(expr), target)

    # -- the import ------------------------------------------------------------------
    def run(self) -> tvm.IRModule:
        graph = self.model.graph
        self._parse_graph_initializers(graph)
        for t in graph.initializer:
            k = known_from_numpy(tensor_array(t)) if _small(t) else None
            if k is not None:
                self.known[t.name] = k
        params = self._graph_inputs(graph)
        try:
            with self.bb.function("main", params=params):
                with self.bb.dataflow():
                    for node in graph.node:
                        self._node(node)
                    outs = [self.expr(o.name) for o in graph.output]
                    out = self.bb.emit_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
                self.bb.emit_func_output(out)
        except BaseException:
            self.bb._end_block()  # the block the failed scope left open (else TVM warns on stderr)
            raise
        mod = self.bb.get()
        facts = {"num_input": len(params), LIMITS_ATTR: json.dumps(self.sym.limits),
                 MINIMUMS_ATTR: json.dumps(self.sym.minimums),
                 OUTPUT_DIMS_ATTR: json.dumps(self._output_dims(graph)),
                 ZERO_ATTR: json.dumps(self._may_be_zero(graph)), PINS_ATTR: json.dumps(self.pins)}
        mod["main"] = mod["main"].with_attrs(facts)
        return relax.transform.DeadCodeElimination(["main"])(mod)

    def _output_dims(self, graph) -> list:
        """Each output's dims as derived here (``seq``, ``past + seq``), not as the exporter
        named them (the legacy exporter invents names such as ``MatMullogits_dim_0``)."""
        dims = []
        for o in graph.output:
            d = self.dims(o.name)
            dims.append(None if d is None else [v if isinstance(v, int) else dim_text(v) for v in d])
        return dims

    def _may_be_zero(self, graph) -> list[str]:
        """Symbols that may be 0 at run time: those that size some output (a KV cache's
        past length sizes the present outputs) and whose being 0 (the others 1) leaves no
        output empty (logits stay [batch, seq, vocab]). batch and seq do not qualify, nor
        does a length that only indexes (a mask over an unnamed total length)."""
        outs = [self.dims(o.name) for o in graph.output]
        if any(d is None for d in outs) or self.sym.minimum > 0:
            return []
        from tvm.sym import Analyzer

        names = []
        for name, var in self.sym.vars.items():
            if name in self.sym.minimums:
                continue
            at = Analyzer()
            for v in self.sym.vars.values():
                at.bind(v, tirx.IntImm("int64", 0 if v.same_as(var) else 1))
            sizes = [d if isinstance(d, int) else at.simplify(d) for dims in outs for d in dims]
            in_outputs = any(var.same_as(v) for dims in outs for d in dims if not isinstance(d, int)
                             for v in tirx.analysis.undefined_vars(d))
            if in_outputs and all(int(z) > 0 if isinstance(z, (int, tirx.IntImm)) else False for z in sizes):
                names.append(name)
        return names

    def _graph_inputs(self, graph) -> list[relax.Var]:
        inits = {t.name for t in graph.initializer}
        params, composite = [], []
        for vi in graph.input:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type
            if not tt.HasField("shape"):
                raise QtvmError(f"input '{vi.name}' has no shape (not even a rank)",
                                "re-export with the input's shape, its variable dims named (dim_param)")
            dims = []
            for axis, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value"):
                    dims.append(tirx.IntImm("int64", d.dim_value))
                elif d.dim_param in self.pins:
                    dims.append(tirx.IntImm("int64", self.pins[d.dim_param]))
                elif d.dim_param:
                    dim = self.sym.dim(d.dim_param)
                    dims.append(self.sym.expr(dim))
                    if not isinstance(dim, tirx.Var):
                        composite.append((vi.name, d.dim_param))
                else:  # unnamed: a symbol of its own
                    dims.append(self.sym.var(f"{_identifier(vi.name)}_dim{axis}"))
            var = relax.Var(_identifier(vi.name), relax.TensorType(dims, get_type(tt.elem_type)))
            self._nodes[vi.name] = var
            self._inputs[vi.name] = var
            params.append(var)
        bare = {str(d) for p in params for d in p.ty.shape.values if isinstance(d, tirx.Var)}
        for name, text in composite:
            missing = [s for s in dimexpr.symbols(text) if s not in bare]
            if missing:
                raise QtvmError(f"dimension '{text}' of input '{name}' uses {', '.join(repr(m) for m in missing)}, "
                                "which no input has as a dimension of its own",
                                "name that dimension on the input it belongs to (e.g. the past length of the "
                                "past_key_values inputs)")
        return params

    def _node(self, node: onnx.NodeProto) -> None:
        from qtvm.frontend.converters import CONVERTERS

        op = node.op_type
        attrs = self._parse_attr(node.attribute)
        try:
            if op == "Constant":
                array = constant_array(attrs)
                k = known_from_numpy(array)
                if k is not None:
                    self.known[node.output[0]] = k
                else:
                    self._nodes[node.output[0]] = relax.const(array, str(array.dtype))
                return
            ins = [self.known.get(n) if n else None for n in node.input]
            folded = self.folder.fold(op, attrs, ins, lambda i: self.dims(node.input[i]))
            if folded is not None and len(folded) >= len(node.output):
                for name, k in zip(node.output, folded):
                    if name:
                        self.known[name] = k
                return
            if op in ("Shape", "Size"):
                raise ImportFailure(f"the shape of {self.describe(node.input[0])} is unknown at this point")
            convert = CONVERTERS.get(op if node.domain in ("", "ai.onnx") else f"{node.domain}.{op}")
            result = convert(self, node, attrs) if convert is not None else None
            if result is None:
                result = self.tvm_convert(node, attrs)
            self._bind(node, result)
            self._carry_index_top(node, attrs)
            if op in WINDOWED:  # a window that covers nothing is not valid ONNX (onnxruntime refuses it)
                for d in (self.dims(node.output[0]) or [])[2:]:
                    self.sym.at_least(d, 1)
        except (QtvmError, PinDims):
            raise
        except ImportFailure as e:
            raise QtvmError(f"cannot import {_where(node)}: {e.problem}", e.fix or _FIX) from None
        except Exception as e:  # TVM's converters and type inference raise anything
            if os.environ.get("QTVM_DEBUG"):
                raise
            text = str(e).strip().splitlines()
            detail = next((line for line in reversed(text) if line.strip()), type(e).__name__)
            raise QtvmError(f"cannot import {_where(node)} (inputs: "
                            f"{', '.join(self.describe(n) for n in node.input)}): {detail.strip()[:300]}",
                            _FIX) from None

    def _carry_index_top(self, node: onnx.NodeProto, attrs: dict) -> None:
        """An index tensor's bound through ops that keep its values (Unsqueeze, Reshape, Expand,
        an integer Cast) or add one known non-negative offset (XGLM's 2; GPT-2's legacy export
        adds past to Range(0, seq))."""
        top = self.index_tops.get(node.input[0]) if node.input else None
        if node.op_type == "Add" and len(node.input) == 2:
            for i in (0, 1):
                k = self.known_input(node, 1 - i)
                if node.input[i] not in self.index_tops or k is None or k.dtype.kind not in "iu":
                    continue
                values = [self.sym.expr(self.sym.norm(v)) for v in k.ints()]
                if len(set(map(str, values))) == 1 and self.sym.prove(tirx.GE(values[0], self.sym.expr(0))):
                    # one offset, constant or a dim (GPT-2's legacy export: Range(0, seq) + past)
                    self.index_tops[node.output[0]] = self.sym.norm(self.sym.expr(self.index_tops[node.input[i]])
                                                                    + values[0])
            return
        if top is None:
            return
        moves = ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Flatten")
        widening_cast = node.op_type == "Cast" and attrs.get("to") in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        if node.op_type in moves or widening_cast:
            self.index_tops[node.output[0]] = top

    def _bind(self, node: onnx.NodeProto, result) -> None:
        if isinstance(result, relax.Expr) and not isinstance(result, relax.Tuple):
            result = self.bb.normalize(result)
            if isinstance(result.ty, relax.TupleType):
                result = relax.Tuple([self.bb.emit(relax.TupleGetItem(result, i))
                                      for i in range(len(result.ty.fields))])
        values = list(result.fields) if isinstance(result, relax.Tuple) else [result]
        if len(values) < len([o for o in node.output if o]):
            raise ImportFailure(f"the converter gave {len(values)} outputs for {len(node.output)}")
        for name, value in zip(node.output, values):
            if name:  # a shape only known at run time (data-dependent) is left to the VM
                self._nodes[name] = value

    def values_tensor(self, values: list, dtype: str = "int64") -> relax.Expr:
        """A 1-D tensor of ``values`` (ints and dimension expressions): a constant, or
        computed from the symbols at run time."""
        if not any(is_symbolic(v) for v in values):
            return relax.const(np.array(values, dtype=dtype), dtype)
        t = self.bb.emit(self._values_call([self.sym.expr(v) for v in values]))
        return t if dtype == "int64" else self.bb.emit(relax.op.astype(t, dtype))

    def _values_call(self, exprs: list) -> relax.Expr:
        """A [len(exprs)] int64 tensor holding ``exprs`` (over the dimension symbols), from a
        PrimFunc of its own that takes the symbols as scalars. Not ``shape_to_tensor``: that
        one, fused with its neighbours by the CPU fusion passes, makes FuseTIR define a
        symbol twice (TVM 0.27); this function is opaque to fusion."""
        symbols = expr_symbols(exprs)
        key = tuple(str(e) for e in exprs)
        if key not in self._value_funcs:
            name = f"qtvm_shape_values{len(self._value_funcs)}"
            func = shape_values_func(exprs, symbols).with_attr("global_symbol", name)
            self._value_funcs[key] = self.bb.add_func(func, name)
        return relax.call_tir(self._value_funcs[key], relax.Tuple([relax.prim_value(v) for v in symbols]),
                              relax.TensorType([len(exprs)], "int64"))

    def _materialize(self, k: Known) -> relax.Expr:
        if not k.symbolic:
            return relax.const(k.numpy(), str(k.dtype))
        flat = [self.sym.expr(v) for v in k.values.flat]
        flat = [tirx.Cast("int64", v) if str(v.ty) == "bool" else v for v in flat]
        t = self.bb.emit(self._values_call(flat))
        if k.values.shape != (len(flat),):
            t = self.bb.emit(relax.op.reshape(t, relax.ShapeExpr(list(k.values.shape))))
        if k.dtype != np.int64:
            t = self.bb.emit(relax.op.astype(t, str(k.dtype)))
        return t


_FIX = "re-export the model (or simplify it), or report it with the model attached"


def _where(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node '{node.name or node.output[0]}'"


def _small(t: onnx.TensorProto) -> bool:
    n = 1
    for d in t.dims:
        n *= d
    return n <= 64


def _identifier(name: str) -> str:
    """A Relax-printable variable name (cosmetic: inputs are bound by position)."""
    out = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return out if out and (out[0].isalpha() or out[0] == "_") else f"input_{out}"


def import_model(model: onnx.ModelProto) -> tvm.IRModule:
    """Symbols are first only known to be >= 0, so that a KV past length may be 0. Where
    that leaves dims unrelated (``x[:, :1]`` of a [batch, seq] tensor has length
    ``min(1, seq)``, which only seq >= 1 makes 1), the import is redone with every symbol
    >= 1, and the artefact then refuses zero-sized inputs altogether (no ``may_be_zero``)."""
    if any(n.op_type in CONTROL_FLOW for n in model.graph.node):
        return _tvm_import(model)
    pins: dict[str, int] = {}
    for _ in range(8):  # each restart pins at least one more name
        try:
            try:
                return Importer(model, pins=pins).run()
            except QtvmError:
                return Importer(model, positive=True, pins=pins).run()
        except PinDims as p:
            if not set(p.pins) - set(pins):
                raise QtvmError(f"the import pinned {p.pins} twice", _FIX) from None
            pins.update(p.pins)
    raise QtvmError(f"the import kept pinning input dims ({pins})", _FIX)


def _tvm_import(model: onnx.ModelProto) -> tvm.IRModule:
    """Graphs with control flow (If): TVM's own importer, which converts branches (without
    symbolic shape folding); its failures still come back as one sentence."""
    from qtvm.quiet import tvm_output_captured

    failure = None
    with tvm_output_captured():
        try:
            mod = relax.frontend.onnx.from_onnx(model, keep_params_in_input=False)
        except Exception as e:
            if os.environ.get("QTVM_DEBUG"):
                raise
            failure = next((line for line in reversed(str(e).strip().splitlines()) if line.strip()), type(e).__name__)
        if failure is not None:  # the failed import's BlockBuilder logs "destroyed with remaining blocks" as it goes
            gc.collect()
    if failure is not None:
        raise QtvmError(f"TVM's ONNX importer failed on this graph with control flow: {failure.strip()[:300]}",
                        _control_flow_fix(model))
    no_dims = json.dumps([None] * len(model.graph.output))
    mod["main"] = mod["main"].with_attrs({LIMITS_ATTR: "{}", MINIMUMS_ATTR: "{}", OUTPUT_DIMS_ATTR: no_dims,
                                          ZERO_ATTR: "[]"})
    return mod


def _control_flow_fix(model: onnx.ModelProto) -> str:
    """The fix for a graph TVM's importer could not convert: where an If tests a model input
    (optimum's merged decoder: the whole decoder in each branch of ``use_cache_branch``),
    binding that input inlines the branch it takes, and qtvm's own import converts that."""
    inputs = {i.name for i in model.graph.input}
    conds = sorted({n.input[0] for n in model.graph.node if n.op_type == "If" and n.input[0] in inputs})
    if not conds:
        return _FIX
    return (f"bind the If's input to compile the branch it takes: {' '.join(f'--bind {c}=1' for c in conds)} "
            "(a merged decoder's with-past decoder, which also runs the first step from an empty past)")


def import_facts(mod: tvm.IRModule) -> dict:
    """What the import derived, for the artefact's metadata: ``dim_limits`` {symbol: max},
    ``dim_minimums`` {symbol: min} (inputs a convolution needs),
    ``output_dims`` (per output, derived from the input symbols), ``may_be_zero`` [symbols],
    ``pinned_dims`` {input dim name: constant} (``PinDims``)."""
    attrs = mod["main"].attrs
    return {"dim_limits": json.loads(str(attrs[LIMITS_ATTR])),
            "dim_minimums": json.loads(str(attrs.get(MINIMUMS_ATTR, "{}"))),
            "output_dims": json.loads(str(attrs[OUTPUT_DIMS_ATTR])),
            "may_be_zero": json.loads(str(attrs[ZERO_ATTR])),
            "pinned_dims": json.loads(str(attrs.get(PINS_ATTR, "{}")))}
