"""onnxruntime's fused BERT ops, written back as the standard ops they fuse, at load.

onnxruntime's transformer optimizer (and optimum's ``ORTOptimizer``, whose optimized BERT files
are on the model hub beside the plain ones) fuses a BERT layer's self-attention into
``com.microsoft.Attention`` (the QKV projection's weight inside the node) and the embeddings
into ``com.microsoft.EmbedLayerNormalization``. Written as MatMul / Gather / Softmax / ...
here, before anything reads the graph, the QKV weight is an ordinary MatMul weight: the
summary counts it, the quantizer packs it, ``qtvm check``'s reference dequantizes it, and
onnxruntime runs the same graph as the reference. tests/frontend/test_ort_fused.py holds each
decomposition to onnxruntime's own kernel of the fused op at several bindings.

quantize_dynamic's QAttention and QEmbedLayerNormalization are the float ops on DequantizeLinear'd
inputs (the int8 weight then reads as quantized ONNX).

What a decomposition does not model (rotary inside Attention, a shared past/present buffer, the
2 x batch and 4-D mask forms) is refused by name (``QtvmError``), not left for a wrong answer.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtvm.errors import QtvmError

MS = "com.microsoft"
NOTE_KEY = "qtvm.decomposed"  # metadata_props keys (+ ".0", ".1", ...) of the notes load_onnx records
_HALF = {TensorProto.FLOAT16: np.float16, TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


class _Emit:
    """Nodes and constants for one fused node, named after it (unique in the graph)."""

    def __init__(self, node: onnx.NodeProto, index: int, opset: int):
        self.prefix = f"{node.name or node.op_type}.qtvm{index}"
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}.{what}{self.count}"

    def const(self, value, dtype) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out

    def axes_op(self, op_type: str, x: str, axes: list[int], since: int, out: str | None = None, **attrs) -> str:
        """Unsqueeze / Squeeze / ReduceSum / ReduceMean: axes an attribute before opset ``since``, an input from it."""
        if self.opset >= since:
            return self.op(op_type, [x, self.const(axes, np.int64)], out, **attrs)
        return self.op(op_type, [x], out, axes=axes, **attrs)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.axes_op("Unsqueeze", x, axes, 13)

    def length(self, x: str, axis: int) -> str:
        """x's dim ``axis`` as an int64 scalar."""
        return self.op("Gather", [self.op("Shape", [x]), self.const(axis, np.int64)], axis=0)

    def arange(self, x: str, axis: int) -> str:
        return self.op("Range", [self.const(0, np.int64), self.length(x, axis), self.const(1, np.int64)])


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _given(node, i: int) -> str | None:
    return node.input[i] if len(node.input) > i and node.input[i] else None


def _refuse(node, what: str) -> None:
    raise QtvmError(f"{node.domain}.{node.op_type} '{node.name}': qtvm does not read its {what}",
                    "export without onnxruntime's fusions (the plain transformers export), or file an issue "
                    "naming it")


def _float_type(node, elem: int | None) -> int:
    if elem not in _HALF:
        _refuse(node, f"element type {TensorProto.DataType.Name(elem) if elem else 'unknown'} (float32, float16 "
                      "or float64 are read)")
    return elem


def _attention(node, index: int, opset: int, types: dict, shapes: dict, batch: set) -> _Emit:
    """Attention(x, W, bias, mask_index, past, attention_bias) -> (y, present): x @ W + bias split into Q, K, V by
    ``qkv_hidden_sizes`` (default three equal parts), heads of ``num_heads``, K and V after past's
    (present: both), softmax(scale Q K^T
    + the mask's and causal ``mask_filter_value``s + attention_bias) V, heads joined: onnxruntime's
    CPU kernel, the mask added after scaling as its GEMM does. ``batch``: the names and sizes a
    batch dim has in this graph (a 1-D mask_index must be one: the [2 x batch] form is refused)."""
    a = _attrs(node)
    past = _given(node, 4)
    present = node.output[1] if len(node.output) > 1 and node.output[1] else None
    if _given(node, 6):
        _refuse(node, "past_sequence_length input (a shared past/present buffer)")
    if a.get("do_rotary", 0):
        _refuse(node, "rotary embedding (do_rotary=1)")
    if a.get("past_present_share_buffer", 0):
        _refuse(node, "shared past/present buffer")
    heads = int(a["num_heads"])
    w = shapes.get(node.input[1])
    if w is None or len(w) != 2:
        _refuse(node, "weights of unknown shape (a constant [input_hidden, q + k + v hidden] is read)")
    sizes = [int(s) for s in a.get("qkv_hidden_sizes", [])] or [w[1] // 3] * 3
    if sum(sizes) != w[1] or any(s % heads for s in sizes) or sizes[0] != sizes[1]:
        _refuse(node, f"qkv_hidden_sizes {sizes} against weights {list(w)} and {heads} heads")
    if (past or present) and sizes[2] != sizes[0]:
        _refuse(node, f"past state with V heads of another size than K's (qkv_hidden_sizes {sizes})")
    elem = _float_type(node, types.get(node.input[0]) or types.get(node.input[1]))
    dtype = _HALF[elem]
    head_q, head_v = sizes[0] // heads, sizes[2] // heads
    scale = float(a.get("scale", 0.0)) or 1.0 / float(np.sqrt(head_q))
    fill = float(a.get("mask_filter_value", -10000.0))
    e = _Emit(node, index, opset)
    qkv = e.op("MatMul", [node.input[0], node.input[1]])
    if _given(node, 2):
        qkv = e.op("Add", [qkv, node.input[2]])
    bounds = np.cumsum([0, *sizes])
    q, k, v = (e.op("Slice", [qkv, e.const([lo], np.int64), e.const([hi], np.int64), e.const([-1], np.int64)])
               for lo, hi in zip(bounds[:-1], bounds[1:]))

    def heads_first(x, size):  # [B, S, heads * size] -> [B, heads, S, size]
        return e.op("Transpose", [e.op("Reshape", [x, e.const([0, 0, heads, size], np.int64)])], perm=[0, 2, 1, 3])

    q, k, v = heads_first(q, head_q), heads_first(k, head_q), heads_first(v, head_v)
    if past:  # past [2, B, heads, P, size]: the keys and values are past's, then this step's
        k, v = (e.op("Concat", [e.op("Gather", [past, e.const(i, np.int64)], axis=0), x], axis=2)
                for i, x in ((0, k), (1, v)))
    if present:  # [2, B, heads, P + S, size]
        e.op("Concat", [e.unsqueeze(k, [0]), e.unsqueeze(v, [0])], present, axis=0)
    scores = e.op("Mul", [e.op("MatMul", [q, e.op("Transpose", [k], perm=[0, 1, 3, 2])]), e.const(scale, dtype)])
    zero, filled = e.const(0, dtype), e.const(fill, dtype)

    def additive(valid, axes):  # bool -> 0 where valid, mask_filter_value where not, unsqueezed to 4-D
        return e.unsqueeze(e.op("Where", [valid, zero, filled]), axes)

    mask = _given(node, 3)
    if mask is not None:
        dims = shapes.get(mask)
        rank = len(dims) if dims is not None else None
        if rank == 1 and (dims[0] is None or dims[0] not in batch):
            _refuse(node, f"1-D mask_index of length {dims[0] or 'unknown'}: key lengths [batch] are read, "
                          "the [2 x batch] end/start form is not (its length is not the batch's dim)")
        if rank == 1:  # key lengths [B]: key j of row b is masked from j = length[b]
            ends = e.unsqueeze(e.op("Cast", [mask], to=TensorProto.INT64), [1])
            keys = e.unsqueeze(e.arange(k, 2), [0])  # past's keys, then this step's
            scores = e.op("Add", [scores, additive(e.op("Less", [keys, ends]), [1, 2])])
        elif rank in (2, 3):  # raw masks [B, T] / [B, S, T]: 0 masks
            valid = e.op("Greater", [e.op("Cast", [mask], to=TensorProto.INT64), e.const(0, np.int64)])
            scores = e.op("Add", [scores, additive(valid, [1, 2] if rank == 2 else [1])])
        else:
            _refuse(node, f"mask_index of {f'rank {rank}' if rank else 'unknown shape'} (key lengths [batch] and "
                          "raw masks [batch, seq] or [batch, seq, seq] are read)")
    if a.get("unidirectional", 0):  # key j > query i's position (past length + i) masked
        keys = e.arange(k, 2)
        offset = e.op("Sub", [e.length(k, 2), e.length(node.input[0], 1)])
        queries = e.op("Add", [e.arange(node.input[0], 1), offset])
        future = e.op("Greater", [e.unsqueeze(keys, [0]), e.unsqueeze(queries, [1])])
        scores = e.op("Add", [scores, additive(e.op("Not", [future]), [0, 1])])
    if _given(node, 5):
        scores = e.op("Add", [scores, node.input[5]])
    probs = e.op("Softmax", [scores], axis=-1)
    out = e.op("Transpose", [e.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    e.op("Reshape", [out, e.const([0, 0, sizes[2]], np.int64)], node.output[0])
    return e


def _embed_layer_norm(node, index: int, opset: int, types: dict, shapes: dict, batch: set) -> _Emit:
    """EmbedLayerNormalization(ids, segment_ids, word, position, segment, gamma, beta, mask,
    position_ids): LayerNormalization(word[ids] + position[0..S-1 or position_ids] +
    segment[segment_ids]); mask_index = the mask's row sums (zeros without a mask) as onnxruntime
    computes it; embedding_sum the sum before the norm."""
    a = _attrs(node)
    if int(a.get("mask_index_type", 1)) not in (0, 1):
        _refuse(node, f"mask_index_type={a['mask_index_type']}")
    e = _Emit(node, index, opset)
    word = e.op("Gather", [node.input[2], node.input[0]])
    positions = _given(node, 8) or e.unsqueeze(e.arange(node.input[0], 1), [0])
    total = e.op("Add", [word, e.op("Gather", [node.input[3], positions])])
    if _given(node, 1) and _given(node, 4):
        total = e.op("Add", [total, e.op("Gather", [node.input[4], node.input[1]])])
    elem = _float_type(node, types.get(node.input[5]))
    gamma, beta = node.input[5], _given(node, 6)
    epsilon = float(a.get("epsilon", 1e-12))
    if opset >= 17:
        e.op("LayerNormalization", [total, gamma, beta or e.op("Mul", [gamma, e.const(0, _HALF[elem])])],
             node.output[0], axis=-1, epsilon=epsilon)
    else:  # LayerNormalization's function body: centred, over sqrt(variance + epsilon), scaled, shifted
        centred = e.op("Sub", [total, e.axes_op("ReduceMean", total, [-1], 18, keepdims=1)])
        var = e.axes_op("ReduceMean", e.op("Mul", [centred, centred]), [-1], 18, keepdims=1)
        normed = e.op("Div", [centred, e.op("Sqrt", [e.op("Add", [var, e.const(epsilon, _HALF[elem])])])])
        y = e.op("Mul", [normed, gamma], None if beta else node.output[0])
        if beta:
            e.op("Add", [y, beta], node.output[0])
    if len(node.output) > 1 and node.output[1]:
        ones = e.op("Cast", [node.input[7] if _given(node, 7) else node.input[0]], to=TensorProto.INT64)
        if not _given(node, 7):  # no mask: onnxruntime gives zeros
            ones = e.op("Mul", [ones, e.const(0, np.int64)])
        e.op("Cast", [e.axes_op("ReduceSum", ones, [1], 13, keepdims=0)], node.output[1], to=TensorProto.INT32)
    if len(node.output) > 2 and node.output[2]:
        e.op("Identity", [total], node.output[2])
    return e


def _dequantized(node, index: int, opset: int, types: dict, shapes: dict, batch: set, float_op: str,
                 quantized: dict[int, tuple[int, int | None, int]], keep: dict[int, int]):
    """A quantized fused op (onnxruntime's quantize_dynamic of an optimized BERT) as its float op
    on DequantizeLinear'd inputs: ``quantized`` maps the float op's input to (codes, scale,
    zero point) inputs of ``node``, ``keep`` the float op's other inputs to ``node``'s. The
    weights' DequantizeLinear is what qtvm reads as quantized ONNX (the int8 codes kept)."""
    e = _Emit(node, index, opset)
    inputs = [""] * (max([*quantized, *keep]) + 1)
    for to, (codes, scale, zero) in quantized.items():
        if not _given(node, codes):
            continue
        scale_shape = shapes.get(node.input[scale])
        per_column = bool(scale_shape) and int(np.prod(scale_shape)) > 1
        if per_column and opset < 13:
            _refuse(node, f"per-column scales at opset {opset} (13 or later: DequantizeLinear's axis)")
        args = [node.input[codes], node.input[scale]] + ([node.input[zero]] if zero is not None and _given(node, zero) else [])
        inputs[to] = e.op("DequantizeLinear", args, **({"axis": 1} if per_column else {}))
        types[inputs[to]] = types.get(node.input[scale], TensorProto.FLOAT)
        if node.input[codes] in shapes:
            shapes[inputs[to]] = shapes[node.input[codes]]
    for to, source in keep.items():
        inputs[to] = _given(node, source) or ""
    while inputs and not inputs[-1]:
        inputs.pop()
    float_node = helper.make_node(float_op, inputs, list(node.output), name=f"{node.name or node.op_type}.float",
                                  domain=MS)
    float_node.attribute.extend(node.attribute)
    try:
        inner = _DECOMPOSE[float_op](float_node, index, opset, types, shapes, batch)
    except QtvmError as err:  # named as the user's file names it
        raise QtvmError(err.problem.replace(f"{MS}.{float_op} '{float_node.name}'", f"{MS}.{node.op_type} '{node.name}'"),
                        err.fix) from None
    e.nodes.extend(inner.nodes)
    e.inits.extend(inner.inits)
    return e


def _q_attention(node, index, opset, types, shapes, batch):
    """QAttention(x codes, W codes, bias, x scale, W scale, mask_index, x zero, W zero, past): the
    Attention of the dequantized x and W (onnxruntime's integer GEMM, then both scales: the same
    product up to float rounding)."""
    return _dequantized(node, index, opset, types, shapes, batch, "Attention", {0: (0, 3, 6), 1: (1, 4, 7)},
                        {2: 2, 3: 5, 4: 8})


def _q_embed_layer_norm(node, index, opset, types, shapes, batch):
    """QEmbedLayerNormalization(ids, segment_ids, word, position, segment, gamma, beta codes,
    mask, their scales, their zero points): EmbedLayerNormalization of the dequantized tables."""
    return _dequantized(node, index, opset, types, shapes, batch, "EmbedLayerNormalization",
                        {i: (i, i + 6, i + 11) for i in range(2, 7)}, {0: 0, 1: 1, 7: 7})


_DECOMPOSE = {"Attention": _attention, "EmbedLayerNormalization": _embed_layer_norm,
              "QAttention": _q_attention, "QEmbedLayerNormalization": _q_embed_layer_norm}


def decompose_fused(model: onnx.ModelProto) -> list[str]:
    """Each ``com.microsoft`` EmbedLayerNormalization, then Attention, of the main graph replaced
    by standard ops, in place (module doc); the embeddings first, so that shape inference knows
    the mask_index they give the attention. Returns a note per op type decomposed."""
    from qtvm.frontend.onnx import weightless_copy

    graph = model.graph
    notes = []
    for op_types in (("EmbedLayerNormalization", "QEmbedLayerNormalization"), ("Attention", "QAttention")):
        found = {i for i, n in enumerate(graph.node) if n.domain == MS and n.op_type in op_types}
        if not found:
            continue
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        if opset < 11:
            _refuse(graph.node[min(found)], f"graph's opset {opset} (11 or later: Range)")
        types, shapes = _facts(model, weightless_copy)
        batch = {shapes[v.name][0] for v in graph.input if len(shapes.get(v.name) or ()) >= 2} - {None}
        for op_type in op_types:  # noted before the nodes are replaced
            count = sum(graph.node[i].op_type == op_type for i in found)
            if count:
                notes.append(f"onnxruntime's fused {op_type} x{count} written as standard ops"
                             + (" (its QKV weight a MatMul weight)" if op_type.endswith("Attention") else ""))
        nodes, inits = [], []
        for i, node in enumerate(graph.node):
            if i not in found:
                nodes.append(node)
                continue
            e = _DECOMPOSE[node.op_type](node, i, opset, types, shapes,
                                         batch | {(shapes.get(node.input[0]) or [None])[0]} - {None})
            nodes.extend(e.nodes)
            inits.extend(e.inits)
        copies = [onnx.NodeProto() for _ in nodes]
        for c, n in zip(copies, nodes):
            c.CopyFrom(n)
        del graph.node[:]
        graph.node.extend(copies)
        graph.initializer.extend(inits)
    return notes


def _facts(model: onnx.ModelProto, weightless_copy) -> tuple[dict, dict]:
    """(element type, shape as ints or dim names) of the values shape inference knows."""
    types, shapes = {}, {}
    for t in model.graph.initializer:
        types[t.name], shapes[t.name] = t.data_type, list(t.dims)
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_copy(model), strict_mode=False)
    except Exception:  # noqa: BLE001 -- without inference, only the graph's declarations
        inferred = model
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tt = v.type.tensor_type
        if v.name in types or not v.type.HasField("tensor_type"):
            continue
        types[v.name] = tt.elem_type
        if tt.HasField("shape"):
            shapes[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    return types, shapes
