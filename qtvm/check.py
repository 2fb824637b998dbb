"""``qtvm check MODEL.onnx ARTEFACT.so``: is this artefact right on this model?

Runs the artefact (qtvm's thin runtime) and onnxruntime on the same inputs at several
bindings of the symbolic dims and reports, per output, two relative errors
(max |a - b| / max |b|):

- against the float model: what the weight format costs (large for int2, small for int8);
- against onnxruntime running the same graph with the weights qtvm stored, dequantized
  (for ``--quant none`` artefacts, the float model itself): the compiler's own error. Above
  float rounding it means a miscompile, and the command exits 1.

``--act int8`` artefacts round matmul inputs to int8 on purpose; their reference rounds the
same inputs the same way (``qtvm.reference``, from the target's own ``int8_rounding``): one
layer matches it to ~3e-7. A rounding step still moves where a last-bit difference upstream
crosses a half, and a deep model amplifies each such step (MiniLM: up to ~1e-2 of its
output), so the bound is measured on the model: the reference is run again with its rounded
inputs jittered (``FLIP_JITTERS``, relative), the largest difference that makes at a binding
is its "flip noise", and the own error may reach ``FLIP_FACTOR`` x the largest flip noise (at
least ``INT8_ACT_FLOOR``). Where ONNX cannot express the rounding here
(``UnmodelledRounding``) the reference keeps fp32 activations and the looser
``INT8_UNMODELLED_TOLERANCE``; the report says which. A model that quantizes its own
activations (QuantizeLinear, DynamicQuantizeLinear: onnxruntime's static and dynamic
quantizers) has rounding steps of its own: its reference is jittered at those nodes
(``_jittered_quantizers``) and the tolerance measured the same way.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from qtvm.errors import QtvmError

FP32_TOLERANCE = 1e-4
#: a half precision model's tolerance, in its type's epsilon: every layer's output is rounded to
#: it, so sums in another order move later layers by a few of its last bits (a 2-layer float16
#: LLaMA export, weights unquantized: 3-9e-4 of the largest logit against onnxruntime)
HALF_EPSILONS = 4
HALF_TYPES = {10: ("float16", 2.0 ** -10), 16: ("bfloat16", 2.0 ** -7)}  # ONNX type -> (name, epsilon)
#: What stands in for onnxruntime on a bfloat16 model (``qtvm.reference.bfloat16_in_float32``).
BF16_STAND_IN = "the model run in float32 with each bfloat16 value rounded to bfloat16 where it is made"
INT8_ACT_FLOOR = 1e-3
# MiniLM, int2/int3/bcq3 at 9 bindings: the own error was at most 1.0x the flip noise of its
# binding with these four jitters (one jitter at a time: up to 2.6x), at most 0.7x the largest.
FLIP_JITTERS = (2.0 ** -16, 2.0 ** -14, 2.0 ** -16, 2.0 ** -14)
#: a half precision model's jitters, in its type's epsilon: its layers' outputs differ upstream by
#: its last bits, not float32's (a float16 model's int8 check: own error 6.4e-3 against a flip
#: noise of 2.3e-4 measured with the float32 jitters)
HALF_FLIP_JITTERS = (0.25, 1.0, 0.25, 1.0)
FLIP_FACTOR = 2.0
INT8_UNMODELLED_TOLERANCE = 1e-1  # against fp32 activations: the rounding itself (MiniLM: 0.04-0.06)
DEFAULT_DIM_VALUES = (1, 3, 17)
_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"}


@dataclass
class OutputCheck:
    binding: dict
    name: str
    shape: tuple
    err_vs_float: float
    err_own: float
    flip_noise: float | None = None  # the jittered int8 reference against the reference


@dataclass
class CheckReport:
    tolerance: float | None  # None until an int8 artefact's flip noise is measured
    reference: str  # what the "own" column compares with
    rows: list[OutputCheck] = field(default_factory=list)
    rule: str = ""  # how the tolerance was set, when the check measured it

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


def default_bindings(dims: list[str], minimums: dict | None = None) -> list[dict]:
    """Three bindings, dims taking different values in each (so a swapped axis shows), and
    every dim 1 where none of them is: rows M = batch x seq = 1 run the decode kernels (the
    GEMVs every generated token runs; with two dims the three bindings give M = 3, 51, 17,
    all prefill). A dim the model needs at least m of (``dim_minimums``: audio samples under a
    convolution) takes m - 1 more than each value instead."""
    if not dims:
        return [{}]
    minimums = minimums or {}
    n = len(DEFAULT_DIM_VALUES)
    bindings = [{d: DEFAULT_DIM_VALUES[(i + j) % n] for j, d in enumerate(dims)} for i in range(n)]
    ones = {d: 1 for d in dims}
    bindings = bindings if ones in bindings else [ones, *bindings]
    return [{d: v + max(minimums.get(d, 1), 1) - 1 for d, v in b.items()} for b in bindings]


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


def tied_dims(meta: dict) -> dict:
    """Symbol -> the expression it must equal, from what the compiler found: a KV-cache
    export whose mask length is a symbol of its own (torch.onnx's dynamo exporter names it
    like ``s53``) has it equal past + seq (``kv_step``: the mask, a cache's length axis, the
    ids). Bound apart, onnxruntime refuses the model."""
    kv = meta.get("kv_step")
    if not kv:
        return {}
    from qtvm import dims as dimexpr

    shapes = {i["name"]: i["shape"] for i in meta["inputs"]}
    try:
        total, past, seq = shapes[kv["mask"]][-1], shapes[kv["caches"][0]][kv["axis"]], shapes[kv["ids"]][-1]
    except (KeyError, IndexError, TypeError):
        return {}
    plain = [isinstance(d, str) and d != "?" and dimexpr.parse(d) is None for d in (total, past, seq)]
    if not all(plain) or total in (past, seq):
        return {}
    return {total: f"{past} + {seq}"}


def _onnxruntime_prompt_rule(model, meta: dict, bindings: list[dict]) -> list[dict]:
    """onnxruntime's GroupQueryAttention runs a prompt after a past (seq > 1, past > 0) only
    at batch 1: a default binding asking for more is made a first prompt (past 0)."""
    kv = meta.get("kv_step")
    if not kv or not any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
                         for n in model.graph.node):
        return bindings
    shapes = {i["name"]: i["shape"] for i in meta["inputs"]}
    batch, seq = shapes[kv["ids"]][0], shapes[kv["ids"]][-1]
    past = shapes[kv["caches"][0]][kv["axis"]]
    out = []
    for b in bindings:
        b = dict(b)
        if b.get(batch, 1) > 1 and b.get(seq, 1) > 1 and b.get(past, 0) > 0:
            b[past] = 0
        out.append(b)
    return out


def _evaluate(dim: str, binding: dict):
    from qtvm import dims as dimexpr

    return dimexpr.evaluate(dim, binding) if dimexpr.parse(dim) is not None else None


def index_bounds(model) -> dict[str, int]:
    """Graph input -> the fewest rows of a constant table it indexes (a Gather of an initializer or
    of its DequantizeLinear, indexed directly or through a Cast)."""
    inits = {t.name: t for t in model.graph.initializer}
    casts = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    dequantized = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out: dict[str, int] = {}
    for n in model.graph.node:
        table = dequantized.get(n.input[0], n.input[0]) if n.input else None  # a quantized table's codes
        if n.op_type != "Gather" or len(n.input) < 2 or table not in inits:
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        dims = inits[table].dims
        if not -len(dims) <= axis < len(dims):
            continue
        source = casts.get(n.input[1], n.input[1])
        out[source] = min(out.get(source, dims[axis]), dims[axis])
    return out


def random_feeds(inputs: list[dict], binding: dict, rng: np.random.Generator, int_high: int = 16,
                 index_bounds: dict | None = None) -> dict:
    """Float inputs ~ N(0, 1); integer inputs in [0, int_high) (valid token ids for any real
    vocabulary), or below the rows of the tables they index where fewer (``index_bounds``: BERT's
    token_type_ids index a table of 2), except ones named as masks: all 1 (no padding; a mask
    of 15s makes a transformer's output chaotic); booleans at random."""
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
        elif dtype.startswith(("int", "uint")) and "mask" in spec["name"].lower():
            feeds[spec["name"]] = np.ones(shape, dtype)
        elif dtype.startswith(("int", "uint")):
            high = min(int_high, (index_bounds or {}).get(spec["name"], int_high))
            feeds[spec["name"]] = rng.integers(0, max(high, 1), shape).astype(dtype)
        elif dtype == "bfloat16":  # numpy has no bfloat16: ml_dtypes' (onnx's own dependency)
            import ml_dtypes

            feeds[spec["name"]] = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        else:
            feeds[spec["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _given_dims(inputs: list[dict], feeds: dict) -> dict:
    """The symbolic dims the given inputs' shapes fix (the other inputs are drawn at them)."""
    dims, specs = {}, {i["name"]: i for i in inputs}
    for name, value in feeds.items():
        if name not in specs:
            raise QtvmError(f"--input names '{name}', which the artefact does not take",
                            f"its inputs are {sorted(specs)}")
        shape = specs[name]["shape"]
        if len(shape) != np.ndim(value):
            raise QtvmError(f"--input {name} has {np.ndim(value)} dims; the artefact's '{name}' has {len(shape)}")
        for d, size in zip(shape, np.shape(value)):
            if isinstance(d, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", d):
                if dims.setdefault(d, int(size)) != int(size):
                    raise QtvmError(f"the given inputs bind dim '{d}' to both {dims[d]} and {size}",
                                    "give inputs whose shapes agree")
    return dims


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


def _ort_session(model, path=None):
    """onnxruntime on ``model``, read from ``path`` where that file is the model as it is (no copy
    of it in memory); a model past protobuf's 2 GiB without one goes through a temporary file
    with its weights beside it."""
    import tempfile

    import onnx
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave the cores to qtvm
    opts.log_severity_level = 4  # its warnings are not the user's business here; its errors come back raised
    # onnxruntime fuses a blocked DequantizeLinear -> MatMul into MatMulNBits at accuracy_level 4 by default
    # (int8 activations: 1e-2 off the model's float product); the reference is the model's arithmetic
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")

    def session(source):
        try:
            return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
            raise QtvmError(f"onnxruntime cannot run the model ({str(e).strip().splitlines()[0][:200]})",
                            "qtvm check needs a model onnxruntime or ONNX's reference evaluator runs") from None

    if path is not None or _weight_bytes(model) <= SERIALIZED_LIMIT:
        return session(str(path) if path is not None else model.SerializeToString())
    with tempfile.TemporaryDirectory(prefix="qtvm-check-") as tmp:
        copy = _copy(model)  # saving with external data moves the copy's weights to the file
        onnx.save_model(copy, f"{tmp}/model.onnx", save_as_external_data=True, location="model.onnx.data")
        del copy
        return session(f"{tmp}/model.onnx")


#: initializer bytes past which a model is handed to onnxruntime as files (protobuf's limit is 2 GiB)
SERIALIZED_LIMIT = 1 << 30


def _weight_bytes(model) -> int:
    """The initializers' bytes, from their dims (protobuf's ByteSize walks the data)."""
    import math

    import onnx

    return sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer)


@dataclass
class _Value:
    name: str
    shape: list


class _Session:
    """onnxruntime on ``model``; where onnxruntime cannot load or run it (ONNX ops newer than its
    kernels: opset 23's RotaryEmbedding with per-token cos/sin caches fails in onnxruntime 1.32),
    ONNX's reference evaluator, the spec's own numpy implementation, from then on; ``fallback``
    holds onnxruntime's reason. If the reference evaluator fails too, onnxruntime's error stands."""

    def __init__(self, model, path=None):
        self.model, self.fallback, self._reference = model, None, None
        self.stand_in = "ONNX's reference evaluator"  # what ran the model where onnxruntime could not
        self._widen = False  # bfloat16 feeds go in as float32 (the model in float32: BF16_STAND_IN)
        try:
            self._ort = _ort_session(model, path)
        except QtvmError as e:
            from onnx.reference import ReferenceEvaluator

            from qtvm.reference import bfloat16_in_float32

            emulated = bfloat16_in_float32(model) if _half_precision(model) == HALF_TYPES[16] else None
            try:  # a bfloat16 model: onnxruntime on its float32 form, rounded to bfloat16 as it goes
                self._ort = _ort_session(emulated) if emulated is not None else None
            except QtvmError:
                self._ort = None
            if self._ort is not None:
                self.fallback, self.stand_in, self._widen = e.problem, BF16_STAND_IN, True
                return
            try:
                self._reference = ReferenceEvaluator(model)
            except Exception:  # noqa: BLE001 -- the reference evaluator raises anything
                raise e from None
            self.fallback = e.problem

    def get_inputs(self) -> list[_Value]:
        inits = {t.name for t in self.model.graph.initializer}
        return [_Value(i.name, [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim])
                for i in self.model.graph.input if i.name not in inits]

    def get_outputs(self) -> list[_Value]:
        return [_Value(o.name, []) for o in self.model.graph.output]

    def run(self, names, feed: dict) -> list:
        takes = {i.name for i in self.get_inputs()}  # a reference built bound takes no bound input
        feed = {k: v for k, v in feed.items() if k in takes}
        if self._widen:
            feed = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in feed.items()}
        if self._reference is not None:
            return self._reference.run(names, feed)
        try:
            return self._ort.run(names, feed)
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
            from onnx.reference import ReferenceEvaluator

            try:
                reference = ReferenceEvaluator(self.model)
                values = reference.run(names, feed)
            except Exception:  # noqa: BLE001 -- the reference evaluator raises anything
                raise e from None
            self._reference, self.fallback = reference, f"onnxruntime cannot run the model ({_ort_message(e)[:200]})"
            return values


def _session(model, path=None) -> _Session:
    return _Session(model, path)


def _with_checkpoint_weights(model_path, meta: dict, gptq, gptq_format, calib):
    """The model (its ``--bind`` inputs bound) with each weight a GPTQ checkpoint supplied as
    the float32 weight its codes stand for, or None for an artefact without GPTQ weights. The
    weights enter through a Cast from float64 (exact), so the preset's rule for the remaining
    float weights (``qtvm.reference.dequantized_model``) passes them by."""
    from onnx import TensorProto, helper, numpy_helper

    from qtvm.formats.gptq_checkpoint import GptqCheckpoint
    from qtvm.frontend.bind import bind_inputs
    from qtvm.frontend.onnx import load_onnx
    from qtvm.frontend.quantized import lower_quantized
    from qtvm.gptq_compile import CalibratedCheckpoint, is_gptq_preset

    calibrated = is_gptq_preset(meta.get("format", ""))
    if not calibrated and "GPTQ" not in str(meta.get("prequantized", "")):
        if gptq is not None or calib is not None:
            raise QtvmError("--gptq/--calib given, but the artefact holds no GPTQ weights", "drop them")
        return None
    if (calib if calibrated else gptq) is None:
        raise QtvmError("the artefact's weights came from a GPTQ checkpoint, which the check needs to know what "
                        "they should be", f"pass {'--calib FILE (the one compiled with)' if calibrated else '--gptq CKPT'}")
    binds = meta.get("bound_inputs", {})
    if calibrated:  # the calibration's model, loaded and bound once (the run copies it)
        with CalibratedCheckpoint(model_path, meta["format"], calib, binds) as made:
            lowered = lower_quantized(made.model, GptqCheckpoint(made.path), in_place=True)
    else:
        model = load_onnx(model_path)
        bind_inputs(model, binds)
        lowered = lower_quantized(model, GptqCheckpoint(gptq, gptq_format), in_place=True)
    graph = lowered.model.graph
    markers = set(lowered.weights)
    kept = [vi for vi in graph.input if vi.name not in markers]
    del graph.input[:]
    graph.input.extend(kept)
    for name, weight in lowered.weights.items():
        w32 = weight.dequantize_reference().astype("float32")  # the stored codes' values, as the kernels' float32
        graph.initializer.append(numpy_helper.from_array(w32.astype("float64"), f"{name}_f64"))
        graph.node.insert(0, helper.make_node("Cast", [f"{name}_f64"], [name], to=TensorProto.FLOAT))
    return lowered.model


def _dequantized_reference(model, meta: dict):
    """(onnx model, description, tolerance) of what the artefact must equal. An int8 artefact's
    reference has jitter inputs (``qtvm.reference.JITTER_INPUT``: fed ones it is the reference,
    fed noise it measures the flip noise that sets the tolerance, None until then)."""
    fmt_name = meta.get("format", "none")
    int8 = meta.get("activations") == "int8"
    if fmt_name == "none" or "quantized_matmuls" not in meta:
        if int8 and meta.get("prequantized_matmuls"):  # the kernels round x; onnxruntime, relaxed, does not
            reference = _copy(model)
            _float_activations(reference)
            return reference, (f"onnxruntime on the model's own quantized weights (int8 activations not modelled: "
                               f"{meta['prequantized_matmuls']} matmuls came quantized in the model; their rounding "
                               "is in the error)"), INT8_UNMODELLED_TOLERANCE
        if int8 or not _int8_activation_levels(model):
            what = ("the model on its own quantized weights" if meta.get("prequantized_matmuls")
                    else "the float model (no weights were quantized)")
            return model, what, FP32_TOLERANCE
        reference = _copy(model)
        _float_activations(reference)
        return reference, "onnxruntime on the model's own quantized weights" + _RELAXED, FP32_TOLERANCE
    from qtvm.formats import PRESETS, get_format
    from qtvm.reference import UnmodelledRounding, dequantized_model

    if fmt_name not in PRESETS:
        raise QtvmError(f"the artefact's format '{fmt_name}' cannot be rebuilt for a reference",
                        "check an artefact compiled with a preset from `qtvm formats`")
    fmt, what = get_format(fmt_name), f"onnxruntime on the {fmt_name} weights dequantized"
    if meta.get("prequantized_matmuls") and meta["prequantized_matmuls"] == meta["quantized_matmuls"]:
        what = "onnxruntime on the model's own quantized weights (no float weights were left to quantize)"
    experts = bool(meta.get("routed_experts"))
    if not int8:
        reference = dequantized_model(model, fmt, experts=experts)
        return reference, what + (_RELAXED if _float_activations(reference) else ""), FP32_TOLERANCE
    from qtvm.target import parse_target
    from schedules import facts

    unmodelled = None
    if meta.get("prequantized_matmuls"):  # onnxruntime runs those nodes itself, on unrounded x
        unmodelled = f"{meta['prequantized_matmuls']} matmuls came quantized in the model"
    else:
        try:
            rounded = dequantized_model(model, fmt, int8_facts=facts(parse_target(meta["target"])), jitter=True,
                                        experts=experts)
        except UnmodelledRounding as e:
            unmodelled = str(e)
    if unmodelled is not None:
        return (dequantized_model(model, fmt, experts=experts), what + f" (int8 activations not modelled: {unmodelled}; their "
                "rounding is in the error)", INT8_UNMODELLED_TOLERANCE)
    return rounded, what + ", matmul inputs rounded to int8 as the kernels round them", None


_RELAXED = (" (its MatMulNBits at accuracy_level 0: float activations, as the artefact's; the model asks "
            "onnxruntime for int8 ones, whose rounding would be in the error)")


def _copy(model):
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _int8_activation_levels(model) -> list:
    """The ``accuracy_level`` attributes of ``model``'s MatMulNBits that ask onnxruntime for
    other than float32 activations (4: int8, onnxruntime-genai's CPU default; 0 and 1 are
    float32)."""
    from qtvm.frontend.onnx import graph_scopes

    return [a for graph, _ in graph_scopes(model.graph) for n in graph.node
            if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"
            for a in n.attribute if a.name == "accuracy_level" and a.i not in (0, 1)]


def _float_activations(model) -> int:
    """``model``'s (a copy's) MatMulNBits set to accuracy_level 0: onnxruntime then multiplies
    float activations, as an fp32-activation artefact does (int8 ones differ by ~1e-3: not a
    miscompile). Returns how many were changed."""
    levels = _int8_activation_levels(model)
    for a in levels:
        a.i = 0
    return len(levels)


def check(model_path, artefact, bindings: list[dict] | None = None, feeds: dict | None = None,
          tolerance: float | None = None, seed: int = 0, int_high: int = 16, *, gptq=None,
          gptq_format: str | None = None, calib=None) -> CheckReport:
    """Compare ``artefact`` with onnxruntime on ``model_path`` at each binding. An artefact whose
    weights came from a GPTQ checkpoint is held to the model with that checkpoint's weights:
    ``gptq`` (``compile --gptq``), or ``calib`` (``compile --quant gptq:<preset> --calib``: the
    calibration run again, deterministic)."""
    import qtvm.formats  # noqa: F401 -- imports the compiler's TVM, which qtvm.runtime must not replace
    from qtvm import runtime
    from qtvm.frontend.onnx import load_onnx

    model = load_onnx(model_path)

    module = runtime.load(artefact)
    meta = module.metadata
    bound, unread = _bound_inputs(model, meta, [i["name"] for i in module.inputs])
    checkpoint_model = _with_checkpoint_weights(model_path, meta, gptq, gptq_format, calib)
    if checkpoint_model is not None:
        from qtvm.gptq_compile import base_format, is_gptq_preset

        # compile --quant gptq:<preset>: the weights the calibration left (behind a Transpose) took the preset
        preset = base_format(meta["format"]).name if is_gptq_preset(meta["format"]) else meta["format"]
        ref_model, reference, default_tol = _dequantized_reference(checkpoint_model, dict(meta, format=preset))
        reference = reference.replace("the model on its own quantized weights", "the model on the GPTQ "
                                      "checkpoint's weights").replace("the model's own", "the GPTQ checkpoint's")
    else:
        ref_model, reference, default_tol = _dequantized_reference(model, meta)
    quantizers = _activation_quantizers(ref_model) if default_tol == FP32_TOLERANCE else []
    if quantizers:
        ref_model = _jittered_quantizers(ref_model, quantizers)
        reference, default_tol = reference + QDQ_NOTE, None
    half = _half_precision(model)
    half_floor = HALF_EPSILONS * half[1] if half is not None else 0.0
    half_rule = f"{HALF_EPSILONS} x {half[0]}'s epsilon (a {half[0]} model rounds every layer's output to it)" \
        if half is not None else ""
    rule = ""
    if half is not None and default_tol == FP32_TOLERANCE:
        default_tol, rule = max(FP32_TOLERANCE, half_floor), half_rule
    jitters = FLIP_JITTERS if half is None else tuple(half[1] * j for j in HALF_FLIP_JITTERS)
    float_sess = _session(model, model_path)  # the file as loaded: onnxruntime reads it itself
    ref_sess = float_sess if ref_model is model else _session(ref_model)
    from qtvm.reference import JITTER_INPUT

    jitter_inputs = [(i.name, i.shape[0] if i.shape else 0) for i in ref_sess.get_inputs()
                     if i.name.startswith(JITTER_INPUT)]
    no_jitter = {name: np.ones(k, np.float32) if k else np.zeros((), np.float32) for name, k in jitter_inputs}
    report = CheckReport(tolerance if tolerance is not None else default_tol, reference,
                         rule=rule if tolerance is None else "")
    tied = tied_dims(meta)
    dims = [d for d in _symbolic_dims(module.inputs) if d not in tied]
    rng_jitter = np.random.default_rng(seed + 1)
    given = _given_dims(module.inputs, feeds or {})
    if feeds is not None and set(feeds) >= {i["name"] for i in module.inputs}:
        runs = [({}, feeds)]
    else:
        rng = np.random.default_rng(seed)
        if bindings is None:
            free = [d for d in dims if d not in given]
            bindings = _onnxruntime_prompt_rule(model, meta, default_bindings(free, meta.get("dim_minimums")))\
                if free else [{}]
        bindings = [{**given, **b} for b in bindings]
        for b in bindings:
            for name, expr in tied.items():
                value = _evaluate(expr, b)
                if name not in b and value is not None:
                    b[name] = value
        bounds = index_bounds(model)
        runs = [(b, {**random_feeds(module.inputs, b, rng, int_high, bounds), **(feeds or {})}) for b in bindings]
    for binding, feed in runs:
        model_feed = {**feed, **bound, **_unread_feeds(unread, binding)}
        want_float = _run(float_sess, model_feed, binding)
        got = module.run(feed)
        want_ref = _run(ref_sess, {**model_feed, **no_jitter}, binding)
        noise = _flip_noise(ref_sess, model_feed, jitter_inputs, want_ref, rng_jitter, jitters) if jitter_inputs else {}
        for name, value in got.items():
            report.rows.append(OutputCheck(binding, name, tuple(value.shape), _rel(value, want_float[name]),
                                           _rel(value, want_ref[name]), noise.get(name)))
    fallback = float_sess.fallback or ref_sess.fallback
    if fallback:
        stand_in = (ref_sess if ref_sess.fallback else float_sess).stand_in
        if stand_in == BF16_STAND_IN:
            report.reference += f", {stand_in} ({fallback})"
        elif "onnxruntime" in report.reference:
            report.reference = report.reference.replace("onnxruntime", stand_in, 1) + f" ({fallback})"
        else:
            report.reference += f", run by {stand_in} ({fallback})"
    if report.tolerance is None and not jitter_inputs:  # int8 asked, but no matmul input was rounded
        report.tolerance = max(FP32_TOLERANCE, half_floor)
        report.rule = "float rounding: no matmul of this artefact rounds its input to int8 (each kept fp32)"
    if report.tolerance is None:  # int8: the bound this model's flip noise sets (and its half precision's)
        report.tolerance = max(INT8_ACT_FLOOR, half_floor, FLIP_FACTOR * max(r.flip_noise for r in report.rows))
        report.rule = (f"max({INT8_ACT_FLOOR:g}, " + (f"{half_rule}, " if half is not None else "")
                       + f"{FLIP_FACTOR:g} x the largest flip noise: the error of the reference with its rounded "
                       f"inputs jittered by up to 2^{round(np.log2(max(jitters)))})")
    return report


def _bound_inputs(model, meta: dict, artefact_inputs: list[str]) -> tuple[dict, list]:
    """The values the artefact was compiled with bound (``--bind``), as onnxruntime is fed them,
    and the model inputs the binding left unread (the branch not taken's), as ValueInfos. The
    artefact must take the model's other inputs, in order."""
    from qtvm.frontend.bind import bound_value

    inits = {t.name for t in model.graph.initializer}
    specs = [vi for vi in model.graph.input if vi.name not in inits]
    texts = meta.get("bound_inputs", {})
    bound = {vi.name: bound_value(vi, texts[vi.name]) for vi in specs if vi.name in texts}
    rest = [vi for vi in specs if vi.name not in texts]
    unread = [vi for vi in rest if vi.name not in artefact_inputs] if texts else []
    if [vi.name for vi in rest if vi not in unread] != artefact_inputs or any(isinstance(v, str) for v in bound.values()):
        raise QtvmError(f"the artefact takes inputs {artefact_inputs} but the model takes {[vi.name for vi in specs]}"
                        + (f" (bound: {', '.join(texts)})" if texts else ""),
                        "pass the model the artefact was compiled from")
    return bound, unread


def _unread_feeds(unread: list, binding: dict) -> dict:
    """Inputs only the branch not taken reads: zeros of their rank (a dim the binding does not
    size is 0), which onnxruntime needs and never reads."""
    from onnx.helper import tensor_dtype_to_np_dtype

    feeds = {}
    for vi in unread:
        dims = vi.type.tensor_type.shape.dim
        shape = [d.dim_value if d.HasField("dim_value") else (_evaluate(d.dim_param, binding) or 0) for d in dims]
        feeds[vi.name] = np.zeros(shape, tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    return feeds


QDQ_NOTE = ("; the model's own activation quantizers (QuantizeLinear, DynamicQuantizeLinear) round too, so "
            "a last-bit difference upstream can move a rounding step: the tolerance is measured as for int8")


def _half_precision(model) -> tuple[str, float] | None:
    """(type name, epsilon) of the coarsest half precision float type ``model`` stores or casts
    to (its inputs, outputs, initializers and Cast nodes, If/Loop bodies' too), None for a float32 model."""
    from qtvm.frontend.onnx import graph_scopes

    graphs = [g for g, _ in graph_scopes(model.graph)]
    types = {v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    types |= {t.data_type for g in graphs for t in g.initializer}
    types |= {a.i for g in graphs for n in g.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    found = [HALF_TYPES[t] for t in types if t in HALF_TYPES]
    return max(found, key=lambda h: h[1]) if found else None


def _activation_quantizers(model) -> list[int]:
    """Indices of ``model``'s QuantizeLinear / DynamicQuantizeLinear nodes of values computed at run
    time; none for a model with half-precision inputs (the jitter is float32 arithmetic)."""
    from onnx import TensorProto

    from qtvm.frontend.op_support import compile_time_names

    if any(i.type.tensor_type.elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16) for i in model.graph.input):
        return []
    known = compile_time_names(model)
    return [i for i, n in enumerate(model.graph.node) if n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear")
            and n.input and n.input[0] not in known]


def _jittered_quantizers(model, targets: list[int]):
    """A copy whose activation quantizers (``targets``: node indices, ``_activation_quantizers``)
    read x * (1 + J * u), u a fixed uniform(-1, 1) noise per node and J the scalar input
    ``JITTER_INPUT + "qdq"`` (fed 0: exactly the model), so the check measures how far this
    model's rounding steps move its outputs (its flip noise)."""
    import onnx
    from onnx import TensorProto, helper

    from qtvm.reference import JITTER_INPUT

    out = _copy(model)
    scale, one = JITTER_INPUT + "qdq", "qtvm_qdq_jitter/one"
    out.graph.input.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
    targets = set(targets)
    nodes = [helper.make_node("Constant", [], [one], value=helper.make_tensor("", TensorProto.FLOAT, [], [1.0]))]
    for i, node in enumerate(out.graph.node):
        if i in targets:
            x, tag = node.input[0], f"qtvm_qdq_jitter/{i}"
            nodes += [helper.make_node("RandomUniformLike", [x], [tag + "/u"], low=-1.0, high=1.0, seed=float(i + 1)),
                      helper.make_node("Mul", [tag + "/u", scale], [tag + "/ju"]),
                      helper.make_node("Add", [one, tag + "/ju"], [tag + "/f"]),
                      helper.make_node("Mul", [x, tag + "/f"], [tag + "/x"])]
            node = onnx.NodeProto.FromString(node.SerializeToString())
            node.input[0] = tag + "/x"
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _run(session, feed: dict, binding: dict) -> dict:
    """Output name -> value; onnxruntime's refusal of a binding as one line naming it."""
    try:
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
        where = ",".join(f"{k}={v}" for k, v in binding.items()) or "the given inputs"
        if getattr(session, "fallback", None):  # what stood in for onnxruntime ran it, and failed
            why = str(e).strip().splitlines()[0][:150] if str(e).strip() else type(e).__name__
            who = "onnxruntime on the model in float32" if session.stand_in == BF16_STAND_IN else session.stand_in
            raise QtvmError(f"{who} fails on the model at {where} ({why}); it stood in for onnxruntime: "
                            f"{session.fallback[:150]}",
                            "qtvm check needs a reference that runs the model: compare the artefact's outputs "
                            "with your framework's (qtvm run), or export the model in float32 or float16") from None
        raise QtvmError(f"onnxruntime cannot run the model at {where} ({_ort_message(e)[:200]})",
                        "bind dims that must agree (a KV export's mask length is past + seq) with --shape, "
                        "e.g. --shape batch=1,seq=3,past=5,<mask dim>=8") from None


def _ort_message(e: Exception) -> str:
    """onnxruntime's error, its first line without the ``[ONNXRuntimeError] : 1 : FAIL :`` prefix."""
    return re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", str(e).strip().splitlines()[0])


def _flip_noise(session, feed: dict, jitter_inputs: list, want: dict, rng: np.random.Generator,
                jitters=FLIP_JITTERS) -> dict:
    """Output name -> the largest error of the jittered reference (``jitters``, relative) against ``want``."""
    names = [o.name for o in session.get_outputs()]
    noise = dict.fromkeys(names, 0.0)
    for size in jitters:  # a scalar jitter (k = 0) scales its node's fixed noise pattern
        jitter = {n: (1 + size * rng.uniform(-1, 1, k)).astype(np.float32) if k
                  else np.array(size * rng.uniform(-1, 1), np.float32) for n, k in jitter_inputs}
        for name, value in zip(names, session.run(None, {**feed, **jitter})):
            noise[name] = max(noise[name], _rel(value, want[name]))
    return noise


def format_report(report: CheckReport) -> str:
    noise = any(r.flip_noise is not None for r in report.rows)
    lines = [f"{'shape binding':<24} {'output':<20} {'shape':<18} {'vs float':>10} {'own error':>10}"
             + (f" {'flip noise':>10}" if noise else "")]
    for r in report.rows:
        dims = ",".join(f"{k}={v}" for k, v in r.binding.items()) or "(given inputs)"
        flag = "" if r.err_own <= report.tolerance else "  <-- above tolerance"
        extra = f" {r.flip_noise:>10.3g}" if noise else ""
        lines.append(f"{dims:<24} {r.name[:20]:<20} {str(list(r.shape)):<18} {r.err_vs_float:>10.3g} "
                     f"{r.err_own:>10.3g}{extra}{flag}")
    rule = f" = {report.rule}" if report.rule else ""
    lines.append(f"own error: against {report.reference}; tolerance {report.tolerance:.3g}{rule}")
    noise_note = " and the int8 rounding steps float rounding moves" if noise else ""
    lines.append(f"OK: the artefact computes what the model does, to float rounding{noise_note}" if report.ok else
                 "MISMATCH: the artefact's own error is above tolerance (a miscompile: please report it "
                 "with the model)")
    return "\n".join(lines)
