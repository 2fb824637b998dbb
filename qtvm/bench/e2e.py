"""`qtvm bench e2e`: prefill and decode tokens/s of a whole LLaMA-style model with a KV
cache, qtvm against onnxruntime, in one run.

The model is built from a transformers ``LlamaConfig`` (random weights, seeded) and
exported with past key/values by torch.onnx's legacy exporter (input_ids,
attention_mask, past_key_values.* in; logits, present.* out). The default size
(hidden 2048, 8 layers, intermediate 5632, vocab 32000: 1.9 GB of fp32 weights, 0.27 GB
at int4-g128) does not fit in any L3, so decoding streams the weights from DRAM per token.
Engines, all on the same exported model:

* ``qtvm int4-g128`` (fp32 activations) and ``qtvm int4-g128 --act int8``: the artefact's
  in-place KV-cache step (``qtvm.generate``); on request (``--engines``) the same for
  ``bcq3-g128`` (LUT-GEMM decode), and ``--act int8 --kv-cache fp16`` (caches in float16;
  with ``ort-fp32`` among the engines, the table gives each one's logits cosine against it);
* ``ort fp32``: onnxruntime on the exported model;
* ``ort int4 (MatMulNBits acc=4)``: onnxruntime on the model quantized by its own
  ``MatMulNBitsQuantizer`` (block 128, with zero points, accuracy_level 4: int8
  activations, as qtvm's ``--act int8``).

onnxruntime runs with IO binding: the presents stay OrtValues and are bound as the next
step's past, no numpy copies. Each thread count runs in a fresh process (TVM sizes its
pool once), onnxruntime with ``intra_op_num_threads`` = threads and no spinning (its pool
would otherwise starve TVM's). Per round every engine runs one generation (a prompt of
``--prompt`` tokens, then ``--decode`` tokens one at a time, greedy), engines interleaved;
reported: medians over rounds. Exports, quantized models and artefacts are cached in
``--cache-dir`` under a key of the model config and (for artefacts) qtvm's own sources, so
a rerun only measures.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from qtvm.bench.harness import turn_order
from qtvm.models.hf_cache import flat_cache_module

DEFAULT = {"hidden": 2048, "layers": 8, "intermediate": 5632, "vocab": 32000, "heads": 32, "kv_heads": 4}
#: qtvm engines: (--quant, --act, --kv-cache) of their artefact. BCQ (LUT-GEMM decode) and
#: the float16 cache on request only.
QTVM_BUILDS = {"qtvm-int4": ("int4-g128", "fp32", "model"), "qtvm-int4-a8": ("int4-g128", "int8", "model"),
               "qtvm-int4f16-a8": ("int4-g128-f16", "int8", "model"),  # float16 scales: 4.25 bits a weight
               "qtvm-int4-a8-kv16": ("int4-g128", "int8", "fp16"),
               "qtvm-bcq3": ("bcq3-g128", "fp32", "model"), "qtvm-bcq3-a8": ("bcq3-g128", "int8", "model")}
ENGINES = (*QTVM_BUILDS, "ort-fp32", "ort-int4")
DEFAULT_ENGINES = ("qtvm-int4", "qtvm-int4-a8", "ort-fp32", "ort-int4")
LABELS = {**{name: f"qtvm {quant}" + (" --act int8" if act == "int8" else "") +
             (f" --kv-cache {kv}" if kv != "model" else "") for name, (quant, act, kv) in QTVM_BUILDS.items()},
          "ort-fp32": "ort fp32", "ort-int4": "ort int4 (MatMulNBits acc=4)"}


# -- the model and its variants (cached) --------------------------------------------------
def _atomic(path: Path, write) -> Path:
    """``write(tmp)`` then rename: a cache entry is whole or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp / path.name)
        for f in tmp.iterdir():  # the model and any external-data file beside it
            os.replace(f, path.parent / f.name)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return path


def config_key(cfg: dict) -> str:
    import importlib.metadata as md

    text = json.dumps(cfg, sort_keys=True) + md.version("torch") + md.version("transformers")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def source_key() -> str:
    """A hash of qtvm's compiler sources: artefacts are rebuilt when the compiler changes."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in ("qtvm", "relay_passes", "schedules"):
        for f in sorted((root / package).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def export_model(cfg: dict, path: Path) -> Path:
    """LlamaForCausalLM from ``cfg`` (random weights, seed 0), exported with a KV cache."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                            num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                            num_key_value_heads=cfg["kv_heads"], max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(config).eval()
    layers, heads, dim = cfg["layers"], cfg["kv_heads"], cfg["hidden"] // cfg["heads"]

    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    args = (torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long),
            *[torch.zeros(1, heads, 4, dim) for _ in past])
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "past + seq"},
            **{n: {0: "batch", 2: "past"} for n in past}, **{n: {0: "batch", 2: "past + seq"} for n in present}}

    def write(tmp):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(flat_cache_module(model, layers), args, str(tmp), dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask", *past],
                              output_names=["logits", *present], dynamic_axes=axes)
    return _atomic(path, write)


def ort_int4_model(src: Path, path: Path) -> Path:
    """onnxruntime's MatMulNBitsQuantizer: 4 bits, block 128, zero points, accuracy_level 4."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=4, block_size=128, is_symmetric=False, accuracy_level=4)
    q.process()
    return _atomic(path, lambda tmp: onnx.save(q.model.model, str(tmp)))


def prepare(cfg: dict, cache_dir: Path, engines, log=print) -> dict:
    """{engine: file} with everything built or taken from the cache."""
    cache_dir = Path(cache_dir)
    key = config_key(cfg)
    files = {}
    onnx_path = cache_dir / f"llama_{key}.onnx"
    if not onnx_path.exists():
        t0 = time.perf_counter()
        export_model(cfg, onnx_path)
        log(f"exported {onnx_path} in {time.perf_counter() - t0:.0f} s")
    if "ort-fp32" in engines:
        files["ort-fp32"] = onnx_path
    if "ort-int4" in engines:
        path = cache_dir / f"llama_{key}_matmulnbits4.onnx"
        if not path.exists():
            t0 = time.perf_counter()
            ort_int4_model(onnx_path, path)
            log(f"quantized {path} (MatMulNBitsQuantizer) in {time.perf_counter() - t0:.0f} s")
        files["ort-int4"] = path
    src = source_key()
    for engine, (quant, act, kv_cache) in QTVM_BUILDS.items():
        if engine not in engines:
            continue
        path = cache_dir / f"llama_{key}_{quant}_{act}{'_kv' + kv_cache if kv_cache != 'model' else ''}_{src}.so"
        if not path.exists():
            from qtvm.pipeline import compile_model
            from qtvm.quiet import tvm_output_captured

            t0 = time.perf_counter()
            with tvm_output_captured():
                result = compile_model(onnx_path, path, "host", quant, act, kv_cache=kv_cache)
            if not result.metadata.get("kv_step"):
                raise RuntimeError(f"{path}: no in-place KV-cache step ({'; '.join(result.notes)})")
            log(f"compiled {path} in {time.perf_counter() - t0:.0f} s")
        files[engine] = path
    return files


# -- engines ------------------------------------------------------------------------------
class QtvmEngine:
    def __init__(self, path, threads: int):
        from qtvm import runtime

        self.module = runtime.load(path)

    def generate(self, prompt: np.ndarray, new: int):
        """(tokens, prefill seconds, decode seconds, last prefill logits)."""
        clock = time.perf_counter
        s = self.module.session(prompt.shape[0])
        t0 = clock()
        logits = s.feed(prompt, last=True)  # generation's prefill: the next token's logits only
        t1 = clock()
        first = logits[:, -1]
        tokens = [first.argmax(-1)]
        for _ in range(new - 1):
            logits = s.feed(tokens[-1][:, None].astype(np.int64))
            tokens.append(logits[:, -1].argmax(-1))
        t2 = clock()
        return np.stack(tokens, 1), t1 - t0, t2 - t1, first


class OrtEngine:
    def __init__(self, path, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.ort = ort
        self.past = [i for i in self.sess.get_inputs() if i.name.startswith("past_key_values")]
        self.outs = [o.name for o in self.sess.get_outputs()]

    def _step(self, ids, mask, past):
        b = self.sess.io_binding()
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("attention_mask", mask)
        for spec, value in zip(self.past, past):
            if isinstance(value, np.ndarray):
                b.bind_cpu_input(spec.name, value)
            else:
                b.bind_ortvalue_input(spec.name, value)
        for name in self.outs:
            b.bind_output(name, "cpu")
        self.sess.run_with_iobinding(b)
        outs = b.get_outputs()
        return outs[0].numpy(), outs[1:]

    def generate(self, prompt: np.ndarray, new: int):
        clock = time.perf_counter
        batch = prompt.shape[0]
        past = [np.zeros((batch, p.shape[1], 0, p.shape[3]), np.float32) for p in self.past]
        mask = np.ones(prompt.shape, np.int64)
        t0 = clock()
        logits, past = self._step(prompt, mask, past)
        t1 = clock()
        first = logits[:, -1]
        tokens = [first.argmax(-1)]
        for _ in range(new - 1):
            mask = np.ones((batch, mask.shape[1] + 1), np.int64)
            logits, past = self._step(tokens[-1][:, None].astype(np.int64), mask, past)
            tokens.append(logits[:, -1].argmax(-1))
        t2 = clock()
        return np.stack(tokens, 1), t1 - t0, t2 - t1, first


def child(files: dict, threads: int, prompt: int, decode: int, rounds: int, gap_s: float = 0.2) -> dict:
    """One thread count in its own process: every engine loaded, checked, then timed in
    interleaved rounds, the order rotated each round (``harness.turn_order``)."""
    rng = np.random.default_rng(0)
    engines = {}
    for name, path in files.items():
        t0 = time.perf_counter()
        engines[name] = (QtvmEngine if name.startswith("qtvm") else OrtEngine)(path, threads)
        print(f"[{threads} thr] {LABELS[name]} loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results = {name: {"prefill_s": [], "decode_s": []} for name in engines}
    firsts, ids = {}, None
    for name, engine in engines.items():  # warm-up (pools, allocations) and the logits check
        if ids is None:
            vocab = engine.generate(np.zeros((1, 1), np.int64), 1)[3].shape[-1]
            ids = rng.integers(0, vocab, (1, prompt)).astype(np.int64)
        _, _, _, first = engine.generate(ids, min(decode, 4))
        firsts[name] = first[0]
        if not np.all(np.isfinite(first)):
            raise RuntimeError(f"{name}: non-finite logits")
    names = list(engines)
    for r in range(rounds):
        for name in (names[j] for j in turn_order(len(names), r)):
            engine = engines[name]
            time.sleep(gap_s)  # the previous runtime's pool winds down first
            tokens, t_pre, t_dec, _ = engine.generate(ids, decode + 1)
            results[name]["prefill_s"].append(t_pre)
            results[name]["decode_s"].append(t_dec)
            print(f"[{threads} thr] round {r + 1}: {LABELS[name]:<30} prefill {prompt / t_pre:8.1f} tok/s  "
                  f"decode {decode / t_dec:7.2f} tok/s", file=sys.stderr, flush=True)
    rows = []
    ref = firsts.get("ort-fp32")
    for name in engines:
        pre, dec = float(np.median(results[name]["prefill_s"])), float(np.median(results[name]["decode_s"]))
        first = firsts[name]
        cos = None if ref is None else float(np.dot(first, ref) / (np.linalg.norm(first) * np.linalg.norm(ref)))
        rows.append({"engine": name, "label": LABELS[name], "threads": threads, "prompt": prompt, "decode": decode,
                     "prefill_tok_s": prompt / pre, "decode_tok_s": decode / dec, "decode_ms_per_token": dec / decode * 1e3,
                     "prefill_ms": pre * 1e3, "round_prefill_ms": [t * 1e3 for t in results[name]["prefill_s"]],
                     "round_decode_ms": [t * 1e3 for t in results[name]["decode_s"]],
                     "logits_cosine_vs_ort_fp32": cos, "loadavg_1min": os.getloadavg()[0]})
    return {"results": rows}


# -- table, JSON, command -----------------------------------------------------------------
def add_speedups(rows: list[dict]) -> list[dict]:
    by = {(r["engine"], r["threads"]): r for r in rows}
    for r in rows:
        for peer in ("ort-fp32", "ort-int4"):
            p = by.get((peer, r["threads"]))
            r[f"decode_x_{peer}"] = r["decode_tok_s"] / p["decode_tok_s"] if p else None
            r[f"prefill_x_{peer}"] = r["prefill_tok_s"] / p["prefill_tok_s"] if p else None
    return rows


def format_table(rows: list[dict]) -> str:
    headers = ["engine", "thr", "prefill tok/s", "decode tok/s", "ms/token", "decode vs ort fp32",
               "decode vs ort int4", "cos vs ort fp32"]

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    table = [[r["label"], str(r["threads"]), f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}",
              f"{r['decode_ms_per_token']:.2f}", x(r.get("decode_x_ort-fp32")), x(r.get("decode_x_ort-int4")),
              "-" if r["logits_cosine_vs_ort_fp32"] is None else f"{r['logits_cosine_vs_ort_fp32']:.4f}"]
             for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), "  ".join("-" * w for w in widths)]
    prev = None
    for r, t in zip(rows, table):
        if prev is not None and r["threads"] != prev:
            out.append("")
        out.append(line(t))
        prev = r["threads"]
    return "\n".join(out)


def run(cfg: dict, cache_dir: Path, engines=DEFAULT_ENGINES, threads=(1, 2), prompt: int = 128, decode: int = 64,
        rounds: int = 3, json_path: Path | None = None, huge_pages: bool = True) -> list[dict]:
    from qtvm.bench import harness

    pages = harness.pages_meta(huge_pages)
    print(f"{harness.cpu_named()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; weights on "
          f"{pages['weights_on']} (THP mode {pages['thp_mode']})", flush=True)
    print(f"model: LLaMA hidden {cfg['hidden']}, {cfg['layers']} layers, intermediate {cfg['intermediate']}, "
          f"vocab {cfg['vocab']}, heads {cfg['heads']} ({cfg['kv_heads']} KV); prompt {prompt}, decode {decode}, "
          f"{rounds} rounds", flush=True)
    files = prepare(cfg, cache_dir, engines, log=lambda m: print(m, flush=True))
    rows = []
    for t in threads:
        out = harness.run_in_subprocess("qtvm.bench.e2e:child", {
            "files": {k: str(v) for k, v in files.items()}, "threads": t, "prompt": prompt, "decode": decode,
            "rounds": rounds}, harness.thread_env(t, huge_pages))
        rows += out["results"]
    rows.sort(key=lambda r: (r["threads"], ENGINES.index(r["engine"])))
    add_speedups(rows)
    print()
    print(format_table(rows))
    if json_path is not None:
        onnx_path = Path(cache_dir) / f"llama_{config_key(cfg)}.onnx"
        harness.write_json(rows, json_path, {
            "benchmark": "e2e", "model": {**cfg, "family": "LlamaForCausalLM (random weights)",
                                          "onnx_bytes": onnx_path.stat().st_size},
            "prompt": prompt, "decode": decode, "rounds": rounds, "threads": list(threads), "pages": pages,
            "timing": "median over rounds of one generation per engine per round, engines interleaved; "
                      "each thread count in a fresh process; onnxruntime with IO binding, no spinning",
            "files": {k: str(v) for k, v in files.items()}})
        print(f"wrote {json_path}")
    return rows


def add_e2e_parser(bsub) -> None:
    p = bsub.add_parser("e2e", help="prefill and decode tokens/s of a LLaMA-style model with a KV cache: qtvm int4 "
                                    "vs onnxruntime fp32 and MatMulNBits int4")
    for name, value in DEFAULT.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, dest=name)
    p.add_argument("--prompt", type=int, default=128, help="prefill tokens (default 128)")
    p.add_argument("--decode", type=int, default=64, help="decoded tokens per generation (default 64)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma list of {', '.join(ENGINES)} (default: {', '.join(DEFAULT_ENGINES)})")
    p.add_argument("--cache-dir", type=Path, default=Path("out/e2e_cache"),
                   help="exports, quantized models and artefacts, reused by later runs")
    p.add_argument("--json", type=Path, default=Path("out/bench_e2e.json"))
    from qtvm.bench.gemv import add_pages_argument

    add_pages_argument(p)
    p.set_defaults(fn=e2e_command)


def e2e_command(args) -> int:
    from qtvm.errors import QtvmError

    cfg = {name: getattr(args, name) for name in DEFAULT}
    if any(v < 1 for v in cfg.values()):
        raise QtvmError("model sizes must be >= 1")
    if cfg["hidden"] % cfg["heads"] or cfg["heads"] % cfg["kv_heads"]:
        raise QtvmError(f"--hidden {cfg['hidden']} must be a multiple of --heads {cfg['heads']}, and --heads of "
                        f"--kv-heads {cfg['kv_heads']}")
    if args.prompt < 1 or args.decode < 1 or args.rounds < 1 or any(t < 1 for t in args.threads):
        raise QtvmError("--prompt, --decode, --rounds and --threads must be >= 1")
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise QtvmError(f"unknown engines: {', '.join(unknown) or '(none given)'}", f"choose from {', '.join(ENGINES)}")
    try:
        import transformers  # noqa: F401
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # noqa: F401
    except ImportError as e:
        raise QtvmError(f"qtvm bench e2e builds its model with transformers and onnxruntime's quantizer ({e.name} "
                        "is missing)", "pip install -e '.[test]'") from None
    for path in (args.cache_dir, args.json.parent):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QtvmError(f"cannot create directory {path}: {e.strerror}") from None
    run(cfg, args.cache_dir, engines, args.threads, args.prompt, args.decode, args.rounds, args.json,
        huge_pages=args.pages == "huge")
    return 0
