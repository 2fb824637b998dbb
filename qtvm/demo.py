"""The main job: compile the bundled tiny LLaMA for the host and check it.

Prints, for two (batch, seq) shapes served by ONE artefact: error against
onnxruntime running the same graph with the dequantized weights (the
compiler's own error), error against the float model (the format's error),
artefact size against the fp32 weights, and median latencies beside
onnxruntime's fp32 and qtvm's own fp32 build.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

SHAPES = ((1, 16), (2, 64))


def _median_seconds(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run_demo(out_dir: Path, target: str = "host", quant: str = "int4-g128") -> dict:
    import onnx
    import onnxruntime as ort

    from qtvm import runtime
    from qtvm.formats import get_format
    from qtvm.models.tiny_llama import default_model_path
    from qtvm.pipeline import compile_model
    from qtvm.reference import dequantized_model

    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = default_model_path()
    print(f"model: {model_path} (tiny LLaMA: RMSNorm, RoPE, GQA, SwiGLU; symbolic batch, seq)")
    q = compile_model(model_path, out_dir / f"tiny_llama_{quant}.so", target, quant)
    q8 = compile_model(model_path, out_dir / f"tiny_llama_{quant}_act-int8.so", target, quant, "int8")
    f = compile_model(model_path, out_dir / "tiny_llama_fp32.so", target, "none")
    meta = q.metadata
    print(f"compiled {q.path} in {q.seconds:.1f} s for {meta['target']}")
    for note in q.notes:
        print(note)

    model = onnx.load(str(model_path))
    ort_float = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_deq = ort.InferenceSession(dequantized_model(model, get_format(quant)).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    qmod, q8mod, fmod = runtime.load(q.path), runtime.load(q8.path), runtime.load(f.path)

    weight_mb, packed_mb = meta["float_weight_bytes"] / 1e6, meta["packed_bytes"] / 1e6
    print(f"\nmatmul weights: {weight_mb:.2f} MB fp32 -> {packed_mb:.2f} MB {quant} "
          f"({weight_mb / packed_mb:.1f}x smaller); artefact {q.path.stat().st_size / 1e6:.2f} MB "
          f"vs fp32 artefact {f.path.stat().st_size / 1e6:.2f} MB")
    header = (f"{'batch x seq':>11} | {'activations':>11} | {'rel err vs ORT(deq)':>19} | {'rel err vs float':>16} | "
              f"{'cosine':>8} | {'top-1 agree':>11} | {'latency':>9} | {'qtvm fp32':>9} | {'ORT fp32':>8}")
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    rows = []
    for batch, seq in SHAPES:
        ids = rng.integers(0, 512, (batch, seq)).astype(np.int64)
        feed = {"input_ids": ids}
        deq = ort_deq.run(None, feed)[0].astype(np.float64)
        ref = ort_float.run(None, feed)[0].astype(np.float64)
        # onnxruntime's idle threads spin (its fastest setting) on the cores qtvm's calls need:
        # qtvm is timed once they have gone to sleep, onnxruntime last (in one process, qtvm's
        # fp32 run measured 3-4 ms instead of 0.28 ms right after onnxruntime's calls).
        time.sleep(0.2)
        tf = _median_seconds(lambda: fmod.run(feed))
        shape_rows = []
        for act, module in (("fp32", qmod), ("int8", q8mod)):
            got = module.run(feed)["logits"].astype(np.float64)
            rel_deq = float(np.abs(got - deq).max() / np.abs(deq).max())
            rel_float = float(np.abs(got - ref).max() / np.abs(ref).max())
            cos = float((got * ref).sum() / np.sqrt((got * got).sum() * (ref * ref).sum()))
            top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
            tq = _median_seconds(lambda: module.run(feed))
            shape_rows.append(dict(batch=batch, seq=seq, activations=act, rel_err_vs_ort_dequant=rel_deq,
                                   rel_err_vs_float=rel_float, cosine=cos, top1=top1, ms_qtvm=tq * 1e3,
                                   ms_qtvm_fp32=tf * 1e3))
        to = _median_seconds(lambda: ort_float.run(None, feed))
        for row in shape_rows:
            row["ms_ort_fp32"] = to * 1e3
            print(f"{f'{batch} x {seq}':>11} | {row['activations']:>11} | {row['rel_err_vs_ort_dequant']:>19.2e} | "
                  f"{row['rel_err_vs_float']:>16.3f} | {row['cosine']:>8.5f} | {row['top1']:>11.1%} | "
                  f"{row['ms_qtvm']:>6.2f} ms | {tf * 1e3:>6.2f} ms | {to * 1e3:>5.2f} ms")
        rows += shape_rows
    print(f"\n{quant} weights in every row; 'activations' int8 is the opt-in `--act int8` (rounds each matmul "
          "input per 32 values). rel err = max |a - b| / max |b| over all logits; ORT(deq) runs the same graph "
          "with the dequantized weights, so its column is qtvm's own error. Latencies: medians of 15 runs. "
          "This tiny model's latency is mostly per-call overhead; see `qtvm bench gemv` and `qtvm bench prefill` "
          "for kernel-level numbers.")
    return {"rows": rows, "metadata": meta}
