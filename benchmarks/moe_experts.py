"""A stack of mixture-of-experts routed matmuls, decode and prefill: qtvm with the experts
packed (``qmatmul_experts``; with ``--act int8``, ``qmatmul_a8_experts``), qtvm with them float (what the compiler did before: a gather
of whole expert matrices, then a batched matmul) and onnxruntime on the same ONNX file, in
one run beside the machine's read bandwidth; one fresh process per thread count.

    python benchmarks/moe_experts.py                          # 1 and 2 threads
    python benchmarks/moe_experts.py --threads 1 --layers 4 --json out/moe.json

The graph: ``layers`` routed matmuls y += Gather(W_l[E, N, K], ids) @ x[s, K, 1], as
transformers' batched experts export a MoE block's projections (Qwen1.5-MoE-A2.7B's
gate-up shape by default: K 2048, N 2816); ids pick ``top`` experts per token at random
each call, so what one call reads is ``layers x rows`` expert matrices, and with the default
12 layers x 16 experts the packed set (~0.6 GB) is past the L3. Rows: one token (decode:
``top`` rows) and 16 tokens (prefill: 16 x ``top`` rows). GB/s counts the bytes of the
expert matrices a call multiplies by (each row's expert once per row: the kernels do not
share a matrix between rows that picked the same expert).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtvm.bench import bandwidth, harness  # noqa: E402


def moe_stack(k: int, n: int, experts: int, layers: int, seed: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array([2], np.int64), "axis2")]
    nodes = [helper.make_node("Unsqueeze", ["x", "axis2"], ["x3"])]
    for layer in range(layers):
        w = (rng.standard_normal((experts, n, k), dtype=np.float32) * 0.02).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{layer}"))
        nodes += [helper.make_node("Gather", [f"w{layer}", "ids"], [f"g{layer}"], axis=0),
                  helper.make_node("MatMul", [f"g{layer}", "x3"], [f"p{layer}"])]
        if layer:
            nodes.append(helper.make_node("Add", [f"sum{layer - 1}", f"p{layer}"], [f"sum{layer}"]))
        else:
            nodes.append(helper.make_node("Identity", ["p0"], ["sum0"]))
    nodes.append(helper.make_node("Squeeze", [f"sum{layers - 1}", "axis2"], ["y"]))
    graph = helper.make_graph(nodes, "moe_stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", k]),
                                                   helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def child(onnx_path: str, artefacts: dict, tokens: list, top: int, experts: int, calls: int) -> dict:
    """Times each engine (median of ``calls`` calls, engines interleaved call by call; onnxruntime
    without spinning, and an idle pause before each call, so no pool's spinning is charged to
    the next engine)."""
    import onnxruntime as ort

    from qtvm import runtime

    threads = int(__import__("os").environ["QTVM_BENCH_THREADS"])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    engines = {name: runtime.load(path) for name, path in artefacts.items()}
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    runs = {name: (lambda feed, m=m: m.run(feed)["y"]) for name, m in engines.items()}
    runs["onnxruntime fp32"] = lambda feed: session.run(None, feed)[0]
    rng = np.random.default_rng(0)
    out = {}
    for t in tokens:
        rows = t * top
        x = rng.standard_normal((rows, session.get_inputs()[0].shape[1])).astype(np.float32)
        times = {name: [] for name in runs}
        errors = {}
        for call in range(calls + 1):
            ids = np.concatenate([rng.choice(experts, top, replace=False) for _ in range(t)]).astype(np.int64)
            feed = {"x": x, "ids": ids}
            results = {}
            for name, fn in runs.items():
                time.sleep(harness.POOL_WIND_DOWN_S)  # the previous engine's pool stops spinning
                start = time.perf_counter()
                results[name] = fn(feed)
                if call:  # the first call of each: warm-up
                    times[name].append(time.perf_counter() - start)
            ref = results["onnxruntime fp32"]
            for name, y in results.items():
                errors[name] = max(errors.get(name, 0.0), float(np.abs(y - ref).max() / np.abs(ref).max()))
        out[t] = {name: {"median_s": harness.median(v), "rel_err_vs_ort_fp32": errors[name]}
                  for name, v in times.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quant", default="int4-g128")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--json", type=Path, default=Path("out/bench_moe_experts.json"))
    a = ap.parse_args(argv)
    if a.quant == "none":
        ap.error("--quant names the packed format to compare with the float experts (e.g. int4-g128)")
    print(f"{harness.cpu_named()}; L3 {bandwidth.l3_cache_bytes() >> 20} MiB; CPU busy before start "
          f"{100 * harness.cpu_busy_fraction(1.0):.0f}%", flush=True)
    work = Path(tempfile.mkdtemp(prefix="qtvm_moe_"))
    try:
        return _run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model and artefacts (GBs at the default sizes)


def _run(a, work: Path) -> int:
    import onnx

    from qtvm.pipeline import compile_model

    model = work / "moe.onnx"
    onnx.save(moe_stack(a.k, a.n, a.experts, a.layers), str(model), save_as_external_data=True,
              location="moe.weights")
    artefacts = {}
    for label, quant, act in ((f"qtvm {a.quant} experts packed", a.quant, "fp32"),
                              (f"qtvm {a.quant} packed, int8 act", a.quant, "int8"),
                              ("qtvm fp32 (experts gathered)", "none", "fp32")):
        start = time.perf_counter()
        result = compile_model(model, work / f"{quant}_{act}.so", "host", quant, activations=act)
        print(f"compiled {label} in {time.perf_counter() - start:.0f} s", flush=True)
        artefacts[label] = str(result.path)
        if quant != "none":
            packed_per_expert = result.metadata["packed_bytes"] / (a.layers * a.experts)
    float_per_expert = a.k * a.n * 4
    probe = bandwidth.BandwidthProbe(huge_pages=True)
    bw = {t: max(probe.measure_detail(t, 5).values()) for t in a.threads}
    del probe
    rows_out = []
    for t in a.threads:
        res = harness.run_in_subprocess("benchmarks.moe_experts:child", {
            "onnx_path": str(model), "artefacts": artefacts, "tokens": a.tokens, "top": a.top,
            "experts": a.experts, "calls": a.calls}, harness.thread_env(t))
        for tokens, engines in res.items():
            rows = int(tokens) * a.top
            for name, r in engines.items():
                per_expert = packed_per_expert if "packed" in name else float_per_expert
                gbps = a.layers * rows * per_expert / r["median_s"] / 1e9
                rows_out.append({"threads": t, "tokens": int(tokens), "rows": rows, "engine": name,
                                 "median_ms": 1e3 * r["median_s"], "gbps": gbps, "pct_of_bw": 100 * gbps / bw[t],
                                 "rel_err_vs_ort_fp32": r["rel_err_vs_ort_fp32"]})
    print(f"\n{a.layers} routed matmuls, {a.experts} experts of K {a.k} x N {a.n}, top {a.top}; read bandwidth "
          + ", ".join(f"{t} thread(s) {bw[t]:.1f} GB/s" for t in a.threads))
    print(f"{'thr':>3} {'tokens':>6} {'rows':>5}  {'engine':<36}{'median ms':>10}{'GB/s':>8}{'%BW':>6}"
          f"{'x vs ORT':>9}{'err vs ORT':>11}")
    for r in rows_out:
        ort_ms = next(o["median_ms"] for o in rows_out if o["threads"] == r["threads"]
                      and o["tokens"] == r["tokens"] and o["engine"] == "onnxruntime fp32")
        r["speedup_vs_ort"] = ort_ms / r["median_ms"]
        print(f"{r['threads']:>3} {r['tokens']:>6} {r['rows']:>5}  {r['engine']:<36}{r['median_ms']:>10.2f}"
              f"{r['gbps']:>8.1f}{r['pct_of_bw']:>6.0f}{r['speedup_vs_ort']:>9.2f}{r['rel_err_vs_ort_fp32']:>11.1e}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.json.with_suffix(".tmp")
    tmp.write_text(json.dumps({"machine": harness.machine_meta(bw), "config": vars(a) | {"json": str(a.json)},
                               "rows": rows_out}, indent=1))
    tmp.replace(a.json)
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
