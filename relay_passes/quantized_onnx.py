"""Relax side of quantized ONNX in: markers -> packed kernels, then out of the signature.

``qtvm.frontend.quantized.lower_quantized`` turned every quantized weight of the
ONNX model into a marker: a function parameter of the weight's shape that only
MatMul/Gemm weights use. Here ``prepacked`` resolves ``matmul(x, marker)`` and
``matmul(x, permute_dims(marker))`` (Gemm transB) to the marker's repacked uniform
tensor, which ``relay_passes.quantize_weights`` emits with its usual kernels
(GEMV / prefill dispatch, int8 activations when asked), and ``drop_markers``
removes the then-unused parameters so the artefact takes the model's own inputs.
"""
from __future__ import annotations

import tvm
from tvm import relax

from qtvm.errors import QtvmError
from qtvm.formats.blockwise import BlockQuantized
from relay_passes.quantize_weights import PERMUTE, quantize_weights


def _marker_params(mod: tvm.IRModule, markers) -> dict[str, relax.Var]:
    params = {p.name: p for p in mod["main"].params}
    missing = [m for m in markers if m not in params]
    if missing:
        raise QtvmError(f"internal: TVM's importer lost the quantized weight placeholders {missing[:3]}",
                        "report this with the model attached")
    return {m: params[m] for m in markers}


def make_prepacked(mod: tvm.IRModule, weights: dict[str, BlockQuantized]):
    """The ``prepacked`` hook of ``quantize_weights`` for these markers (repacks once per use)."""
    params = _marker_params(mod, weights)
    by_var = {var: weights[name] for name, var in params.items()}

    def find(expr) -> BlockQuantized | None:
        for var, weight in by_var.items():
            if expr.same_as(var):
                return weight
        return None

    def prepacked(expr, lookup):
        transposed = False
        if isinstance(expr, relax.Var) and find(expr) is None:
            bound = lookup(expr)
            if bound is None:
                return None
            expr = bound
        if isinstance(expr, relax.Call) and expr.op == PERMUTE:
            axes = expr.attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None
            expr, transposed = expr.args[0], True
        weight = find(expr)
        return None if weight is None else weight.for_matmul(transposed)

    return prepacked


def drop_markers(mod: tvm.IRModule, markers) -> tvm.IRModule:
    """``main`` without the marker parameters; every use must have been rewritten."""
    if not markers:
        return mod
    params = _marker_params(mod, markers)
    main = relax.analysis.remove_all_unused(mod["main"])  # e.g. the permute_dims of a Gemm's weight
    used = relax.analysis.free_vars(main.body)
    left = [name for name, var in params.items() if any(var.same_as(u) for u in used)]
    if left:
        raise QtvmError(f"internal: quantized weights {left[:3]} are used by something other than a float32 "
                        "matmul", "report this with the model attached")
    keep = [p for p in main.params if not any(p.same_as(v) for v in params.values())]
    func = relax.Function(keep, main.body, main.ret_ty, main.is_pure, main.attrs, main.span)
    if main.attrs is not None and "num_input" in main.attrs:  # the importer counted the markers as inputs
        func = func.with_attr("num_input", int(main.attrs["num_input"]) - len(params))
    mod = mod.copy() if hasattr(mod, "copy") else mod
    mod["main"] = func
    return mod


def lower_prequantized(mod: tvm.IRModule, weights: dict[str, BlockQuantized], fmt, target, activations: str):
    """quantize_weights with the markers resolved first; returns (module without markers, report,
    how many of the report's layers are the model's own quantized weights)."""
    hook, count = None, [0]
    if weights:
        resolve = make_prepacked(mod, weights)

        def hook(expr, lookup):
            packed = resolve(expr, lookup)
            count[0] += packed is not None
            return packed
    mod, report = quantize_weights(mod, fmt, target, activations, hook)
    return drop_markers(mod, list(weights)), report, count[0]
