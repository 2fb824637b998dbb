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
    from qtvm.pipeline import compile_model

    result = compile_model(args.model, args.output, args.target, args.quant, args.act, args.db)
    meta = result.metadata
    print(f"wrote {result.path} ({result.path.stat().st_size / 1e6:.2f} MB) in {result.seconds:.1f} s")
    print(f"target: {meta['target']}")
    if "quantized_matmuls" in meta:
        print(f"quantized {meta['quantized_matmuls']} matmuls to {meta['format']} ({meta['activations']} activations): "
              f"{meta['float_weight_bytes'] / 1e6:.2f} MB fp32 -> {meta['packed_bytes'] / 1e6:.2f} MB packed")
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


def _cmd_run(args) -> int:
    import numpy as np

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

    from qtvm import runtime

    meta = runtime.inspect(args.artefact)
    print(json.dumps(meta, indent=2))
    if meta.get("device") == "cuda":
        print(f"needs an NVIDIA GPU of architecture {meta['required_gpu_arch']} or newer (CUDA)")
    elif meta.get("device") == "opencl":
        print("needs an OpenCL device and a TVM runtime built with OpenCL")
    return 0


def _cmd_tune(args) -> int:
    from schedules.tune import tune_command  # imports MetaSchedule: only for this command

    return tune_command(args)


def _cmd_demo(args) -> int:
    from qtvm.demo import run_demo

    run_demo(out_dir=Path(args.out_dir), target=args.target, quant=args.quant)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qtvm", description="Quantized-weight compiler on Apache TVM")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="ONNX model -> shared library with packed low-bit matmuls")
    c.add_argument("model", help="ONNX file")
    c.add_argument("--target", default="host",
                   help="'host', a classic string such as llvm -mcpu=znver2 (quoted or not), or JSON")
    c.add_argument("--quant", default="int4-g128", help="weight format preset (see `qtvm formats`), or none")
    c.add_argument("--act", choices=("fp32", "int8", "fp16", "fp16-acc16"), default="fp32",
                   help="activation precision inside quantized matmuls: fp32 (exact), int8 (rounded per 32 "
                        "values, ~2-4x faster kernels on AVX2/AVX-512 VNNI; `qtvm demo` reports its error), or "
                        "fp16 (GPU targets: decode GEMV on fp16 activations with fp16 sums per lane chunk; "
                        "OpenCL: fp32 sums, and fp16-acc16 for fp16 sums per lane chunk)")
    c.add_argument("--db", metavar="DIR", help="tuning database from `qtvm tune`; kernels it measured faster "
                                                 "than the analytic schedule use the tuned schedule")
    c.add_argument("-o", "--output", required=True, help="artefact path (.so)")
    c.set_defaults(fn=_cmd_compile)

    r = sub.add_parser("run", help="run an artefact with the thin runtime")
    r.add_argument("artefact")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    r.add_argument("--save", metavar="OUT.npz", help="save outputs")
    r.set_defaults(fn=_cmd_run)

    f = sub.add_parser("formats", help="list weight format presets")
    f.set_defaults(fn=_cmd_formats)

    i = sub.add_parser("inspect", help="print an artefact's metadata")
    i.add_argument("artefact")
    i.set_defaults(fn=_cmd_inspect)

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
    t.add_argument("--quiet", action="store_true", help="no per-batch progress lines")
    t.set_defaults(fn=_cmd_tune)

    from qtvm.bench.gemv import add_bench_parser  # argparse only; imports lazily
    from qtvm.bench.prefill import add_prefill_parser  # argparse only; imports lazily
    from qtvm.report import add_report_parser  # argparse only; the report imports lazily

    add_report_parser(sub)  # qtvm quantize-report
    add_prefill_parser(add_bench_parser(sub))  # qtvm bench gemv, qtvm bench prefill
    return p


def main(argv: list[str] | None = None) -> int:
    from qtvm.target import split_cli_target

    argv = split_cli_target(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except QtvmError as e:
        print(f"qtvm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("qtvm: interrupted", file=sys.stderr)
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
