"""`qtvm quantize-report`: what each weight format does to a model's weights and outputs.

For every MatMul/Gemm whose weight (input B) is a constant initializer -- the
rule of ``qtvm.reference`` (a Gemm with ``transB`` has its B transposed to
[K, N]; a weight shared by several nodes counts once; non-2-D or non-float32
initializers are skipped) -- and every preset, the report gives

- bits per weight counted from the stored arrays (``QuantizedTensor.bits_per_weight``:
  codes, scales, zeros, outliers, padding, everything the format keeps);
- max abs error, mean abs error and relative Frobenius error
  ||W - W_q||_F / ||W||_F of the dequantized weight;

and per preset the model-level error: onnxruntime runs the float model and the
model with every such weight replaced by its dequantized value (the model
``qtvm.reference.dequantized_model`` builds; here built from the same quantized
tensors the per-layer numbers come from, so each weight is quantized once), and
each float output is compared: max abs error, relative max error
(max |y - y_q| / max |y|), and cosine similarity of the output rows (vectors along
the last axis: mean and min over rows) and of the whole flattened output.

Inputs. ``inputs`` (``--input NAME=FILE.npy``) are the model inputs of the output
comparison; ``calib`` (``--calib-input NAME=FILE.npy``) those of calibration.
Either one alone serves both (then calibrated formats are judged on the data
they were calibrated on, which flatters them: GPTQ with fewer samples than K
can fit those very activations almost exactly). Without either, synthetic inputs
are made, from ``seed`` for the comparison and ``seed + 1`` for calibration: a
symbolic first dim is 2, other symbolic dims 16; an integer input
that indexes a Gather of a constant table gets random ids below the table's
first dimension, other integer inputs (masks) are ones, float inputs are
standard normal.

Calibration. Formats whose ``quantize`` takes ``calib_x`` (mixed-2-4-16 uses it
for its Hessian sensitivity) and GPTQ rows (``gptq:<uniform preset>``, e.g.
``gptq:int4-g128``, through ``qtvm.formats.gptq.gptq_quantize``) need each
layer's input activations X [S, K]. They are collected from one onnxruntime run
of the *float* model on the inputs above, with each layer's input tensor (MatMul
input A; a Gemm with ``transA`` contributes A^T) added as an extra graph output;
the tensor is reshaped to [-1, K] (every position of every batch row is a sample,
padding included), and a weight shared by several nodes gets their rows
concatenated. Every layer is calibrated on float activations (GPTQ's reference
implementation instead feeds each layer the outputs of the already-quantized
layers before it).

Nothing here imports tvm, numpy or onnx at module level, so the CLI stays fast.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qtvm.atomic import atomic_file
from qtvm.errors import QtvmError

DEFAULT_PRESETS = ("int2-g64", "int3-g128", "int4-g128", "int8-g128", "bcq3-g128", "e0m4-g128", "mixed-2-4-16")
GPTQ_PREFIX = "gptq:"
SYNTH_BATCH, SYNTH_DIM = 2, 16


# -- results ---------------------------------------------------------------------------
@dataclass
class LayerError:
    preset: str
    node: str  # the consuming MatMul/Gemm (first one if the weight is shared)
    weight: str  # initializer name
    k: int
    n: int
    bits_per_weight: float
    max_abs_err: float
    mean_abs_err: float
    rel_fro_err: float


@dataclass
class OutputError:
    name: str
    max_abs_err: float
    rel_max_err: float
    cos_mean: float  # cosine similarity of rows along the last axis
    cos_min: float
    cos_flat: float  # cosine similarity of the whole flattened output


@dataclass
class FormatSummary:
    preset: str
    calibrated: bool
    bits_per_weight: float  # stored bits / weights over all quantized weights
    mean_rel_fro_err: float  # mean over layers
    mean_abs_err: float  # over all weights (weight-count weighted)
    max_abs_err: float
    outputs: list[OutputError]
    seconds: float


@dataclass
class Report:
    model: str
    presets: list[str]
    weights: int  # number of quantized weight matrices
    weight_count: int  # scalars in them
    inputs: dict  # of the output comparison: name -> {"shape", "dtype", "source"}
    calibration_inputs: dict | str  # the same, or "same as inputs"
    layers: list[LayerError] = field(default_factory=list)
    summary: list[FormatSummary] = field(default_factory=list)
    # With keep_outputs=True: the float model's outputs ("float") and each preset's (not in the JSON).
    outputs: dict = field(default_factory=dict, repr=False)

    # -- queries ------------------------------------------------------------------
    def format_summary(self, preset: str) -> FormatSummary:
        for s in self.summary:
            if s.preset == preset:
                return s
        raise QtvmError(f"the report has no preset '{preset}'", f"it has: {', '.join(self.presets)}")

    def layer_errors(self, preset: str) -> list[LayerError]:
        self.format_summary(preset)
        return [row for row in self.layers if row.preset == preset]

    def mae_ratio(self, preset: str, baseline: str) -> float:
        """MAE(preset) / MAE(baseline) over all quantized weights (Transformer-Lite Table 2 style)."""
        den = self.format_summary(baseline).mean_abs_err
        return self.format_summary(preset).mean_abs_err / den if den else math.inf

    # -- output --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in ("model", "presets", "weights", "weight_count", "inputs",
                                           "calibration_inputs")}
        d["layers"] = [asdict(r) for r in self.layers]
        d["summary"] = [asdict(s) for s in self.summary]
        return _finite(d)

    def write_json(self, path: str | os.PathLike) -> Path:
        """Atomic: the file is either the complete report or untouched."""
        path = _check_json_path(path)
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        with atomic_file(path, "w") as f:
            f.write(text + "\n")
        return path

    def layer_table(self) -> str:
        head = ["layer", "weight", "K x N", "format", "bits/w", "max|err|", "mean|err|", "rel.Frob"]
        order: dict[str, int] = {}
        for r in self.layers:
            order.setdefault(r.weight, len(order))
        ranked = sorted(self.layers, key=lambda r: (order[r.weight], self.presets.index(r.preset)))
        rows = [[r.node, r.weight, f"{r.k}x{r.n}", r.preset, f"{r.bits_per_weight:.3f}", _g(r.max_abs_err),
                 _g(r.mean_abs_err), _g(r.rel_fro_err)] for r in ranked]
        return _text_table(head, rows)

    def summary_table(self, markdown: bool = False) -> str:
        head = ["format", "bits/w", "mean rel.Frob", "weight MAE", "output", "out max|err|", "out rel.max",
                "cos mean", "cos min", "seconds"]
        rows = []
        for s in self.summary:
            for i, o in enumerate(s.outputs or [None]):
                first = [s.preset + (" (calibrated)" if s.calibrated else ""), f"{s.bits_per_weight:.3f}",
                         _g(s.mean_rel_fro_err), _g(s.mean_abs_err)] if i == 0 else ["", "", "", ""]
                out = ([o.name, _g(o.max_abs_err), _g(o.rel_max_err), f"{o.cos_mean:.5f}", f"{o.cos_min:.5f}"]
                       if o else ["-", "-", "-", "-", "-"])
                rows.append(first + out + [f"{s.seconds:.1f}" if i == 0 else ""])
        return _markdown_table(head, rows) if markdown else _text_table(head, rows)


def _g(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _finite(obj):
    """NaN/Inf -> None so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _markdown_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _check_json_path(path) -> Path:
    from qtvm.pipeline import check_output_path

    return check_output_path(path, "--json", "report.json")


# -- presets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Preset:
    name: str
    fmt: object  # QuantFormat
    gptq: bool
    calibrated: bool


def resolve_presets(names) -> list[_Preset]:
    """Validate every name first (all unknown names reported at once)."""
    import inspect

    from qtvm.formats import PRESETS
    from qtvm.formats.uniform import UniformFormat

    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise QtvmError("no formats to report on", f"pass e.g. --formats {','.join(DEFAULT_PRESETS[:3])}")
    out, bad = [], []
    for name in dict.fromkeys(names):
        base = name.removeprefix(GPTQ_PREFIX)
        fmt = PRESETS.get(base)
        if fmt is None:
            bad.append(name)
            continue
        if name.startswith(GPTQ_PREFIX):
            if not isinstance(fmt, UniformFormat):
                raise QtvmError(f"'{name}': GPTQ quantizes to uniform formats only, not {base}",
                                "use gptq:<intB-gG>, e.g. gptq:int4-g128")
            out.append(_Preset(name, fmt, True, True))
        else:
            takes_calib = "calib_x" in inspect.signature(fmt.quantize).parameters
            out.append(_Preset(name, fmt, False, takes_calib))
    if bad:
        raise QtvmError(f"unknown format preset{'s' if len(bad) > 1 else ''} {', '.join(repr(b) for b in bad)}",
                        f"valid presets: {', '.join(PRESETS)}; and gptq:<uniform preset> (e.g. gptq:int4-g128)")
    return out


# -- the model's weights ---------------------------------------------------------------------
@dataclass
class _Weight:
    init_name: str  # the stored tensor's name: an initializer's, or a Constant node's output
    nodes: list[str]
    act_inputs: list[tuple[str, bool]]  # (node input A, transA)
    trans_b: bool  # stored [N, K]: Gemm transB, or a Transpose on the way (a tied lm_head)
    k: int
    n: int
    tensor: object = None  # the onnx.TensorProto holding it, as stored


def constant_weights(model, required: bool = True) -> list[_Weight]:
    """The weights the compiler quantizes (``qtvm.frontend.onnx.weight_sources``: float32, float16
    or bfloat16, through Transposes and Constant nodes too, as ``qtvm.reference.dequantized_model``)
    in the model's own graph (the report reads each layer's input as a graph output), with their
    consumers.

    Raises QtvmError when there are none (``required``), or when one holds NaN/Inf (naming it).
    """
    import onnx

    from qtvm.formats.base import check_weight
    from qtvm.frontend.onnx import WEIGHT_TYPES, tensor_array, weight_sources

    by_name: dict[str, _Weight] = {}
    for src in weight_sources(model, [(model.graph, ())]):
        node = src.node
        node_name = node.name or f"{node.op_type}_{src.index}"
        trans_a = node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute)
        if src.name in by_name:  # shared: quantized once (as its first consumer sees it), calibrated by all
            w = by_name[src.name]
            if w.trans_b == src.transposed:
                w.nodes.append(node_name)
                w.act_inputs.append((node.input[0], trans_a))
            continue
        if len(src.tensor.dims) != 2 or src.tensor.data_type not in WEIGHT_TYPES:
            continue
        rows, cols = (int(d) for d in src.tensor.dims)
        k, n = (cols, rows) if src.transposed else (rows, cols)
        by_name[src.name] = _Weight(src.name, [node_name], [(node.input[0], trans_a)], src.transposed, k, n,
                                    src.tensor)
    if not by_name and required:
        raise QtvmError("the model has no MatMul/Gemm with a constant float 2-D weight, so there is nothing "
                        "to quantize", "export with constant folding so Linear weights become MatMul/Gemm "
                        "initializers")
    for w in by_name.values():
        check_weight(tensor_array(w.tensor), _what(w))
    return list(by_name.values())


def _what(w: _Weight) -> str:
    return f"weight '{w.init_name}' of {w.nodes[0]}"


def _kn(w: _Weight):
    import numpy as np

    from qtvm.frontend.onnx import tensor_array

    a = tensor_array(w.tensor).astype(np.float32, copy=False)
    return np.ascontiguousarray(a.T if w.trans_b else a)


# -- inputs -------------------------------------------------------------------------------------
def graph_inputs(model) -> list:
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def prepare_inputs(model, calib: dict | None, seed: int = 0) -> tuple[dict, dict]:
    """(feeds, description): the given inputs checked and cast, or synthetic ones (module doc)."""
    import numpy as np
    from onnx import helper

    from qtvm.frontend.onnx import is_float_dtype

    specs = graph_inputs(model)
    feeds, desc = {}, {}
    if calib is not None:
        names = [v.name for v in specs]
        unknown = sorted(set(calib) - set(names))
        missing = [n for n in names if n not in calib]
        if unknown or missing:
            raise QtvmError(f"inputs do not match the model: unknown {unknown or 'none'}, missing {missing or 'none'}",
                            f"give exactly the model inputs: {', '.join(names)}")
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in model.graph.initializer}
    sizes: dict[str, int] = {}  # a symbol's synthetic size, shared by every input that names it
    for v in specs:
        tt = v.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        dims = list(tt.shape.dim) if tt.HasField("shape") else None
        if calib is not None:
            arr = np.asarray(calib[v.name])
            if dims is not None:
                if arr.ndim != len(dims):
                    raise QtvmError(f"input '{v.name}' has {arr.ndim} dims but the model expects {len(dims)}",
                                    "reshape the array")
                for i, d in enumerate(dims):
                    if d.HasField("dim_value") and d.dim_value != arr.shape[i]:
                        raise QtvmError(f"input '{v.name}' has shape {list(arr.shape)} but dim {i} must be "
                                        f"{d.dim_value}", "reshape the array")
            if is_float_dtype(arr.dtype) and not np.all(np.isfinite(arr.astype(np.float32))):
                raise QtvmError(f"input '{v.name}' contains NaN/Inf values", "pass finite inputs")
            feeds[v.name] = arr.astype(dtype, copy=False)
            source = "given"
        else:
            if dims is None:
                raise QtvmError(f"input '{v.name}' has no shape in the model, so no synthetic input can be made",
                                "pass inputs with --input NAME=FILE.npy")
            shape = [d.dim_value if d.HasField("dim_value") else _synthetic_dim(d.dim_param, i, sizes)
                     for i, d in enumerate(dims)]
            if is_float_dtype(dtype):
                feeds[v.name] = rng.standard_normal(shape).astype(dtype)
                source = "synthetic: standard normal"
            elif dtype == np.bool_:
                feeds[v.name] = np.ones(shape, np.bool_)
                source = "synthetic: all true"
            else:
                table = next((inits[n.input[0]] for n in model.graph.node if n.op_type == "Gather"
                              and len(n.input) > 1 and n.input[1] == v.name and n.input[0] in inits), None)
                if table is not None and len(table.dims):
                    feeds[v.name] = rng.integers(0, table.dims[0], shape).astype(dtype)
                    source = f"synthetic: random ids < {table.dims[0]}"
                else:
                    feeds[v.name] = np.ones(shape, dtype)
                    source = "synthetic: ones"
        desc[v.name] = {"shape": list(feeds[v.name].shape), "dtype": str(feeds[v.name].dtype), "source": source}
    return feeds, desc


def _synthetic_dim(text: str, axis: int, sizes: dict) -> int:
    """A symbolic dim's synthetic size: a symbol is ``SYNTH_BATCH`` on axis 0, else ``SYNTH_DIM``,
    the same wherever it is named; an expression of symbols (a KV export's mask, ``past + seq``)
    is evaluated over them."""
    from qtvm import dims as dimexpr

    plain = SYNTH_BATCH if axis == 0 else SYNTH_DIM
    if not text:
        return plain
    if dimexpr.parse(text) is None:
        return sizes.setdefault(text, plain)
    return dimexpr.evaluate(text, sizes, lambda name: SYNTH_DIM)


def _session(model):
    """onnxruntime on ``model``; on a bfloat16 model it cannot load (its CPU kernels have next to no
    bfloat16 ones), on the model in float32 rounded to bfloat16 as it goes, as ``qtvm check`` runs
    it (``qtvm.reference.bfloat16_in_float32``: its bfloat16 inputs fed as float32)."""
    import onnxruntime as ort

    from qtvm.reference import bfloat16_in_float32

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        error = QtvmError(f"onnxruntime cannot load the model: {first[:300]}", "check that the model is valid ONNX")
    emulated = bfloat16_in_float32(model) if _stores_bfloat16(model) else None
    if emulated is None:
        raise error from None
    try:
        return _Widened(ort.InferenceSession(emulated.SerializeToString(), opts, providers=["CPUExecutionProvider"]))
    except Exception:
        raise error from None


def _stores_bfloat16(model) -> bool:
    bf16 = 16  # onnx.TensorProto.BFLOAT16
    return any(v.type.tensor_type.elem_type == bf16 for v in model.graph.input) or \
        any(t.data_type == bf16 for t in model.graph.initializer)


class _Widened:
    """A session of a model's float32 form, fed its bfloat16 inputs as float32."""

    def __init__(self, sess):
        self.sess = sess

    def get_outputs(self):
        return self.sess.get_outputs()

    def run(self, names, feeds: dict):
        return self.sess.run(names, {k: v.astype("float32") if v.dtype.name == "bfloat16" else v
                                     for k, v in feeds.items()})


def _run(sess, feeds: dict, what: str) -> dict:
    try:
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, feeds)))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QtvmError(f"onnxruntime failed to run the {what}: {first[:300]}",
                        "check the inputs' shapes and dtypes") from None


def collect_layer_inputs(model, feeds: dict, weights: list[_Weight]) -> tuple[dict, dict]:
    """(float outputs, {initializer name: X [S, K] float32}) from one run of the float model.

    Each layer's input tensor is added as an extra graph output (module doc).
    """
    import numpy as np
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    outputs = [o.name for o in model.graph.output]
    have = set(outputs) | set(feeds)
    for w in weights:
        for name, _ in w.act_inputs:
            if name not in have:  # a matmul's A has its B's type (ONNX's type constraint T)
                m.graph.output.append(helper.make_tensor_value_info(name, w.tensor.data_type, None))
                have.add(name)
    values = _run(_session(m), feeds, "float model with layer inputs as outputs")
    values.update({k: v for k, v in feeds.items() if k not in values})
    acts = {}
    for w in weights:
        rows = []
        for name, trans_a in w.act_inputs:
            a = np.asarray(values[name], np.float32)
            rows.append((a.T if trans_a else a).reshape(-1, w.k))
        acts[w.init_name] = np.concatenate(rows) if rows else np.zeros((0, w.k), np.float32)
    return {k: values[k] for k in outputs}, acts


def compare_outputs(ref: dict, got: dict) -> list[OutputError]:
    import numpy as np

    from qtvm.frontend.onnx import is_float_dtype

    out = []
    for name, y in ref.items():
        y = np.asarray(y)
        if not is_float_dtype(y.dtype):
            continue
        y = y.astype(np.float64)
        q = np.asarray(got[name]).astype(np.float64)
        diff = np.abs(y - q)
        max_abs = float(diff.max()) if diff.size else 0.0
        peak = float(np.abs(y).max()) if y.size else 0.0
        rel = max_abs / peak if peak else (0.0 if max_abs == 0 else math.inf)
        rows_y = y.reshape(-1, y.shape[-1]) if y.ndim >= 2 else y.reshape(1, -1)
        rows_q = q.reshape(rows_y.shape)
        cos = _cosine(rows_y, rows_q)
        flat = float(_cosine(y.reshape(1, -1), q.reshape(1, -1))[0]) if y.size else 1.0
        out.append(OutputError(name, max_abs, rel, float(cos.mean()) if cos.size else 1.0,
                               float(cos.min()) if cos.size else 1.0, flat))
    return out


def _cosine(a, b):
    import numpy as np

    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    both_zero = (na == 0) & (nb == 0)
    return np.where(both_zero, 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))


# -- the report ---------------------------------------------------------------------------------
def quantize_report(model, presets=DEFAULT_PRESETS, calib: dict | None = None, *, inputs: dict | None = None,
                    seed: int = 0, keep_outputs: bool = False, progress=None,
                    binds: dict[str, str] | None = None) -> Report:
    """Per-layer weight errors and model-level output errors for each preset (module doc).

    ``model``: an ``onnx.ModelProto`` or a path; ``calib``: model inputs by name
    for calibrated formats; ``inputs``: model inputs for the output comparison.
    Either alone serves both; neither: synthetic inputs. ``progress``: optional
    callable taking one line of text; ``keep_outputs``: keep the float and each
    preset's output arrays in ``Report.outputs``; ``binds``: inputs fixed as ``qtvm compile
    --bind`` fixes them (a merged decoder's ``use_cache_branch``: the branch reported).
    """
    import numpy as np
    import onnx

    from qtvm.frontend.bind import bind_inputs
    from qtvm.frontend.onnx import load_onnx, routed_sources
    from qtvm.reference import dequantized_model

    label = "<in-memory model>"
    if not isinstance(model, onnx.ModelProto):
        label = str(model)
        model = load_onnx(model)
    elif binds:
        model, given = onnx.ModelProto(), model
        model.CopyFrom(given)
    bind_inputs(model, binds or {})
    chosen = resolve_presets(list(presets))
    routed = list({src.name: src for src in routed_sources(model)}.values())  # each gathered W[E] once
    weights = constant_weights(model, required=not routed)
    separate = (calib is None) == (inputs is None)  # both given, or both synthetic
    feeds, inputs_desc = prepare_inputs(model, inputs if inputs is not None else calib, seed)
    cal_feeds, cal_desc = prepare_inputs(model, calib, seed + 1) if separate else (feeds, "same as inputs")
    float_w = {w.init_name: _kn(w) for w in weights}

    acts = {}
    if any(p.calibrated for p in chosen):
        ref, acts = collect_layer_inputs(model, cal_feeds, weights)
    if separate or not acts:
        ref = _run(_session(model), feeds, "float model")
    report = Report(label, [p.name for p in chosen], len(weights) + sum(int(r.tensor.dims[0]) for r in routed),
                    int(sum(w.k * w.n for w in weights) + sum(math.prod(r.tensor.dims) for r in routed)),
                    inputs_desc, cal_desc)
    if keep_outputs:
        report.outputs["float"] = ref

    for p in chosen:
        start = time.perf_counter()
        made = {}
        stored_bits = abs_sum = 0.0
        fro, max_abs = [], 0.0
        for w in weights:
            kn = float_w[w.init_name]
            qt = _quantize(p, kn, acts.get(w.init_name), w)
            deq = qt.dequantize()
            diff = deq.astype(np.float64) - kn
            absd = np.abs(diff)
            norm = float(np.linalg.norm(kn.astype(np.float64)))
            err = float(np.linalg.norm(diff))
            rel = err / norm if norm else (0.0 if err == 0 else math.inf)
            row = LayerError(p.name, w.nodes[0] + (f" (+{len(w.nodes) - 1} more)" if len(w.nodes) > 1 else ""),
                             w.init_name, w.k, w.n, float(qt.bits_per_weight), float(absd.max()),
                             float(absd.mean()), rel)
            report.layers.append(row)
            stored_bits += 8.0 * qt.nbytes
            abs_sum += float(absd.sum())
            fro.append(rel)
            max_abs = max(max_abs, row.max_abs_err)
            made[w.init_name, w.trans_b] = qt
        experts = routed and not (p.calibrated and not p.gptq)  # a composite format leaves them float
        for src in routed:
            row, bits = _experts_row(p, src, experts)
            report.layers.append(row)
            stored_bits += bits
            abs_sum += row.mean_abs_err * math.prod(src.tensor.dims)
            fro.append(row.rel_fro_err)
            max_abs = max(max_abs, row.max_abs_err)
        # the compiled model's weights (the reference's rule: a tied embedding table stays float, the
        # If branches' and half precision weights are quantized by the format)
        qmodel = dequantized_model(model, p.fmt, quantized=made, experts=bool(experts))
        got = _run(_session(qmodel), feeds, f"{p.name} model")
        del qmodel
        if keep_outputs:
            report.outputs[p.name] = got
        summary = FormatSummary(p.name, p.calibrated, stored_bits / report.weight_count, float(np.mean(fro)),
                                abs_sum / report.weight_count, max_abs, compare_outputs(ref, got),
                                time.perf_counter() - start)
        report.summary.append(summary)
        if progress:
            o = summary.outputs[0] if summary.outputs else None
            progress(f"{p.name}: {summary.bits_per_weight:.3f} bits/w, mean rel.Frob {summary.mean_rel_fro_err:.4g}"
                     + (f", {o.name} cos mean {o.cos_mean:.5f}" if o else "") + f" ({summary.seconds:.1f} s)")
    return report


def _experts_row(p: _Preset, src, packed: bool) -> tuple[LayerError, float]:
    """A mixture of experts' routed weight W[E] (``qtvm.frontend.onnx.routed_sources``): every
    expert through the format on its own, in the [K, N] orientation the compiler packs, the
    errors over all of them; or, where the compiler leaves them float (``packed`` False), their
    stored bits and no error. Returns (row, stored bits)."""
    import numpy as np
    from onnx.helper import tensor_dtype_to_np_dtype

    from qtvm.frontend.onnx import tensor_array

    w = tensor_array(src.tensor).astype(np.float32, copy=False)
    count, rows, cols = w.shape
    k, n = (cols, rows) if src.side == 0 else (rows, cols)
    node = f"{src.node.name or f'MatMul_{src.index}'} ({count} experts)"
    if not packed:
        bits = 8.0 * w.size * np.dtype(tensor_dtype_to_np_dtype(src.tensor.data_type)).itemsize
        return LayerError(p.name, node, src.name, k, n, bits / w.size, 0.0, 0.0, 0.0), bits
    bits = sq_diff = sq_norm = abs_sum = max_abs = 0.0
    for e in range(count):
        kn = np.ascontiguousarray(w[e].T if src.side == 0 else w[e])
        qt = p.fmt.quantize(kn, name=f"expert {e} of '{src.name}'")
        diff = qt.dequantize().astype(np.float64) - kn
        bits += 8.0 * qt.nbytes
        sq_diff, sq_norm = sq_diff + float((diff * diff).sum()), sq_norm + float((kn.astype(np.float64) ** 2).sum())
        abs_sum, max_abs = abs_sum + float(np.abs(diff).sum()), max(max_abs, float(np.abs(diff).max()))
    rel = math.sqrt(sq_diff / sq_norm) if sq_norm else (0.0 if sq_diff == 0 else math.inf)
    return LayerError(p.name, node, src.name, k, n, bits / w.size, max_abs, abs_sum / w.size, rel), bits


def _quantize(p: _Preset, kn, x, w: _Weight):
    what = _what(w)
    if p.calibrated and (x is None or len(x) == 0):
        raise QtvmError(f"no calibration activations for {what}", "pass model inputs that reach this layer")
    if p.gptq:
        from qtvm.formats.gptq import gptq_quantize

        return gptq_quantize(kn, x, p.fmt, name=what)
    if p.calibrated:
        return p.fmt.quantize(kn, calib_x=x, name=what)
    return p.fmt.quantize(kn, name=what)


# -- command line -------------------------------------------------------------------------------
def _parse_input(text: str):
    import numpy as np

    if "=" not in text:
        raise QtvmError(f"--input '{text}' is not NAME=FILE.npy", "e.g. --input input_ids=ids.npy")
    name, path = text.split("=", 1)
    if not Path(path).is_file():
        raise QtvmError(f"input file '{path}' for '{name}' does not exist", "check the path")
    try:
        return name, np.load(path, allow_pickle=False)
    except Exception:
        raise QtvmError(f"input file '{path}' is not a .npy array", "save it with numpy.save") from None


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``quantize-report`` to a CLI's subparsers (sets ``fn=report_command``)."""
    p = subparsers.add_parser(
        "quantize-report", help="per-layer and model-level quantization error of weight formats on an ONNX model",
        description="For every MatMul/Gemm with a constant weight and every format: bits/weight counted from the "
                    "stored arrays, max/mean abs and relative Frobenius weight error; per format: the model "
                    "outputs' error against the float model (onnxruntime).")
    p.add_argument("model", help="ONNX file")
    p.add_argument("--formats", default=",".join(DEFAULT_PRESETS),
                   help="comma-separated presets (see `qtvm formats`), plus gptq:<uniform preset> for GPTQ "
                        f"(default: {','.join(DEFAULT_PRESETS)})")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="a model input for the output comparison (and calibration unless --calib-input is "
                        "given); give every input, or none for synthetic inputs")
    p.add_argument("--calib-input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="a model input for calibrated formats (mixed-2-4-16, gptq:...); default: --input")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs")
    p.add_argument("--bind", action="append", default=[], metavar="NAME=VALUE",
                   help="as `qtvm compile --bind`: an input fixed, the If branches it chooses reported "
                        "(e.g. use_cache_branch=1 for a merged decoder)")
    p.add_argument("--json", metavar="OUT.json", help="also write the full report as JSON (atomically)")
    p.add_argument("--summary-only", action="store_true", help="print the per-format summary only")
    p.set_defaults(fn=report_command)
    return p


def report_command(args) -> int:
    from qtvm.frontend.bind import parse_bind_options

    if args.json:
        _check_json_path(args.json)  # fail before the work, not after
    inputs = dict(_parse_input(t) for t in args.input) if args.input else None
    calib = dict(_parse_input(t) for t in args.calib_input) if args.calib_input else None
    report = quantize_report(args.model, args.formats.split(","), calib, inputs=inputs, seed=args.seed,
                             progress=lambda line: print(line, file=sys.stderr, flush=True),
                             binds=parse_bind_options(args.bind))
    print(f"model: {report.model}: {report.weights} constant weight matrices (MatMul/Gemm weights; a mixture of "
          f"experts' experts one each), {report.weight_count:,} values")

    def describe(feeds: dict) -> str:
        return "; ".join(f"{k} {v['shape']} {v['dtype']} ({v['source']})" for k, v in feeds.items())

    print(f"inputs: {describe(report.inputs)}")
    if any(s.calibrated for s in report.summary):
        cal = report.calibration_inputs
        print(f"calibration inputs: {cal if isinstance(cal, str) else describe(cal)}")
    if not args.summary_only:
        print()
        print(report.layer_table())
    print()
    print(report.summary_table())
    if args.json:
        print(f"\nwrote {report.write_json(args.json)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m qtvm.report MODEL.onnx ...``: the same command without the qtvm CLI."""
    parser = argparse.ArgumentParser(prog="python -m qtvm.report")
    sub = parser.add_subparsers(dest="command", required=True)
    add_report_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "quantize-report":
        argv = ["quantize-report", *argv]
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except QtvmError as e:
        print(f"qtvm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
