"""Relax pass: matmuls by constant weights -> packed low-bit kernels.

Every ``relax.matmul(x, W)`` whose W is a 2-D float32 constant (directly, or
through ``permute_dims`` as ONNX Gemm with transB=1 imports) becomes
``reshape -> call_tir(qmatmul) -> reshape`` with W packed by the chosen format
and re-laid out by the target rule. Matmuls by computed tensors stay in float.
What the target's kernels look like (column block, row tile, GEMV/prefill threshold,
which kernels exist) comes from ``schedules.facts(target)``: no target module is imported.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym import Analyzer

from qtvm import ops
from qtvm.deploy.weights import tensor_nbytes
from qtvm.formats import QuantFormat, QuantizedTensor
from qtvm.formats.base import bits_per_weight
from schedules import facts as target_facts
from schedules import schedule_kernel

MATMUL = tvm.ir.Op.get("relax.matmul")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
CONCAT = tvm.ir.Op.get("relax.concat")
ASTYPE = tvm.ir.Op.get("relax.astype")
TAKE = tvm.ir.Op.get("relax.take")
GATHER_ND = tvm.ir.Op.get("relax.gather_nd")
HALF = ("float16", "bfloat16")  # weights quantized from these too, read as float32
OPAQUE = 8  # relax OpPatternKind.kOpaque: FuseOps must leave the kernel alone


@dataclass
class QuantizedMatmul:
    """What one packed matmul holds: its sizes, not its arrays (those live on as the module's
    constants; a second copy here would double a large model's compile memory)."""

    k: int
    n: int
    fmt: QuantFormat
    packed_bytes: int
    float_bytes: int
    experts: int = 1  # a mixture of experts' routed matmul: one [K, N] weight per expert

    @classmethod
    def of(cls, qt: QuantizedTensor, float_bytes: int) -> "QuantizedMatmul":
        return cls(qt.k, qt.n, qt.fmt, qt.nbytes, float_bytes)

    @property
    def bits_per_weight(self) -> float:
        return bits_per_weight(self.packed_bytes, self.k, self.n * self.experts)


@dataclass
class QuantizeReport:
    layers: list[QuantizedMatmul] = field(default_factory=list)
    float_matmuls: int = 0  # weight is computed at run time
    fp32_activation_fallbacks: list[str] = field(default_factory=list)  # int8 asked, not possible
    routed: int = 0  # mixture-of-experts matmuls packed (``take(W[E], ids) @ x``)

    @property
    def packed_bytes(self) -> int:
        return sum(layer.packed_bytes for layer in self.layers)

    @property
    def float_bytes(self) -> int:
        return sum(layer.float_bytes for layer in self.layers)


def _weight_source(expr, lookup, widened: bool = False, dtypes: tuple = ("float32",)):
    """The parts of ``expr`` where it is a [K, N] float32 weight made of constants, else None;
    nothing is read. A part is (constant tensor, transposed): a constant, a constant through 2-D
    permute_dims (as ONNX Gemm transB imports), and the parts of a concat of such along N (as
    ``relay_passes.combine_matmuls`` joins weights, read only when packed). ``widened``: also a
    float16/bfloat16 weight through ``astype`` to float32, as ``fp32_accumulate`` gives a half
    precision model's matmuls their weights (read as float32)."""
    if isinstance(expr, relax.Var):
        bound = lookup(expr)
        if bound is None:
            return None
        expr = bound
    if isinstance(expr, tvm.ir.expr.Constant):
        t = expr.value
        ok = isinstance(t, tvm.runtime.Tensor) and len(t.shape) == 2 and str(t.dtype) in dtypes
        return [(t, False)] if ok else None
    if not isinstance(expr, relax.Call):
        return None
    if expr.op == PERMUTE:
        inner = _weight_source(expr.args[0], lookup, widened, dtypes)
        axes = expr.attrs.axes
        if inner is not None and len(inner) == 1 and (axes is None or [int(a) for a in axes] == [1, 0]):
            return [(inner[0][0], not inner[0][1])]
    if expr.op == CONCAT and int(expr.attrs.axis) in (1, -1):
        fields = lookup(expr.args[0]) if isinstance(expr.args[0], relax.Var) else expr.args[0]
        parts = [_weight_source(e, lookup, widened, dtypes) for e in fields.fields] \
            if isinstance(fields, relax.Tuple) else [None]
        if all(p is not None for p in parts) and len({weight_rows(p) for p in parts}) == 1:
            return [part for p in parts for part in p]
    if widened and expr.op == ASTYPE and str(expr.attrs.dtype) == "float32" and dtypes == ("float32",):
        return _weight_source(expr.args[0], lookup, False, HALF)
    return None


def weight_rows(source) -> int:
    """K of a ``_weight_source``."""
    tensor, transposed = source[0]
    return int(tensor.shape[1 if transposed else 0])


def weight_columns(source) -> int:
    """N of a ``_weight_source``."""
    return sum(int(t.shape[0 if transposed else 1]) for t, transposed in source)


def read_weight(source, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Columns [lo, hi) of the [K, N] weight of a ``_weight_source``, a copy (only those
    columns are read)."""
    hi = weight_columns(source) if hi is None else hi
    arrays, start = [], 0
    for tensor, transposed in source:
        n = int(tensor.shape[0 if transposed else 1])
        a, b = max(lo, start) - start, min(hi, start + n) - start
        if a < b:
            view = _float_view(tensor)
            arrays.append(_as_float32(view[a:b].T if transposed else view[:, a:b]))
        start += n
    return arrays[0].copy(order="C") if len(arrays) == 1 else np.concatenate(arrays, axis=1)


def _float_view(tensor) -> np.ndarray:
    """A CPU tensor's elements without a copy; bfloat16 as its uint16 bits (numpy has no bfloat16)."""
    if str(tensor.dtype) == "bfloat16":
        return np.from_dlpack(tensor._create_view(tuple(int(d) for d in tensor.shape), "uint16"))
    return np.from_dlpack(tensor)


def _as_float32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def source_nbytes(source) -> int:
    """The bytes a ``_weight_source``'s constants hold (2 a weight for a half precision model)."""
    return sum(tensor_nbytes(t) for t, _ in source)


#: float bytes quantized at a time: a format's quantize holds several times its input (int4 3x,
#: e0m4 9x, bcq3 15x, measured on a 2048 x 32000 lm_head), and Llama-3's lm_head is 2.1 GB fp32
QUANTIZE_BLOCK_BYTES = 16 << 20


def quantize_source(fmt: QuantFormat, source) -> QuantizedTensor:
    """``fmt.quantize`` of a ``_weight_source`` (``quantize_columns``)."""
    return quantize_columns(fmt, weight_rows(source), weight_columns(source),
                            lambda lo, hi: read_weight(source, lo, hi))


def quantize_columns(fmt: QuantFormat, k: int, n: int, read) -> QuantizedTensor:
    """``fmt.quantize`` of a [K, N] weight, ``read(lo, hi)`` giving its columns [lo, hi) as a
    float32 array of their own, a block of columns at a time where the format allows it
    (``columns_independent``: the arrays of [W1 | W2] are those of W1 and W2 side by side,
    tested for every such preset)."""
    step = max(64, QUANTIZE_BLOCK_BYTES // (4 * k) // 64 * 64) if fmt.columns_independent else n
    if step >= n:
        return fmt.quantize(read(0, n))
    parts = [fmt.quantize(read(lo, min(lo + step, n))).arrays for lo in range(0, n, step)]
    return QuantizedTensor(fmt, k, n, {name: np.concatenate([p[name] for p in parts], axis=-1) for name in parts[0]})


def _constant_weight(expr, lookup) -> np.ndarray | None:
    """The [K, N] float32 weight behind ``expr``, or None if it is computed."""
    source = _weight_source(expr, lookup)
    return None if source is None else read_weight(source)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, fmt: QuantFormat | None, target: tvm.target.Target, report: QuantizeReport,
                 activations: str, prepacked=None):
        super().__init__(mod)
        self.fmt, self.target, self.report, self.activations = fmt, target, report, activations
        self.facts = target_facts(target)
        self.prepacked = prepacked
        self.kernels: dict[tuple, tvm.ir.GlobalVar] = {}

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op != MATMUL:
            return call
        x = call.args[0]
        packed = self.prepacked(call.args[1], self.lookup_binding) if self.prepacked else None
        if packed is not None:  # a weight the model brought quantized (relay_passes/quantized_onnx.py)
            qt, perm = packed
            self.report.layers.append(QuantizedMatmul.of(qt, 4 * qt.k * qt.n))
            if perm is not None:  # act-order: x @ W == x[..., perm] @ W_kernel
                x = self.builder_.emit(relax.op.take(x, relax.const(perm), axis=-1))
            return self._emit_qmatmul(x, qt)
        routed = self._routed_experts(call) if self.fmt is not None and self.facts.routed_experts else None
        if routed is not None:
            return routed
        source = _weight_source(call.args[1], self.lookup_binding, widened=True) if self.fmt is not None else None
        if source is None or x.ty.dtype != "float32" or x.ty.ndim < 1:
            self.report.float_matmuls += 1
            return call
        qt = quantize_source(self.fmt, source)
        self.report.layers.append(QuantizedMatmul.of(qt, source_nbytes(source)))
        return self._emit_qmatmul(x, qt)

    def _routed_experts(self, call):
        """A mixture of experts' routed matmul as transformers' batched experts export it:
        ``take(W[E, N, K], ids) @ x[S, K, 1]`` or ``x[S, 1, K] @ take(W[E, K, N], ids)``, W a
        float32 constant (or float16/bfloat16 gathered, then cast to float32 by fp32_accumulate),
        ids [S] (an expert per row). Each expert's [K, N] weight is packed and one
        ``qmatmul_experts`` kernel multiplies each row by its expert's weight, where the float
        graph gathered S copies of whole matrices. None (left in float) for any other form and
        for a composite format (mixed precision ranks rows per matrix)."""
        for side in (0, 1):
            gathered, x = self._bound(call.args[side]), call.args[1 - side]
            widened = isinstance(gathered, relax.Call) and gathered.op == ASTYPE \
                and str(gathered.attrs.dtype) == "float32"
            if widened:  # a half precision model's experts, gathered then read as float32 (fp32_accumulate)
                gathered = self._bound(gathered.args[0])
            ids = _expert_ids(gathered)
            if ids is None:
                continue
            weight = self._bound(gathered.args[0])
            if not (isinstance(weight, tvm.ir.expr.Constant) and isinstance(weight.value, tvm.runtime.Tensor)
                    and len(weight.value.shape) == 3
                    and str(weight.value.dtype) in (HALF if widened else ("float32",))):
                continue
            if not (x.ty.dtype == "float32" and x.ty.ndim == 3 and x.ty.shape is not None):
                continue
            experts, rows_w, cols_w = (int(d) for d in weight.value.shape)
            k, n = (cols_w, rows_w) if side == 0 else (rows_w, cols_w)
            s, a, b = x.ty.shape.values
            vector = (a, b) if side == 0 else (b, a)  # (K, 1): x is [S, K, 1] or [S, 1, K]
            if not (_is_int(vector[0], k) and _is_int(vector[1], 1)
                    and Analyzer().can_prove_equal(s, ids.ty.shape.values[0])):
                continue
            stacked = _float_view(weight.value)

            def expert(e):  # W[e] as [K, N] float32, a block of columns at a time
                return quantize_columns(self.fmt, k, n, lambda lo, hi: np.ascontiguousarray(_as_float32(
                    stacked[e, lo:hi].T if side == 0 else stacked[e, :, lo:hi])))

            tensors = [expert(0)]
            parts = self.fmt.kernel_parts(tensors[0], **self.facts.parts_options)
            if parts.sparse is not None or len(parts.dense) != 1 or parts.dense[0][0] is not None:
                return None
            tensors += [expert(e) for e in range(1, experts)]
            int8 = self.activations == "int8" and self.facts.routed_int8_rounding(self.fmt, k) is not None
            if self.activations != "fp32" and not int8:
                self.report.fp32_activation_fallbacks.append(
                    f"mixture-of-experts routed matmuls ({self.fmt.name} with K={k}: fp32 kernel only)")
            self.report.layers.append(QuantizedMatmul(k, n, self.fmt, sum(t.nbytes for t in tensors),
                                                      tensor_nbytes(weight.value), experts))
            self.report.routed += 1
            fmt, nb, options = self.fmt, self.facts.col_block, self.facts.gemv_options(self.fmt, k)
            if n % self.facts.col_pad:  # zero columns up to the target's column tile, sliced off after
                tensors = [ops.pad_columns(t, self.facts.col_pad) for t in tensors]
            width = tensors[0].n
            if int8:  # each row's int8 GEMV by its expert
                kernel = self._kernel("qmatmul_a8_experts", fmt, lambda: ops.qmatmul_a8_expert_func(
                    fmt, k, width, nb, experts), k, width, experts)
            else:
                kernel = self._kernel("qmatmul_experts", fmt, lambda: ops.qmatmul_experts_func(
                    fmt, k, width, nb, experts, **options), k, width, experts)
            x2 = self.builder_.emit(relax.op.reshape(x, relax.ShapeExpr([s, k])))
            if ids.ty.ndim == 2:  # GatherND's [S, 1]
                ids = self.builder_.emit(relax.op.reshape(ids, relax.ShapeExpr([s])))
            ids64 = ids if str(ids.ty.dtype) == "int64" else self.builder_.emit(relax.op.astype(ids, "int64"))
            weights = [relax.const(a) for a in ops.expert_arrays(tensors, nb, int8)]
            y2 = self.builder_.emit(relax.op.call_tir(kernel, relax.Tuple([x2, ids64, *weights]),
                                                      relax.TensorType([s, width], "float32")))
            if width != n:
                y2 = self.builder_.emit(relax.op.strided_slice(y2, axes=[1], begin=[0], end=[n]))
            return relax.op.reshape(y2, relax.ShapeExpr([s, n, 1] if side == 0 else [s, 1, n]))
        return None

    def _bound(self, expr):
        """The value a dataflow variable is bound to (the expression itself otherwise)."""
        if isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            return expr if value is None else value
        return expr

    def _kernel(self, kind: str, fmt: QuantFormat, make, *shape) -> tvm.ir.GlobalVar:
        """One PrimFunc per (kind, format, shape), shared by every call site."""
        key = (kind, fmt.name, *shape)
        if key not in self.kernels:
            name = f"{kind}_{fmt.name.replace('-', '_')}_{'x'.join(map(str, shape))}"
            func = make()
            if ops.KERNEL_ATTR in func.attrs:
                func = schedule_kernel(func, self.target).with_attrs({"tir.is_scheduled": True})
            func = func.with_attrs({"op_pattern": OPAQUE, "global_symbol": name})
            self.kernels[key] = self.builder_.add_func(func, name)
        return self.kernels[key]

    def _int8_rounding(self, fmt: QuantFormat, k: int):
        """``facts.int8_rounding`` under ``--act int8`` (else None), noting the fallbacks."""
        if self.activations != "int8":
            return None
        rounding = self.facts.int8_rounding(fmt, k)
        if rounding is None or rounding.max_rows is not None:
            reason = (f"{fmt.name} with K={k}" if not ops.supports_int8_activations(fmt, k)
                      else f"target {self.target.kind.name} has no int8 dot")
            self.report.fp32_activation_fallbacks.append(
                reason + (", prefill only (its decode GEMV is int8)" if rounding is not None else ""))
        return rounding

    def _f16_activations(self, fmt: QuantFormat, k: int) -> bool:
        """fp16 activations for this matmul: its decode GEMV, and its prefill GEMM where the
        target has the fp16-operand one (``facts.f16_gemm``); else both stay fp32 (reported)."""
        if self.activations not in self.facts.f16_accumulate:
            return False
        if not self.facts.f16_activations(fmt, k):
            self.report.fp32_activation_fallbacks.append(f"{fmt.name} with K={k} (no fp16 kernel)")
            return False
        return True

    def _emit_qmatmul(self, x, qt: QuantizedTensor):
        shape = list(x.ty.shape.values)
        lead = shape[:-1]
        rows = tvm.tirx.const(1, "int64")
        for d in lead:
            rows = rows * d
        x2 = self.builder_.emit(relax.op.reshape(x, relax.ShapeExpr([rows, qt.k])))
        parts = qt.fmt.kernel_parts(qt, **self.facts.parts_options)
        y2 = None
        for row_index, part in parts.dense:
            xp = x2 if row_index is None else self.builder_.emit(
                relax.op.take(x2, relax.const(row_index), axis=1, mode="clip"))
            yp = self._emit_dense(xp, rows, part)
            y2 = yp if y2 is None else self.builder_.emit(relax.op.add(y2, yp))
        if parts.sparse is not None:
            y2 = self.builder_.emit(relax.op.add(y2, self._emit_sparse(x2, rows, qt, parts.sparse)))
        return relax.op.reshape(y2, relax.ShapeExpr([*lead, qt.n]))

    def _emit_dense(self, x2, rows, qt: QuantizedTensor):
        n = qt.n
        if qt.n % self.facts.col_pad:  # zero columns up to the target's column tile, sliced off after
            qt = ops.pad_columns(qt, self.facts.col_pad)
        y = self._emit_dense_padded(x2, qt)
        if qt.n == n:
            return y
        return self.builder_.emit(relax.op.strided_slice(y, axes=[1], begin=[0], end=[n]))

    def _emit_dense_padded(self, x2, qt: QuantizedTensor):
        nb = self.facts.col_block
        rounding = self._int8_rounding(qt.fmt, qt.k)
        if rounding is not None and rounding.max_rows is None:
            weights = [relax.const(a) for a in ops.a8_arrays(qt, nb)]
            small = self._a8_branch(qt, weights, nb, 1)
            large = self._a8_branch(qt, weights, nb, self.facts.row_tile)
        else:
            from qtvm.ops_gemm import qmatmul_gemm_f16_func, qmatmul_gemm_func

            fmt, k, n = qt.fmt, qt.k, qt.n
            weights = [relax.const(a) for a in ops.blocked_arrays(qt, nb)]
            decode = self.facts.decode_kernel.get(str(fmt.describe().get("family")), "qmatmul")
            f16 = self._f16_activations(fmt, k)
            if f16:
                accumulate = self.facts.f16_accumulate[self.activations]
                gemv = self._kernel("qmatmul_f16", fmt, lambda: ops.qmatmul_f16_func(
                    fmt, k, n, nb, **self.facts.gemv_options(fmt, k), accumulate=accumulate), k, n)
            elif decode == "lut_gemv":
                from qtvm.lut_gemv import lut_gemv_func

                gemv = self._kernel("lut_gemv", fmt, lambda: lut_gemv_func(fmt, k, n, nb), k, n)
            elif rounding is not None and self.facts.bcq_a8_gemv(fmt, k):  # x86 BCQ, VBMI + VNNI: int8 nibble tables
                from qtvm.bcq_a8_gemv import bcq_a8_gemv_func

                gemv = self._kernel("bcq_a8_gemv", fmt, lambda: bcq_a8_gemv_func(fmt, k, n, nb), k, n)
            elif rounding is not None:  # x86 BCQ's decode GEMV: int16 tables of int8-rounded x
                from qtvm.lut_gemv import lut16_a8_gemv_func

                gemv = self._kernel("lut16_a8_gemv", fmt, lambda: lut16_a8_gemv_func(fmt, k, n, nb), k, n)
            elif self.facts.lut16_gemv(fmt, k):  # x86 BCQ: table lookups beat dequantizing (schedules/x86_lut.py)
                from qtvm.lut_gemv import lut16_gemv_func

                gemv = self._kernel("lut16_gemv", fmt, lambda: lut16_gemv_func(fmt, k, n, nb), k, n)
            else:
                options = self.facts.gemv_options(fmt, k)
                gemv = self._kernel("qmatmul", fmt, lambda: ops.qmatmul_func(fmt, k, n, nb, **options), k, n)
            if f16 and self.facts.f16_gemm:  # tensor cores
                gemm = self._kernel("qmatmul_gemm_f16", fmt, lambda: qmatmul_gemm_f16_func(fmt, k, n, nb), k, n)
            else:
                gemm = self._kernel("qmatmul_gemm", fmt, lambda: qmatmul_gemm_func(fmt, k, n, nb), k, n)
            small, large = self._call_branch(gemv, weights, n), self._call_branch(gemm, weights, n)
        return self.builder_.emit(relax.Call(self._dispatch_by_rows(qt, small, large), [x2]))

    @staticmethod
    def _call_branch(kernel, weights, n: int):
        """x -> [y = call_tir(kernel, x, weights)]."""
        return lambda x, m: [relax.op.call_tir(kernel, relax.Tuple([x, *weights]), relax.TensorType([m, n], "float32"))]

    def _a8_branch(self, qt: QuantizedTensor, weights, nb: int, row_tile: int):
        """row_tile 1: x -> [y = call_tir(int8 GEMV, x)] (the GEMV rounds x itself, serially
        before its parallel loop); the target's row tile: x -> [acts = quantize_activations(x), its three parts,
        y = call_tir(prefill kernel)] (activations padded to whole tiles)."""
        fmt, k, n = qt.fmt, qt.k, qt.n
        if row_tile == 1:
            gemv = self._kernel("qmatmul_a8", fmt, lambda: ops.qmatmul_a8_func(fmt, k, n, nb), k, n)
            return self._call_branch(gemv, weights, n)
        kp, groups = fmt.padded_k(k), fmt.padded_k(k) // fmt.group_size_for(k)
        quant = self._kernel("quantize_act", fmt, lambda: ops.quantize_activations_func(fmt, k, row_tile), k, row_tile)
        kernel = self._kernel("qmatmul_a8_gemm", fmt, lambda: ops.qmatmul_a8_gemm_func(fmt, k, n, nb, row_tile), k, n)

        def bindings(x, m):
            mp = ((m - 1) // row_tile + 1) * row_tile
            acts = relax.op.call_tir(quant, relax.Tuple([x]), [
                relax.TensorType([mp, kp], "int8"), relax.TensorType([mp, kp // ops.ACT_BLOCK], "float32"),
                relax.TensorType([mp, groups], "float32")])
            parts = [lambda prev, i=i: relax.TupleGetItem(prev[0], i) for i in range(3)]
            return [acts, *parts, lambda prev: relax.op.call_tir(
                kernel, relax.Tuple([*prev[1:4], *weights]), relax.TensorType([m, n], "float32"))]
        return bindings

    def _dispatch_by_rows(self, qt: QuantizedTensor, small, large) -> tvm.ir.GlobalVar:
        """A private function choosing at run time: the GEMV for decode-sized M, else the
        prefill kernel (the target's threshold; x86 measured its crossover at M = 3).
        Relax allows ``If`` only outside dataflow blocks, hence a function of its own.
        A branch is a list of bindings: an expression, or prev-values -> expression."""
        m = tvm.tirx.Var("m", "int64")
        x = relax.Var("x", relax.TensorType([m, qt.k], "float32"))
        out_ty = relax.TensorType([m, qt.n], "float32")

        def seq(bindings) -> relax.SeqExpr:
            names, pairs = [], []
            for make in bindings(x, m):
                value = self.builder_.normalize(make if isinstance(make, relax.Expr) else make(names))
                names.append(relax.Var(f"t{len(names)}", value.ty))
                pairs.append(relax.VarBinding(names[-1], value))
            return relax.SeqExpr([relax.BindingBlock(pairs)], names[-1])

        then, other = seq(small), seq(large)
        result = relax.Var("y", out_ty)
        choose = relax.If(relax.prim_value(m <= self.facts.gemv_max_rows), then, other)
        body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(result, choose)])], result)
        func = relax.Function([x], body, out_ty, is_pure=True)  # private: no global symbol
        return self.builder_.add_func(func, f"{DISPATCH_PREFIX}{len(self.report.layers)}")

    def _emit_sparse(self, x2, rows, qt: QuantizedTensor, csr):
        """Sparse fp16 outliers: a small gather-reduce, scheduled by TVM's defaults."""
        from qtvm.formats.mixed import sparse_outlier_arrays, sparse_outlier_func

        longest = int(np.diff(csr[0]).max(initial=0))  # the kernel's reduction extent
        kernel = self._kernel("outliers", qt.fmt, lambda: sparse_outlier_func(csr, qt.k, qt.n),
                              qt.k, qt.n, len(csr[2]), longest)
        arrays = [relax.const(a) for a in sparse_outlier_arrays(csr)]
        return self.builder_.emit(relax.op.call_tir(kernel, relax.Tuple([x2, *arrays]),
                                                    relax.TensorType([rows, qt.n], "float32")))


def _expert_ids(gathered):
    """The expert ids [S] (or GatherND's [S, 1]) of ``take(W, ids, axis=0)`` or
    ``gather_nd(W, ids[S, 1])`` (as torch.onnx's dynamo exporter writes the same gather), else None."""
    if not isinstance(gathered, relax.Call) or gathered.op not in (TAKE, GATHER_ND):
        return None
    ids = gathered.args[1]
    if not isinstance(ids.ty, relax.TensorType) or str(ids.ty.dtype) not in ("int32", "int64") or ids.ty.shape is None:
        return None
    if gathered.op == TAKE and gathered.attrs.axis is not None and int(gathered.attrs.axis) == 0 and ids.ty.ndim == 1:
        return ids
    if gathered.op == GATHER_ND and int(gathered.attrs.batch_dims) == 0 and ids.ty.ndim == 2 \
            and _is_int(ids.ty.shape.values[1], 1):
        return ids
    return None


def _is_int(dim, value: int) -> bool:
    return isinstance(dim, tvm.tirx.IntImm) and int(dim.value) == value


ACTIVATIONS = ("fp32", "int8", "fp16", "fp16-acc16")
#: Name prefix of the per-layer dispatch functions ([m, k] -> [m, n], each row on its own).
DISPATCH_PREFIX = "qmatmul_dispatch_"


def quantize_weights(mod: tvm.IRModule, fmt: QuantFormat | None, target: tvm.target.Target,
                     activations: str = "fp32", prepacked=None) -> tuple[tvm.IRModule, QuantizeReport]:
    """Rewrite every Relax function of ``mod``; returns the module and what was packed.

    ``activations="int8"`` rounds each matmul's input to int8 per 32 values
    (a numerics change the user asks for, like llama.cpp's q8 activations);
    ``"fp16"`` (GPU targets) rounds the decode GEMV's input to fp16 and sums each lane's
    chunk in fp16.
    ``prepacked(weight_expr, lookup) -> (QuantizedTensor, perm | None) | None`` is asked
    first for every matmul: weights the model brought already quantized, emitted by
    the same kernels (``perm``: activation permutation of act-order tensors).
    ``fmt=None`` leaves float constant weights alone.
    """
    if activations not in ACTIVATIONS:
        from qtvm.errors import QtvmError

        raise QtvmError(f"unknown activation mode '{activations}'", f"use one of: {', '.join(ACTIVATIONS)}")
    facts = target_facts(target)
    if fmt is not None:  # prepacked weights are uniform, which every target builds
        facts.check_format(fmt, target.kind.name)
    facts.check_activations(activations, target.kind.name)
    report = QuantizeReport()
    rewriter = _Rewriter(mod, fmt, target, report, activations, prepacked)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            # what only led to a packed weight (a Gemm's permute_dims, a combined concat) goes
            rewriter.builder_.update_func(gv, relax.analysis.remove_all_unused(rewriter.visit_expr(func)))
    out = rewriter.builder_.get()
    # The mutator and its TVM object refer to each other, so only the collector frees them, and
    # with them the float module they were given and the weights ``prepacked`` holds: now, not
    # while the export holds its own copy (measured: 2.5 GB of int4 weights live twice).
    del rewriter
    gc.collect()
    return out, report
