"""ONNX's Attention (opsets 23-25) and RotaryEmbedding (opset 23), which TVM 0.27 lacks.

``torch.onnx.export(dynamo=True, opset_version=23)`` emits both for a transformers decoder
(scaled_dot_product_attention and the rotary embedding), and TVM 0.27's converter table maps
the op type ``Attention`` to onnxruntime's contrib op of that name (one packed QKV weight,
a ``num_heads`` attribute): a different op. These converters follow the ONNX reference
(``onnx.reference.ops.op_attention``) step by step in Relax, so the numbers are the spec's:
Q and K each scaled by sqrt(scale) before the product, softcap before the mask, a boolean mask
as 0 / -inf, the causal frontier aligned to the bottom right (a query at block index i sees
key j iff j <= i + offset, offset = the past length, or ``nonpad_kv_seqlen[b] - q_len``), KV
heads repeated for grouped queries (h0, h0, h1, h1, ...), and a query row with every key masked
giving zeros, not NaN. Every output shape is an expression of the input symbols, so one
compiled module serves every batch, sequence and past length.
"""
from __future__ import annotations

import numpy as np
from tvm import relax

from qtvm.frontend.converters import _data_dims, _shape_expr, _unrelated, converter
from qtvm.frontend.importer import ImportFailure
from qtvm.frontend.shapes import is_symbolic

DEFAULT_DOMAINS = ("", "ai.onnx")
FLOAT_TYPES = ("float16", "bfloat16", "float32", "float64")
#: softmax_precision (an ONNX element type) -> dtype
PRECISIONS = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}


def _input(node, i: int) -> str | None:
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _wants(node, i: int) -> bool:
    return len(node.output) > i and bool(node.output[i])


def _dtype(expr: relax.Expr) -> str:
    return str(expr.ty.dtype)


def _dims(imp, expr: relax.Expr) -> list:
    return [imp.sym.norm(d) for d in expr.ty.shape.values]


def _const(value, dtype: str) -> relax.Expr:
    return relax.const(np.array(value, dtype="float32" if dtype == "bfloat16" else dtype), dtype)


def _broadcast(imp, node, op, a: relax.Expr, b: relax.Expr, names=("a", "b")) -> relax.Expr:
    """``op(a, b)`` with its broadcast dims derived here (a clear error if they cannot be related)."""
    a, b = imp.bb.normalize(a), imp.bb.normalize(b)
    da, db = _dims(imp, a), _dims(imp, b)
    out = imp.sym.broadcast(da, db)
    if None in out:
        raise _unrelated(imp, node, [(names[0], da), (names[1], db)], out)
    return imp.ensure_shape(imp.emit(op(a, b)), out)


def _static(imp, node, dim, what: str) -> int:
    if is_symbolic(dim):
        raise ImportFailure(f"its {what} is symbolic ({imp.sym.text(dim)}); it must be a constant")
    return int(dim)


def _heads_first(imp, x: relax.Expr, heads: int, name: str, node) -> relax.Expr:
    """[batch, seq, heads * size] -> [batch, heads, seq, size] (the spec's 3-D form)."""
    b, s, hidden = _dims(imp, x)
    hidden = _static(imp, node, hidden, f"hidden size of '{name}'")
    if heads <= 0 or hidden % heads:
        raise ImportFailure(f"the hidden size {hidden} of '{name}' is not a multiple of its {heads} heads")
    x = imp.emit(relax.op.reshape(x, _shape_expr(imp, [b, s, heads, hidden // heads])))
    return imp.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))


def _positions(imp, start, count) -> relax.Expr:
    """int64 [count]: start, start + 1, ..."""
    e = imp.sym.expr
    stop = imp.sym.norm(e(start) + e(count))
    return imp.ensure_shape(imp.emit(relax.op.arange(e(start), e(stop), e(1), "int64")), [count])


def _where_bias(imp, allowed: relax.Expr, dtype: str) -> relax.Expr:
    """0 where allowed, -inf elsewhere (select, not multiply: 0 * -inf is NaN)."""
    return imp.emit(relax.op.where(allowed, _const(0.0, dtype), _const(-np.inf, dtype)))


def _frontier(imp, node, q_len, kv_len, offset, batch_offsets):
    """(i + offset) - j over [q_len, kv_len], or [batch, 1, q_len, kv_len] with per-batch offsets."""
    i = imp.emit(relax.op.reshape(_positions(imp, offset if batch_offsets is None else 0, q_len),
                                  _shape_expr(imp, [q_len, 1])))
    j = imp.emit(relax.op.reshape(_positions(imp, 0, kv_len), _shape_expr(imp, [1, kv_len])))
    diff = _broadcast(imp, node, relax.op.subtract, i, j)
    if batch_offsets is None:
        return diff
    return _broadcast(imp, node, relax.op.add, diff, batch_offsets)


def _mask_bias(imp, node, mask_name: str, kv_len, dtype: str) -> relax.Expr:
    """attn_mask as an additive bias: a bool mask as 0 / -inf; a mask shorter than the keys padded
    with -inf (False) up to ``kv_len``, as the spec does."""
    mask = imp.expr(mask_name)
    dims = _data_dims(imp, node, 3)
    if not imp.sym.equal(dims[-1], kv_len):
        pad = imp.sym.norm(imp.sym.expr(kv_len) - imp.sym.expr(dims[-1]))
        if not is_symbolic(pad) and pad < 0:
            raise ImportFailure(f"its attn_mask {imp.describe(mask_name)} has more columns than the "
                                f"{imp.sym.text(kv_len)} keys")
        fill = relax.const(False, "bool") if _dtype(mask) == "bool" else _const(-np.inf, _dtype(mask))
        tail = imp.emit(relax.op.broadcast_to(fill, _shape_expr(imp, [*dims[:-1], pad])))  # not full: TVM 0.27
        # legalizes a bool full with a dtype object its topi.full cannot read
        mask = imp.ensure_shape(imp.emit(relax.op.concat([mask, tail], axis=-1)), [*dims[:-1], kv_len])
    if _dtype(mask) == "bool":
        return _where_bias(imp, mask, dtype)
    return mask if _dtype(mask) == dtype else imp.emit(relax.op.astype(mask, dtype))


@converter("Attention")
def attention(imp, node, attrs):
    if node.domain not in DEFAULT_DOMAINS:
        return None
    if imp.opset < 23:
        return None
    q_name, k_name, v_name = node.input[:3]
    q, k, v = imp.expr(q_name), imp.expr(k_name), imp.expr(v_name)
    dtype = _dtype(q)
    if dtype not in FLOAT_TYPES:
        raise ImportFailure(f"Q is {dtype}; Attention needs float tensors")
    rank = len(_data_dims(imp, node, 0))
    if rank == 3:
        hq, hkv = int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        if not hq or not hkv:
            raise ImportFailure("3-D Q, K and V need the q_num_heads and kv_num_heads attributes")
        q, k, v = (_heads_first(imp, x, h, n, node) for x, h, n in ((q, hq, q_name), (k, hkv, k_name),
                                                                     (v, hkv, v_name)))
    elif rank != 4:
        raise ImportFailure(f"Q {imp.describe(q_name)} must be 3-D or 4-D")

    past_key, past_value = _input(node, 4), _input(node, 5)
    nonpad = _input(node, 6)
    if (past_key is None) != (past_value is None):
        raise ImportFailure("past_key and past_value must be given together")
    if nonpad is not None and past_key is not None:
        raise ImportFailure("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    past_len = 0
    if past_key is not None:
        past_len = _data_dims(imp, node, 4)[2]
        k = _append_cache(imp, node, imp.expr(past_key), k, past_key, k_name)
        v = _append_cache(imp, node, imp.expr(past_value), v, past_value, v_name)
    present_key, present_value = k, v

    batch, heads_q, q_len, head_size = _dims(imp, q)
    heads_kv, kv_len = _dims(imp, k)[1], _dims(imp, k)[2]
    heads_q = _static(imp, node, heads_q, "number of query heads")
    heads_kv = _static(imp, node, heads_kv, "number of key/value heads")
    if heads_q != heads_kv:
        if heads_q % heads_kv:
            raise ImportFailure(f"its {heads_q} query heads are not a multiple of its {heads_kv} key/value heads")
        k, v = (_repeat_heads(imp, x, heads_q // heads_kv) for x in (k, v))

    scale = attrs.get("scale")
    if scale is None:
        scale = 1.0 / np.sqrt(_static(imp, node, head_size, "head size"))
    root = _const(np.sqrt(np.float64(scale)), dtype)
    qs = imp.emit(relax.op.multiply(q, root))
    # k^T then the scale (the same numbers): the form relay_passes.kv_cache recognises, so the KV
    # step multiplies by the cache in place rather than copying it
    ks = imp.emit(relax.op.multiply(imp.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), root))
    scores = imp.emit(relax.op.matmul(qs, ks))  # [batch, heads, q_len, kv_len]
    raw = scores
    softcap = float(attrs.get("softcap", 0.0) or 0.0)
    if softcap > 0:
        cap = _const(softcap, dtype)
        scores = imp.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, cap)), cap))

    bias, may_mask_rows = _attention_bias(imp, node, attrs, dtype, q_len, kv_len, past_len, nonpad, batch)
    biased = scores if bias is None else _broadcast(imp, node, relax.op.add, scores, bias, ("QK^T", "the mask"))

    precision = PRECISIONS.get(int(attrs["softmax_precision"]), dtype) if "softmax_precision" in attrs else dtype
    logits = biased if precision == dtype else imp.emit(relax.op.astype(biased, precision))
    probs = imp.emit(relax.op.nn.softmax(logits, axis=-1))
    if may_mask_rows:  # a row whose bias is -inf everywhere: zeros (the spec), not exp(-inf + inf) = NaN
        row_max = imp.emit(relax.op.max(bias, axis=[-1], keepdims=True))
        masked = imp.emit(relax.op.equal(row_max, _const(-np.inf, dtype)))
        probs = _broadcast(imp, node, lambda a, b: relax.op.where(a, _const(0.0, precision), b), masked, probs)
    if precision != dtype:
        probs = imp.emit(relax.op.astype(probs, dtype))
    y = imp.emit(relax.op.matmul(probs, v))  # [batch, heads, q_len, v_size]
    if rank == 3:
        v_size = _dims(imp, y)[3]
        y = imp.emit(relax.op.permute_dims(y, [0, 2, 1, 3]))
        y = imp.emit(relax.op.reshape(y, _shape_expr(imp, [batch, q_len, imp.sym.norm(
            imp.sym.expr(heads_q) * imp.sym.expr(v_size))])))

    outputs = [y, present_key, present_value]
    if _wants(node, 3):
        mode = int(attrs.get("qk_matmul_output_mode", 0))
        by_mode = {0: raw, 1: scores, 2: biased, 3: probs}  # raw QK, after softcap, with the mask, softmax
        if mode not in by_mode:
            raise ImportFailure(f"qk_matmul_output_mode={mode} is not one of 0-3")
        if mode == 0 and softcap > 0:
            raise ImportFailure("the qk_matmul_output of mode 0 with a softcap is ambiguous (the spec says raw QK, "
                                "ONNX's reference gives the capped one)", "ask for mode 1 (after softcap) instead")
        outputs.append(by_mode[mode])
    return relax.Tuple(outputs[:max(len(node.output), 1)])


def _repeat_heads(imp, x: relax.Expr, rep: int) -> relax.Expr:
    """[b, h, t, d] -> [b, h * rep, t, d], each head rep times in a row (h0, h0, h1, h1, ...), as
    expand_dims + broadcast_to + reshape: transformers' repeat_kv, which relay_passes.kv_cache
    reads so that the KV step multiplies by the cache without a copy."""
    b, h, t, d = _dims(imp, x)
    wide = imp.emit(relax.op.broadcast_to(imp.emit(relax.op.expand_dims(x, 2)), _shape_expr(imp, [b, h, rep, t, d])))
    return imp.emit(relax.op.reshape(wide, _shape_expr(imp, [b, h * rep, t, d])))


def _append_cache(imp, node, past, new, past_name, new_name) -> relax.Expr:
    """concat([past, new], axis=2) after checking that batch, heads and size agree."""
    dp, dn = _dims(imp, past), _dims(imp, new)
    if len(dp) != 4 or any(not imp.sym.equal(dp[a], dn[a]) for a in (0, 1, 3)):
        raise ImportFailure(f"its cache {imp.describe(past_name)} does not match the new keys/values "
                            f"{imp.sym.dims_text(dn)} (from '{new_name}') in batch, heads or head size")
    return imp.ensure_shape(imp.emit(relax.op.concat([past, new], axis=2)),
                            [dn[0], dn[1], imp.sym.norm(imp.sym.expr(dp[2]) + imp.sym.expr(dn[2])), dn[3]])


def _attention_bias(imp, node, attrs, dtype, q_len, kv_len, past_len, nonpad, batch):
    """The additive bias (broadcastable to [batch, heads, q_len, kv_len]) or None, and whether
    some query row may have every key masked."""
    is_causal = bool(attrs.get("is_causal", 0))
    left, right = int(attrs.get("left_window_size", -1)), int(attrs.get("right_window_size", -1))
    mask_name = _input(node, 3)
    bias = _mask_bias(imp, node, mask_name, kv_len, dtype) if mask_name else None
    may_mask_rows = mask_name is not None or nonpad is not None or left >= 0 or right >= 0
    offsets = None
    if nonpad is not None:  # the external cache: per batch, the keys past nonpad_kv_seqlen[b] are padding
        lengths = imp.emit(relax.op.astype(imp.expr(nonpad), "int64"))
        lengths = imp.emit(relax.op.reshape(lengths, _shape_expr(imp, [batch, 1, 1, 1])))
        j = imp.emit(relax.op.reshape(_positions(imp, 0, kv_len), _shape_expr(imp, [1, 1, 1, kv_len])))
        padding = _where_bias(imp, _broadcast(imp, node, relax.op.less, j, lengths), dtype)
        bias = padding if bias is None else _broadcast(imp, node, relax.op.add, bias, padding)
        offsets = imp.emit(relax.op.subtract(lengths, _scalar(imp, q_len)))  # nonpad_kv_seqlen[b] - q_len
    if is_causal or left >= 0 or right >= 0:
        diff = _frontier(imp, node, q_len, kv_len, past_len, offsets)  # (i + offset) - j
        zero = relax.const(np.array(0, "int64"), "int64")
        allowed = None
        for on, cond in ((is_causal, lambda: relax.op.greater_equal(diff, zero)),
                         (left >= 0, lambda: relax.op.less_equal(diff, relax.const(np.array(left, "int64")))),
                         (right >= 0, lambda: relax.op.greater_equal(diff, relax.const(np.array(-right, "int64"))))):
            if on:
                c = imp.emit(cond())
                allowed = c if allowed is None else imp.emit(relax.op.logical_and(allowed, c))
        frontier = _where_bias(imp, allowed, dtype)
        bias = frontier if bias is None else _broadcast(imp, node, relax.op.add, bias, frontier)
    return bias, may_mask_rows


def _scalar(imp, value) -> relax.Expr:
    """A 0-d int64 tensor holding ``value`` (an int or a dimension expression)."""
    t = imp.values_tensor([value])
    return imp.emit(relax.op.reshape(t, relax.ShapeExpr([])))


@converter("RotaryEmbedding")
def rotary_embedding(imp, node, attrs):
    if node.domain not in DEFAULT_DOMAINS:
        return None
    x_name = node.input[0]
    x = imp.expr(x_name)
    dims = _data_dims(imp, node, 0)
    if _dtype(x) not in FLOAT_TYPES:
        raise ImportFailure(f"its input is {_dtype(x)}; RotaryEmbedding needs float tensors")
    if len(dims) == 3:
        heads = int(attrs.get("num_heads", 0))
        if not heads:
            raise ImportFailure("a 3-D input needs the num_heads attribute")
        batch, seq, hidden = dims
        hidden = _static(imp, node, hidden, "hidden size")
        if hidden % heads:
            raise ImportFailure(f"the hidden size {hidden} is not a multiple of its {heads} heads")
        x4 = imp.emit(relax.op.reshape(x, _shape_expr(imp, [batch, seq, heads, hidden // heads])))
        cache_axis = 2  # cos/sin [batch, seq, half] -> [batch, seq, 1, half]
    elif len(dims) == 4:
        x4, cache_axis = x, 1  # [batch, heads, seq, size]; cos/sin -> [batch, 1, seq, half]
    else:
        raise ImportFailure(f"its input {imp.describe(x_name)} must be 3-D or 4-D")
    size = _static(imp, node, _dims(imp, x4)[3], "head size")
    rot = int(attrs.get("rotary_embedding_dim", 0) or 0) or size
    if rot % 2 or rot > size:
        raise ImportFailure(f"rotary_embedding_dim={rot} must be even and at most the head size {size}")
    half = rot // 2

    caches = []
    for i, what in ((1, "cos_cache"), (2, "sin_cache")):
        c = imp.expr(node.input[i])
        if _input(node, 3) is not None:  # [max_position, half] indexed by position_ids [batch, seq]
            ids = imp.emit(relax.op.astype(imp.expr(node.input[3]), "int64"))
            c = imp.emit(relax.op.take(c, ids, axis=0, mode="clip"))  # a position past the table: its last row
        if not imp.sym.equal(_dims(imp, c)[-1], half):
            raise ImportFailure(f"its {what} {imp.describe(node.input[i])} has {imp.sym.text(_dims(imp, c)[-1])} "
                                f"columns, not rotary_embedding_dim / 2 = {half}")
        if _dtype(c) != _dtype(x):
            c = imp.emit(relax.op.astype(c, _dtype(x)))
        caches.append(imp.emit(relax.op.expand_dims(c, cache_axis)))
    cos, sin = caches
    out = rotate(imp, node, x4, cos, sin, rot, bool(attrs.get("interleaved", 0)))
    if len(dims) == 3:
        out = imp.emit(relax.op.reshape(out, _shape_expr(imp, dims)))
    return imp.ensure_shape(out, dims)


def rotate(imp, node, x4: relax.Expr, cos: relax.Expr, sin: relax.Expr, rot: int, interleaved: bool) -> relax.Expr:
    """The rotary embedding of ``x4`` [batch, heads, seq, size] (or [batch, seq, heads, size]):
    its first ``rot`` features as rot/2 pairs (the two halves, or neighbours if interleaved)
    rotated by cos/sin (broadcastable to [..., rot/2]); the rest passed through."""
    size = int(_dims(imp, x4)[3])
    half = rot // 2

    def part(begin, end, stride=1):
        return imp.emit(relax.op.strided_slice(x4, [3], [begin], [end], [stride], assume_inbound=True))

    x1, x2 = (part(0, rot, 2), part(1, rot, 2)) if interleaved else (part(0, half), part(half, rot))
    mul = relax.op.multiply
    real = imp.emit(relax.op.subtract(_broadcast(imp, node, mul, cos, x1), _broadcast(imp, node, mul, sin, x2)))
    imag = imp.emit(relax.op.add(_broadcast(imp, node, mul, sin, x1), _broadcast(imp, node, mul, cos, x2)))
    if interleaved:  # (real_0, imag_0, real_1, imag_1, ...)
        pairs = imp.emit(relax.op.stack([real, imag], axis=4))
        rotated = imp.emit(relax.op.reshape(pairs, _shape_expr(imp, [*_dims(imp, real)[:3], rot])))
    else:
        rotated = imp.emit(relax.op.concat([real, imag], axis=3))
    return rotated if rot == size else imp.emit(relax.op.concat([rotated, part(rot, size)], axis=3))
