"""Run qtvm's CUDA kernels and artefacts on a real GPU that has no TVM compiler beside it.

Two halves, because a GPU machine may hold only TVM's runtime (its 260 MB compiler is the
part that does not travel):

    python3 benchmarks/gpu_device_check.py build .gpu/bundle [--arch sm_90]  # here: nvcc, references
    python3 benchmarks/gpu_device_check.py pack .gpu                         # TVM's runtime, to carry
    bash benchmarks/gpu_device_run.sh .gpu OUT                               # there: installs, runs

(``run .gpu/bundle OUT`` is the check itself; ``profile .gpu/bundle NAME...`` calls kernels
for ``ncu``; ``gpu_device_run.sh`` with NCU="name ..." profiles them too.)

``build`` compiles, for one CUDA architecture (``--parts`` picks, an existing manifest keeps
the other parts' entries),
  * kernels: every GPU kernel family on the awkward shapes of tests/schedules/test_gpu_*.py
    (K not a multiple of the group, N not a multiple of a block's columns, M = 1 and M > 1)
    and with K a multiple of the chunk, with inputs and each format's numpy reference;
  * layers: each quantized layer's Relax dispatch of the bundled model (tiny LLaMA), with the
    same layer built for the CPU as reference (a wrong kernel vs a whole-graph fault);
  * models: the bundled model as CUDA artefacts for several presets, with the logits of the
    same preset's CPU artefact on several (batch, seq) bindings;
  * timing, gemm, sweep, rows: the decode GEMVs at LLM shapes, the prefill GEMM at M = 256,
    the GEMV's launch knobs around the analytic choice, and int4's GEMV and GEMM at M = 1..16
    (weights are random bits made on the GPU: timing needs the layout, not the values);
  * tc, tc_timing: the ``--act fp16`` prefill GEMM on tensor cores on awkward shapes (against
    the numpy emulation of its fp16 rounding), and timed at M = 1..2048 beside torch's fp16
    matmul and the fp16 GEMV at M <= 16;
  * kv: KV-cache models (transformers and onnxruntime-genai exports, float32 and float16
    caches) as CUDA artefacts, with the logits of every feed and the caches of the same
    compile's CPU session (``KV_FEEDS``: the cache crosses 64 tokens); timed per decode token.
``run`` loads them with TVM's runtime alone (TVM_USE_RUNTIME_LIB=1), checks every output
against its reference (outputs poisoned with NaN first), then times with
``qtvm.bench.gpu_gemv``'s method (weights rotated past twice the L2, a CUDA graph per round,
CUDA events) next to torch's fp16 ``mv``, int4 kernel and fp16 matmul and the HBM read
bandwidth. It prints a table and writes ``OUT/gpu_check.json``; ``--only _tracing`` also
records every packed matmul's input and output of a model run (the VM's instrument hook).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMING_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672)]
TIMING_FORMATS = [("int4-g128", "fp32"), ("int4-g128", "fp16"), ("int4-g128-f16", "fp32"), ("int3-g128", "fp32"),
                  ("int2-g64", "fp32"), ("e0m4-g128", "fp32"), ("e0m4-g128", "fp16"), ("bcq3-g128", "fp32"),
                  ("bcq3-g128", "fp32-lut"), ("int8-g32", "fp32")]
MODEL_PRESETS = [("int4-g128", "fp32"), ("int4-g128", "fp16"), ("int3-g128", "fp32"), ("e0m4-g128", "fp32"),
                 ("bcq3-g128", "fp32"), ("mixed-2-4-16", "fp32"), ("int4-g128-qz", "fp32"), ("e0m4-g128", "fp16"),
                 ("int8-g32", "fp16"), ("int4-g128-f16", "fp32")]
MODEL_BINDINGS = [(1, 1), (2, 3), (1, 67), (3, 16)]
VECTOR_CASES = [("int4-g128", 4096, 70), ("int3-g128", 2048, 37), ("e0m4-g128", 4096, 37), ("int8-g32", 4096, 37),
                ("int2-g64", 4096, 37), ("bcq3-g128", 1024, 37), ("int4-g128-qz", 2048, 37)]
GEMM_SHAPES = [(4096, 11008), (11008, 4096)]
GEMM_FORMATS = ["int4-g128", "int3-g128"]
GEMM_ROWS = 256
ROWS_SHAPES = [(4096, 11008), (11008, 4096)]
ROWS = (1, 2, 3, 4, 8, 16)
LAYER_PRESETS = ["int4-g128", "int3-g128", "e0m4-g128", "bcq3-g128"]
#: the in-place KV-cache step (``qtvm.generate.KVSession``) on the GPU: (source, family, exporter,
#: quant, activations, cache dtype); "hf" is a transformers export, "genai" onnxruntime-genai's
#: builder (GroupQueryAttention, int4 MatMulNBits as written)
KV_MODELS = [("hf", "llama", "legacy", "int4-g128", "fp32", "model"),
             ("hf", "llama", "legacy", "int4-g128", "fp32", "fp16"),
             ("hf", "llama", "legacy", "int4-g128", "fp16", "fp16"),
             ("hf", "qwen3", "dynamo", "int4-g128", "fp32", "model"),
             ("hf", "qwen3", "dynamo", "int4-g128", "fp32", "fp16"),
             ("hf", "gpt2", "legacy", "int4-g128", "fp32", "model"),
             ("genai", "llama", "", "int4-g128", "fp32", "model"),
             ("genai", "llama", "", "int4-g128", "fp32", "fp16")]
#: feeds of the KV check, batch 2 (row 1 left-padded by 5 in the prompt): (tokens, last only);
#: the cache crosses 64 tokens (its rows re-laid) at the third feed
KV_FEEDS = [(60, True), (1, False), (7, False), (1, True), *[(1, False)] * 8]
#: ``--act fp16`` prefill on tensor cores (``schedules/gpu_gemm_tc.py``): checked at these rows
#: (awkward shapes from tests/schedules/test_gpu_gemm_tc.py, and int4 at K = 2048), timed
#: for int4-g128 at each M below (beside torch's fp16 matmul and, at M <= 16, the fp16 GEMV),
#: the other fp16 formats at M = GEMM_ROWS
TC_ROWS = (1, 17, 67, 256)
TC_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (8192, 28672)]
TC_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
TC_FORMATS = ["e0m4-g128", "int8-g32", "int2-g64", "int4-g128-qz"]
#: (preset, K values in a lane's chunk, lanes, warps, columns per warp): lanes past 32 split K
#: over several warps of a block (their sums meet in shared memory)
SWEEP_VARIANTS = [("int4-g128", 32, 32, 4, 4),  # the kernel before (a lane's chunk: one 16-byte load)
                  ("int4-g128", 8, 128, 1, 4), ("int4-g128", 16, 128, 1, 4), ("int4-g128", 32, 128, 1, 4),
                  ("int4-g128", 16, 256, 1, 4), ("int4-g128", 16, 64, 2, 4), ("int4-g128", 16, 128, 1, 2),
                  ("int4-g128", 16, 128, 2, 4), ("e0m4-g128", 8, 128, 1, 4), ("e0m4-g128", 16, 128, 1, 4),
                  ("int3-g128", 32, 32, 4, 4), ("int3-g128", 32, 64, 2, 4), ("int3-g128", 32, 128, 1, 4),
                  ("int2-g64", 16, 128, 1, 4), ("int2-g64", 32, 128, 1, 4), ("int8-g32", 8, 128, 1, 4),
                  ("int8-g32", 16, 128, 1, 4), ("bcq3-g128", 32, 32, 4, 4), ("bcq3-g128", 32, 128, 1, 4)]


def _slug(text: str) -> str:
    return text.replace("-", "_").replace(" ", "_")


def _param_specs(func) -> list[dict]:
    """Each parameter's shape (an int, or the name of a symbolic dim) and dtype."""
    specs = []
    for param in func.params:
        buf = func.buffer_map[param] if hasattr(func, "buffer_map") else param  # TVM 0.27: params are buffers
        shape = [int(d) if hasattr(d, "value") else str(d) for d in buf.shape]
        specs.append({"name": str(buf.name), "shape": shape, "dtype": str(buf.dtype)})
    return specs


def _export(funcs: dict, target, path: Path) -> None:
    import tvm

    from qtvm.cuda import compile_cuda

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    compile_cuda(mod, target, relax_pipeline=None).export_library(str(path))


def _correctness_kernels(target):
    """(name, scheduled func, preset, k, n, rows of x) for each family's awkward shapes."""
    from qtvm import lut_gemv, ops
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_func
    from schedules import facts, gpu, gpu_gemv, gpu_lut, schedule_kernel
    from tests.schedules import test_gpu_gemm, test_gpu_gemv, test_gpu_lut

    f = facts(target)
    for preset, k, n in test_gpu_gemv.CASES:
        fmt = get_format(preset)
        yield (f"gemv_{_slug(preset)}_{k}x{n}", schedule_kernel(ops.qmatmul_func(fmt, k, n, f.col_block,
                                                                                  **f.gemv_options(fmt, k)), target),
               preset, k, n, (1, 3, 16))
    for preset, k, n in test_gpu_gemv.F16_CASES:
        fmt = get_format(preset)
        yield (f"gemv_f16_{_slug(preset)}_{k}x{n}",
               schedule_kernel(ops.qmatmul_f16_func(fmt, k, n, 1, **f.gemv_options(fmt, k)), target),
               preset, k, n, (1, 3, 16))
    for preset, k, n in test_gpu_gemm.CASES:
        yield (f"gemm_{_slug(preset)}_{k}x{n}",
               schedule_kernel(qmatmul_gemm_func(get_format(preset), k, n, f.col_block), target),
               preset, k, n, (1, 5, 67))
    for preset, k, n in VECTOR_CASES:  # K a multiple of the chunk: x read in 32-byte loads
        fmt = get_format(preset)
        yield (f"gemv_vx_{_slug(preset)}_{k}x{n}", schedule_kernel(
            ops.qmatmul_func(fmt, k, n, f.col_block, **f.gemv_options(fmt, k)), target), preset, k, n, (1, 3, 16))
        if f.f16_activations(fmt, k):
            yield (f"gemv_f16_vx_{_slug(preset)}_{k}x{n}", schedule_kernel(
                ops.qmatmul_f16_func(fmt, k, n, 1, **f.gemv_options(fmt, k)), target), preset, k, n, (1, 3, 16))
    for preset, k, n in [*test_gpu_gemv.CASES, *VECTOR_CASES]:  # other launch shapes (the sweep's), awkward too
        fmt = get_format(preset)
        func = ops.qmatmul_func(fmt, k, n, f.col_block, chunk=gpu.target_chunk(target, fmt, k))
        for lanes, warps, cols in ((256, 1, 4), (64, 2, 4), (32, 4, 4)):
            yield (f"gemv_l{lanes}_w{warps}_{_slug(preset)}_{k}x{n}", gpu_gemv.schedule_qmatmul_gpu(
                func, target, lanes=lanes, warps=warps, cols=cols).mod["main"], preset, k, n, (1, 3, 16))
    for preset in ("int3-g128", "e0m4-g128"):  # the bundled model's shapes: K a whole number of groups
        fmt = get_format(preset)
        for k, n in ((256, 64), (704, 256)):
            yield (f"gemv_{_slug(preset)}_{k}x{n}", schedule_kernel(
                ops.qmatmul_func(fmt, k, n, f.col_block, **f.gemv_options(fmt, k)), target), preset, k, n, (1, 3, 16))
            yield (f"gemm_{_slug(preset)}_{k}x{n}",
                   schedule_kernel(qmatmul_gemm_func(fmt, k, n, f.col_block), target), preset, k, n, (5, 48))
    for preset, k, n in test_gpu_lut.CASES:
        sch = gpu_lut.schedule_lut_gemv_gpu(lut_gemv.lut_gemv_func(get_format(preset), k, n, 1), target)
        yield f"lut_{_slug(preset)}_{k}x{n}", sch.mod["main"], preset, k, n, (1, 3)


def _timing_func(preset: str, act: str, k: int, n: int, target):
    """The decode kernel the compiler picks (``act`` "fp32-lut": BCQ's LUT-GEMM regardless),
    N padded as the pass pads it; None where the format has no such kernel."""
    from qtvm.bench.gpu_gemv import decode_gemv_func
    from qtvm.formats import get_format
    from schedules import schedule_kernel

    func = decode_gemv_func(get_format(preset), k, _padded_n(n, target), target, "fp32" if act == "fp32-lut" else act,
                            lut=True if act == "fp32-lut" else None)
    return None if func is None else schedule_kernel(func, target)


def build(out: Path, arch: str, parts=("kernels", "timing", "gemm", "sweep", "rows", "layers", "models", "tc",
                                      "tc_timing", "kv")) -> None:
    """Each part writes its files and its manifest entries; an existing manifest keeps the
    entries of the parts not rebuilt."""
    from qtvm.target import parse_target

    target = parse_target(f"cuda -arch={arch}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "manifest.json"
    manifest = {"kernels": [], "timing": [], "gemm": [], "sweep": [], "rows": [], "layers": [], "models": [],
                "tc": [], "tc_timing": [], "kv": [],
                **(json.loads(path.read_text()) if path.is_file() else {}),
                "arch": arch, "l2_bytes": int(target.attrs["l2_cache_size_bytes"])}
    for part in parts:
        manifest[part] = []
        globals()[f"_build_{part}"](out, target, manifest)
        path.write_text(json.dumps(manifest, indent=1))


def _build_kernels(out: Path, target, manifest: dict, part: str = "kernels", kernels=None) -> None:
    from qtvm import ops
    from qtvm.formats import get_format

    funcs, arrays = {}, {}
    for name, func, preset, k, n, rows in _correctness_kernels(target) if kernels is None else kernels:
        fmt = get_format(preset)
        qt = fmt.quantize(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))
        specs = _param_specs(func)
        weights = ops.blocked_arrays(qt, 1)
        assert len(weights) == len(specs) - 2, (name, len(weights), specs)
        for i, w in enumerate(weights):
            arrays[f"{name}/w{i}"] = w
        for m in rows:
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            arrays[f"{name}/x{m}"] = x.astype(specs[0]["dtype"])
            arrays[f"{name}/want{m}"] = x.astype(specs[0]["dtype"]).astype(np.float64) @ qt.dequantize()
            if specs[0]["dtype"] == "float16" and "zeros" in qt.arrays:  # what the fp16 kernel should give
                from schedules import gpu
                from tests.schedules.test_gpu_gemv import emulate_f16_gemv

                arrays[f"{name}/emulated{m}"] = emulate_f16_gemv(x, qt, gpu.target_chunk(target, fmt, k))
            if name.startswith("gemm_f16"):  # fp16 operands, fp32 sums
                from tests.schedules.test_gpu_gemm_tc import emulate_f16_gemm

                arrays[f"{name}/emulated{m}"] = emulate_f16_gemm(x, qt)
        funcs[name] = func
        manifest[part].append({"name": name, "preset": preset, "k": k, "n": n, "rows": list(rows),
                               "params": specs, "weights": len(weights)})
        print(f"built {name}", flush=True)
    _export(funcs, target, out / f"{part}.so")
    np.savez_compressed(out / f"{part}.npz", **arrays)


def _build_tc(out: Path, target, manifest: dict) -> None:
    """The tensor-core prefill GEMM on awkward shapes (N not padded: the rule pads)."""
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_f16_func
    from schedules import schedule_kernel
    from tests.schedules.test_gpu_gemm_tc import CASES

    kernels = [(f"gemm_f16_{_slug(preset)}_{k}x{n}", schedule_kernel(qmatmul_gemm_f16_func(get_format(preset), k, n, 1),
                                                                     target), preset, k, n, TC_ROWS)
               for preset, k, n in [*CASES, ("int4-g128", 2048, 512)]]
    _build_kernels(out, target, manifest, "tc", kernels)


def _build_tc_timing(out: Path, target, manifest: dict) -> None:
    """int4-g128's tensor-core GEMM at every M of TC_M and its fp16 GEMV at M <= 16 (where one
    should hand over to the other under ``--act fp16``); the other fp16 formats' GEMM at
    M = GEMM_ROWS."""
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_f16_func
    from schedules import schedule_kernel

    funcs = {}
    for k, n in TC_SHAPES:
        for preset in ["int4-g128", *TC_FORMATS]:
            name = f"tc_{_slug(preset)}_{k}x{n}"
            funcs[name] = schedule_kernel(qmatmul_gemm_f16_func(get_format(preset), k, _padded_n(n, target), 1), target)
            for m in TC_M if preset == "int4-g128" else (GEMM_ROWS,):
                manifest["tc_timing"].append(_timed_entry(name, funcs[name], preset, "fp16 TC GEMM", k, n, m=m))
        gemv = f"tcv_int4_g128_{k}x{n}"
        funcs[gemv] = _timing_func("int4-g128", "fp16", k, n, target)
        for m in (m for m in TC_M if m <= 16):
            manifest["tc_timing"].append(_timed_entry(gemv, funcs[gemv], "int4-g128", "fp16 GEMV", k, n, m=m))
    _export(funcs, target, out / "tc_timing.so")
    print("built the tensor-core GEMM timing kernels", flush=True)


def _build_timing(out: Path, target, manifest: dict) -> None:
    timing = {}
    for k, n in TIMING_SHAPES:
        for preset, act in TIMING_FORMATS:
            func = _timing_func(preset, act, k, n, target)
            if func is None:
                continue
            name = f"t_{_slug(preset)}_{_slug(act)}_{k}x{n}"
            timing[name] = func
            manifest["timing"].append(_timed_entry(name, func, preset, act, k, n))
    _export(timing, target, out / "timing.so")
    print("built the timing kernels", flush=True)


def _build_gemm(out: Path, target, manifest: dict) -> None:
    """Prefill: the GEMM rule at M = GEMM_ROWS (timed beside torch's fp16 matmul)."""
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_func
    from schedules import facts, schedule_kernel

    funcs = {}
    for k, n in GEMM_SHAPES:
        for preset in GEMM_FORMATS:
            name = f"g_{_slug(preset)}_{k}x{n}"
            funcs[name] = schedule_kernel(qmatmul_gemm_func(get_format(preset), k, _padded_n(n, target),
                                                            facts(target).col_block), target)
            manifest["gemm"].append(_timed_entry(name, funcs[name], preset, "fp32", k, n, m=GEMM_ROWS))
    _export(funcs, target, out / "gemm.so")
    print("built the prefill GEMM kernels", flush=True)


def _build_rows(out: Path, target, manifest: dict) -> None:
    """int4-g128's decode GEMV and prefill GEMM at small M: where one should hand over to the
    other (``gpu.GEMV_MAX_ROWS``; the decode kernels are checked at M = 16 too)."""
    from qtvm.formats import get_format
    from qtvm.ops_gemm import qmatmul_gemm_func
    from schedules import facts, schedule_kernel

    funcs = {}
    for k, n in ROWS_SHAPES:
        gemv, gemm = f"r_gemv_{k}x{n}", f"r_gemm_{k}x{n}"
        funcs[gemv] = _timing_func("int4-g128", "fp32", k, n, target)
        funcs[gemm] = schedule_kernel(qmatmul_gemm_func(get_format("int4-g128"), k, _padded_n(n, target),
                                                        facts(target).col_block), target)
        for m in ROWS:
            manifest["rows"].append(_timed_entry(gemv, funcs[gemv], "int4-g128", "fp32 GEMV", k, n, m=m))
            if m > 1:
                manifest["rows"].append(_timed_entry(gemm, funcs[gemm], "int4-g128", "fp32 GEMM", k, n, m=m))
    _export(funcs, target, out / "rows.so")
    print("built the GEMV/GEMM row sweep", flush=True)


def _layer_module(mod, target):
    """Each quantized layer's dispatch (decode GEMV or prefill GEMM by M) of ``mod`` as a
    public Relax function, with the kernels it calls; compiled for ``target``."""
    import tvm

    from qtvm.pipeline import compile_relax

    keep = {}
    for gv, f in mod.functions.items():
        if isinstance(f, tvm.tirx.PrimFunc):
            keep[gv] = f
        elif gv.name_hint.startswith("qmatmul_dispatch"):
            keep[gv] = f.with_attr("global_symbol", gv.name_hint)
    return compile_relax(tvm.IRModule(keep), target)


def _build_sweep(out: Path, target, manifest: dict) -> None:
    """The decode GEMV's variants around the analytic choice at the timing shapes: launch
    knobs (lanes splitting K, groups per block, columns per group), the lane chunk (K values
    a lane reduces per step: 32 for int4 = one 128-bit load of a column, 8 = one word; the
    lanes' x chunks then contiguous): which streams HBM best."""
    from qtvm import ops
    from qtvm.formats import get_format
    from schedules import facts, gpu, gpu_gemv

    f, funcs = facts(target), {}
    for k, n in TIMING_SHAPES:
        for preset, chunk, lanes, warps, cols in SWEEP_VARIANTS:
            fmt = get_format(preset)
            knobs = f"k{chunk} l{lanes} w{warps} c{cols}"
            name = f"s_{_slug(preset)}_{knobs.replace(' ', '_')}_{k}x{n}"
            func = ops.qmatmul_func(fmt, k, n, f.col_block, chunk=chunk)
            funcs[name] = gpu_gemv.schedule_qmatmul_gpu(func, target, lanes=lanes, warps=warps, cols=cols).mod["main"]
            manifest["sweep"].append(_timed_entry(name, funcs[name], preset, knobs, k, n))
    _export(funcs, target, out / "sweep.so")
    print("built the GEMV variant sweep", flush=True)


def _build_layers(out: Path, target, manifest: dict) -> None:
    """Per layer, the GPU dispatch against the same layer built for the CPU: tells a wrong
    kernel or plumbing in one layer from a fault that needs the whole graph."""
    import tvm

    from qtvm.models.tiny_llama import export_onnx
    from qtvm.pipeline import build_module
    from qtvm.target import parse_target

    model = export_onnx(out / "layers.onnx")
    refs = {}
    for preset in LAYER_PRESETS:
        built = {}
        for t in (target, parse_target("host")):  # the CPU's layers uncombined: dispatch i is the same layer
            mod, *_ = build_module(model, t, preset, "fp32", combine=False)
            built[t.kind.name] = (mod, _layer_module(mod, t))
        name = f"layers_{_slug(preset)}"
        built["cuda"][1].export_library(str(out / f"{name}.so"))
        host_mod, host_ex = built["llvm"]
        vm = tvm.runtime.vm.VirtualMachine(host_ex, tvm.cpu())
        funcs = sorted(gv.name_hint for gv in host_mod.functions if gv.name_hint.startswith("qmatmul_dispatch"))
        for fn in funcs:
            k = int(host_mod[fn].params[0].ty.shape[1])
            for m in (1, 3, 48):
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                refs[f"{name}/{fn}/x{m}"] = x
                refs[f"{name}/{fn}/want{m}"] = vm[fn](tvm.runtime.tensor(x)).numpy()
        manifest["layers"].append({"name": name, "preset": preset, "funcs": funcs, "rows": [1, 3, 48]})
        print(f"built {name}", flush=True)
    np.savez_compressed(out / "layers.npz", **refs)
    (out / "layers.onnx").unlink()


def _build_models(out: Path, target, manifest: dict) -> None:
    from qtvm import runtime
    from qtvm.models.tiny_llama import export_onnx
    from qtvm.pipeline import compile_model

    model = export_onnx(out / "tiny_llama.onnx")
    rng = np.random.default_rng(0)
    ids = {f"{b}x{s}": rng.integers(0, 512, (b, s)).astype(np.int64) for b, s in MODEL_BINDINGS}
    refs = {f"ids/{key}": v for key, v in ids.items()}

    for preset, act in MODEL_PRESETS:
        name = f"tiny_{_slug(preset)}_{act}"
        start = time.perf_counter()
        try:
            compile_model(model, out / f"{name}.so", target, preset, act)
        except Exception as e:  # noqa: BLE001 -- a failed compile is a finding, the rest goes on
            manifest.setdefault("build_errors", []).append(f"{name}: {str(e).strip().splitlines()[-1][:300]}")
            print(f"FAILED {name}: {str(e).strip().splitlines()[-1][:300]}", flush=True)
            continue
        cpu = runtime.load(compile_model(model, out / "cpu.so", "host", preset, "fp32").path)
        for key, v in ids.items():
            refs[f"{name}/{key}"] = cpu.run({"input_ids": v})["logits"]
        manifest["models"].append({"name": name, "preset": preset, "act": act})
        print(f"built {name} ({time.perf_counter() - start:.0f} s)", flush=True)
    (out / "cpu.so").unlink(missing_ok=True)
    np.savez_compressed(out / "models.npz", **refs)


def _kv_feeds(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray | None, bool]]:
    """(ids [2, n], mask or None, last) per feed of KV_FEEDS."""
    rng = np.random.default_rng(seed)
    feeds = []
    for i, (n, last) in enumerate(KV_FEEDS):
        mask = None
        if i == 0:
            mask = np.ones((2, n), np.int64)
            mask[1, :5] = 0
        feeds.append((rng.integers(0, 256, (2, n)).astype(np.int64), mask, last))
    return feeds


def _kv_run(module, feeds, prefix: str) -> dict:
    """Each feed's logits and, after the last, every cache as the session holds it."""
    session = module.session(2)
    got = {f"{prefix}/logits{i}": session.feed(ids, mask, last=last).copy()
           for i, (ids, mask, last) in enumerate(feeds)}
    for name in module.metadata["kv_step"]["caches"]:
        got[f"{prefix}/cache/{name}"] = session.cache(name)
    return got


def _build_kv(out: Path, target, manifest: dict) -> None:
    """The KV models as CUDA artefacts, and the same compile for the CPU run through the same
    feeds here: the reference is the CPU's step with the same cache dtype (a float16 cache's
    rounding is in both)."""
    from qtvm import runtime
    from qtvm.pipeline import compile_model
    from tests.frontend import genai_builder_models, transformers_exports

    exports = Path(os.environ.get("QTVM_TEST_EXPORTS") or out / "exports")
    feeds = _kv_feeds()
    refs = {}
    for source, family, exporter, quant, act, kv_cache in KV_MODELS:
        path = genai_builder_models.cached_model(exports, family) if source == "genai" else \
            transformers_exports.cached_export(exports, family, exporter, kv=True)
        name = _slug("_".join(filter(None, ("kv", source, family, exporter, quant, act, kv_cache))))
        start = time.perf_counter()
        try:
            compile_model(path, out / f"{name}.so", target, quant, act, max_batch=2, kv_cache=kv_cache)
        except Exception as e:  # noqa: BLE001 -- a failed compile is a finding, the rest goes on
            manifest.setdefault("build_errors", []).append(f"{name}: {str(e).strip().splitlines()[-1][:300]}")
            print(f"FAILED {name}: {str(e).strip().splitlines()[-1][:300]}", flush=True)
            continue
        cpu_act = "fp32" if act == "fp16" else act  # --act fp16: against fp32 activations (no such CPU kernels)
        cpu = compile_model(path, out / "cpu.so", "host", quant, cpu_act, max_batch=2, kv_cache=kv_cache)
        refs.update(_kv_run(runtime.load(cpu.path), feeds, name))
        bar = 1e-2 if act == "fp16" else 1e-3 if kv_cache == "fp16" else 1e-4
        manifest["kv"].append({"name": name, "act": act, "kv_cache": kv_cache, "bar": bar})
        print(f"built {name} ({time.perf_counter() - start:.0f} s)", flush=True)
    (out / "cpu.so").unlink(missing_ok=True)
    np.savez_compressed(out / "kv.npz", **refs)


def _timed_entry(name: str, func, preset: str, act: str, k: int, n: int, **extra) -> dict:
    """A manifest row for a kernel the GPU side times: its parameters and weight bytes."""
    specs = _param_specs(func)
    return {"name": name, "preset": preset, "act": act, "k": k, "n": n, **extra, "params": specs,
            "weight_bytes": sum(_nbytes(s) for s in specs[1:-1])}


def _padded_n(n: int, target) -> int:
    """N as the pass pads it (zero columns to the GPU's column tile)."""
    from schedules import facts

    pad = facts(target).col_pad
    return -(-n // pad) * pad


def _nbytes(spec: dict) -> int:
    size = int(np.prod([d if isinstance(d, int) else 1 for d in spec["shape"]]))
    return size * np.dtype(spec["dtype"]).itemsize


# ---- the GPU side: TVM's runtime, torch, numpy -------------------------------------------

def _rel(got, want) -> float:
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _check_kernels(d: Path, manifest: dict, results: dict, part: str = "kernels") -> None:
    import tvm

    dev = tvm.cuda(0)
    lib = tvm.runtime.load_module(str(d / f"{part}.so"))
    arrays = np.load(d / f"{part}.npz")
    for entry in manifest[part]:
        name = entry["name"]
        f = lib[name]
        weights = [tvm.runtime.tensor(arrays[f"{name}/w{i}"], device=dev) for i in range(entry["weights"])]
        out_dtype = entry["params"][-1]["dtype"]
        for m in entry["rows"]:
            x = arrays[f"{name}/x{m}"]
            y = tvm.runtime.tensor(np.full((m, entry["n"]), np.nan, out_dtype), device=dev)
            try:
                f(tvm.runtime.tensor(x, device=dev), *weights, y)
                dev.sync()
                err = _rel(y.numpy(), arrays[f"{name}/want{m}"])
            except Exception as e:  # noqa: BLE001 -- reported, the run goes on
                err = float("inf")
                results.setdefault("errors", []).append(f"{name} m={m}: {str(e).splitlines()[0][:300]}")
            row = {"name": name, "m": m, "rel_err": err, "bar": 1e-5, "ok": err < 1e-5}
            if "f16" in name:  # fp16 sums: against the numpy emulation of its rounding where there is one
                key = f"{name}/emulated{m}"
                emulated = arrays[key] if key in arrays.files else None
                row["bar"] = 1e-2 if emulated is None else 1e-4
                row["vs_emulated"] = None if emulated is None else _rel(y.numpy(), emulated)
                row["ok"] = err < 1e-2 and (emulated is None or row["vs_emulated"] < 1e-4)
            results["kernels"].append(row)


def _check_tc(d: Path, manifest: dict, results: dict) -> None:
    _check_kernels(d, manifest, results, "tc")


def _check_layers(d: Path, manifest: dict, results: dict) -> None:
    import tvm
    import tvm.runtime.vm  # noqa: F401 -- not loaded with the runtime alone

    dev = tvm.cuda(0)
    refs = np.load(d / "layers.npz")
    for entry in manifest.get("layers", []):
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(d / f"{entry['name']}.so")), dev)
        for fn in entry["funcs"]:
            for m in entry["rows"]:
                key = f"{entry['name']}/{fn}/"
                try:
                    got = vm[fn](tvm.runtime.tensor(refs[key + f"x{m}"], device=dev)).numpy()
                    err = _rel(got, refs[key + f"want{m}"].astype(np.float64))
                except Exception as e:  # noqa: BLE001
                    err = float("inf")
                    results.setdefault("errors", []).append(f"{key} m={m}: {str(e).splitlines()[0][:300]}")
                results["layers"].append({"name": f"{entry['name']}/{fn}", "m": m, "rel_err": err, "bar": 1e-5,
                                          "ok": err < 1e-5})


def trace_model(path, ids: np.ndarray, device) -> dict:
    """Every packed-matmul call of one run of the artefact at ``path``: its input and output,
    in call order (the VM's instrument hook), to find where a GPU run leaves the CPU's."""
    import tvm

    from qtvm.runtime import Module
    from relay_passes.outline_branches import is_branch_function

    module = Module(path)  # a CPU artefact's weights are arguments (qtvm.deploy.weights)
    if device.dlpack_device_type() != tvm.cpu().dlpack_device_type():
        module._use_device()
    vm = module._vm
    calls, order = {}, []

    def instrument(func, symbol, before_run, ret, *args):
        if not before_run and str(symbol).startswith("qmatmul") and not is_branch_function(str(symbol)):
            i = len(order)
            order.append(str(symbol))
            tensors = [a for a in args if hasattr(a, "numpy")]
            calls[f"{i:03d}_{symbol}/x"] = tensors[0].numpy()
            # a kernel writes its last argument; a Relax function (a dispatch) returns its output
            calls[f"{i:03d}_{symbol}/y"] = (ret if hasattr(ret, "numpy") else tensors[-1]).numpy()
        return 0

    vm.set_instrument(instrument)
    out = module.entry("main")(tvm.runtime.tensor(ids, device=device))
    calls["logits"] = (out[0] if isinstance(out, (list, tuple)) or hasattr(out, "__getitem__") and
                       not hasattr(out, "numpy") else out).numpy()
    return calls


def _trace_models(d: Path, manifest: dict, results: dict, out: Path) -> None:
    import tvm

    refs = np.load(d / "models.npz")
    for name in TRACE_MODELS:
        calls = trace_model(d / f"{name}.so", refs["ids/1x1"], tvm.cuda(0))
        np.savez_compressed(out / f"trace_{name}.npz", **calls)
        print(f"traced {name}: {len(calls) // 2} packed-matmul calls", flush=True)


def _check_models(d: Path, manifest: dict, results: dict) -> None:
    from qtvm import runtime

    refs = np.load(d / "models.npz")
    for entry in manifest["models"]:
        try:
            module = runtime.load(d / f"{entry['name']}.so")
        except Exception as e:  # noqa: BLE001
            results.setdefault("errors", []).append(f"{entry['name']}: {str(e).splitlines()[0][:300]}")
            continue
        for b, s in MODEL_BINDINGS:
            key = f"{b}x{s}"
            try:
                got = module.run({"input_ids": refs[f"ids/{key}"]})["logits"]
                err = _rel(got, refs[f"{entry['name']}/{key}"].astype(np.float64))
            except Exception as e:  # noqa: BLE001
                err = float("inf")
                results.setdefault("errors", []).append(f"{entry['name']} {key}: {str(e).splitlines()[0][:300]}")
            bar = 1e-2 if entry["act"] == "fp16" else 1e-4
            results["models"].append({"name": entry["name"], "binding": key, "rel_err": err, "bar": bar,
                                      "ok": err < bar})



def _check_kv(d: Path, manifest: dict, results: dict) -> None:
    """Each KV artefact's session on the GPU (caches in device memory) through the CPU's feeds:
    logits per feed and the caches after them against the CPU step's; then decode time per
    token at batch 1 (64 tokens after a 32-token prompt: one re-layout of the rows among them)."""
    from qtvm import runtime

    refs = np.load(d / "kv.npz")
    feeds = _kv_feeds()
    results.setdefault("kv", [])
    for entry in manifest["kv"]:
        name = entry["name"]
        try:
            module = runtime.load(d / f"{name}.so")
            got = _kv_run(module, feeds, name)
        except Exception as e:  # noqa: BLE001
            results.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            results["kv"].append({"name": name, "what": "session", "rel_err": float("inf"), "bar": entry["bar"],
                                  "ok": False})
            continue
        for key, value in got.items():
            err = _rel(value, refs[key].astype(np.float64)) if value.shape == refs[key].shape else float("inf")
            results["kv"].append({"name": name, "what": key.split("/", 1)[1], "rel_err": err, "bar": entry["bar"],
                                  "ok": err < entry["bar"]})
        session = module.session(1)
        session.feed(np.arange(32, dtype=np.int64)[None] % 256, last=True)
        times = []
        for i in range(64):
            start = time.perf_counter()
            session.feed(np.array([[i % 256]], np.int64))
            times.append(time.perf_counter() - start)
        results["kv_timing"] = results.get("kv_timing", []) + [{
            "name": name, "ms_per_token_median": float(np.median(times)) * 1e3,
            "ms_relayout_feed": float(times[64 - 32]) * 1e3, "ms_max": float(np.max(times)) * 1e3}]


def _random_tensor(spec: dict, torch):
    shape = [d if isinstance(d, int) else 1 for d in spec["shape"]]
    dtype = getattr(torch, spec["dtype"])
    if dtype.is_floating_point:
        return (torch.rand(shape, device="cuda") * 0.02 - 0.01).to(dtype)
    count = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (count,), dtype=torch.uint8, device="cuda").view(dtype).reshape(shape)


def _time_kernels(d: Path, manifest: dict, results: dict, rounds: int) -> None:
    """Every timing, GEMM and sweep kernel, then torch's peers, with ``qtvm.bench.gpu_gemv``'s
    method (weights rotated past twice the L2, a CUDA graph per round, CUDA events)."""
    import torch
    import tvm
    from tvm_ffi import from_dlpack

    from qtvm.bench.gpu_gemv import graph_time, reference_bandwidth, torch_peers
    from schedules.gpu_tune import rotation_copies

    l2 = manifest["l2_bytes"]
    bw = {"read_GB_s": reference_bandwidth(rounds)[0]}
    results["bandwidth"] = bw
    print(f"HBM read bandwidth {bw['read_GB_s']:.0f} GB/s", flush=True)
    entries = []
    for part in ("timing", "gemm", "sweep", "rows", "tc_timing"):
        if manifest.get(part):
            lib = tvm.runtime.load_module(str(d / f"{part}.so"))
            entries += [(entry, lib) for entry in manifest[part]]
    for entry, lib in entries:
        f = lib[entry["name"]]
        specs, m = entry["params"], entry.get("m", 1)
        x_t = torch.randn([m, entry["k"]], device="cuda").to(getattr(torch, specs[0]["dtype"]))
        y_t = torch.empty([m] + specs[-1]["shape"][1:], device="cuda", dtype=getattr(torch, specs[-1]["dtype"]))
        x, y = from_dlpack(x_t), from_dlpack(y_t)
        keep = [[_random_tensor(s, torch) for s in specs[1:-1]]
                for _ in range(rotation_copies(entry["weight_bytes"], l2))]
        sets = [[from_dlpack(t) for t in ws] for ws in keep]
        try:
            seconds = graph_time(lambda ws: f(x, *ws, y), sets, rounds)
        except Exception as e:  # noqa: BLE001
            results.setdefault("errors", []).append(f"{entry['name']}: {str(e).splitlines()[0][:300]}")
            continue
        finally:
            del keep, sets
        results["timing"].append(_row(entry["k"], entry["n"], f"qtvm {entry['preset']} {entry['act']}",
                                      seconds, entry["weight_bytes"], bw, m))
        print(f"timed {entry['name']}: {seconds * 1e6:.2f} us", flush=True)
    for k, n in sorted({(e["k"], e["n"]) for e in manifest["timing"]}):
        for name, launch, sets, nbytes in torch_peers(k, n, l2):
            results["timing"].append(_row(k, n, name, graph_time(launch, sets, rounds), nbytes, bw))
            del sets
    matmul_rows = {}  # torch's fp16 matmul beside the prefill GEMMs: (k, n) -> the rows timed there
    for part, rows in (("gemm", (GEMM_ROWS,)), ("tc_timing", TC_M)):
        for e in manifest.get(part, []):
            matmul_rows.setdefault((e["k"], e["n"]), set()).update(rows)
    for (k, n), rows in sorted(matmul_rows.items()):
        w16 = torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
        sets = [w16.clone() for _ in range(rotation_copies(w16.numel() * 2, l2))]
        for m in sorted(rows):
            x16 = torch.randn(m, k, device="cuda", dtype=torch.float16)
            seconds = graph_time(lambda w: x16 @ w, sets, rounds)
            results["timing"].append(_row(k, n, "torch fp16 matmul", seconds, w16.numel() * 2, bw, m))
        del sets, w16


def _row(k, n, name, seconds, nbytes, bw, m=1) -> dict:
    gbs = nbytes / seconds / 1e9
    return {"shape": f"{m}x{k}x{n}", "kernel": name, "us": seconds * 1e6, "weight_bytes": nbytes, "GB_s": gbs,
            "pct_read_bw": 100 * gbs / bw["read_GB_s"], "TFLOP_s": 2 * m * k * n / seconds / 1e12}



def profile(d: Path, names: list[str]) -> None:
    """Call each named timing kernel once on random weights (for ``ncu``, which replays it)."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qtvm.cuda import load_cuda_runtime
    from tvm_ffi import from_dlpack

    load_cuda_runtime(allow_stub=False)
    manifest = json.loads((d / "manifest.json").read_text())
    for part in ("timing", "sweep", "gemm"):
        lib = tvm.runtime.load_module(str(d / f"{part}.so"))
        for entry in manifest.get(part, []):
            if entry["name"] not in names:
                continue
            specs, m = entry["params"], entry.get("m", 1)
            x = from_dlpack(torch.randn([m, entry["k"]], device="cuda").to(getattr(torch, specs[0]["dtype"])))
            y = from_dlpack(torch.empty([m] + specs[-1]["shape"][1:], device="cuda",
                                        dtype=getattr(torch, specs[-1]["dtype"])))
            ws = [from_dlpack(_random_tensor(s, torch)) for s in specs[1:-1]]
            lib[entry["name"]](x, *ws, y)
            torch.cuda.synchronize()
            print(f"profiled {entry['name']}", flush=True)


def run(d: Path, out: Path, rounds: int, only=()) -> int:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # the runtime alone, as a deployment loads it
    import tvm

    from qtvm.cuda import device_arch, load_cuda_runtime

    manifest = json.loads((d / "manifest.json").read_text())
    load_cuda_runtime(allow_stub=False)
    import torch

    results = {"device_arch": device_arch(), "torch_device": torch.cuda.get_device_name(0), "kernels": [],
               "layers": [], "models": [], "timing": [], "tvm": tvm.__version__}
    out.mkdir(parents=True, exist_ok=True)
    def _timing(*args):
        _time_kernels(*args, rounds)

    def _tracing(*args):
        _trace_models(*args, out)

    steps = [_check_kernels, _check_tc, _check_layers, _check_models, _check_kv, _timing, _tracing]
    for step in [s for s in steps if s.__name__ in only] if only else steps:
        try:
            step(d, manifest, results)
        except Exception as e:  # noqa: BLE001 -- keep the rest of the run
            results.setdefault("errors", []).append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))  # what a cut-off run got
    _print(results)
    return 0 if all(r["ok"] for r in results["kernels"] + results["layers"] + results["models"]
                    + results.get("kv", [])) else 1


def _print(results: dict) -> None:
    print(f"\n{results['torch_device']} ({results['device_arch']})")
    for r in results["kernels"] + results["layers"] + results["models"] + results.get("kv", []):
        if not r["ok"]:
            print(f"FAIL {r['name']} {r.get('m', r.get('binding', r.get('what')))}: rel err {r['rel_err']:.2e} "
                  f"(bar {r['bar']:.0e})")
    for kind in ("kernels", "layers", "models", "kv"):
        rows = results.get(kind, [])
        worst = max((r["rel_err"] for r in rows), default=float("nan"))
        print(f"{kind}: {sum(r['ok'] for r in rows)}/{len(rows)} within the bar; worst rel err {worst:.2e}")
    for line in results.get("errors", []):
        print("ERROR", line)
    print(f"{'MxKxN':>16} {'kernel':<26} {'us':>8} {'GB/s':>7} {'%read':>6} {'TFLOP/s':>8}")
    for r in results["timing"]:
        print(f"{r['shape']:>16} {r['kernel']:<26} {r['us']:8.2f} {r['GB_s']:7.0f} {r['pct_read_bw']:6.1f} "
              f"{r['TFLOP_s']:8.2f}")
    for r in results.get("kv_timing", []):
        print(f"{r['name']:<48} decode {r['ms_per_token_median']:.3f} ms/token (median of 64; the feed that "
              f"re-lays the rows {r['ms_relayout_feed']:.3f} ms)")


def pack(out: Path, python: str) -> None:
    """TVM's runtime without its compiler (libtvm_compiler.so is 260 MB), as a tarball, and the
    apache-tvm-ffi wheel for the GPU machine's Python: what ``gpu_device_run.sh`` installs."""
    import importlib.metadata
    import shutil
    import subprocess
    import tarfile
    import tempfile

    import tvm

    out.mkdir(parents=True, exist_ok=True)
    src = Path(tvm.__file__).parent
    skip = {"3rdparty", "__pycache__", "libtvm_compiler.so"}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(src, Path(tmp) / "tvm", ignore=lambda _d, names: [n for n in names if n in skip])
        with tarfile.open(out / "tvm_runtime.tar.xz.tmp", "w:xz") as tar:
            tar.add(Path(tmp) / "tvm", arcname="tvm")
    os.replace(out / "tvm_runtime.tar.xz.tmp", out / "tvm_runtime.tar.xz")
    version = importlib.metadata.version("apache-tvm-ffi")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(out), f"apache-tvm-ffi=={version}"], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--parts", default="kernels,timing,gemm,sweep,rows,layers,models,tc,tc_timing,kv")
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--rounds", type=int, default=20)
    r.add_argument("--only", default="", help="comma-separated steps: _check_kernels,_check_layers,...")
    pk = sub.add_parser("pack")
    pk.add_argument("dir", type=Path)
    pk.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    pr = sub.add_parser("profile")
    pr.add_argument("dir", type=Path)
    pr.add_argument("names", nargs="+")
    args = p.parse_args()
    if args.cmd == "pack":
        pack(args.dir, args.python)
        return 0
    if args.cmd == "profile":
        profile(args.dir, args.names)
        return 0
    if args.cmd == "build":
        build(args.dir, args.arch, tuple(args.parts.split(",")))
        return 0
    return run(args.dir, args.out, args.rounds, tuple(filter(None, args.only.split(","))))


if __name__ == "__main__":
    sys.exit(main())
