"""compile(): ONNX file -> one exported shared library (weights inside)."""
from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from qtvm.errors import require_compiler_tvm

require_compiler_tvm()
import numpy as np
import tvm
from tvm import relax

from qtvm.errors import QtvmError
from qtvm.formats import get_format
from qtvm.frontend.importer import import_facts
from qtvm.frontend.onnx import OnnxSummary, import_onnx, load_onnx, rename_dims, summarize, validate
from qtvm.frontend.ort_fused import NOTE_KEY
from qtvm.target import cpu_flags_required, gpu_required, parse_target, with_host

METADATA_FUNC = "qtvm_metadata"
FLOAT = "none"  # --quant none: compile the float model through the same pipeline


@dataclass
class CompileResult:
    path: Path
    metadata: dict
    summary: OnnxSummary
    seconds: float
    notes: list[str] = field(default_factory=list)


def check_output_path(out: str | os.PathLike, what: str = "output", example: str = "model.so") -> Path:
    """Fail before the work, not after, when ``out`` cannot be written."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise QtvmError(f"{what} path '{out}' is a directory", f"give a file name such as {example}")
    if not parent.is_dir():
        raise QtvmError(f"{what} directory '{parent}' does not exist", "create it first")
    try:  # a real probe: permission bits say nothing for root or read-only mounts
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise QtvmError(f"{what} directory '{parent}' is not writable ({e.strerror})", "choose another path") from None
    return out


def _metadata_function(meta: dict) -> relax.Function:
    """The artefact describes itself: a function returning its metadata as bytes."""
    data = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    func = relax.Function([], relax.const(data), relax.TensorType([len(data)], "uint8"))
    return func.with_attr("global_symbol", METADATA_FUNC)  # public: GPU pipelines drop private functions


def build_module(model_path, target: str | tvm.target.Target = "host", quant: str = "int4-g128",
                 activations: str = "fp32", db: str | os.PathLike | None = None,
                 gptq: str | os.PathLike | None = None, gptq_format: str | None = None,
                 calib: str | os.PathLike | None = None, max_length: int | None = None, max_batch: int = 1,
                 kv_step: bool = True, dims: dict[str, str] | None = None, combine: bool = True,
                 kv_cache: str = "model", binds: dict[str, str] | None = None):
    """ONNX -> (Relax IRModule with packed kernels, metadata, summary, notes); no export.

    A past_key_values export also gets ``qtvm_kv_step`` (``relay_passes.kv_cache``): greedy
    generation over caches allocated once for ``max_length`` tokens (default: the model's
    position limit, else 2048) and ``max_batch`` sequences, held in the model's dtype
    (``kv_cache="model"``) or, float32 ones, in float16 (``"fp16"``: half the memory and the
    bytes decode reads per past token; the compile reports the error it measured).

    Weights the model brings quantized (MatMulNBits, DequantizeLinear, MatMulInteger) or
    that a GPTQ checkpoint (``gptq``) supplies run on packed kernels whatever ``quant`` is;
    ``quant`` quantizes the remaining float weights ("none": they stay float);
    ``quant="gptq:<uniform preset>"`` GPTQ-quantizes them on the calibration inputs in
    ``calib`` (``qtvm.gptq_compile``). ``dims`` {input dim name: expression} restates dims the
    exporter named on its own (``--dim s53='past + seq'``: ``frontend.onnx.rename_dims``).
    ``binds`` {input name: value} fixes inputs at compile time, inlining the If branches they
    choose (``--bind use_cache_branch=1``: a merged decoder's with-past decoder; ``frontend.bind``).
    ``combine``: matmuls sharing an input and a column-independent format run as one kernel
    (``relay_passes.combine_matmuls``; every target's kernels compute a column alone: tested bit
    for bit on x86 and, for the GPU rules, on PoCL)."""
    from qtvm.formats.gptq_checkpoint import GptqCheckpoint
    from qtvm.frontend.bind import bind_inputs
    from qtvm.frontend.quantized import lower_quantized
    from qtvm.gptq_compile import CalibratedCheckpoint, base_format, is_gptq_preset
    from relay_passes.quantized_onnx import lower_prequantized
    from relay_passes.safe_gather import safe_gather

    if kv_cache not in KV_CACHE_DTYPES:
        raise QtvmError(f"--kv-cache {kv_cache} is not one of {', '.join(KV_CACHE_DTYPES)}",
                        "use --kv-cache model (exact) or --kv-cache fp16")
    if kv_cache != "model" and not kv_step:
        raise QtvmError(f"--kv-cache {kv_cache} with --no-kv-step: without the step there is no cache to hold",
                        "drop one of the two options")
    target = parse_target(target) if isinstance(target, str) else target
    gptq_notes = []
    if is_gptq_preset(quant):
        fmt = base_format(quant)
        if calib is None:
            raise QtvmError(f"--quant {quant} needs calibration inputs", "pass --calib FILE.npz (or .npy)")
        if gptq is not None:
            raise QtvmError(f"--quant {quant} and --gptq both supply GPTQ weights", "use one of them")
        with CalibratedCheckpoint(model_path, quant, calib, binds) as ckpt:
            gptq, gptq_notes = GptqCheckpoint(ckpt.path), ckpt.notes  # read whole: the file may go
    else:
        if calib is not None:
            raise QtvmError("--calib is only used by --quant gptq:<preset>", "e.g. --quant gptq:int4-g128")
        fmt = None if quant == FLOAT else get_format(quant)
        gptq = GptqCheckpoint(gptq, gptq_format) if gptq is not None else None
    model = load_onnx(model_path, lazy=True)  # external weights read as each is imported
    fused_notes = [p.value for p in model.metadata_props if p.key.startswith(NOTE_KEY)]
    bind_notes = bind_inputs(model, binds or {})
    rename_dims(model, dims or {})
    validate(model, f"'{model_path}'")
    summary = summarize(model)
    lowered = lower_quantized(model, gptq, in_place=True)
    summary.float_matmuls = [n for n in summary.float_matmuls if n not in lowered.matmul_nodes]
    mod = import_onnx(lowered.model)
    del model, lowered.model  # the weights are the module's constants now: no second copy while packing
    facts = import_facts(mod)
    mod = safe_gather(mod)
    notes = fused_notes + bind_notes + gptq_notes + list(lowered.notes)
    from relay_passes.fp32_accumulate import fp32_accumulate

    mod, widened = fp32_accumulate(mod)
    if widened:
        notes.append(f"{widened} float16/bfloat16 matmuls, reductions and math functions compute in float32 (as "
                     "onnxruntime does)")
    meta = {
        "format": quant,
        "activations": activations if fmt is not None or lowered.weights else "fp32",
        "target": str(target),
        "required_cpu_flags": cpu_flags_required(target),
        **gpu_required(target),
        # a dim the import pinned to a constant (a GroupQueryAttention cache's head size) is that constant
        "inputs": [{"name": n, "dtype": d, "shape": [facts["pinned_dims"].get(x, x) for x in s]}
                   for n, d, s in summary.inputs],
        # Output dims as the import derived them from the input symbols (the legacy exporter
        # names them MatMullogits_dim_0 and the like).
        "outputs": [{"name": n, "dtype": d, "shape": derived if derived is not None else s}
                    for (n, d, s), derived in zip(summary.outputs, facts["output_dims"])],
        "dim_limits": facts["dim_limits"],
        "dim_minimums": facts["dim_minimums"],
        "may_be_zero": facts["may_be_zero"],
    }
    if binds:  # `qtvm check` feeds them to onnxruntime
        meta["bound_inputs"] = dict(binds)
    if fmt is None:  # float weights: a scheduled GEMM instead of TVM's default loops
        from relay_passes.dense_weights import dense_weights

        mod, meta["dense_matmuls"] = dense_weights(mod, target)
    if combine and fmt is not None and fmt.columns_independent:
        from relay_passes.combine_matmuls import combine_matmuls

        mod, combined = combine_matmuls(mod)
        if combined:
            meta["combined_matmuls"] = combined
            notes.append(f"{sum(map(len, combined))} matmuls sharing an input run as {len(combined)} (their weights "
                         "concatenated: one kernel call each, the same outputs)")
    if fmt is not None or lowered.weights:
        mod, report, prequantized = lower_prequantized(mod, lowered.weights, fmt, target, activations)
        merged = sum(len(group) - 1 for group in meta.get("combined_matmuls", []))  # the model's matmuls, not kernels
        meta.update(quantized_matmuls=len(report.layers) + merged, packed_bytes=report.packed_bytes,
                    float_weight_bytes=report.float_bytes, layers=_layer_table(report.layers))
        if lowered.weights:
            meta.update(prequantized_matmuls=prequantized, prequantized=lowered.summary())
        if report.fp32_activation_fallbacks:
            notes.append(f"int8 activations not available for {len(report.fp32_activation_fallbacks)} matmuls "
                         f"({'; '.join(sorted(set(report.fp32_activation_fallbacks)))}): they keep fp32 activations")
        if db is not None:
            from schedules.tune import apply_database

            mod, db_notes = apply_database(mod, target, db)
            notes.extend(db_notes)
        if report.routed:
            meta["routed_experts"] = report.routed
            notes.append(f"{report.routed} mixture-of-experts matmuls packed, each expert's weight on its own "
                         "(one kernel call, each row by its routed expert)")
            if report.routed == len(summary.routed_matmuls):
                summary.float_matmuls = [n for n in summary.float_matmuls if n not in summary.routed_matmuls]
        if summary.float_matmuls:
            notes.append(f"left in float: {len(summary.float_matmuls)} MatMul/Gemm whose weight is not a "
                         f"constant ({', '.join(summary.float_matmuls[:4])}"
                         f"{', ...' if len(summary.float_matmuls) > 4 else ''})")
    if kv_step:  # metadata "kv_step" only where the artefact has the step
        mod, info, kv_note = _kv_step(mod, meta, max_length, max_batch, KV_CACHE_DTYPES[kv_cache])
        if info is None and kv_cache != "model":
            kv_note = (kv_note + "; " if kv_note else "") + f"--kv-cache {kv_cache} changes nothing (no in-place cache)"
        notes += [kv_note] if kv_note else []
        if info is not None:
            meta["kv_step"] = info
    mod[METADATA_FUNC] = _metadata_function(meta)
    return mod, meta, summary, notes


DEFAULT_MAX_LENGTH = 2048
KV_CACHE_DTYPES = {"model": None, "fp16": "float16"}  # --kv-cache: the dtype float32 caches are held in


def _kv_step(mod, meta: dict, max_length: int | None, max_batch: int, cache_dtype: str | None = None):
    """The in-place KV-cache step for a past_key_values export (None for other models)."""
    from relay_passes.kv_cache import add_kv_step

    from qtvm.generate import position_limit

    if max_length is None:
        max_length = min(DEFAULT_MAX_LENGTH, position_limit(meta) or DEFAULT_MAX_LENGTH)
    if max_length < 1 or max_batch < 1:
        raise QtvmError(f"--max-length {max_length} and --max-batch {max_batch} must both be >= 1")
    mod, info, note = add_kv_step(mod, max_length, max_batch, cache_dtype)
    if info is not None:
        from relay_passes.last_logits import LAST_FUNC, add_last_logits

        mod, why = add_last_logits(mod, info["function"], info["seq"])
        info = {**info, "last_function": LAST_FUNC if why is None else None}
        if why is not None:
            note = (note + "; " if note else "") + f"a prompt's logits are computed for every position ({why})"
        names = [i["name"] for i in meta["inputs"]]
        info = {**info, "caches": [names[i] for i in info["caches"]], "mask": names[info["mask"]],
                "ids": names[info["ids"]],
                "positions": None if info["positions"] is None else names[info["positions"]]}
        _check_max_length(meta, info, max_length)
    return mod, info, note


def _check_max_length(meta: dict, info: dict, max_length: int) -> None:
    """A cache longer than the model's position tables allow (a limit on past + seq: MPT's
    ALiBi bias, GPT-Neo's causal masks) would read clipped rows past them: refused."""
    from qtvm import dims as dimexpr

    cache = next(i for i in meta["inputs"] if i["name"] == info["caches"][0])
    past = cache["shape"][2]
    tables = {d: top for d, top in meta["dim_limits"].items() if past in dimexpr.symbols(d) or d == past}
    if tables and max_length > min(tables.values()):
        d, top = min(tables.items(), key=lambda kv: kv[1])
        raise QtvmError(f"--max-length {max_length} is past what this model's position tables hold ({d} <= {top})",
                        f"use --max-length {top} or less (the default)")


def _held_in_half(meta: dict) -> bool:
    """The step holds float32 caches in float16 (``--kv-cache fp16``)."""
    kv = meta["kv_step"]
    cache = next(i for i in meta["inputs"] if i["name"] == kv["caches"][0])
    return kv.get("cache_dtype") == "float16" and cache["dtype"] == "float32"


def _order_tolerance(meta: dict) -> float:
    """How far two functions of the artefact computing the same values in another order may
    differ (relative to the largest logit): the last-position step against the step."""
    return 3e-2 if meta["activations"] == "int8" else 1e-3  # int8 rounding may flip on a 1e-7 difference


def step_tolerance(meta: dict) -> float:
    """How far the KV step's logits may be from main's (relative to the largest) at compile."""
    if _held_in_half(meta):  # rows rounded to 11 bits, which flips further int8 roundings (an 8-layer
        # LLaMA's int8 step: 3.3e-2); a wrong rewrite is off by O(1)
        return 6e-2 if meta["activations"] == "int8" else 1e-2
    return _order_tolerance(meta)


def _check_kv_functions(path, meta: dict) -> tuple[str | None, str | None, float | None]:
    """Run the exported step against main, then (where it agrees and the artefact has one) the
    last-position step against the step's last row, here, on one load of the artefact
    (``qtvm.generate.step_errors`` and ``check_last``): what differed in each, or None, and
    the step's largest logits error (relative)."""
    from qtvm import generate
    from qtvm.runtime import Module

    module = Module(path, weights_in_file=True)  # the compile still holds its module: no second copy
    errors = generate.step_errors(module) or {}
    worst = max((e for what, e in errors.items() if what.startswith("logits")), default=None)
    problem = generate.first_over(errors, step_tolerance(meta))
    if problem is not None or not meta["kv_step"].get("last_function"):
        return problem, None, worst
    # both read the same cache: a float16 one widens nothing here (measured 0 - 8e-7)
    return None, generate.check_last(module, tol=_order_tolerance(meta)), worst


def _build_and_export(mod, target: tvm.target.Target, path, toolchain, step=lambda stage: None) -> None:
    """Schedule, compile and export ``mod`` to ``path``. A CPU artefact linked by ``.incbin``
    holds its weights as a blob beside the VM's module (``relay_passes.lift_weights``,
    ``qtvm.deploy.weights``): loaded once, onto huge pages; elsewhere they stay constants."""
    from qtvm.deploy.toolchain import export_library, lifts_weights
    from qtvm.quiet import tvm_output_captured

    step("schedule + build")
    lifted = [] if target.kind.name == "llvm" and lifts_weights(toolchain) else None
    ex = compile_relax(schedule_generic_ops(mod, target), target, lifted)
    step("export")
    with tvm_output_captured():  # TVM logs a warning per planned memory scope while saving
        export_library(ex, path, toolchain, lifted)


def _layer_table(layers) -> list[dict]:
    """Packed matmuls grouped by (format, K, N), for `qtvm inspect`: bits/weight from stored bytes."""
    rows: dict[tuple, dict] = {}
    for layer in layers:
        key = (layer.fmt.name, layer.k, layer.n, layer.experts)
        row = rows.setdefault(key, {"format": key[0], "k": layer.k, "n": layer.n, "count": 0,
                                    "bits_per_weight": round(layer.bits_per_weight, 3)})
        if layer.experts > 1:
            row["experts"] = layer.experts
        row["count"] += 1
    return list(rows.values())


def _runs_here(target: tvm.target.Target) -> bool:
    """A CPU build this machine can execute (a native link; no flag the host lacks)."""
    from qtvm.hostinfo import host_cpu_flags

    return target.kind.name == "llvm" and set(cpu_flags_required(target)) <= host_cpu_flags()


def schedule_generic_ops(mod, target: tvm.target.Target):
    """The target family's rules for the ops around the packed kernels (norms, softmax,
    attention, elementwise): ``schedules/x86_generic.py``, ``schedules/gpu_generic.py``."""
    from schedules import schedule_generic_ops as family_generic

    return family_generic(mod, target)


def compile_relax(mod, target: tvm.target.Target, lifted: list | None = None):
    """tvm.compile with the target family's Relax pipeline (GPU families already fused and
    scheduled the graph) and what a CUDA target needs around it (``qtvm.cuda``).

    ``lifted`` (a list, CPU targets): the weights leave the VM's constants
    (``relay_passes.lift_weights``): each function that reads one takes it as a trailing
    parameter ``qtvm_w<index>``, and they are appended to ``lifted`` in index order (for the
    export's blob)."""
    from relay_passes.outline_branches import outline_branches
    from schedules import family, tir_pipeline

    mod, _ = outline_branches(mod)  # TVM's memory planner lends a branch's storage past its If
    pipeline = getattr(family(target), "relax_pipeline", None)
    pipeline = pipeline(target) if pipeline is not None else "default"
    if target.kind.name == "cuda":
        from qtvm.cuda import compile_cuda

        return compile_cuda(mod, target, relax_pipeline=pipeline)
    if lifted is not None:
        pipeline = tvm.transform.Sequential([relax.get_pipeline(pipeline) if isinstance(pipeline, str) else pipeline,
                                             _lift_weights_pass(lifted)])
    try:
        return tvm.compile(mod, target=target, relax_pipeline=pipeline, tir_pipeline=tir_pipeline(target))
    except tvm.error.InternalError as e:
        if "CodeGenVM cannot emit" not in str(e):
            raise
        call = next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), "an operator")
        raise QtvmError(f"TVM left {call} without a kernel: its input shapes were not inferred",
                        "where an If on a model input holds it, --bind that input to compile the branch it takes "
                        "(TVM's importer converts If branches without qtvm's symbolic shape folding); else report "
                        "it with the model attached") from None


def _lift_weights_pass(lifted: list):
    from relay_passes.lift_weights import lift_weights

    @tvm.transform.module_pass(opt_level=0, name="qtvm.LiftWeights")
    def lift(mod, _ctx):
        mod, weights = lift_weights(mod, keep=(METADATA_FUNC,))
        lifted.extend(weights)
        return mod

    return lift


def compile_model(model_path, out, target: str | tvm.target.Target = "host", quant: str = "int4-g128",
                  activations: str = "fp32", db: str | os.PathLike | None = None,
                  gptq: str | os.PathLike | None = None, gptq_format: str | None = None,
                  calib: str | os.PathLike | None = None, *,
                  host: str | tvm.target.Target | None = None, cross_cc: str | None = None,
                  progress=None, max_length: int | None = None, max_batch: int = 1,
                  kv_step: bool = True, dims: dict[str, str] | None = None, combine: bool = True,
                  kv_cache: str = "model", binds: dict[str, str] | None = None) -> CompileResult:
    """Compile and export atomically: ``out`` is either complete or untouched.

    ``progress(stage)`` (optional) is called as each stage starts (the CLI's progress bar).

    ``host`` is the CPU part of a device target (``--host``); an artefact for another
    machine (``-mtriple``) is linked by its cross toolchain (``qtvm.deploy.toolchain``,
    resolved before any work; ``cross_cc`` names one) and checked with readelf."""
    from qtvm.deploy.toolchain import toolchain_for, with_default_host

    start = time.perf_counter()
    out = check_output_path(out)
    target = with_host(parse_target(target) if isinstance(target, str) else target, host)
    target, host_note = with_default_host(target)
    toolchain = toolchain_for(target, cross_cc)
    step = progress or (lambda stage: None)
    step("import + quantize")
    mod, meta, summary, notes = build_module(model_path, target, quant, activations, db, gptq, gptq_format, calib,
                                             max_length, max_batch, kv_step, dims, combine, kv_cache, binds)
    notes = ([host_note] if host_note else []) + notes
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".so", dir=out.parent if str(out.parent) else ".")
    os.close(fd)
    try:
        _build_and_export(mod, target, tmp, toolchain, step)
        if meta.get("kv_step"):
            gc.collect()  # the executable and its weights, before the check loads the artefact
            problem, last_problem, step_error = (_check_kv_functions(tmp, meta) if toolchain is None
                                                 and _runs_here(target) else ("skip", None, None))
            if step_error is not None and not problem and _held_in_half(meta):
                flips = " (--act int8: mostly roundings to int8 that the cache's rounding flips)" \
                    if meta["activations"] == "int8" else ""
                notes.append(f"KV caches held in float16 (--kv-cache fp16): the step's logits within "
                             f"{step_error:.1e} of main's with float32 caches (relative to the largest logit; "
                             f"random ids, a 3-token prompt and a token){flips}")
            if problem == "skip":
                notes.append("the KV-cache step was not run against main here (another machine's target)")
            elif problem or last_problem:  # a rewrite is not right for this model: ship without it
                last = meta["kv_step"]["last_function"]
                if last:  # derived from the step: goes with it, or alone
                    del mod[last]
                if problem:
                    notes.append(f"no in-place KV-cache step ({problem}): generation feeds the presents back")
                    del mod[meta.pop("kv_step")["function"]]
                else:
                    notes.append(f"a prompt's logits are computed for every position ({last_problem})")
                    meta["kv_step"]["last_function"] = None
                mod[METADATA_FUNC] = _metadata_function(meta)
                Path(tmp).unlink()  # a new file, not one rewritten under the check's mapping
                _build_and_export(mod, target, tmp, toolchain)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if toolchain is not None:
        notes.append(f"cross-built for {toolchain.triple} (linked by {toolchain.cc}; readelf: "
                     f"{toolchain.elf_machine}, qtvm_metadata present): copy it to the device")
    return CompileResult(out, meta, summary, time.perf_counter() - start, notes)
