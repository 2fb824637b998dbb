"""ONNX file -> Relax IRModule with symbolic dims, with errors a user can act on."""
from __future__ import annotations

import math
import mmap
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from qtvm.errors import QtvmError

WEIGHT_OPS = ("MatMul", "Gemm")
#: weight types quantized (half precision read as float32: relay_passes.quantize_weights)
WEIGHT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
# Custom-domain ops qtvm reads itself before TVM's importer (qtvm/frontend/quantized.py).
QTVM_READS = {("com.microsoft", "MatMulNBits")}


def is_float_dtype(dtype) -> bool:
    """numpy's floats and ml_dtypes' bfloat16 (which numpy does not count as floating)."""
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


@dataclass
class OnnxSummary:
    """What the quantizer will see, by ONNX node name."""

    weight_matmuls: list[str] = field(default_factory=list)  # B is a constant initializer
    float_matmuls: list[str] = field(default_factory=list)  # B is computed at run time
    routed_matmuls: list[str] = field(default_factory=list)  # of those, experts gathered by id (``routed_sources``)
    inputs: list[tuple[str, str, list]] = field(default_factory=list)  # name, dtype, dims
    outputs: list[tuple[str, str, list]] = field(default_factory=list)


def load_onnx(path: str | os.PathLike, lazy: bool = False) -> onnx.ModelProto:
    """The model at ``path``, its nodes in order (``sort_nodes``) and onnxruntime's fused BERT ops
    written as standard ops (``qtvm.frontend.ort_fused``: notes in metadata_props). ``lazy``: initializers stored in external files stay there (their
    locations made absolute) and are read one at a time where used (``tensor_array``): the
    compile imports each into TVM's memory, so loading them all first held every weight twice
    (protobuf frees nothing of a loaded message until the whole message goes)."""
    path = Path(path)
    if not path.exists():
        raise QtvmError(f"model file '{path}' does not exist", "check the path")
    if path.is_dir():
        raise QtvmError(f"'{path}' is a directory, not an ONNX file", "pass the .onnx file itself")
    try:
        model = onnx.load(str(path), load_external_data=not lazy)
    except Exception:  # protobuf raises DecodeError and friends for non-ONNX bytes
        raise QtvmError(f"'{path}' is not a readable ONNX model (not ONNX, or truncated)",
                        "re-export the model or check the download") from None
    if not model.graph.node or not model.opset_import:
        raise QtvmError(f"'{path}' is not a readable ONNX model (no graph nodes or opset)",
                        "re-export the model or check the download")
    if lazy:
        _locate_external_data(model, path.parent)
    sort_nodes(model.graph)
    from qtvm.frontend.ort_fused import NOTE_KEY, decompose_fused

    for i, note in enumerate(decompose_fused(model)):  # onnxruntime's fused BERT ops as the standard ops they fuse
        model.metadata_props.add(key=f"{NOTE_KEY}.{i}", value=note)
    return model


def _outer_reads(node: onnx.NodeProto) -> set[str]:
    """Names ``node``'s subgraphs (If branches, Loop bodies) read from enclosing graphs."""
    out: set[str] = set()
    for sub in subgraphs(node):
        made = {i.name for i in sub.input} | {t.name for t in sub.initializer}
        for inner in sub.node:
            out |= {n for n in (*inner.input, *_outer_reads(inner)) if n and n not in made}
            made |= set(inner.output)
    return out


def sort_nodes(graph: onnx.GraphProto, outer: frozenset = frozenset()) -> None:
    """Nodes in an order that defines each name before it is read, in place, in ``graph`` and its
    subgraphs, where they are not already: onnxruntime's float16 converter (``keep_io_types``)
    appends its input Casts after the nodes that read them, and onnxruntime runs such a file while
    ONNX's checker refuses it. Stable (of the nodes ready, the first in the file goes first); a
    graph that no order fixes (a name nothing makes, a cycle) is left as it is, for the checker."""
    import heapq

    known = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    made_here = {o for n in graph.node for o in n.output}
    for node in graph.node:
        for sub in subgraphs(node):
            sort_nodes(sub, frozenset(known | made_here))
    needs = [(set(n.input) | _outer_reads(n)) - known for n in graph.node]
    made: set[str] = set()
    for need, node in zip(needs, graph.node):
        if not need <= made:
            break
        made.update(node.output)
    else:
        return  # in order already
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    if any(name not in producer for need in needs for name in need):
        return  # a name nothing makes
    waiting = [len(need) for need in needs]
    readers: dict[str, list[int]] = {}
    for i, need in enumerate(needs):
        for name in need:
            readers.setdefault(name, []).append(i)
    heap = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for name in graph.node[i].output:
            for r in readers.pop(name, ()):
                waiting[r] -= 1
                if waiting[r] == 0:
                    heapq.heappush(heap, r)
    if len(order) < len(graph.node):
        return  # a cycle
    copies = [onnx.NodeProto() for _ in order]
    for c, i in zip(copies, order):
        c.CopyFrom(graph.node[i])
    del graph.node[:]
    graph.node.extend(copies)


def _locate_external_data(model: onnx.ModelProto, base: Path) -> None:
    """Initializers' external locations made absolute (missing files named in one error); other
    external tensors (attributes, subgraphs' initializers: rare) loaded now, as ``onnx.load`` would."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

    missing = set()
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = next((e for e in t.external_data if e.key == "location"), None)
        where = base / entry.value if entry is not None else None
        if where is None or not where.is_file():
            missing.add(entry.value if entry is not None else f"(no location for '{t.name}')")
        else:
            entry.value = str(where.resolve())
    if missing:
        raise QtvmError(f"the model's external weight files are missing: {', '.join(sorted(missing))}",
                        f"put them beside the model in {base}")
    for t in _get_all_tensors(model):  # (protobuf's wrappers are new objects each time: tell by the path)
        if t.data_location == onnx.TensorProto.EXTERNAL and not any(
                e.key == "location" and os.path.isabs(e.value) for e in t.external_data):
            load_external_data_for_tensor(t, str(base))


#: ONNX element types a file holds exactly as numpy does in memory (on a little-endian host)
_MAPPABLE = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT8,
             onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
             onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64}
MAP_ALIGN = 64  # TVM takes memory it is handed only at 64-byte alignment


class MappedWeights:
    """External initializers as copy-on-write views of their files (one mapping per file).

    A compile reads each float weight once, to pack it: read through a mapping, its pages are
    the file's, which the kernel reclaims under pressure, not memory the compile holds (a copy
    held every float weight until the packing ended: the model's size on top of the peak).
    Where a tensor cannot be a view (not 64-byte aligned in its file, a type numpy does not
    lay out as ONNX does, a big-endian host) ``array`` answers None and the caller copies it."""

    def __init__(self):
        self._maps: dict[str, mmap.mmap] = {}

    def array(self, t: onnx.TensorProto):
        if t.data_location != onnx.TensorProto.EXTERNAL or t.data_type not in _MAPPABLE or sys.byteorder != "little":
            return None
        info = {e.key: e.value for e in t.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        count = math.prod(t.dims)
        offset, nbytes = int(info.get("offset", 0)), count * dtype.itemsize
        if nbytes == 0 or offset % MAP_ALIGN or int(info.get("length", nbytes)) != nbytes:
            return None
        path = info["location"]
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if offset + nbytes > len(self._maps[path]):
            return None  # a short file: the copy's read names it
        return np.frombuffer(self._maps[path], dtype, count, offset).reshape(tuple(t.dims))


def tensor_array(t: onnx.TensorProto):
    """A tensor's value as numpy, read from its external file where it has one (one tensor at a
    time, in a message of its own: the model's stays as small as it was loaded)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    with open(info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        data = f.read(int(info["length"]) if "length" in info else -1)
    inline = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=data)
    return onnx.numpy_helper.to_array(inline)


def parse_dim_options(items) -> dict[str, str]:
    """``--dim NAME=EXPR`` options -> {NAME: EXPR}; malformed ones all named in one error."""
    from qtvm import dims as dimexpr

    out, bad = {}, []
    for item in items or ():
        name, sep, expr = str(item).partition("=")
        name, expr = name.strip(), expr.strip()
        if not sep or not name or not expr or dimexpr.parse(name) is not None or \
                (dimexpr.parse(expr) is None and not dimexpr.symbols(expr)[0].isidentifier()):
            bad.append(repr(str(item)))
        else:
            out[name] = expr
    if bad:
        raise QtvmError(f"--dim {', '.join(bad)} is not NAME=EXPRESSION",
                        "e.g. --dim s53='past + seq' (an input's dim name, then + - * // of the other dims)")
    return out


def rename_dims(model: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Give input dims named by the exporter (``s53``, ``unk__0``) the expression the user
    states they equal (``past + seq``), in place: an exporter that cannot name a dim as an
    expression (torch.export's dims derive from one symbol) leaves the compiler a fresh
    symbol it cannot relate to the others. The runtime checks inputs against the expression."""
    if not renames:
        return
    used = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
    unknown = [name for name in renames if name not in used]
    if unknown:
        raise QtvmError(f"--dim names {', '.join(repr(n) for n in unknown)}, which no input dim is called "
                        f"(the inputs' dims: {', '.join(sorted(used)) or 'none named'})",
                        "name a dim as the model's inputs do (`qtvm compile` errors name them)")
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in renames:
                d.dim_param = renames[d.dim_param]


def validate(model: onnx.ModelProto, name: str = "model") -> None:
    """Unsupported ops, attributes and dtypes first (all named at once), then the ONNX checker."""
    from qtvm.frontend.op_support import unsupported_features

    missing = unsupported_ops(model)
    problems = ([f"unsupported ONNX ops: {', '.join(missing)}"] if missing else []) + unsupported_features(model)
    if problems:
        raise QtvmError("; ".join(problems), "re-export without them, or file an issue naming them")
    light = weightless_copy(model, dims=False)
    # onnxruntime registers some ops in ONNX's own domain (onnxruntime-genai's builder writes them
    # there); the checker knows only ONNX's ops there, so they are checked as a custom domain's
    moved = [n for n in light.graph.node if n.domain in ("", "ai.onnx") and n.op_type in ORT_DEFAULT_DOMAIN_OPS]
    for n in moved:
        n.domain = "qtvm.ort"
    if moved:
        light.opset_import.add(domain="qtvm.ort", version=1)
    try:
        onnx.checker.check_model(light)
    except Exception as e:
        first = str(e).strip().splitlines()[0].rstrip(".")
        raise QtvmError(f"{name} fails the ONNX checker: {first}", "re-export the model") from None


#: ops onnxruntime registers in ONNX's own domain (onnxruntime-genai's builder writes them there)
ORT_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization",)

#: initializers of more elements than this carry no data in ``weightless_copy``
_STUB_ELEMENTS = 1 << 14


def weightless_copy(model: onnx.ModelProto, dims: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers carry no data, for onnx's checker and shape
    inference: both serialize the model they are given, a second copy of every weight, and
    fail past protobuf's 2 GiB (onnxruntime-genai's int4 files of 3B parameters are larger).
    With ``dims``, a stub keeps its type and dims and says its data is external (shape
    inference reads no initializer that large); without, it is an empty tensor of its type
    (the checker would look for the external file, and reads no initializer's dims)."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    for t in model.graph.initializer:
        if math.prod(t.dims) <= _STUB_ELEMENTS and t.data_location != onnx.TensorProto.EXTERNAL:
            # (protobuf's ByteSize walks the data: slow)
            light.graph.initializer.add().CopyFrom(t)
            continue
        stub = light.graph.initializer.add(name=t.name, data_type=t.data_type)
        if dims:
            stub.dims.extend(t.dims)
            stub.data_location = onnx.TensorProto.EXTERNAL
            stub.external_data.add(key="location", value="qtvm-weightless-copy")
        else:
            stub.dims.append(0)
    return light


def _copy_fields(src, dst, skip: str) -> None:
    """Every set field of protobuf message ``src`` but ``skip`` into ``dst`` (a fresh message)."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def unsupported_ops(model: onnx.ModelProto) -> list[str]:
    """Every op type TVM's ONNX importer lacks, in the graph and its subgraphs (domain-qualified
    if not default)."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    from qtvm.frontend.converters import CONVERTERS

    known = set(_get_convert_map()) | set(CONVERTERS) | {"Constant", "If"}
    missing = set()
    for node in (n for graph, _ in graph_scopes(model.graph) for n in graph.node):
        custom_domain = node.domain not in ("", "ai.onnx")
        if (node.domain, node.op_type) in QTVM_READS:
            continue
        if f"{node.domain}.{node.op_type}" in CONVERTERS:  # qtvm's own, e.g. com.microsoft.GroupQueryAttention
            continue
        if custom_domain or node.op_type not in known:
            missing.add(f"{node.domain}.{node.op_type}" if custom_domain else node.op_type)
    return sorted(missing)


def declared_dims(value_info) -> list:
    shape = value_info.type.tensor_type.shape
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in shape.dim]


@dataclass
class WeightSource:
    """Where a MatMul/Gemm's constant weight comes from: the 2-D float tensor ``array``
    (an initializer's or a Constant node's value, ``name``), stored [N, K] when
    ``transposed`` (Gemm transB, or a Transpose node on the way), else [K, N]."""

    node: onnx.NodeProto
    index: int  # of node in graph.node
    name: str
    tensor: onnx.TensorProto
    transposed: bool
    graph: onnx.GraphProto  # the model's graph, or the subgraph (an If branch) holding node

    @property
    def array(self):
        """The weight as a numpy array, as stored (a copy: read it where it is used)."""
        return tensor_array(self.tensor)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """A node's graph attributes (an If's branches, a Loop's or Scan's body)."""
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a (sub)graph's nodes read, nested subgraphs included."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for g in subgraphs(node):
            names |= graph_reads(g)
    return names


def graph_scopes(graph: onnx.GraphProto, outer: tuple = ()):
    """(graph, the graphs enclosing it) for ``graph`` and every subgraph under it (If branches,
    Loop and Scan bodies), depth first: a subgraph reads its enclosing graphs' names."""
    yield graph, outer
    for node in graph.node:
        for sub in subgraphs(node):
            yield from graph_scopes(sub, (*outer, graph))


def passes_weight(node: onnx.NodeProto) -> bool:
    """Identity, or a 2-D Transpose: what a constant weight reaches a matmul's B through."""
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return node.op_type == "Identity" or node.op_type == "Transpose" and perm in (None, [1, 0])


def weight_sources(model: onnx.ModelProto, scopes: list | None = None) -> list[WeightSource]:
    """Every MatMul/Gemm whose B is a constant 2-D float weight (``WEIGHT_TYPES``), directly or through
    Identity and 2-D Transpose nodes (dynamo exports a tied lm_head as MatMul(x,
    Transpose(W))), in the graph and its subgraphs (TVM's importer keeps an If branch's
    weights as constants, and the quantizer packs them): the rule relay_passes.quantize_weights
    applies to the imported graph, so what is summarized, quantized and dequantized for
    reference is the same set. ``scopes``: ``graph_scopes(model.graph)``, where the caller
    needs each source's ``graph`` to be one of its objects."""
    out = []
    for graph, outer in (scopes if scopes is not None else graph_scopes(model.graph)):
        arrays = {t.name: t for g in (*outer, graph) for t in g.initializer}  # inner names shadow outer
        producer = {o: n for g in (*outer, graph) for n in g.node for o in n.output}
        for index, node in enumerate(graph.node):
            if node.op_type not in WEIGHT_OPS or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
                continue
            name = node.input[1]
            transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
            while name not in arrays and name in producer:
                p = producer[name]
                if p.op_type == "Constant" and any(a.name == "value" for a in p.attribute):
                    arrays[name] = next(a.t for a in p.attribute if a.name == "value")
                    break
                if not passes_weight(p):
                    break
                name, transposed = p.input[0], transposed != (p.op_type == "Transpose")
            tensor = arrays.get(name)
            if tensor is not None and len(tensor.dims) == 2 and tensor.data_type in WEIGHT_TYPES:
                out.append(WeightSource(node, index, name, tensor, transposed, graph))
    return out


@dataclass
class RoutedSource:
    """A mixture of experts' routed matmul as transformers' batched experts export it:
    MatMul(Gather(W, ids, axis=0), x) (``side`` 0: each W[e] stored [N, K]) or MatMul(x,
    Gather(W, ids)) (``side`` 1: [K, N]), W a 3-D float32/float16/bfloat16 initializer named ``name`` (GatherND
    by ids [S, 1] where torch.onnx's dynamo exporter writes it). The
    pass packs these where the target has the kernel (``relay_passes.quantize_weights``, which
    also checks x's shape), and ``qtvm check``'s reference dequantizes them then."""

    node: onnx.NodeProto
    gather: onnx.NodeProto
    name: str
    tensor: onnx.TensorProto
    side: int
    graph: onnx.GraphProto
    index: int  # the matmul's, in ``graph``


def routed_sources(model: onnx.ModelProto) -> list[RoutedSource]:
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        for side in (0, 1):
            gather = producer.get(node.input[side])
            along_experts = gather is not None and (
                gather.op_type == "Gather" and not any(a.name == "axis" and a.i for a in gather.attribute)
                or gather.op_type == "GatherND" and not any(a.name == "batch_dims" and a.i for a in gather.attribute))
            if not along_experts:
                continue
            tensor = inits.get(gather.input[0])
            if tensor is not None and len(tensor.dims) == 3 and tensor.data_type in WEIGHT_TYPES:
                out.append(RoutedSource(node, gather, tensor.name, tensor, side, graph, index))
                break
    return out


def summarize(model: onnx.ModelProto) -> OnnxSummary:
    scopes = list(graph_scopes(model.graph))
    constant = {(id(w.graph), w.index) for w in weight_sources(model, scopes)}
    s = OnnxSummary()
    name = lambda node, i: node.name or f"{node.op_type}_{i}"  # noqa: E731  (unnamed nodes: by position)
    for graph, _ in scopes:
        for i, node in enumerate(graph.node):
            if node.op_type in WEIGHT_OPS and node.domain in ("", "ai.onnx"):
                (s.weight_matmuls if (id(graph), i) in constant else s.float_matmuls).append(name(node, i))
    s.routed_matmuls = [name(src.node, src.index) for src in routed_sources(model)]
    inits = {t.name for t in model.graph.initializer}
    to_str = onnx.helper.tensor_dtype_to_np_dtype
    graph_inputs = [v for v in model.graph.input if v.name not in inits]
    s.inputs = [(v.name, str(to_str(v.type.tensor_type.elem_type)), declared_dims(v)) for v in graph_inputs]
    s.outputs = [(v.name, str(to_str(v.type.tensor_type.elem_type)), declared_dims(v)) for v in model.graph.output]
    return s


def import_onnx(model: onnx.ModelProto):
    """Relax IRModule with weights bound as constants and dim_params as symbols; shape
    subgraphs folded into expressions of those symbols (qtvm.frontend.importer), op forms
    TVM's converters get wrong repaired first (qtvm.frontend.rewrites)."""
    validate(model)
    from qtvm.frontend.importer import import_model
    from qtvm.frontend.rewrites import repair

    return import_model(repair(model))
