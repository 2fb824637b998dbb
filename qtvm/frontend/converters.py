"""qtvm's own converters for the ONNX ops whose shapes TVM's importer loses.

Each takes ``(importer, node, attrs)`` and returns a Relax expression (or a Tuple), or
None to leave the node to TVM's converter. They read shape-like inputs as known
values (``qtvm.frontend.shapes``) and state every output shape as an expression of
the input symbols:

- Reshape / Expand / ConstantOfShape to a computed shape: ``reshape`` / ``broadcast_to``
  / ``full`` to that shape expression (``-1`` and ``0`` resolved here, by cancelling
  common factors: ``batch*seq*64 / (batch*seq*4) = 16``);
- Range: ``arange`` whose length is ``ceil((limit - start) / delta)`` over the symbols
  (``Range(past, past + seq)`` has length ``seq``, not a fresh symbol);
- Slice: bounds clamped here (``INT64_MAX`` -> the dim), so the slice is in bounds
  and its length an expression;
- broadcasting ops: the output dims are derived here; dims that can be neither
  proven equal nor 1 are a user error naming the tensors and the dims, and where
  TVM's inference could not simplify its result the derived shape is re-attached;
- Pow by a constant 2 or 3: multiplications (exact, no ``pow`` of a negative base).

``CONVERTERS`` is keyed by op type for ONNX's own domain and by ``domain.op`` for others
(``com.microsoft.GroupQueryAttention``: ``qtvm.frontend.ort_contrib``).
"""
from __future__ import annotations

import math
import re

import numpy as np
import onnx
import tvm_ffi
from tvm import relax, tirx

from qtvm.frontend.importer import ImportFailure
from qtvm.frontend.shapes import BIG, is_symbolic

CONVERTERS: dict = {}


def converter(*ops):
    def register(fn):
        for op in ops:
            CONVERTERS[op] = fn
        return fn
    return register


def _shape_expr(imp, dims) -> relax.ShapeExpr:
    return relax.ShapeExpr([imp.sym.expr(d) for d in dims])


def _product(imp, dims):
    total = 1
    for d in dims:
        total = imp.sym.norm(imp.sym.expr(total) * imp.sym.expr(d)) if is_symbolic(d) or is_symbolic(total) \
            else total * d
    return total


def _factors(d) -> list:
    """A dim as the factors of its product (``batch*4`` -> batch, 4), so that a factor of
    one dim can cancel a dim of its own (BLOOM views ``[batch*4, seq, seq]`` as ``[batch, 4, seq, -1]``)."""
    if isinstance(d, tirx.Mul):
        return _factors(d.a) + _factors(d.b)
    return [int(d.value)] if isinstance(d, tirx.IntImm) else [d]


def _divide(imp, num: list, den: list):
    """prod(num) / prod(den) by cancelling equal factors (``batch*4*(past+seq)*16 /
    ((past+seq)*16) = batch*4``, which the arithmetic simplifier alone does not see
    through a sum); None if it does not divide."""
    num = [f for d in num for f in _factors(d)]
    den = [f for d in den for f in _factors(d)]
    den_symbolic = [d for d in den if is_symbolic(d)]
    den = [d for d in den if not is_symbolic(d)]
    for d in den_symbolic:
        match = next((i for i, n in enumerate(num) if is_symbolic(n) and imp.sym.equal(n, d)), None)
        if match is None:
            total, rest = _product(imp, num), _product(imp, [d, *den])
            q = imp.sym.norm(tirx.floordiv(imp.sym.expr(total), imp.sym.expr(rest)))
            return q if imp.sym.equal(imp.sym.expr(q) * imp.sym.expr(rest), total) else None
        num.pop(match)
    num_const = _product(imp, [n for n in num if not is_symbolic(n)])
    den_const = _product(imp, den)
    if den_const == 0:
        return None
    if num_const % den_const:  # a constant inside a symbolic factor (``seq*4*16 / 64 = seq``)
        common = math.gcd(num_const, den_const)
        num_const, den_const = num_const // common, den_const // common
        total = _product(imp, [num_const] + [n for n in num if is_symbolic(n)])
        q = imp.sym.norm(tirx.floordiv(imp.sym.expr(total), imp.sym.expr(den_const)))
        return q if imp.sym.equal(imp.sym.expr(q) * imp.sym.expr(den_const), total) else None
    return _product(imp, [num_const // den_const] + [n for n in num if is_symbolic(n)])


def _same_size(imp, a: list, b: list) -> bool:
    """Whether dims ``a`` and ``b`` hold as many elements, dims equal in both set aside first:
    TVM's analyzer proves X // 8 * 8 == X for a length padded to a multiple of 8 (Mamba-2's
    chunks), but not with another symbol multiplied in (batch * (X // 8) * 8 == batch * X)."""
    rest = list(b)
    kept = []
    for d in a:
        match = next((i for i, e in enumerate(rest) if imp.sym.equal(d, e)), None)
        if match is None:
            kept.append(d)
        else:
            rest.pop(match)
    return imp.sym.equal(_product(imp, kept), _product(imp, rest))


def _data_dims(imp, node, i: int = 0) -> list:
    dims = imp.dims(node.input[i])
    if dims is None:
        raise ImportFailure(f"the shape of its input {imp.describe(node.input[i])} is unknown")
    return dims


@converter("Reshape")
def reshape(imp, node, attrs):
    target = imp.known_input(node, 1)
    if target is None:
        return None
    dims = _data_dims(imp, node)
    out = [imp.sym.norm(v) for v in target.ints()]
    if not attrs.get("allowzero", 0):
        out = [dims[i] if isinstance(v, int) and v == 0 else v for i, v in enumerate(out)]
    if any(isinstance(v, int) and v == -1 for v in out):
        rest = [v for v in out if not (isinstance(v, int) and v == -1)]
        inferred = _divide(imp, dims, rest)
        if inferred is None or not _same_size(imp, [inferred, *rest], dims):
            raise ImportFailure(f"cannot reshape {imp.describe(node.input[0])} to "
                                f"{imp.sym.dims_text(out)}: the -1 dimension does not divide evenly")
        out = [inferred if isinstance(v, int) and v == -1 else v for v in out]
    elif not _same_size(imp, out, dims):
        raise ImportFailure(f"cannot reshape {imp.describe(node.input[0])} to {imp.sym.dims_text(out)}: "
                            "the sizes cannot be proven equal")
    return relax.op.reshape(imp.expr(node.input[0]), _shape_expr(imp, out))


@converter("Expand")
def expand(imp, node, attrs):
    target = imp.known_input(node, 1)
    if target is None:
        return None
    dims = _data_dims(imp, node)
    wanted = [imp.sym.norm(v) for v in target.ints()]
    out = imp.sym.broadcast(dims, wanted)
    if None in out:
        raise _unrelated(imp, node, [(node.input[0], dims), (node.input[1], wanted)], out)
    data = imp.expr(node.input[0])
    if len(out) == len(dims) and all(imp.sym.equal(a, b) for a, b in zip(out, dims)):
        return data
    return relax.op.broadcast_to(data, _shape_expr(imp, out))


@converter("Tile")
def tile(imp, node, attrs):
    """Repeats known as values that name a dim (DeBERTa tiles its key positions, a Range, by
    [seq, 1]): a broadcast over an inserted axis before each dim, merged back by a reshape, so
    the output dims are the products (TVM's converter takes constant repeats only and names
    new dims for the rest, which later ops cannot relate). Constant repeats go to TVM's."""
    reps = imp.known_input(node, 1)
    dims = imp.dims(node.input[0])
    if reps is None or dims is None or not any(is_symbolic(r) for r in reps.ints()):
        return None
    reps = [imp.sym.norm(r) for r in reps.ints()]
    if len(reps) != len(dims):
        raise ImportFailure(f"Tile's {len(reps)} repeats do not match its input's {len(dims)} dims")
    spread = [v for d in dims for v in (1, d)]
    wide = [v for r, d in zip(reps, dims) for v in (r, d)]
    x = imp.emit(relax.op.reshape(imp.expr(node.input[0]), _shape_expr(imp, spread)))
    x = imp.emit(relax.op.broadcast_to(x, _shape_expr(imp, wide)))
    return relax.op.reshape(x, _shape_expr(imp, [_product(imp, [r, d]) for r, d in zip(reps, dims)]))


@converter("Resize")
def resize(imp, node, attrs):
    """Sizes known as values, their batch and channel entries the input's own (symbolic) dims
    (MobileViT: Concat(Shape(x)[:2], [h, w])): TVM's converter reads only the spatial entries,
    and only from a constant, so they are handed to it as one."""
    sizes = imp.known_input(node, 3) if len(node.input) > 3 and node.input[3] else None
    dims = imp.dims(node.input[0])
    if sizes is None or dims is None or not sizes.symbolic:
        return None  # no sizes, or constant ones: TVM's converter as it is
    values = [imp.sym.norm(v) for v in sizes.ints()]
    if (len(values) != len(dims) or any(is_symbolic(v) for v in values[2:])
            or not all(imp.sym.equal(a, b) for a, b in zip(values[:2], dims[:2]))):
        return None
    spatial = relax.const(np.array([1, 1, *values[2:]], np.int64))  # entries 0 and 1: not read
    return imp.tvm_convert(node, attrs, {3: spatial})


@converter("ConstantOfShape")
def constant_of_shape(imp, node, attrs):
    shape = imp.known_input(node, 0)
    if shape is None:
        return None
    fill = onnx.numpy_helper.to_array(attrs["value"]).reshape(-1) if "value" in attrs else np.zeros(1, np.float32)
    dtype = str(fill.dtype)
    value, target = relax.const(fill[0], dtype), _shape_expr(imp, shape.ints())
    floating = fill.dtype.kind == "f" or dtype == "bfloat16"  # ml_dtypes' bfloat16 is of kind "V"
    if floating and not np.isfinite(float(fill[0])):  # TVM's full fails on them (reads its dtype as a str)
        return relax.op.broadcast_to(value, target)
    return relax.op.full(target, value, dtype)


@converter("IsNaN", "IsInf")
def is_nan_or_inf(imp, node, attrs):
    """TVM has no isnan/isinf of bfloat16 (it fails: "not supported for isnan op"; a bfloat16
    dynamo export of Mixtral tests its attention mask): the test runs on the input widened to
    float32, which keeps every NaN and infinity."""
    x = imp.expr(node.input[0])
    if not (isinstance(x.ty, relax.TensorType) and str(x.ty.dtype) == "bfloat16"):
        return None
    return imp.tvm_convert(node, attrs, {0: imp.emit(relax.op.astype(x, "float32"))})


HALF = ("float16", "bfloat16")


@converter("Elu", "Selu", "ThresholdedRelu", "HardSigmoid", "Clip")  # and PRelu, Mod: ``broadcasting``'s own
def half_in_float32(imp, node, attrs):
    """A half precision one: TVM's converter on float32 copies of its inputs of that type, the
    result cast back (rounded once, as onnxruntime's float32 arithmetic). TVM builds Elu, Selu and
    ThresholdedRelu from float32 constants ("Binary operators must have the same datatype": a
    float16 one failed to import), HardSigmoid's alpha * x + beta in float16 (10 ulps off), and
    has no bfloat16 Clip (its isnan), PRelu ("requires float") or fmod (a build failure)."""
    x = imp.expr(node.input[0])
    dtype = str(x.ty.dtype) if isinstance(x.ty, relax.TensorType) else None
    if dtype not in HALF:
        return None
    wide = {i: imp.emit(relax.op.astype(imp.expr(name), "float32")) for i, name in enumerate(node.input)
            if name and str(imp.expr(name).ty.dtype) == dtype}
    return relax.op.astype(imp.tvm_convert(node, attrs, wide), dtype)


@converter("LayerNormalization")
def layer_normalization(imp, node, attrs):
    """ONNX types X, Scale and B alike; torch.onnx's legacy exporter writes float32 data with
    float16 weights for a float16 model's LayerNorm (GPT-2, BERT, OPT, GPT-NeoX): refused by
    name, as onnxruntime refuses it, with the export that works."""
    types = [str(imp.expr(name).ty.dtype) for name in node.input if name
             and isinstance(imp.expr(name).ty, relax.TensorType)]
    if len(set(types)) > 1:
        raise ImportFailure(
            f"its {types[0]} data and {'/'.join(sorted(set(types[1:])))} scale and bias differ in type (ONNX "
            "requires one; onnxruntime refuses the model too)",
            "torch.onnx's legacy exporter writes this for float16 models: export with dynamo=True, or in float32 "
            "(qtvm quantizes float32 weights the same)")
    return None


@converter("TopK")
def top_k(imp, node, attrs):
    """``sorted=0`` leaves the order of the k values to the implementation (ONNX); TVM's
    converter refuses it, so it gets sorted=1, one valid order (GLM-4-MoE's and DeepSeek-V3's
    group-limited routers pick groups so; what they do with the picks does not depend on it)."""
    k = imp.known_input(node, 1)
    if k is not None and k.symbolic:
        return _sort_whole_axis(imp, node, attrs, k.ints()[0])
    if attrs.get("sorted", 1) == 0:
        return imp.tvm_convert(node, {**attrs, "sorted": 1})
    return None


def _sort_whole_axis(imp, node, attrs, k):
    """TopK whose k is an expression of the dims: torch.onnx writes ``torch.sort`` and
    ``argsort`` so, with k the axis's length (JetMoE's router sorts its batch * seq * top_k
    expert picks). TVM's converter takes only a constant k; a k that is the whole axis is a
    sort. Ties keep the lower index first, as ONNX asks of TopK (TVM's argsort is stable)."""
    dims = _data_dims(imp, node)
    axis = attrs.get("axis", -1)
    axis = axis + len(dims) if axis < 0 else axis
    if not imp.sym.equal(k, dims[axis]):
        raise ImportFailure(
            f"its k ({imp.sym.text(k)}) is computed from the input dims and is not the whole axis "
            f"({imp.sym.text(dims[axis])}); qtvm takes a constant k or a sort of the whole axis",
            "make k a constant in the model")
    x = imp.expr(node.input[0])
    descending = bool(attrs.get("largest", 1))
    values = imp.emit(relax.op.sort(x, axis=axis, descending=descending))
    indices = imp.emit(relax.op.argsort(x, axis=axis, descending=descending, dtype="int64"))
    return relax.Tuple([values, indices])


def _nonnegative(imp, values: list) -> bool:
    """Whether every one of ``values`` (ints, dim expressions) is proven >= 0."""
    return all(imp.sym.prove(tirx.GE(imp.sym.expr(v), imp.sym.expr(0))) for v in values)


@converter("Split")
def split(imp, node, attrs):
    """Split sizes given as an input: TVM's converter takes only constants. Sizes that are
    expressions of the dims (x split into its first seq - 1 positions and the last) are
    slices; sizes computed from input values (a mixture of experts grouped by expert, its
    tokens counted per expert: JetMoE's dynamo export) give outputs whose lengths depend on
    data, which no compiled shape can hold, so they are refused by name."""
    if len(node.input) < 2 or not node.input[1]:
        return None
    sizes = imp.known_input(node, 1)
    if sizes is None:
        raise ImportFailure(
            "its split sizes are computed from input values at run time, so its outputs' lengths depend "
            "on the data (qtvm compiles shapes that are constants or expressions of the inputs' dims)",
            "export a form whose split sizes follow the input shapes (a mixture of experts computed for "
            "every token, or with its experts as batched matmuls, rather than grouped by expert)")
    if not sizes.symbolic:
        return None
    dims = _data_dims(imp, node)
    axis = attrs.get("axis", 0)
    axis = axis + len(dims) if axis < 0 else axis
    parts = [imp.sym.norm(v) for v in sizes.ints()]
    total = imp.sym.norm(sum(imp.sym.expr(v) for v in parts))
    if not imp.sym.equal(total, dims[axis]) or not _nonnegative(imp, parts):
        raise ImportFailure(
            f"its split sizes {imp.sym.dims_text(parts)} are not shown to be non-negative and to add up to "
            f"the axis ({imp.sym.text(dims[axis])})")
    x = imp.expr(node.input[0])
    outs, start = [], 0
    for size in parts:
        end = imp.sym.norm(imp.sym.expr(start) + imp.sym.expr(size))
        part = imp.emit(relax.op.strided_slice(x, [axis], [imp.sym.expr(start)], [imp.sym.expr(end)],
                                               assume_inbound=True))
        outs.append(imp.ensure_shape(part, dims[:axis] + [size] + dims[axis + 1:]))
        start = end
    return relax.Tuple(outs)


@converter("Pad")
def pad(imp, node, attrs):
    """Pads that are expressions of the dims (Mamba-2's chunked scan, in Bamba and Falcon-H1,
    pads the sequence to a multiple of its chunk: (c - seq % c) % c): TVM's converter takes
    only constant pads. Constant mode, amounts shown non-negative: the input between blocks
    of the fill value, one concat an axis."""
    if imp.opset < 11:
        return None  # pads are an attribute
    pads = imp.known_input(node, 1)
    if pads is None or not pads.symbolic:
        return None
    mode = attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    amounts = [imp.sym.norm(v) for v in pads.ints()]
    if mode != "constant":
        raise ImportFailure(f"its pads {imp.sym.dims_text(amounts)} are symbolic in mode '{mode}' (qtvm pads "
                            "by symbolic amounts in constant mode only)", "export constant pads or mode 'constant'")
    dims = _data_dims(imp, node)
    axes = list(range(len(dims)))
    if len(node.input) > 3 and node.input[3]:
        known = imp.known_input(node, 3)
        if known is None or known.symbolic:
            raise ImportFailure("its axes input must be a constant")
        axes = [int(a) + len(dims) if int(a) < 0 else int(a) for a in known.ints()]
    if len(amounts) != 2 * len(axes):
        raise ImportFailure(f"it has {len(amounts)} pads for {len(axes)} axes (ONNX: two an axis)")
    if not _nonnegative(imp, amounts):
        raise ImportFailure(f"its pads {imp.sym.dims_text(amounts)} are not shown to be non-negative (a "
                            "negative pad crops)", "export constant pads")
    x = imp.expr(node.input[0])
    dtype = str(x.ty.dtype)
    fill = imp.expr(node.input[2]) if len(node.input) > 2 and node.input[2] else relax.const(0, dtype)
    for axis, before, after in zip(axes, amounts[:len(axes)], amounts[len(axes):]):
        padded = [not imp.sym.equal(size, 0) for size in (before, after)]
        if not any(padded):
            continue

        def block(size, axis=axis):
            shape = [imp.sym.expr(d) for d in dims[:axis] + [size] + dims[axis + 1:]]
            return imp.emit(relax.op.full(relax.ShapeExpr(shape), fill, dtype))
        parts = ([block(before)] if padded[0] else []) + [x] + ([block(after)] if padded[1] else [])
        dims = dims[:axis] + [imp.sym.norm(imp.sym.expr(before) + imp.sym.expr(dims[axis]) + imp.sym.expr(after))] + \
            dims[axis + 1:]
        x = imp.ensure_shape(imp.emit(relax.op.concat(parts, axis=axis)), dims)
    return x


@converter("DFT")
def dft(imp, node, attrs):
    """ONNX's DFT (opsets 17 and 20; FNet's token mixing, torch.fft in dynamo exports), which
    TVM's importer lacks: the signal axis multiplied by cos and sin tables built from the
    axis's length, so a symbolic length (seq) works. The angle of frequency k at sample n is
    taken from k * n mod N, exact in integers, before the one float multiply; the tables and
    sums are float64, the result rounded once to the input's type (as numpy's FFT in float64
    gives ONNX's expected outputs)."""
    dims = _data_dims(imp, node)
    rank = len(dims)
    if imp.opset >= 20:
        known = imp.known_input(node, 2)
        if len(node.input) > 2 and node.input[2] and (known is None or known.symbolic):
            raise ImportFailure("its axis input must be a constant")
        axis = int(known.ints()[0]) if known is not None else -2
    else:
        axis = attrs.get("axis", 1)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1 or dims[-1] not in (1, 2):
        raise ImportFailure(f"its input {imp.describe(node.input[0])} and axis {axis} are not a signal axis "
                            "before a last dim of 1 (real) or 2 (complex)")
    n = dims[axis]
    if len(node.input) > 1 and node.input[1]:
        length = imp.known_input(node, 1)
        if length is None or not imp.sym.equal(length.ints()[0], n):
            raise ImportFailure("its dft_length differs from the signal axis's length (a padded or cut "
                                "signal)", "pad or slice the signal in the model instead")
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    if onesided and inverse:
        raise ImportFailure("its onesided inverse transform (an irfft) is not supported",
                            "export the full spectrum's inverse (torch.fft.ifft) and take its real part")
    if onesided and dims[-1] == 2:
        raise ImportFailure("it asks a onesided transform of a complex signal (ONNX defines it for real input)")
    x = imp.expr(node.input[0])
    dtype = str(x.ty.dtype)
    work = "float64"  # sums that cancel to 0 (an inverse of a real signal's spectrum) stay below float32's step
    if work != dtype:
        x = imp.emit(relax.op.astype(x, work))
    e = imp.sym.expr
    freqs = imp.sym.norm(tirx.floordiv(e(n), e(2)) + 1) if onesided else n
    # [.., N, c] with the signal axis last before the components
    order = [i for i in range(rank - 1) if i != axis] + [axis, rank - 1]
    x = imp.emit(relax.op.permute_dims(x, order))
    real = imp.emit(relax.op.squeeze(relax.op.strided_slice(x, [rank - 1], [0], [1]), [rank - 1]))
    imag = None
    if dims[-1] == 2:
        imag = imp.emit(relax.op.squeeze(relax.op.strided_slice(x, [rank - 1], [1], [2]), [rank - 1]))
    k_idx = imp.emit(relax.op.arange(e(0), e(freqs), e(1), "int64"))
    n_idx = imp.emit(relax.op.arange(e(0), e(n), e(1), "int64"))
    kn = imp.emit(relax.op.multiply(relax.op.expand_dims(n_idx, [1]), relax.op.expand_dims(k_idx, [0])))
    size, size_float = imp.values_tensor([n]), imp.values_tensor([n], work)
    kn = imp.emit(relax.op.floor_mod(kn, size))  # [N, K]: x [.., N] @ table
    step = imp.emit(relax.op.divide(relax.const(2 * np.pi, work), size_float))
    angle = imp.emit(relax.op.multiply(relax.op.astype(kn, work), step))
    cos, sin = imp.emit(relax.op.cos(angle)), imp.emit(relax.op.sin(angle))
    # exact zeros at quarter and half turns (an FFT's are: float32 sin(pi) is -8.7e-8)
    zero = relax.const(0.0, work)
    quarter = relax.op.multiply(kn, relax.const(4, "int64"))
    at_quarter = relax.op.logical_or(relax.op.equal(quarter, size),
                                     relax.op.equal(quarter, relax.op.multiply(size, relax.const(3, "int64"))))
    cos = imp.emit(relax.op.where(at_quarter, zero, cos))
    sin = imp.emit(relax.op.where(relax.op.equal(relax.op.multiply(kn, relax.const(2, "int64")), size), zero, sin))
    # forward: X = sum x e^{-i angle}; inverse: e^{+i angle} / N
    sign = 1.0 if inverse else -1.0
    out_re = imp.emit(relax.op.matmul(real, cos))
    out_im = imp.emit(relax.op.multiply(relax.op.matmul(real, sin), relax.const(sign, work)))
    if imag is not None:
        out_re = imp.emit(relax.op.subtract(out_re, relax.op.multiply(relax.op.matmul(imag, sin),
                                                                      relax.const(sign, work))))
        out_im = imp.emit(relax.op.add(out_im, relax.op.matmul(imag, cos)))
    if inverse:
        scale = imp.emit(relax.op.divide(relax.const(1.0, work), size_float))
        out_re, out_im = imp.emit(relax.op.multiply(out_re, scale)), imp.emit(relax.op.multiply(out_im, scale))
    out = imp.emit(relax.op.stack([out_re, out_im], axis=rank - 1))
    back = [order.index(i) for i in range(rank)]
    out = imp.emit(relax.op.permute_dims(out, back))
    if work != dtype:
        out = imp.emit(relax.op.astype(out, dtype))
    return imp.ensure_shape(out, dims[:axis] + [freqs] + dims[axis + 1:-1] + [2])


@converter("Range")
def range_(imp, node, attrs):
    ks = [imp.known_input(node, i) for i in range(3)]
    if any(k is None for k in ks):
        return _range_from_values(imp, node)
    if not ks[0].symbolic and not ks[1].symbolic and not ks[2].symbolic:
        return None
    if ks[0].dtype.kind not in "iu":
        raise ImportFailure("a float Range with symbolic bounds is not supported")
    start, limit, delta = (k.ints()[0] for k in ks)
    if is_symbolic(delta) or delta == 0:
        raise ImportFailure("Range needs a constant, non-zero delta")
    e = imp.sym.expr
    span = e(limit) - e(start) if delta > 0 else e(start) - e(limit)
    step = abs(delta)
    count = imp.sym.norm(tirx.max(tirx.floordiv(span + (step - 1), e(step)), e(0)))
    dtype = str(ks[0].dtype)
    if is_symbolic(start):
        value = _arange_from(imp, start, count, delta, dtype)
    else:
        value = imp.emit(relax.op.arange(e(start), e(limit), e(delta), dtype))
    if delta > 0 and imp.sym.prove(tirx.GE(e(start), e(0))):  # positions past .. past + seq - 1
        imp.index_tops[node.output[0]] = imp.sym.norm(e(start) + delta * (e(count) - 1) + 1)
    return imp.ensure_shape(value, [count])


def _arange_from(imp, start, count, delta: int, dtype: str) -> relax.Expr:
    """start + delta * arange(count) for a symbolic ``start``, the start a tensor
    (``values_tensor``): an arange from a symbolic start (positions past .. past + seq), fused
    with its consumers, made FuseTIR define the symbol twice (TVM 0.27; XGLM with a KV cache)."""
    e = imp.sym.expr
    value = imp.emit(relax.op.arange(e(0), e(count), e(1), dtype))
    if delta != 1:
        value = imp.emit(relax.op.multiply(value, relax.const(delta, dtype)))
    return imp.emit(relax.op.add(value, imp.values_tensor([start], dtype)))


def _range_from_values(imp, node):
    """Range whose bounds are tensor values known only at run time (a window size fed as
    an input): its length would be a fresh dimension defined by the data. TVM's converter
    leaves that dimension unbound, and binding it by a match_cast does not survive TVM's
    operator fusion (which moves the fused consumers above the binding), so it is refused."""
    raise ImportFailure(
        "its bounds are computed from input values at run time, so the output's length depends on "
        "data (qtvm compiles shapes that are constants or expressions of the inputs' dims)",
        "make the Range bounds constants (fold the value, e.g. a window size, into the model) or derive "
        "them from an input's shape")


def _clamp(imp, v, d):
    """ONNX Slice bound ``v`` (positive step) on a dim of size ``d``: negative counts from
    the end, then clamped to [0, d]; exporters' INT64_MAX means the end."""
    if isinstance(v, int):
        if v >= BIG:
            return d
        if v <= -BIG:
            return 0
        if v < 0:
            v = imp.sym.norm(imp.sym.expr(d) + v) if is_symbolic(d) else d + v
    if not is_symbolic(v) and not is_symbolic(d):
        return max(min(v, d), 0)
    e = imp.sym.expr
    if is_symbolic(v):  # a symbolic bound counts from the end where it is negative (x[-seq:])
        if imp.sym.prove(tirx.LT(e(v), e(0))):
            v = imp.sym.norm(e(d) + e(v))
        elif not imp.sym.prove(tirx.GE(e(v), e(0))):
            raise ImportFailure(f"a Slice bound {imp.sym.text(v)} may be negative (counted from the end) or not: "
                                "its sign decides the slice and is not known at compile time")
    return imp.sym.norm(tirx.max(tirx.min(e(v), e(d)), e(0)))


def _symbol_sum(x) -> list | None:
    """The symbols of ``x`` when it is one symbol or a sum of symbols (``seq``, ``past + seq``:
    the lengths an exporter slices position tables to), else None."""
    if isinstance(x, tirx.Var):
        return [x.name]
    if isinstance(x, tirx.Add):
        a, b = _symbol_sum(x.a), _symbol_sum(x.b)
        return None if a is None or b is None else a + b
    return None


def _tail_length(imp, start, d: int):
    """The count ``t`` (a symbol or a sum of symbols, ``past + seq``: ``_symbol_sum``) where a
    slice from ``start`` to the end of a ``d``-row axis is its last ``t`` rows: ``start`` = d - t
    (>= 0 given t <= d) or -t (< 0 given t >= 1), else None. torch.export writes d - t as
    max(0, d - t), the same given t <= d, but read so only in the import with every dim >= 1:
    with dims >= 0, max(0, 1 - seq) on a 1-row table is length min(seq, 1), which seq >= 1
    makes 1 with no limit."""
    if not is_symbolic(start):
        return None
    e = imp.sym.expr
    start = e(start)
    zero = [isinstance(x, tirx.IntImm) and x.value == 0 for x in (start.b, start.a)] \
        if isinstance(start, tirx.Max) else []
    if imp.sym.minimum >= 1 and any(zero):  # max(0, d - t) -> d - t
        start = start.a if zero[0] else start.b
    from_end = imp.sym.norm(e(d) - start)
    if _symbol_sum(from_end) is not None:
        return from_end
    negated = imp.sym.norm(-start)
    if _symbol_sum(negated) is not None and imp.sym.prove(tirx.GE(negated, e(1))):
        return negated
    return None


def _table_window(imp, start, end, d, step):
    """(first row, count) of ``x[start:end]`` on a fixed-size table axis of ``d`` rows (position
    ids, a causal-mask table) whose end is a sum of symbols, ``seq`` or ``past + seq``, and whose
    start is 0 or a sum of some of those symbols (``past``): rows start .. end - 1, assuming
    end <= d (``Symbols.limit``: the metadata carries it, the runtime enforces it). Else None:
    other slices keep ONNX's clamping."""
    if step != 1 or not isinstance(d, int) or not is_symbolic(end):
        return None
    centred = _centred_window(imp, start, end, d)
    if centred is not None:
        return centred
    ends = _symbol_sum(imp.sym.norm(end))
    starts = [] if isinstance(start, int) and _clamp(imp, start, d) == 0 else _symbol_sum(imp.sym.norm(start))
    if ends is None or starts is None or any(ends.count(v) < starts.count(v) for v in starts):
        return None
    first = 0 if not starts else imp.sym.norm(start)
    imp.sym.limit(end, d)
    return first, imp.sym.norm(imp.sym.expr(end) - imp.sym.expr(first))


def _centred_window(imp, start, end, d: int):
    """(first row, count) of ``x[c - n : c' + n]`` on a ``d``-row table: the ``2n + c' - c``
    rows around its centre, ``n`` an expression of the dims (wav2vec2-Conformer's relative
    positions, ``n`` frames of the audio). ``start + end`` is a constant C, so ``start >= 0``
    is ``end <= C``: the import assumes ``end <= min(C, d)`` (recorded, refused beyond at run
    time), where the model itself works (a negative start would count from the table's end
    and give the wrong number of rows). Else None, also where the runtime could not check
    that limit (``Symbols.enforceable``)."""
    if not is_symbolic(start) or not is_symbolic(end):
        return None
    e = imp.sym.expr
    total = imp.sym.norm(e(start) + e(end))
    count = imp.sym.norm(e(end) - e(start))
    if is_symbolic(total) or not imp.sym.prove(tirx.GE(e(count), e(0))):
        return None
    if not imp.sym.enforceable(end):
        return None
    imp.sym.limit(end, min(total, d))
    return imp.sym.norm(start), count


@converter("Slice")
def slice_(imp, node, attrs):
    if imp.opset < 10:
        return None
    starts, ends = imp.known_input(node, 1), imp.known_input(node, 2)
    axes, steps = imp.known_input(node, 3), imp.known_input(node, 4)
    if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and axes is None) \
            or (len(node.input) > 4 and node.input[4] and steps is None):
        return None
    dims = _data_dims(imp, node)
    starts, ends = starts.ints(), ends.ints()
    axes = [int(a) for a in axes.ints()] if axes is not None else list(range(len(starts)))
    steps = steps.ints() if steps is not None else [1] * len(starts)
    if any(is_symbolic(s) or s <= 0 for s in steps):
        return None  # reversed slices: TVM's converter
    axes = [a + len(dims) if a < 0 else a for a in axes]
    e = imp.sym.expr
    out = list(dims)
    begins, stops, table_axes = [], [], []
    for a, s, t, k in zip(axes, starts, ends, steps):
        window = _table_window(imp, s, t, dims[a], k)
        if window is not None:  # x[:seq], x[past:past + seq] of a table
            table_axes.append((a, *window))
            out[a] = window[1]
            continue
        f = _clamp(imp, t, dims[a])
        try:
            b, unknown_sign = _clamp(imp, s, dims[a]), None
        except ImportFailure as err:  # a start of unknown sign: only the table's-tail rule below takes it
            b, unknown_sign = None, err
        length = None if b is None else imp.sym.norm(tirx.max(tirx.floordiv(e(f) - e(b) + (k - 1), e(k)), e(0)))
        tail = (_tail_length(imp, s, dims[a]) if (b is None or is_symbolic(length)) and k == 1
                and isinstance(dims[a], int) and f == dims[a] else None)
        if tail is None and unknown_sign is not None:
            raise unknown_sign
        if tail is not None:
            # x[-seq:] / x[D - seq:] of a fixed-size table of D rows (MPT's ALiBi bias, with a
            # cache x[D - past - seq:]): the same assumption, seq <= D, makes the length seq; the
            # rows read are D - seq .. D - 1
            imp.sym.limit(tail, dims[a])
            table_axes.append((a, imp.sym.norm(e(dims[a]) - tail), tail))
            out[a] = tail
            continue
        out[a] = length
        begins.append((a, e(b), e(f), e(k)))
    value = imp.expr(node.input[0])
    if begins:
        value = imp.emit(relax.op.strided_slice(value, [a for a, *_ in begins], [b for _, b, _, _ in begins],
                                                [f for _, _, f, _ in begins], [k for *_, k in begins],
                                                assume_inbound=True))
    for a, first, count in table_axes:  # rows first .. first + count - 1
        index = (_arange_from(imp, first, count, 1, "int64") if is_symbolic(first)
                 else imp.emit(relax.op.arange(e(first), e(imp.sym.norm(e(first) + e(count))), e(1), "int64")))
        value = imp.emit(relax.op.take(value, index, axis=a, mode="clip"))
    return imp.ensure_shape(value, out)


@converter("Cast")
def cast(imp, node, attrs):
    """A Cast to the dtype its input already has is the input itself (GPT-Neo casts its keys
    to float32 before the attention and outputs the cast as the present: with a binding of
    its own, the present was no longer the cache's append and the in-place KV step declined);
    others are TVM's converter's."""
    x, to = imp.expr(node.input[0]), attrs.get("to")
    known = to in onnx.TensorProto.DataType.values() and to != onnx.TensorProto.UNDEFINED
    if isinstance(x.ty, relax.TensorType) and known and str(onnx.helper.tensor_dtype_to_np_dtype(to)) == x.ty.dtype:
        return x
    return None


@converter("Gather")
def gather(imp, node, attrs):
    """``take``; negative indices need no run-time normalization here: safe_gather's
    ``mode="wrap"`` maps -1 to the last row, as ONNX does (and known indices are
    normalized now)."""
    dims = _data_dims(imp, node)
    axis = attrs.get("axis", 0)
    axis = axis + len(dims) if axis < 0 else axis
    k = imp.known_input(node, 1)
    if k is not None and not k.symbolic and isinstance(dims[axis], int):
        idx = k.numpy().astype(np.int64)
        idx = np.where(idx < 0, idx + dims[axis], idx)
        indices = relax.const(idx, "int64")
    else:
        indices = imp.expr(node.input[1])
        _limit_by_table(imp, node.input[1], dims[axis])
    return relax.op.take(imp.expr(node.input[0]), indices, axis=axis)


def _limit_by_table(imp, indices: str, rows) -> None:
    """Positions Range(past, past + seq) (+ an offset) gathered from a fixed-size table
    (GPT-2's learned positions, XGLM's sinusoids): the model only works while they index it,
    past + seq + offset <= rows, so that limit is recorded as a Slice of a table records
    one (only for a sum of symbols plus a constant; the runtime enforces it)."""
    top = imp.index_tops.get(indices)
    if top is None or not isinstance(rows, int):
        return
    length, offset = top, 0
    if isinstance(top, tirx.Add) and isinstance(top.b, tirx.IntImm):
        length, offset = top.a, int(top.b.value)
    if _symbol_sum(length) is not None and rows - offset >= 1:
        imp.sym.limit(length, rows - offset)


def _safe_indices(imp, indices: relax.Expr, extents: relax.Expr) -> relax.Expr:
    """ONNX indices (negative counts from the end) made non-negative and clipped into
    [0, extent - 1]: TVM's gather kernels read memory at any index they are given."""
    dtype = indices.ty.dtype
    if extents.ty.dtype != dtype:
        extents = imp.emit(relax.op.astype(extents, dtype))
    zero = relax.const(0, dtype)
    wrapped = imp.emit(relax.op.where(relax.op.less(indices, zero), relax.op.add(indices, extents), indices))
    top = imp.emit(relax.op.subtract(extents, relax.const(1, dtype)))
    return imp.emit(relax.op.minimum(relax.op.maximum(wrapped, zero), top))


@converter("GatherElements")
def gather_elements(imp, node, attrs):
    dims = _data_dims(imp, node)
    axis = attrs.get("axis", 0)
    axis = axis + len(dims) if axis < 0 else axis
    indices = imp.expr(node.input[1])
    extent = imp.values_tensor([dims[axis]])
    extent = imp.emit(relax.op.reshape(extent, relax.ShapeExpr([])))
    return relax.op.gather_elements(imp.expr(node.input[0]), _safe_indices(imp, indices, extent), axis)


@converter("GatherND")
def gather_nd(imp, node, attrs):
    dims = _data_dims(imp, node)
    batch_dims = attrs.get("batch_dims", 0)
    indices = imp.expr(node.input[1])
    idims = imp.dims(node.input[1])
    if idims is None or not isinstance(idims[-1], int):
        return None
    extents = imp.values_tensor(dims[batch_dims:batch_dims + idims[-1]])
    return relax.op.gather_nd(imp.expr(node.input[0]), _safe_indices(imp, indices, extents), batch_dims)


@converter("Pow")
def pow_(imp, node, attrs):
    k = imp.known_input(node, 1)
    if k is None or k.symbolic or k.values.size != 1:
        return None
    exponent = float(k.numpy().reshape(-1)[0])
    x = imp.expr(node.input[0])
    if exponent == 1.0:
        return x
    if exponent == 2.0:
        return relax.op.multiply(x, x)
    if exponent == 3.0:
        x2 = imp.emit(relax.op.multiply(x, x))
        return relax.op.multiply(x2, x)
    if exponent == 0.5 and str(x.ty.dtype).startswith("float"):  # a dtype object here, not a str
        return relax.op.sqrt(x)
    return None


BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
                "GreaterOrEqual", "And", "Or", "Xor", "Where", "Max", "Min", "Sum", "Mean", "BitShift",
                "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu")


def broadcasting(imp, node, attrs, own=None):
    """Derive the output dims first (a clear error if they cannot be related), convert,
    and re-attach the derived dims where TVM's inference could not simplify them."""
    named = [(n, imp.dims(n)) for n in node.input if n]
    if any(d is None for _, d in named):
        return None
    out = named[0][1]
    for _, d in named[1:]:
        out = imp.sym.broadcast(out, d)
        if None in out:
            raise _unrelated(imp, node, named, out)
    result = own(imp, node, attrs) if own is not None else None
    if result is None:
        result = imp.tvm_convert(node, attrs, _restated(imp, node, out))
    result = imp.bb.normalize(result)
    if isinstance(result.ty, relax.TensorType) and result.ty.ndim == len(out):
        return imp.ensure_shape(result, out)
    return result


def _restated(imp, node, out) -> dict:
    """Inputs whose dims qtvm proved equal to the output's but that are written otherwise,
    match-cast to the output's: TVM's inference cannot relate (seq - 30) // 20 + 1 to
    min(T.Div(seq // 10 - 3, 2) + 1, (seq - 10) // 20) (SEW-D's frames, equal for every seq)
    and left the op without a shape, so without a kernel."""
    replace = {}
    for i, name in enumerate(node.input):
        dims = imp.dims(name) if name else None
        if not dims:
            continue
        wanted = [d if isinstance(d, int) and d == 1 else t for d, t in zip(dims, out[len(out) - len(dims):])]
        if any(not tvm_ffi.structural_equal(imp.sym.expr(d), imp.sym.expr(t)) for d, t in zip(dims, wanted)):
            value = imp.expr(name)
            typed = relax.TensorType([imp.sym.expr(d) for d in wanted], value.ty.dtype)
            replace[i] = imp.bb.match_cast(imp.emit(value), typed)
    return replace


_OWN = {"Pow": pow_, "PRelu": half_in_float32, "Mod": half_in_float32}
for _op in BROADCASTING:
    if _op in _OWN:
        CONVERTERS[_op] = lambda imp, node, attrs, own=_OWN[_op]: broadcasting(imp, node, attrs, own)
    else:
        CONVERTERS[_op] = broadcasting


#: dim names exporters make up: torch.export's s53, the legacy exporter's unk__0 and Add_dim_1, ours input_dim1
_EXPORTER_NAMED = re.compile(r"^(s\d+|unk__\d+|.*_dim_?\d+)$")


def _unrelated(imp, node, named, out) -> ImportFailure:
    width = len(out)
    bad = [i for i, d in enumerate(out) if d is None]
    parts, free = [], set()  # free: the symbols of the unrelated dims
    for name, dims in named:
        padded = [1] * (width - len(dims)) + list(dims)
        parts.append(f"'{name}' {imp.sym.dims_text(dims)} (axis {', '.join(str(i - width) for i in bad)}: "
                     f"{', '.join(imp.sym.text(padded[i]) for i in bad)})")
        free |= {v.name for i in bad if is_symbolic(padded[i])
                 for v in tirx.analysis.undefined_vars(imp.sym.expr(padded[i]))}
    invented = sorted(n for n in free if _EXPORTER_NAMED.match(n))
    example = f"--dim {invented[0] if invented else 'NAME'}=EXPR, e.g. 'past + seq'"
    return ImportFailure(
        f"the symbolic dims of {' and '.join(parts)} cannot be related (neither provably equal nor 1)",
        "if they are equal, give them one name (or an expression such as 'past + seq') in the export's "
        f"dynamic axes, or restate an input dim the exporter named on its own ({example}); otherwise the "
        "model is not valid ONNX for these shapes")


from qtvm.frontend import attention as _attention  # noqa: E402,F401  (registers Attention, RotaryEmbedding)
from qtvm.frontend import ort_contrib as _ort_contrib  # noqa: E402,F401  (registers onnxruntime-genai's contrib ops)
