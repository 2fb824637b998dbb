"""Compile the bundled model for every format preset and target given; print a table and
write JSON. Used to check `qtvm compile --target cuda -arch=sm_80|sm_90` on every preset:

    python3 benchmarks/compile_presets.py --target "cuda -arch=sm_80" --target "cuda -arch=sm_90" \\
        --json docs/cuda_presets.json

and the OpenCL phone targets, cross-exported for aarch64:

    python3 benchmarks/compile_presets.py --target "opencl -device=mali" --target "opencl -device=adreno" \\
        --host "llvm -mtriple=aarch64-linux-gnu" --json docs/opencl_presets.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from qtvm.errors import QtvmError
    from qtvm.formats import PRESETS
    from qtvm.models.tiny_llama import export_onnx
    from qtvm.pipeline import compile_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", required=True)
    p.add_argument("--preset", action="append", help="default: every preset")
    p.add_argument("--act", default="fp32", help="activations (fp32, fp16, fp16-acc16 on OpenCL, ...)")
    p.add_argument("--host", help="CPU part of the device targets, e.g. 'llvm -mtriple=aarch64-linux-gnu' "
                                  "(cross export, checked with readelf)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = export_onnx(Path(tmp) / "tiny_llama.onnx")
        for preset in args.preset or list(PRESETS):
            for target in args.target:
                start = time.perf_counter()
                try:
                    result = compile_model(model, Path(tmp) / "m.so", target, preset, args.act,
                                           **({"host": args.host} if args.host else {}))
                    row = {"preset": preset, "target": target, "host": args.host, "act": args.act, "ok": True, "seconds": round(time.perf_counter() - start, 1),
                           "bytes": result.path.stat().st_size, "gpu_arch": result.metadata.get("required_gpu_arch")}
                except QtvmError as e:
                    row = {"preset": preset, "target": target, "ok": False, "error": str(e)}
                rows.append(row)
                print(f"{preset:16s} {target:24s} {'ok' if row['ok'] else 'FAILED'} "
                      f"{row.get('seconds', '')} {row.get('error', '')}", flush=True)
    if args.json:
        tmp_json = f"{args.json}.tmp"
        with open(tmp_json, "w") as f:
            json.dump({"host": os.uname().nodename, "rows": rows}, f, indent=1)
        os.replace(tmp_json, args.json)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
