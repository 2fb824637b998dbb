"""``qtvm check MODEL.onnx ARTEFACT.so``: is this artefact right on this model?

Runs the artefact (qtvm's thin runtime) and onnxruntime on the same inputs at several
bindings of the symbolic dims and reports, per output, two relative errors
(max |a - b| / max |b|):

- against the float model: what the weight format costs (large for int2, small for int8);
- against onnxruntime running the same graph with the weights qtvm stored, dequantized
  (for ``--quant none`` artefacts, the float model itself): the compiler's own error. Above
  float rounding it means a miscompile, and the command exits 1.

``--act int8`` artefacts round every matmul input to int8 on purpose; their own error is
judged against a looser bound that the report states.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from qtvm.errors import QtvmError

FP32_TOLERANCE = 1e-4
INT8_ACT_TOLERANCE = 5e-2
DEFAULT_DIM_VALUES = (1, 3, 17)
_DTYPES = {"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"}


@dataclass
class OutputCheck:
    binding: dict
    name: str
    shape: tuple
    err_vs_float: float
    err_own: float


@dataclass
class CheckReport:
    tolerance: float
    reference: str  # what the "own" column compares with
    rows: list[OutputCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.err_own <= self.tolerance for r in self.rows)


def parse_shape(text: str) -> dict:
    """``batch=2,seq=33`` -> {'batch': 2, 'seq': 33}."""
    out = {}
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"\s*([^=\s]+)\s*=\s*(\d+)\s*", part)
        if not m or int(m.group(2)) < 1:
            raise QtvmError(f"--shape '{text}' is not of the form name=size,name=size with sizes >= 1",
                            "e.g. --shape batch=2,seq=33")
        out[m.group(1)] = int(m.group(2))
    return out


def default_bindings(dims: list[str]) -> list[dict]:
    """Three bindings, dims taking different values in each (so a swapped axis shows)."""
    if not dims:
        return [{}]
    n = len(DEFAULT_DIM_VALUES)
    return [{d: DEFAULT_DIM_VALUES[(i + j) % n] for j, d in enumerate(dims)} for i in range(n)]


def _symbolic_dims(inputs: list[dict]) -> list[str]:
    """The plain symbols of the inputs' dims (an expression such as ``past + seq`` follows
    from its symbols)."""
    from qtvm import dims as dimexpr

    dims = []
    for spec in inputs:
        for d in spec["shape"]:
            if isinstance(d, str) and d != "?":
                dims += [s for s in dimexpr.symbols(d) if s not in dims]
    return dims


def _evaluate(dim: str, binding: dict):
    from qtvm import dims as dimexpr

    return dimexpr.evaluate(dim, binding) if dimexpr.parse(dim) is not None else None


def random_feeds(inputs: list[dict], binding: dict, rng: np.random.Generator, int_high: int = 16) -> dict:
    """Float inputs ~ N(0, 1); integer inputs in [0, int_high) (valid token ids for any real
    vocabulary); booleans at random."""
    feeds = {}
    for spec in inputs:
        shape = []
        for d in spec["shape"]:
            if isinstance(d, int):
                shape.append(d)
            elif d in binding:
                shape.append(binding[d])
            elif _evaluate(d, binding) is not None:  # 'past + seq' of a KV-cache export
                shape.append(_evaluate(d, binding))
            else:
                raise QtvmError(f"input '{spec['name']}' has dim '{d}' with no size",
                                f"give it with --shape {d}=N")
        dtype = spec["dtype"]
        if dtype not in _DTYPES:
            raise QtvmError(f"input '{spec['name']}' has dtype {dtype}, which qtvm check cannot generate",
                            "pass it with --input NAME=FILE.npy")
        if dtype == "bool":
            feeds[spec["name"]] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            feeds[spec["name"]] = rng.integers(0, int_high, shape).astype(dtype)
        else:
            feeds[spec["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    g, w = got.astype(np.float64), want.astype(np.float64)
    if g.size == 0:
        return 0.0
    if not (np.isfinite(g) == np.isfinite(w)).all():
        return float("inf")
    finite = np.isfinite(w)
    if (g[~finite] != w[~finite]).any():
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.abs(g[finite] - w[finite]).max() / max(np.abs(w[finite]).max(), 1e-30))


def _session(model):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave the cores to qtvm
    opts.log_severity_level = 3  # its graph-cleanup warnings are not the user's business here
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
        raise QtvmError(f"onnxruntime cannot run the model ({str(e).strip().splitlines()[0][:200]})",
                        "qtvm check needs a model onnxruntime runs") from None


def _dequantized_reference(model, meta: dict):
    """(onnx model, description) of what the artefact must equal."""
    fmt_name = meta.get("format", "none")
    if fmt_name == "none" or "quantized_matmuls" not in meta:
        return model, "the float model (no weights were quantized)"
    from qtvm.formats import PRESETS, get_format
    from qtvm.reference import dequantized_model

    if fmt_name not in PRESETS:
        raise QtvmError(f"the artefact's format '{fmt_name}' cannot be rebuilt for a reference",
                        "check an artefact compiled with a preset from `qtvm formats`")
    return dequantized_model(model, get_format(fmt_name)), f"onnxruntime on the {fmt_name} weights dequantized"


def check(model_path, artefact, bindings: list[dict] | None = None, feeds: dict | None = None,
          tolerance: float | None = None, seed: int = 0, int_high: int = 16) -> CheckReport:
    """Compare ``artefact`` with onnxruntime on ``model_path`` at each binding."""
    import qtvm.formats  # noqa: F401 -- imports the compiler's TVM, which qtvm.runtime must not replace
    from qtvm import runtime
    from qtvm.frontend.onnx import load_onnx

    model = load_onnx(model_path)

    module = runtime.load(artefact)
    meta = module.metadata
    model_inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if model_inputs != [i["name"] for i in module.inputs]:
        raise QtvmError(f"the artefact takes inputs {[i['name'] for i in module.inputs]} but the model "
                        f"takes {model_inputs}", "pass the model the artefact was compiled from")
    ref_model, reference = _dequantized_reference(model, meta)
    int8 = meta.get("activations") == "int8"
    tol = tolerance if tolerance is not None else (INT8_ACT_TOLERANCE if int8 else FP32_TOLERANCE)
    if int8:
        reference += " (int8 activations: rounding of every matmul input is expected)"
    float_sess, ref_sess = _session(model), _session(ref_model)
    report = CheckReport(tol, reference)
    dims = _symbolic_dims(module.inputs)
    if feeds is not None:
        runs = [({}, feeds)]
    else:
        rng = np.random.default_rng(seed)
        runs = [(b, random_feeds(module.inputs, b, rng, int_high)) for b in (bindings or default_bindings(dims))]
    for binding, feed in runs:
        got = module.run(feed)
        want_float = dict(zip([o.name for o in float_sess.get_outputs()], float_sess.run(None, feed)))
        want_ref = dict(zip([o.name for o in ref_sess.get_outputs()], ref_sess.run(None, feed)))
        for name, value in got.items():
            report.rows.append(OutputCheck(binding, name, tuple(value.shape), _rel(value, want_float[name]),
                                           _rel(value, want_ref[name])))
    return report


def format_report(report: CheckReport) -> str:
    lines = [f"{'shape binding':<24} {'output':<20} {'shape':<18} {'vs float':>10} {'own error':>10}"]
    for r in report.rows:
        dims = ",".join(f"{k}={v}" for k, v in r.binding.items()) or "(given inputs)"
        flag = "" if r.err_own <= report.tolerance else "  <-- above tolerance"
        lines.append(f"{dims:<24} {r.name[:20]:<20} {str(list(r.shape)):<18} {r.err_vs_float:>10.3g} "
                     f"{r.err_own:>10.3g}{flag}")
    lines.append(f"own error: against {report.reference}; tolerance {report.tolerance:g}")
    lines.append("OK: the artefact computes what the model does, to float rounding" if report.ok else
                 "MISMATCH: the artefact's own error is above tolerance (a miscompile: please report it "
                 "with the model)")
    return "\n".join(lines)
