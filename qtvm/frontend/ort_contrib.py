"""onnxruntime's contrib ops that onnxruntime-genai's model builder emits, which TVM 0.27 lacks.

``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` (the usual way to get an int4
LLaMA / Mistral / Qwen / Phi ONNX file) writes MatMulNBits (``qtvm.frontend.quantized``)
and these:

- ``SimplifiedLayerNormalization`` (default domain, onnxruntime only): RMSNorm;
- ``com.microsoft.SkipSimplifiedLayerNormalization`` / ``SkipLayerNormalization``: the
  residual add (input + skip + bias, output 3) and the norm of it (output 0);
- ``com.microsoft.GroupQueryAttention``: rotary embedding, the KV cache append, causal
  grouped-query attention, in one node.

and the elementwise fusions onnxruntime's transformer optimizer (``onnxruntime.transformers.
optimizer.optimize_model``, the usual step before its float16 conversion) writes: ``Gelu``,
``BiasGelu``, ``FastGelu`` (tanh form) and ``QuickGelu``.

GroupQueryAttention follows onnxruntime's CPU kernel, whose cache convention is per batch
row: ``seqlens_k[b] + 1`` is the row's total length, its past ``p_b = seqlens_k[b] + 1 - S``
(0 on the first prompt, ``S == total_sequence_length``), query ``s`` sits at position
``p_b + s`` (its rotary angle) and sees the row's first ``p_b`` cached keys and the new keys
up to itself. Here the present cache is ``concat(past, new)`` (the form
``relay_passes.kv_cache`` turns into an in-place write), and the mask admits exactly those
keys, so the attention output is onnxruntime's for any ``seqlens_k``; the present equals
onnxruntime's whenever ``total_sequence_length = past + S`` and no row is shorter (a
growing cache without padding: what ``qtvm generate`` and ``qtvm check`` feed). A shared
past/present buffer (onnxruntime-genai's ``past_present_share_buffer``) is not modelled.
"""
from __future__ import annotations

import numpy as np
from tvm import relax, tirx

from qtvm.frontend.attention import (FLOAT_TYPES, _append_cache, _broadcast, _const, _dims, _dtype, _input,
                                     _positions, _repeat_heads, _scalar, _static, _wants, _where_bias, rotate)
from qtvm.frontend.converters import _shape_expr, converter
from qtvm.frontend.importer import ImportFailure, PinDims

MS = "com.microsoft"


def _norm_axes(imp, node, x: relax.Expr, axis: int) -> list[int]:
    rank = len(_dims(imp, x))
    if not -rank <= axis < rank:
        raise ImportFailure(f"axis={axis} is out of range for a rank-{rank} input")
    return list(range(axis % rank, rank))


def _float_input(imp, node, i: int) -> relax.Expr:
    x = imp.expr(node.input[i])
    if _dtype(x) not in FLOAT_TYPES:
        raise ImportFailure(f"its input {imp.describe(node.input[i])} is {_dtype(x)}; it needs a float tensor")
    return x


def _rms_norm(imp, node, x, gamma, axes, eps, stash_float32: bool):
    """(y, inv_std_var with the normalized axes kept as 1), computed in float32 when asked."""
    dtype = _dtype(x)
    wide = stash_float32 and dtype != "float32"
    xs = imp.emit(relax.op.astype(x, "float32")) if wide else x
    g = imp.emit(relax.op.astype(gamma, _dtype(xs))) if _dtype(gamma) != _dtype(xs) else gamma
    y = imp.emit(relax.op.nn.rms_norm(xs, g, axes=axes, epsilon=eps))
    if wide:
        y = imp.emit(relax.op.astype(y, dtype))

    def inv_std():
        mean = imp.emit(relax.op.mean(imp.emit(relax.op.multiply(xs, xs)), axis=axes, keepdims=True))
        return imp.emit(relax.op.rsqrt(imp.emit(relax.op.add(mean, _const(eps, _dtype(xs))))))
    return y, inv_std


@converter("SimplifiedLayerNormalization")
def simplified_layer_norm(imp, node, attrs):
    x, gamma = _float_input(imp, node, 0), _float_input(imp, node, 1)
    axes = _norm_axes(imp, node, x, int(attrs.get("axis", -1)))
    y, inv_std = _rms_norm(imp, node, x, gamma, axes, float(attrs.get("epsilon", 1e-5)),
                           int(attrs.get("stash_type", 1)) == 1)
    return relax.Tuple([y, inv_std()] if _wants(node, 1) else [y])


def _skip_sum(imp, node, bias_index: int) -> relax.Expr:
    """input + skip (+ bias): the residual stream, output 3."""
    x, skip = _float_input(imp, node, 0), _float_input(imp, node, 1)
    total = _broadcast(imp, node, relax.op.add, x, skip, ("input", "skip"))
    if _input(node, bias_index) is not None:
        total = _broadcast(imp, node, relax.op.add, total, imp.expr(node.input[bias_index]), ("input", "bias"))
    return total


def _skip_outputs(node, y, total, inv_std=None) -> relax.Tuple:
    if _wants(node, 1):
        raise ImportFailure("its 'mean' output is used; qtvm reads output 0 (the norm), 2 and 3 (the sum)")
    outs = [y, None, None, total]
    if _wants(node, 2):
        if inv_std is None:
            raise ImportFailure("its 'inv_std_var' output is used; qtvm reads outputs 0 and 3")
        outs[2] = inv_std()
    return relax.Tuple([o if o is not None else y for o in outs[:len(node.output)]])


@converter(f"{MS}.SkipSimplifiedLayerNormalization")
def skip_simplified_layer_norm(imp, node, attrs):
    total = _skip_sum(imp, node, 3)
    eps = float(attrs.get("epsilon", 1e-12))
    y, inv_std = _rms_norm(imp, node, total, _float_input(imp, node, 2), [len(_dims(imp, total)) - 1], eps, True)
    return _skip_outputs(node, y, total, inv_std)


@converter(f"{MS}.SkipLayerNormalization")
def skip_layer_norm(imp, node, attrs):
    total = _skip_sum(imp, node, 4)
    gamma = _float_input(imp, node, 2)
    beta = imp.expr(node.input[3]) if _input(node, 3) is not None else _const(np.zeros(_dims(imp, gamma)), _dtype(gamma))
    eps = float(attrs.get("epsilon", 1e-12))
    y = imp.emit(relax.op.nn.layer_norm(total, gamma, beta, axes=[-1], epsilon=eps))
    return _skip_outputs(node, y, total)


def _elementwise(imp, node, body) -> relax.Expr:
    """``body(inputs)`` on float32 copies of half precision inputs, cast back: onnxruntime's CPU
    kernels of these ops compute in float32, their bias sum included (one rounding at the end)."""
    xs = [_float_input(imp, node, i) for i in range(len(node.input)) if _input(node, i) is not None]
    dtype = _dtype(xs[0])
    wide = dtype in ("float16", "bfloat16")
    if wide:
        xs = [imp.emit(relax.op.astype(x, "float32")) for x in xs]
    y = body(xs)
    return imp.emit(relax.op.astype(y, dtype)) if wide else y


def _biased(imp, node, xs) -> relax.Expr:
    """x (+ bias): the sum a fused op computes first."""
    return _broadcast(imp, node, relax.op.add, xs[0], xs[1], ("input", "bias")) if len(xs) > 1 else xs[0]


@converter(f"{MS}.Gelu", f"{MS}.BiasGelu")
def ms_gelu(imp, node, attrs):
    """gelu(x (+ bias)), the erf form."""
    return _elementwise(imp, node, lambda xs: imp.emit(relax.op.nn.gelu(_biased(imp, node, xs))))


@converter(f"{MS}.FastGelu")
def ms_fast_gelu(imp, node, attrs):
    """gelu(x (+ bias)), the tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return _elementwise(imp, node, lambda xs: imp.emit(relax.op.nn.gelu_tanh(_biased(imp, node, xs))))


@converter(f"{MS}.QuickGelu")
def ms_quick_gelu(imp, node, attrs):
    """x * sigmoid(alpha x), alpha 1.702 by default."""
    alpha = float(attrs.get("alpha", 1.702))

    def body(xs):
        scaled = imp.emit(relax.op.multiply(xs[0], _const(alpha, _dtype(xs[0]))))
        return imp.emit(relax.op.multiply(xs[0], imp.emit(relax.op.sigmoid(scaled))))
    return _elementwise(imp, node, body)


# GroupQueryAttention inputs past the ones read here, and attributes whose non-default values are refused
_GQA_UNREAD = {9: "position_ids", 10: "attention_bias", 11: "head_sink", 12: "k_scale", 13: "v_scale",
               14: "q_norm_weight", 15: "k_norm_weight", 16: "query_seqlens"}
_GQA_DEFAULTS = {"causal": 1, "smooth_softmax": (-1, 0), "qk_output": 0, "sliding_window_cache": 0,
                 "kv_cache_bit_width": (0,), "k_quant_type": ("NONE",), "v_quant_type": ("NONE",)}


def _gqa_refusals(node, attrs) -> None:
    unread = [name for i, name in _GQA_UNREAD.items() if _input(node, i) is not None]
    for name, ok in _GQA_DEFAULTS.items():
        if name in attrs:
            value = attrs[name].decode() if isinstance(attrs[name], bytes) else attrs[name]
            if value not in (ok if isinstance(ok, tuple) else (ok,)):
                unread.append(f"{name}={value}")
    if _wants(node, 3):
        unread.append("the output_qk output")
    if unread:
        raise ImportFailure(f"qtvm does not read its {', '.join(unread)}",
                            "export without them, or file an issue (onnxruntime-genai's builder writes none of "
                            "them for LLaMA, Qwen, Phi, Gemma 1, Granite, Nemotron or ERNIE 4.5)")


@converter(f"{MS}.GroupQueryAttention")
def group_query_attention(imp, node, attrs):
    _gqa_refusals(node, attrs)
    heads, kv_heads = int(attrs.get("num_heads", 0)), int(attrs.get("kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ImportFailure(f"num_heads={heads} must be a positive multiple of kv_num_heads={kv_heads}")
    query = _float_input(imp, node, 0)
    dtype = _dtype(query)
    batch, seq, hidden = _dims(imp, query)
    hidden = _static(imp, node, hidden, "hidden size of the query")
    packed = _input(node, 1) is None
    if packed != (_input(node, 2) is None):
        raise ImportFailure("key and value must be given together (or both absent: a packed QKV query)")
    width = heads + 2 * kv_heads if packed else heads
    if hidden % width:
        raise ImportFailure(f"its query width {hidden} is not a multiple of its {width} heads")
    size = hidden // width

    def heads_first(x, n):  # [batch, seq, n * size] -> [batch, n, seq, size]
        x = imp.emit(relax.op.reshape(x, _shape_expr(imp, [batch, seq, n, size])))
        return imp.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))

    if packed:
        def cols(begin, end):
            return imp.emit(relax.op.strided_slice(query, [2], [begin], [end], assume_inbound=True))
        q, k, v = cols(0, heads * size), cols(heads * size, (heads + kv_heads) * size), \
            cols((heads + kv_heads) * size, hidden)
    else:
        q, k, v = query, _float_input(imp, node, 1), _float_input(imp, node, 2)
        for x, name in ((k, node.input[1]), (v, node.input[2])):
            if not imp.sym.equal(_dims(imp, x)[2], kv_heads * size):
                raise ImportFailure(f"its {imp.describe(name)} is not [batch, seq, kv_num_heads * head size "
                                    f"= {kv_heads * size}]")
    q, k, v = heads_first(q, heads), heads_first(k, kv_heads), heads_first(v, kv_heads)

    past_key, past_value = _input(node, 3), _input(node, 4)
    if (past_key is None) != (past_value is None):
        raise ImportFailure("past_key and past_value must be given together")
    past_len = 0
    if past_key is not None:
        _pin_cache_dims(imp, node, kv_heads, size)
        past_len = _dims(imp, imp.expr(past_key))[2]
    # p_b: the rows each batch row already has (onnxruntime's convention, module docstring)
    seqlens = imp.emit(relax.op.astype(imp.expr(node.input[5]), "int64"))
    seqlens = imp.emit(relax.op.reshape(seqlens, _shape_expr(imp, [batch])))
    total = imp.emit(relax.op.reshape(imp.emit(relax.op.astype(imp.expr(node.input[6]), "int64")),
                                      relax.ShapeExpr([])))
    s_len = _scalar(imp, seq)
    first = imp.emit(relax.op.equal(total, s_len))
    row_past = imp.emit(relax.op.where(first, relax.const(0, "int64"),
                                       imp.emit(relax.op.subtract(imp.emit(relax.op.add(
                                           seqlens, relax.const(1, "int64"))), s_len))))

    if int(attrs.get("do_rotary", 0)):
        q, k = _gqa_rotary(imp, node, attrs, q, k, row_past, batch, seq, size)
    elif _input(node, 7) is not None:
        raise ImportFailure("it has cos_cache/sin_cache but do_rotary=0")

    if past_key is not None:
        k = _append_cache(imp, node, imp.expr(past_key), k, past_key, node.input[1] or node.input[0])
        v = _append_cache(imp, node, imp.expr(past_value), v, past_value, node.input[2] or node.input[0])
    present_key, present_value = k, v
    kv_len = _dims(imp, k)[2]
    if heads != kv_heads:
        k, v = (_repeat_heads(imp, x, heads // kv_heads) for x in (k, v))

    scale = float(attrs.get("scale", 0.0) or 0.0) or 1.0 / np.sqrt(size)
    root = _const(np.sqrt(np.float64(scale)), dtype)
    qs = imp.emit(relax.op.multiply(q, root))
    ks = imp.emit(relax.op.multiply(imp.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), root))
    scores = imp.emit(relax.op.matmul(qs, ks))  # [batch, heads, seq, kv_len]
    softcap = float(attrs.get("softcap", 0.0) or 0.0)
    if softcap > 0:
        cap = _const(softcap, dtype)
        scores = imp.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, cap)), cap))
    bias = _gqa_mask(imp, node, int(attrs.get("local_window_size", -1)), dtype, batch, seq, kv_len, past_len,
                     row_past)
    probs = imp.emit(relax.op.nn.softmax(_broadcast(imp, node, relax.op.add, scores, bias, ("QK^T", "the mask")),
                                         axis=-1))
    y = imp.emit(relax.op.matmul(probs, v))  # [batch, heads, seq, size]
    y = imp.emit(relax.op.permute_dims(y, [0, 2, 1, 3]))
    y = imp.emit(relax.op.reshape(y, _shape_expr(imp, [batch, seq, heads * size])))
    return relax.Tuple([y, present_key, present_value][:max(len(node.output), 1)])


def _pin_cache_dims(imp, node, kv_heads: int, size: int) -> None:
    """The caches' head count and head size are constants; a name in their place (the builder's
    ``kv_cache_dim``) is pinned to the constant (``importer.PinDims``)."""
    pins = {}
    for i in (3, 4):
        dims = _dims(imp, imp.expr(node.input[i]))
        if len(dims) != 4:
            raise ImportFailure(f"its cache {imp.describe(node.input[i])} is not [batch, kv heads, length, size]")
        for axis, want in ((1, kv_heads), (3, size)):
            d = dims[axis]
            if isinstance(d, tirx.Var) and node.input[i] in imp._inputs:
                pins[d.name] = want
            elif not imp.sym.equal(d, want):
                raise ImportFailure(f"its cache {imp.describe(node.input[i])} has {imp.sym.text(d)} at axis {axis}, "
                                    f"not {want}")
    if pins:
        raise PinDims(pins)


def _gqa_rotary(imp, node, attrs, q, k, row_past, batch, seq, size):
    """q and k rotated at position ``p_b + s``, onnxruntime's table lookup."""
    if _input(node, 7) is None or _input(node, 8) is None:
        raise ImportFailure("do_rotary=1 needs cos_cache and sin_cache")
    s = imp.emit(relax.op.reshape(_positions(imp, 0, seq), _shape_expr(imp, [1, seq])))
    pos = _broadcast(imp, node, relax.op.add, imp.emit(relax.op.reshape(row_past, _shape_expr(imp, [batch, 1]))), s)
    tables = []
    for i in (7, 8):
        c = _float_input(imp, node, i)
        half = _static(imp, node, _dims(imp, c)[1], f"width of {node.input[i]}")
        c = imp.emit(relax.op.take(c, pos, axis=0, mode="clip"))  # [batch, seq, half]
        if _dtype(c) != _dtype(q):
            c = imp.emit(relax.op.astype(c, _dtype(q)))
        tables.append(imp.emit(relax.op.expand_dims(c, 1)))  # [batch, 1, seq, half]
    rot = 2 * half
    if rot > size:
        raise ImportFailure(f"its cos_cache has {half} columns, more than half the head size {size}")
    interleaved = bool(attrs.get("rotary_interleaved", 0))
    return (rotate(imp, node, x, *tables, rot, interleaved) for x in (q, k))


def _gqa_mask(imp, node, window: int, dtype, batch, seq, kv_len, past_len, row_past) -> relax.Expr:
    """[batch, 1, seq, kv_len] additive mask: key j is visible to query s iff it is one of the row's
    ``p_b`` cached keys (j < p_b) or a new key not after it (0 <= j - past <= s); with a window,
    only the ``window`` positions up to the query's own (> p_b + s - window, as onnxruntime 1.32
    counts it: measured)."""
    i64 = "int64"
    j = imp.emit(relax.op.reshape(_positions(imp, 0, kv_len), _shape_expr(imp, [1, 1, 1, kv_len])))
    s = imp.emit(relax.op.reshape(_positions(imp, 0, seq), _shape_expr(imp, [1, 1, seq, 1])))
    pb = imp.emit(relax.op.reshape(row_past, _shape_expr(imp, [batch, 1, 1, 1])))
    rel = imp.emit(relax.op.subtract(j, _scalar(imp, past_len)))  # the new key's index, or < 0
    zero = relax.const(0, i64)
    cached = _broadcast(imp, node, relax.op.less, j, pb)
    new = _broadcast(imp, node, relax.op.logical_and, imp.emit(relax.op.greater_equal(rel, zero)),
                     _broadcast(imp, node, relax.op.less_equal, rel, s))
    if window > 0:
        w = relax.const(window - 1, i64)
        reach = imp.emit(relax.op.subtract(s, w))  # the first visible position p_b + s - window + 1, less p_b
        cached = _broadcast(imp, node, relax.op.logical_and, cached, _broadcast(
            imp, node, relax.op.greater_equal, j, _broadcast(imp, node, relax.op.add, pb, reach)))
        new = _broadcast(imp, node, relax.op.logical_and, new,
                         _broadcast(imp, node, relax.op.greater_equal, rel, reach))
    return _where_bias(imp, _broadcast(imp, node, relax.op.logical_or, cached, new), dtype)


@converter(f"{MS}.GatherBlockQuantized")
def gather_block_quantized(imp, node, attrs):
    """Rows of a block-quantized table (a tied embedding: the lm_head's int4 weight) gathered
    packed and dequantized after the gather, so the table stays at its bits:
    ``(q - zero_point) * scale`` per block, low-order bits first, zero point 2^(bits-1) if absent."""
    data, ids, scales = imp.expr(node.input[0]), imp.expr(node.input[1]), _float_input(imp, node, 2)
    bits, block = int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
    rank = len(_dims(imp, data))
    if _dtype(data) != "uint8" or bits not in (2, 4, 8):
        raise ImportFailure(f"its data is {_dtype(data)} with bits={bits}; qtvm reads uint8 data of 2, 4 or 8 bits")
    if int(attrs.get("gather_axis", 0)) != 0 or int(attrs.get("quantize_axis", 1)) % rank != rank - 1 or rank != 2:
        raise ImportFailure("qtvm reads a 2-D table gathered on axis 0 and quantized along axis 1")
    if "int" not in _dtype(ids):
        raise ImportFailure(f"its indices are {_dtype(ids)}")
    rows_n, packed_k = (_static(imp, node, d, "table size") for d in _dims(imp, data))
    per_byte = 8 // bits
    k = packed_k * per_byte
    blocks = _static(imp, node, _dims(imp, scales)[1], "number of scale blocks")
    if block <= 0 or k != blocks * block:
        raise ImportFailure(f"its {k} columns are not {blocks} blocks of {block}")
    idx_dims = _dims(imp, ids)
    ids = imp.emit(relax.op.astype(ids, "int64"))
    ids = imp.emit(relax.op.where(imp.emit(relax.op.less(ids, relax.const(0, "int64"))),
                                  imp.emit(relax.op.add(ids, relax.const(rows_n, "int64"))), ids))  # Gather's -1

    def unpack(packed, count):  # [..., n] uint8 -> [..., n * per_byte] float32, low-order bits first
        if per_byte == 1:
            return imp.emit(relax.op.astype(packed, "float32"))
        mask = relax.const(2 ** bits - 1, "uint8")
        parts = [imp.emit(relax.op.bitwise_and(relax.op.right_shift(packed, relax.const(bits * i, "uint8")), mask))
                 for i in range(per_byte)]
        wide = imp.emit(relax.op.stack(parts, axis=-1))
        dims = _dims(imp, packed)
        flat = imp.emit(relax.op.reshape(wide, _shape_expr(imp, [*dims[:-1], dims[-1] * per_byte])))
        if dims[-1] * per_byte != count:
            flat = imp.emit(relax.op.strided_slice(flat, [len(dims) - 1], [0], [count]))
        return imp.emit(relax.op.astype(flat, "float32"))

    q = unpack(imp.emit(relax.op.take(data, ids, axis=0)), k)  # [..., k]
    scale = imp.emit(relax.op.take(scales, ids, axis=0))  # [..., blocks]
    scale = scale if _dtype(scale) == "float32" else imp.emit(relax.op.astype(scale, "float32"))
    if _input(node, 3) is not None:
        zp = unpack(imp.emit(relax.op.take(imp.expr(node.input[3]), ids, axis=0)), blocks)
    else:
        zp = relax.const(float(2 ** (bits - 1)), "float32")
    q = imp.emit(relax.op.reshape(q, _shape_expr(imp, [*idx_dims, blocks, block])))
    by_block = [*idx_dims, blocks, 1]
    scale = imp.emit(relax.op.reshape(scale, _shape_expr(imp, by_block)))
    if _input(node, 3) is not None:
        zp = imp.emit(relax.op.reshape(zp, _shape_expr(imp, by_block)))
    out = imp.emit(relax.op.multiply(imp.emit(relax.op.subtract(q, zp)), scale))
    out = imp.emit(relax.op.reshape(out, _shape_expr(imp, [*idx_dims, k])))
    return out if _dtype(scales) == "float32" else imp.emit(relax.op.astype(out, _dtype(scales)))
