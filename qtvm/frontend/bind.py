"""``--bind NAME=VALUE``: a model input fixed at compile time, and the If branches it chooses inlined.

optimum's merged decoder (``decoder_model_merged.onnx``, as transformers.js and older optimum
exports ship it) holds the no-past and the with-past decoder as the two branches of an If on
its bool input ``use_cache_branch``. TVM's importer converts If branches without qtvm's
symbolic shape folding, so a whole decoder in a branch does not import. Bound, the chosen
branch is the graph: ``use_cache_branch=1`` leaves the with-past decoder, which a first step
runs with a past of length 0 (what qtvm's KV step and ``qtvm generate`` do).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtvm.errors import QtvmError
from qtvm.frontend.onnx import declared_dims, graph_reads, graph_scopes, is_float_dtype, subgraphs

_TRUE, _FALSE = ("1", "true", "True"), ("0", "false", "False")


def parse_bind_options(items) -> dict[str, str]:
    """``--bind NAME=VALUE`` options -> {NAME: VALUE}; malformed ones all named in one error."""
    out, bad = {}, []
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip() or not value.strip():
            bad.append(repr(str(item)))
        else:
            out[name.strip()] = value.strip()
    if bad:
        raise QtvmError(f"--bind {', '.join(bad)} is not NAME=VALUE", "e.g. --bind use_cache_branch=1")
    return out


def bound_value(vi: onnx.ValueInfoProto, text: str) -> np.ndarray | str:
    """The bound tensor (the input's dtype, filled to its fixed shape), or why not."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return "not a tensor"
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    if None in dims:
        return f"its shape {declared_dims(vi)} is not fixed"
    dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
    try:
        if dtype == np.bool_:
            if text not in _TRUE + _FALSE:
                return f"'{text}' is not a bool (1, 0, true, false)"
            value = text in _TRUE
        elif np.issubdtype(dtype, np.integer):
            value = int(text)
        elif is_float_dtype(dtype):
            value = float(text)
        else:
            return f"its dtype {dtype} cannot be bound"
    except ValueError:
        return f"'{text}' is not a {dtype} value"
    return np.full(dims, value, dtype)


def bind_inputs(model: onnx.ModelProto, binds: dict[str, str]) -> list[str]:
    """Inputs in ``binds`` become constants, in place; an If on one of them is replaced by the
    branch it takes (in every scope), and inputs and initializers nothing reads any more are
    dropped. Returns notes saying what was chosen and dropped."""
    if not binds:
        return []
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    inputs = {vi.name: vi for vi in graph.input if vi.name not in inits}
    problems = []
    values = {}
    for name, text in binds.items():
        if name not in inputs:
            problems.append(f"'{name}' is not an input of the model")
            continue
        value = bound_value(inputs[name], text)
        if isinstance(value, str):
            problems.append(f"'{name}': {value}")
        else:
            values[name] = value
    if problems:
        raise QtvmError(f"--bind: {'; '.join(problems)}",
                        f"bind inputs of fixed shape by name (the model's inputs: {', '.join(inputs)})")
    kept = [vi for vi in graph.input if vi.name not in values]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in values.items())
    chosen = _inline_branches(model, graph, values)
    dropped = _drop_unread(graph, set(inputs) - set(values)) if chosen else []
    notes = [f"--bind {name}={binds[name]}: the model's input is that constant" for name in values]
    if chosen:
        notes.append(f"{len(chosen)} If nodes on bound inputs replaced by the branch taken ({', '.join(chosen[:4])})")
    if dropped:
        notes.append(f"inputs only the other branch read are dropped: {', '.join(dropped)}")
    notes += _mask_after_past(graph) if chosen else []
    return notes


def _all_names(model: onnx.ModelProto) -> set[str]:
    names = set()
    for g, _ in graph_scopes(model.graph):
        names |= {v.name for v in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
        names |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    return names


def _inline_branches(model: onnx.ModelProto, graph: onnx.GraphProto, values: dict) -> list[str]:
    """Each If in ``graph`` and its subgraphs whose condition is a bound input, replaced by its
    chosen branch's nodes (its names that clash with the model's renamed; its outputs named as
    the If's)."""
    chosen = []
    while True:
        found = next(((i, n) for i, n in enumerate(graph.node)
                      if n.op_type == "If" and n.input and n.input[0] in values), None)
        if found is None:
            break
        index, node = found
        take = "then_branch" if bool(values[node.input[0]].reshape(-1)[0]) else "else_branch"
        branch = next(a.g for a in node.attribute if a.name == take)
        chosen.append(f"{node.name or 'If'}: {take.split('_')[0]}")
        del graph.node[index]  # first: its branches' names are not taken by the rest of the model
        nodes, initializers = _renamed_branch(branch, list(node.output), _all_names(model))
        for offset, n in enumerate(nodes):
            graph.node.insert(index + offset, n)
        graph.initializer.extend(initializers)
    for n in graph.node:
        for sub in subgraphs(n):
            chosen += _inline_branches(model, sub, values)
    return chosen


def _renamed_branch(branch: onnx.GraphProto, outputs: list[str], taken: set[str]):
    """The branch's nodes and initializers, with its own names moved off ``taken`` and its
    outputs renamed to ``outputs`` (an Identity where an output is not a node's own)."""
    own = [o for n in branch.node for o in n.output if o] + [t.name for t in branch.initializer]
    rename = {}
    for name in own:
        new, k = name, 0
        while new in taken:
            k += 1
            new = f"{name}__{branch.name or 'branch'}{k}"
        rename[name] = new
        taken.add(new)
    produced = {o for n in branch.node for o in n.output}
    identities, named = [], set()
    for out, target in zip((o.name for o in branch.output), outputs):
        if out in produced and out not in named:  # the node that makes it writes the If's output
            named.add(out)
            rename[out] = target
        else:  # an outer value, or one value given twice
            identities.append(helper.make_node("Identity", [rename.get(out, out)], [target]))
    nodes = []
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        _rename_reads(copy, rename)
        copy.output[:] = [rename.get(o, o) for o in copy.output]
        nodes.append(copy)
    initializers = []
    for t in branch.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        copy.name = rename[t.name]
        initializers.append(copy)
    return nodes + identities, initializers


def _rename_reads(node: onnx.NodeProto, rename: dict) -> None:
    """A node's inputs, and what its subgraphs read from outside, renamed."""
    node.input[:] = [rename.get(i, i) for i in node.input]
    for sub in subgraphs(node):
        for n in sub.node:
            _rename_reads(n, rename)
        for o in sub.output:
            o.name = rename.get(o.name, o.name)


def _drop_unread(graph: onnx.GraphProto, candidates: set[str]) -> list[str]:
    """Initializers and the ``candidates`` inputs that nothing reads (the branch not taken's)."""
    read = graph_reads(graph) | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    dropped = [vi.name for vi in graph.input if vi.name in candidates and vi.name not in read]
    kept_inputs = [vi for vi in graph.input if vi.name not in dropped]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    return dropped


def _mask_after_past(graph: onnx.GraphProto) -> list[str]:
    """A merged decoder declares its inputs as the no-past decoder does: ``attention_mask``
    [batch, sequence_length], the ids' length (or a name of its own). The with-past branch reads
    a mask over the past and the new tokens, so where past_key_values inputs remain its length
    is restated as ``past + sequence`` (the with-past export's own declaration)."""
    by_name = {vi.name: vi for vi in graph.input}
    ids, mask = by_name.get("input_ids"), by_name.get("attention_mask")
    pasts = [vi for name, vi in by_name.items() if name.startswith("past_key_values")]
    if ids is None or mask is None or not pasts:
        return []
    seq, length = _dim(ids, 1), _dim(mask, 1)
    past = {_dim(vi, 2) for vi in pasts}
    elsewhere = [d.dim_param for vi in graph.input if vi is not mask for d in vi.type.tensor_type.shape.dim]
    if seq is None or len(past) != 1 or None in past or length is None or (length != seq and length in elsewhere):
        return []
    total = f"{past.pop()} + {seq}"
    mask.type.tensor_type.shape.dim[1].dim_param = total
    return [f"attention_mask's length restated as '{total}' (the merged decoder declares the no-past "
            f"decoder's, '{length}')"]


def _dim(vi: onnx.ValueInfoProto, axis: int) -> str | None:
    dims = vi.type.tensor_type.shape.dim
    return dims[axis].dim_param or None if len(dims) > axis else None
