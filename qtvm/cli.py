"""`qtvm` command line. Bad input: one line on stderr, exit code 2, nothing written.

Nothing here imports tvm at module level, so `qtvm run` stays runtime-only.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qtvm.errors import QtvmError

EXIT_USAGE = 2
EXIT_INTERNAL = 3


def _cmd_compile(args) -> int:
    from qtvm.frontend.bind import parse_bind_options
    from qtvm.frontend.onnx import parse_dim_options
    from qtvm.pipeline import compile_model
    from qtvm.quiet import tvm_output_captured

    from qtvm.progress import stages

    with tvm_output_captured(), stages(["import + quantize", "schedule + build", "export"], "qtvm compile") as step:
        result = compile_model(args.model, args.output, args.target, args.quant, args.act, args.db, args.gptq,
                               args.gptq_format, getattr(args, "calib", None), host=args.host, cross_cc=args.cross_cc, progress=step,
                               max_length=args.max_length, max_batch=args.max_batch, kv_step=not args.no_kv_step,
                               dims=parse_dim_options(args.dim), kv_cache=args.kv_cache,
                               binds=parse_bind_options(args.bind))
    meta = result.metadata
    print(f"wrote {result.path} ({result.path.stat().st_size / 1e6:.2f} MB) in {result.seconds:.1f} s")
    print(f"target: {meta['target']}")
    if "quantized_matmuls" in meta:
        sizes = (f"({meta['activations']} activations): {meta['float_weight_bytes'] / 1e6:.2f} MB float -> "
                 f"{meta['packed_bytes'] / 1e6:.2f} MB packed")
        pre = meta.get("prequantized_matmuls", 0)
        if not pre:
            print(f"quantized {meta['quantized_matmuls']} matmuls to {meta['format']} {sizes}")
        else:
            rest = meta["quantized_matmuls"] - pre
            preset = meta["format"].removeprefix("gptq:")  # what GPTQ calibration did not reach takes the preset
            print(f"packed {meta['quantized_matmuls']} matmuls: {pre} quantized in the model or checkpoint "
                  f"({meta['prequantized']}), {rest} to {preset if rest else '-'} {sizes}")
    for note in result.notes:
        print(note)
    return 0


def _parse_feed(text: str):
    import numpy as np

    if "=" not in text:
        raise QtvmError(f"--input '{text}' is not name=file.npy")
    name, path = text.split("=", 1)
    if not Path(path).is_file():
        raise QtvmError(f"input file '{path}' for '{name}' does not exist")
    try:
        return name, np.load(path, allow_pickle=False)
    except Exception:
        raise QtvmError(f"input file '{path}' is not a .npy array", "save it with numpy.save") from None


def _cmd_generate(args) -> int:
    import time

    import numpy as np

    from qtvm.deploy.elf import refuse_foreign

    if (args.prompt is None) == (args.prompt_file is None):
        raise QtvmError("give the prompt token ids with --prompt 1,2,3 or --prompt-file ids.npy (one of them)")
    if args.prompt is not None:
        try:
            ids = np.array([[int(t) for t in args.prompt.split(",") if t.strip()]], np.int64)
        except ValueError:
            raise QtvmError(f"--prompt '{args.prompt}' is not comma-separated token ids", "e.g. --prompt 1,2,3") from None
    else:
        _, ids = _parse_feed(f"prompt={args.prompt_file}")
        ids = np.asarray(ids, np.int64).reshape(1, -1) if np.ndim(ids) < 2 else np.asarray(ids, np.int64)
    if ids.size == 0:
        raise QtvmError("the prompt is empty")
    refuse_foreign(args.artefact)
    from qtvm import runtime

    module = runtime.load(args.artefact)
    start = time.perf_counter()
    tokens = module.generate(ids, args.max_new_tokens, eos_token_id=args.eos)
    seconds = time.perf_counter() - start
    for row in tokens:
        print(" ".join(str(int(t)) for t in row[ids.shape[1]:]))
    if not getattr(args, "quiet", False):
        from qtvm.generate import ConcatSession, KVSession

        mode = (KVSession if module.metadata.get("kv_step") else ConcatSession).mode
        print(f"{args.max_new_tokens} tokens after {ids.shape[1]} prompt tokens in {seconds * 1e3:.1f} ms "
              f"({mode})", file=sys.stderr)
    return 0


def _cmd_run(args) -> int:
    import numpy as np

    from qtvm.deploy.elf import refuse_foreign

    refuse_foreign(args.artefact)  # before the runtime tries to dlopen another machine's code
    from qtvm import runtime

    module = runtime.load(args.artefact)
    feeds = dict(_parse_feed(t) for t in args.input)
    outputs = module.run(feeds)
    for name, value in outputs.items():
        print(f"{name}: shape {list(value.shape)} {value.dtype}  min {value.min():.4g}  max {value.max():.4g}  "
              f"mean {value.mean():.4g}")
    if args.save:
        out = Path(args.save)
        tmp = out.with_name(f".{out.name}.tmp.npz")
        np.savez(tmp, **outputs)
        os.replace(tmp, out)
        print(f"saved {', '.join(outputs)} to {out}")
    return 0


def _cmd_formats(args) -> int:
    from qtvm.formats import PRESETS

    print(f"{'preset':<16}{'bits/weight':>12}  description")
    for name, fmt in PRESETS.items():
        print(f"{name:<16}{fmt.bits_per_weight_nominal():>12.3f}  {fmt.describe()}")
    return 0


def _cmd_inspect(args) -> int:
    import json

    from qtvm.describe import read_metadata, summary

    meta = read_metadata(args.artefact)  # read from the file: another machine's artefacts too
    print(json.dumps(meta, indent=2) if args.json else summary(meta, args.artefact))
    return 0


def _cmd_bundle_runtime(args) -> int:
    from qtvm.deploy.native import bundle
    from qtvm.deploy.toolchain import toolchain_for
    from qtvm.target import parse_target

    out = bundle(toolchain_for(parse_target(args.host), args.cross_cc), args.output)
    print(f"wrote {out}/qtvm_run, libtvm_runtime.so, libtvm_ffi.so: copy them with the artefact to the device "
          "and run ./qtvm_run model.so NAME=input.npy -o OUTDIR")
    return 0


def _cmd_check(args) -> int:
    from qtvm.check import check, format_report, parse_shape

    feeds = dict(_parse_feed(t) for t in args.input) if args.input else None
    bindings = [parse_shape(s) for s in args.shape] or None
    report = check(args.model, args.artefact, bindings, feeds, args.tol, args.seed, gptq=args.gptq,
                   gptq_format=args.gptq_format, calib=args.calib)
    print(format_report(report))
    return 0 if report.ok else 1


def _cmd_tune(args) -> int:
    from schedules.tune import tune_command  # imports MetaSchedule: only for this command

    return tune_command(args)


def _cmd_demo(args) -> int:
    from qtvm.demo import run_demo

    run_demo(out_dir=Path(args.out_dir), target=args.target, quant=args.quant)
    return 0


def _add_deploy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="CPU part of a device target, e.g. --target opencl -device=adreno "
                                  "--host 'llvm -mtriple=aarch64-linux-gnu' (quoted or not)")
    p.add_argument("--cross-cc", metavar="CXX", help="C++ compiler that links for the target's -mtriple (default: "
                                                      "aarch64-linux-gnu-g++; Android: the NDK's clang++ under "
                                                      "ANDROID_NDK_HOME, or TVM_NDK_CC)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qtvm", description="Quantized-weight compiler on Apache TVM")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="ONNX model -> shared library with packed low-bit matmuls")
    c.add_argument("model", help="ONNX file")
    c.add_argument("--target", default="host",
                   help="'host', a classic string such as llvm -mcpu=znver2 (quoted or not), or JSON")
    c.add_argument("--quant", default="int4-g128",
                   help="weight format preset (see `qtvm formats`) for float weights, or none, or "
                        "gptq:<uniform preset> (GPTQ on --calib inputs); weights the model brings quantized "
                        "(MatMulNBits, DequantizeLinear, MatMulInteger) keep their own format")
    c.add_argument("--act", choices=("fp32", "int8", "fp16", "fp16-acc16"), default="fp32",
                   help="activation precision inside quantized matmuls: fp32 (exact), int8 (rounded per 32 "
                        "values, ~2-4x faster kernels on AVX2/AVX-512 VNNI; BCQ formats: the decode GEMV, "
                        "rounded per weight group, on AVX-512BW; `qtvm demo` reports its error), or "
                        "fp16 (GPU targets: decode GEMV on fp16 activations with fp16 sums per lane chunk, "
                        "CUDA prefill on tensor cores with fp16 operands and fp32 sums; "
                        "OpenCL: fp32 sums, and fp16-acc16 for fp16 sums per lane chunk)")
    c.add_argument("--max-length", type=int, metavar="N",
                   help="past_key_values exports: tokens the generation cache holds (default: the model's "
                        "position limit, else 2048); memory is planned for it once")
    c.add_argument("--max-batch", type=int, default=1, metavar="B",
                   help="past_key_values exports: sequences generated at once (default 1)")
    c.add_argument("--kv-cache", choices=("model", "fp16"), default="model",
                   help="past_key_values exports: the generation cache's precision: the model's own (default, "
                        "exact) or fp16 (float32 caches held in float16: half the memory and the bytes a decoded "
                        "token reads per past token; the compile prints the error it measured)")
    c.add_argument("--no-kv-step", action="store_true",
                   help="past_key_values exports: no in-place KV-cache step (generation feeds presents back)")
    c.add_argument("--db", metavar="DIR", help="tuning database from `qtvm tune`; kernels it measured faster "
                                                 "than the analytic schedule use the tuned schedule")
    c.add_argument("--gptq", metavar="CKPT.safetensors",
                   help="GPTQ checkpoint in the AutoGPTQ/GPTQModel layout (P.qweight, P.qzeros, P.scales, P.g_idx) "
                        "whose layers replace the model's float MatMul/Gemm weights. Layer P maps to the "
                        "MatMul/Gemm whose weight initializer is named P.weight or P, or whose node is named "
                        "/P/MatMul with '.' for '/' (torch's exporter: /layers.0/attn/q_proj/MatMul -> "
                        "layers.0.attn.q_proj); exact names first, then unique dotted suffixes "
                        "(model.layers.0.q_proj matches layers.0.q_proj). Layers that match nothing, several "
                        "weights, or a weight of another shape are all named in one error")
    c.add_argument("--gptq-format", choices=("gptq", "gptq_v2"), default=None,
                   help="zero-point convention of --gptq: gptq = v1 (AutoGPTQ: stored zero + 1), gptq_v2 "
                        "(GPTQModel: stored as is); default: the file's checkpoint_format metadata, else gptq")
    c.add_argument("--calib", metavar="FILE.npz",
                   help="calibration inputs for --quant gptq:<preset> (e.g. gptq:int4-g128: GPTQ on each layer's "
                        "activations from one run of the float model): a .npz with one array per model input, or "
                        "a .npy for a one-input model")
    c.add_argument("--dim", action="append", default=[], metavar="NAME=EXPR",
                   help="an input dim the exporter named on its own, restated as an expression of the "
                        "other dims (e.g. --dim s53='past + seq' for a dynamo export's attention-mask length); "
                        "the runtime checks inputs against it. Repeat for several")
    c.add_argument("--bind", action="append", default=[], metavar="NAME=VALUE",
                   help="fix an input of fixed shape at compile time; an If on it becomes the branch it takes "
                        "(e.g. --bind use_cache_branch=1 for a merged decoder: its with-past decoder, run from a "
                        "past of length 0 on the first step). Repeat for several")
    c.add_argument("-o", "--output", required=True, help="artefact path (.so)")
    _add_deploy_arguments(c)
    c.set_defaults(fn=_cmd_compile)

    r = sub.add_parser("run", help="run an artefact with the thin runtime")
    r.add_argument("artefact")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    r.add_argument("--save", metavar="OUT.npz", help="save outputs")
    r.set_defaults(fn=_cmd_run)

    g = sub.add_parser("generate", help="greedy generation with an artefact compiled from a past_key_values export")
    g.add_argument("artefact")
    g.add_argument("--prompt", metavar="IDS", help="prompt token ids, comma-separated")
    g.add_argument("--prompt-file", metavar="IDS.npy", help="prompt token ids, [n] or [batch, n] int64")
    g.add_argument("-n", "--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--eos", type=int, help="end-of-sequence token id (rows stop at it)")
    g.set_defaults(fn=_cmd_generate)

    f = sub.add_parser("formats", help="list weight format presets")
    f.set_defaults(fn=_cmd_formats)

    i = sub.add_parser("inspect", help="what an artefact needs and holds: target, CPU flags, signature, formats")
    i.add_argument("artefact")
    i.add_argument("--json", action="store_true", help="the full metadata as JSON")
    i.set_defaults(fn=_cmd_inspect)

    k = sub.add_parser("check", help="run an artefact and onnxruntime on the same inputs and report the "
                                     "artefact's own error (exit 1 above float rounding)")
    k.add_argument("model", help="the ONNX file the artefact was compiled from")
    k.add_argument("artefact")
    k.add_argument("--shape", action="append", default=[], metavar="DIM=N,...",
                   help="bind the symbolic dims (repeat for several bindings); default: every dim 1 "
                        "(the decode kernels) and three bindings of sizes 1, 3, 17")
    k.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="use this array for input NAME (repeat for several); the others are drawn at "
                   "random at the dims it fixes (all given: one run on them)")
    k.add_argument("--tol", type=float, help="own-error tolerance (default 1e-4; for --act int8 artefacts 2x the largest flip "
                   "noise the report measures, at least 1e-3)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--gptq", metavar="CKPT.safetensors",
                   help="the GPTQ checkpoint the artefact was compiled with (compile --gptq): the reference "
                        "holds its weights")
    k.add_argument("--gptq-format", choices=("gptq", "gptq_v2"), default=None, help="as compile --gptq-format")
    k.add_argument("--calib", metavar="FILE.npz",
                   help="the calibration inputs of a compile --quant gptq:<preset> --calib FILE: the GPTQ run is "
                        "repeated (deterministic) for the reference")
    k.set_defaults(fn=_cmd_check)

    d = sub.add_parser("demo", help="compile and check the bundled tiny LLaMA model (the main job)")
    d.add_argument("--out-dir", default="out")
    d.add_argument("--target", default="host")
    d.add_argument("--quant", default="int4-g128")
    d.set_defaults(fn=_cmd_demo)

    t = sub.add_parser("tune", help="MetaSchedule-tune the packed kernels of a model (seeded by the analytic "
                                     "schedule) into a database that `qtvm compile --db` reuses")
    t.add_argument("model", help="ONNX file")
    t.add_argument("--target", default="host",
                   help="'host', a classic string such as llvm -mcpu=znver2 (quoted or not), or JSON; "
                        "it must run on this machine")
    t.add_argument("--trials", type=int, default=32, help="measured schedules in all (default 32)")
    t.add_argument("--db", required=True, metavar="DIR", help="tuning database directory (created if missing)")
    t.add_argument("--quant", default="int4-g128", help="weight format preset (see `qtvm formats`)")
    t.add_argument("--act", choices=("fp32", "int8"), default="fp32",
                   help="activations of the kernels to tune, as `qtvm compile --act` (int8: the int8 GEMV and "
                        "prefill kernels; compile with the same --act to use the database)")
    t.add_argument("--dim", action="append", default=[], metavar="NAME=EXPR",
                   help="as `qtvm compile --dim`: an input dim the exporter named on its own, restated")
    t.add_argument("--bind", action="append", default=[], metavar="NAME=VALUE",
                   help="as `qtvm compile --bind`: an input fixed at compile time (e.g. use_cache_branch=1)")
    t.add_argument("--quiet", action="store_true", help="no per-batch progress lines")
    _add_deploy_arguments(t)
    t.add_argument("--rpc", metavar="HOST:PORT", help="measure on the RPC servers registered with this TVM tracker "
                                                       "(python -m tvm.exec.rpc_tracker) instead of this machine")
    t.add_argument("--device-key", metavar="KEY", help="the tracker key the device's RPC servers registered under")
    t.add_argument("--rpc-wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for a free RPC server before giving up (default 30)")
    t.set_defaults(fn=_cmd_tune)

    b = sub.add_parser("bundle-runtime", help="TVM runtime libraries + qtvm_run (C++ loader) for a device, "
                                              "to copy next to a cross-built artefact")
    b.add_argument("--host", required=True, help="the device's CPU target, e.g. 'llvm -mtriple=aarch64-linux-gnu'")
    b.add_argument("--cross-cc", metavar="CXX", help="cross C++ compiler (default: found from the triple)")
    b.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write (created)")
    b.set_defaults(fn=_cmd_bundle_runtime)

    from qtvm.bench.e2e import add_e2e_parser  # argparse only; imports lazily
    from qtvm.bench.gemv import add_bench_parser  # argparse only; imports lazily
    from qtvm.bench.prefill import add_prefill_parser  # argparse only; imports lazily
    from qtvm.report import add_report_parser  # argparse only; the report imports lazily

    add_report_parser(sub)  # qtvm quantize-report
    bench = add_bench_parser(sub)  # qtvm bench gemv
    add_prefill_parser(bench)  # qtvm bench prefill
    add_e2e_parser(bench)  # qtvm bench e2e
    _add_verbosity(p)
    return p


def _version() -> str:
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    return f"qtvm {v('qtvm')} (apache-tvm {v('apache-tvm')}, apache-tvm-ffi {v('apache-tvm-ffi')})"


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose and -q/--quiet on the main parser and every subcommand (before or after it)."""
    parsers = [parser]
    while parsers:
        q = parsers.pop()
        taken = q._option_string_actions
        if "-v" not in taken:
            q.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                           help="more output (-vv: debug)")
        if "-q" not in taken:
            names = ["-q"] + (["--quiet"] if "--quiet" not in taken else [])
            q.add_argument(*names, action="store_true", dest="quiet", default=argparse.SUPPRESS,
                           help="no progress bars or info messages")
        for action in q._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())


def main(argv: list[str] | None = None) -> int:
    from qtvm.target import split_cli_target

    argv = split_cli_target(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    from qtvm.progress import configure

    configure(getattr(args, "verbose", 0) - (1 if getattr(args, "quiet", False) else 0))
    try:
        return args.fn(args)
    except QtvmError as e:
        print(f"qtvm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `qtvm ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as e:
        print(f"qtvm: interrupted{f'; {e}' if str(e) else ''}", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in qtvm: say so in one line unless asked for the trace
        if os.environ.get("QTVM_DEBUG"):
            raise
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        print(f"qtvm: internal error ({type(e).__name__}: {last[:300]}); rerun with QTVM_DEBUG=1 for the "
              "traceback and report it", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
