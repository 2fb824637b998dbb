"""Decoders made the way most int4 ONNX LLMs are made for CPUs: onnxruntime-genai's model
builder (``python -m onnxruntime_genai.models.builder -p int4 -e cpu``) run on a transformers
checkpoint. Its files use onnxruntime's contrib ops (MatMulNBits at accuracy_level 4,
GroupQueryAttention with the rotary embedding inside, SkipSimplifiedLayerNormalization,
GatherBlockQuantized for a tied embedding) and name the caches' head size ``kv_cache_dim``.

Tiny random configs (hidden 64, 2 layers; phi 128 so that its partial rotary is a multiple of
8 wide, as onnxruntime requires); a word-level tokenizer of the 256-token vocabulary (the
builder copies one). Built into a directory named by the library versions, atomically.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

VOCAB = 256
#: family -> (builder model type, what it exercises)
FAMILIES = {
    "llama": "grouped KV heads, rotary inside GroupQueryAttention, SkipSimplifiedLayerNormalization",
    "qwen2_tied": "a tied embedding (GatherBlockQuantized on the lm_head's int4 weight), q/k/v biases",
    "phi": "a partial rotary, SkipLayerNormalization, LayerNormalization, Gelu",
    "qwen3": "q/k RMSNorm per head (Reshape around SimplifiedLayerNormalization)",
    "phi3": "Phi-3 / Phi-4-mini, whose checkpoint fuses qkv and gate_up (the builder's graph has LLaMA's shape)",
    "gemma": "Gelu MLP, the embedding scaled by sqrt(hidden), a tied embedding",
    "granite": "embedding, residual and attention multipliers, logits scaling",
    "nemotron": "LayerNormalization / SkipLayerNormalization, squared-ReLU MLP (Pow), partial rotary",
    "ernie4_5": "an interleaved rotary inside GroupQueryAttention, a tied embedding",
}
#: families the builder writes that qtvm refuses, and the name in the refusal
REFUSED = {"gemma2": "sliding_window_cache=1"}


def _checkpoint(family: str, directory: pathlib.Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small))
    elif family == "qwen2_tied":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **small))
    elif family == "phi":
        model = tf.PhiForCausalLM(tf.PhiConfig(num_key_value_heads=4, partial_rotary_factor=0.5,
                                               **{**small, "hidden_size": 128}))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **small))
    elif family == "phi3":  # max = original max position embeddings: the builder's plain (not LongRoPE) Phi-3
        model = tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=4, original_max_position_embeddings=256, **small))
    elif family == "gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=2, head_dim=16, **small))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                     query_pre_attn_scalar=16, **small))
    elif family == "granite":
        model = tf.GraniteForCausalLM(tf.GraniteConfig(num_key_value_heads=2, embedding_multiplier=12.0,
                                                       residual_multiplier=0.22, attention_multiplier=1 / 64,
                                                       logits_scaling=8.0, **small))
    elif family == "nemotron":  # hidden 128: a rotary of 16 (cos_cache 8 wide, onnxruntime's minimum)
        model = tf.NemotronForCausalLM(tf.NemotronConfig(num_key_value_heads=2, partial_rotary_factor=0.5,
                                                         **{**small, "hidden_size": 128}))
    elif family == "ernie4_5":  # head_dim 16 (its default, 128, is wider than hidden / heads here)
        model = tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(num_key_value_heads=2, head_dim=16, **small))
    else:
        raise ValueError(family)
    model.eval().save_pretrained(str(directory))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                               pad_token="t0").save_pretrained(str(directory))


def build(family: str, out: pathlib.Path) -> pathlib.Path:
    """Checkpoint -> builder -> ``out`` (a directory with model.onnx), written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _checkpoint(family, work / "hf")
        builder_type = {"qwen2_tied": "qwen2"}.get(family, family)
        run = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(work / "hf"),
                              "-m", builder_type, "-o", str(work / "onnx"), "-p", "int4", "-e", "cpu",
                              "-c", str(work / "cache")], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if run.returncode or not (work / "onnx" / "model.onnx").exists():
            raise RuntimeError(f"onnxruntime-genai's builder failed on {family}:\n{run.stderr[-3000:]}")
        os.replace(work / "onnx", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / "model.onnx"


def cached_model(directory: str | os.PathLike, family: str) -> pathlib.Path:
    """The builder's model.onnx for ``family`` in ``directory``, made on first use."""
    import onnxruntime_genai
    import torch
    import transformers

    versions = f"{onnxruntime_genai.__version__} {torch.__version__} {transformers.__version__} v1"
    out = pathlib.Path(directory) / f"genai_{family}_{hashlib.sha256(versions.encode()).hexdigest()[:10]}"
    return out / "model.onnx" if (out / "model.onnx").exists() else build(family, out)


def float_activations(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy whose MatMulNBits run float activations in onnxruntime (accuracy_level 0):
    the reference for an fp32-activation artefact."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    onnx.save(model, str(out))
    return out
