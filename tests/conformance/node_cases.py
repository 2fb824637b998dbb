"""ONNX's backend node tests through qtvm's own pipeline.

The onnx wheel carries its node tests as generators (``collect_testcases``): each case is a
one-node model (or its expanded function body) with input and expected output arrays. A case
goes through what a user runs: ``compile_model(..., quant="none")`` -> exported artefact ->
``qtvm.runtime`` -> outputs compared with ONNX's expected values at the case's own tolerance.

Outcomes: ``pass``; ``refused`` (a QtvmError at compile time: the op or attribute is named);
``wrong`` (numbers differ); ``error`` (anything else: a raw exception at compile or run time,
a QtvmError at run time on valid inputs). Only the first two are acceptable.
"""
from __future__ import annotations

import functools
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from qtvm.frontend.op_support import CONSTANT_INPUTS

ACCEPTABLE = ("pass", "refused")


@dataclass
class Outcome:
    name: str
    ops: tuple[str, ...]
    status: str
    detail: str = ""
    seconds: float = 0.0


@functools.lru_cache(maxsize=1)
def all_cases() -> dict:
    """name -> TestCase, for every node test the installed onnx wheel generates."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():  # the generators overflow casts on purpose
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return {c.name: c for c in collect_testcases(None)}


def case_ops(case) -> tuple[str, ...]:
    """The op types of a case's graph, domain-qualified outside the default domain."""
    ops = []
    for node in case.model.graph.node:
        name = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        if name not in ops:
            ops.append(name)
    return tuple(ops)


def _array(value) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _feeds(case, inputs) -> dict:
    initializers = {t.name for t in case.model.graph.initializer}
    names = [i.name for i in case.model.graph.input if i.name not in initializers]
    return {n: _array(v) for n, v in zip(names, inputs)}


def _low_precision_rtol(dtype) -> float:
    """Two ulps of a float16/bfloat16 output (0 for other types).

    ONNX's node tests compare at rtol 1e-3, finer than float16's own spacing (9.8e-4) and
    bfloat16's (7.8e-3): a graph that rounds each intermediate to its type, as the expanded
    Attention functions do, can then fail by one ulp against a reference that rounded
    elsewhere (onnxruntime's float16 QK^T differs from the exactly rounded product in 23 of
    its elements, qtvm's in none). Two ulps of the output type is the honest bound there.
    """
    import ml_dtypes

    if dtype == np.float16 or dtype == ml_dtypes.bfloat16:
        return 2 * float(ml_dtypes.finfo(dtype).eps)
    return 0.0


def _transform_atol(ops, want: np.ndarray, atol: float) -> float:
    """A DFT's outputs are sums over the signal: float32 rounds each to the scale of the
    largest, so an output that should be 0 is off by ~1e-7 of that. ONNX's expected inverse
    DFT is the signal its (float32-rounded) spectrum was made from: the exact float64 inverse
    of the spectrum given differs from it by 1.9e-6 (outputs up to 99), onnxruntime's by 1.9e-5,
    against an atol of 1e-7. One float32 step of the largest output is the honest bound."""
    if "DFT" not in ops or want.dtype.kind != "f" or not want.size:
        return atol
    return max(atol, float(np.abs(want).max()) * 2.0 ** -23)


def _mismatch(name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str | None:
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype and not (got.dtype.kind == want.dtype.kind == "b"):
        return f"{name}: dtype {got.dtype}, expected {want.dtype}"
    if want.dtype.kind in "biu":
        bad = got != want
    else:
        rtol = max(rtol, _low_precision_rtol(want.dtype))
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    worst = ""
    if want.dtype.kind in "fiu":
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        worst = f", max abs diff {np.nanmax(np.where(bad, diff, 0)):.3g}"
    return f"{name}: {int(bad.sum())} of {bad.size} elements differ{worst}"


#: Inputs that are parameters of the op (axes, shapes, pads, k, scales): exporters emit them as
#: constants; ONNX's node tests often feed them as graph inputs, which qtvm refuses by name.
PARAMETER_INPUTS = {  # those qtvm requires constant, and those it reads better so (Slice, Tile, ...)
    **CONSTANT_INPUTS, **{op: (1,) for op in ("Tile", "Squeeze", "Unsqueeze", "Trilu")},
    "Slice": (1, 2, 3, 4), "Range": (0, 1, 2), "Clip": (1, 2),
}


def with_constant_parameters(case):
    """A copy of the case whose parameter inputs (PARAMETER_INPUTS) are initializers holding the
    test's values (the form exporters produce), or None when it has none or they vary by data set."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    graph_inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    frozen = set()
    for node in model.graph.node:
        for pos in PARAMETER_INPUTS.get(node.op_type, ()):
            if pos < len(node.input) and node.input[pos] in graph_inputs:
                frozen.add(node.input[pos])
    if not frozen:
        return None
    index = {name: i for i, name in enumerate(graph_inputs)}
    for name in sorted(frozen):
        values = [_array(inputs[index[name]]) for inputs, _ in case.data_sets]
        if any(not np.array_equal(values[0], v) for v in values[1:]):
            return None
        model.graph.initializer.append(numpy_helper.from_array(values[0], name))
    kept = [i for i in model.graph.input if i.name not in frozen]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    data_sets = [([v for n, v in zip(graph_inputs, inputs) if n not in frozen], outputs)
                 for inputs, outputs in case.data_sets]
    return type(case)(**{**case.__dict__, "model": model, "data_sets": data_sets,
                         "name": f"{case.name}_constant_parameters"})


def run_case(case, workdir: str | os.PathLike | None = None, target: str = "host") -> Outcome:
    """One node test through compile -> export -> qtvm.runtime -> compare."""
    from qtvm.errors import QtvmError
    from qtvm.pipeline import compile_model

    start = time.perf_counter()
    ops = case_ops(case)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        model_path, artefact = Path(tmp) / f"{case.name}.onnx", Path(tmp) / f"{case.name}.so"
        onnx.save(case.model, str(model_path))
        try:
            compile_model(model_path, artefact, target, "none")
        except QtvmError as e:
            return Outcome(case.name, ops, "refused", str(e), time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 -- any raw exception is the defect being counted
            return Outcome(case.name, ops, "error", f"compile: {type(e).__name__}: {_last_line(e)}",
                           time.perf_counter() - start)
        try:
            from qtvm import runtime

            module = runtime.load(artefact)
            problems = []
            for inputs, outputs in case.data_sets:
                got = module.run(_feeds(case, inputs))
                for spec, want in zip(module.outputs, outputs):
                    problem = _mismatch(spec["name"], got[spec["name"]], _array(want), case.rtol,
                                        _transform_atol(ops, _array(want), case.atol))
                    if problem:
                        problems.append(problem)
        except Exception as e:  # noqa: BLE001
            return Outcome(case.name, ops, "error", f"run: {type(e).__name__}: {_last_line(e)}",
                           time.perf_counter() - start)
    status = "wrong" if problems else "pass"
    return Outcome(case.name, ops, status, "; ".join(problems[:3]), time.perf_counter() - start)


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else ""
