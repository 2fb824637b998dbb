"""Bundled default model: a small LLaMA-style decoder in plain torch, exported to ONNX.

Written so that the legacy ONNX exporter yields a graph TVM's Relax ONNX
frontend imports with symbolic ``batch``/``seq``: every runtime shape derives
from ``input_ids`` itself, never from ``Range`` (TVM gives a Range's length a
fresh symbol unrelated to ``seq``, and broadcasts against it lose their shape):

- positions are ``cumsum(ones_like(input_ids)) - 1``, hence [batch, seq];
- RoPE cos/sin are gathered from precomputed tables at those positions;
- the causal mask compares those positions (key position > query position);
- grouped-query attention lets K/V broadcast over the query groups inside
  MatMul, so there is no Expand; head split/merge reshape to sizes read from
  ``x.shape``, which the frontend folds into (batch, seq) shape expressions.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass

import torch

from qtvm.models.export import cached, export_torch_onnx
from torch import nn

__all__ = ["TinyLlamaConfig", "build_torch_model", "export_onnx", "default_model_path"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    # Not a multiple of 128 on purpose: exercises the quantizer's group padding.
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Length of the precomputed RoPE tables, i.e. the longest supported sequence.
    max_position_embeddings: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    # `half` is passed in rather than read from x.shape so no shape arithmetic is exported.
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masked: torch.Tensor
    ) -> torch.Tensor:
        # x: [b, s, hidden]; cos/sin: [b, s, 1, d]; masked: [b, 1, 1, s, s], True = future key.
        kv, d = self.num_kv_heads, self.head_dim
        groups = self.num_heads // kv
        b, s = x.shape[0], x.shape[1]
        # Query head h uses KV head h // groups: split q heads as (kv, groups) so
        # K/V ([b, kv, 1, s, d]) broadcast over groups inside MatMul, no Expand.
        q = self.q_proj(x).view(b, s, kv * groups, d)
        k = self.k_proj(x).view(b, s, kv, d)
        v = self.v_proj(x).view(b, s, kv, d)
        q = q * cos + _rotate_half(q, d // 2) * sin
        k = k * cos + _rotate_half(k, d // 2) * sin
        q = q.view(b, s, kv, groups, d).permute(0, 2, 3, 1, 4)  # [b, kv, g, s, d]
        k = k.permute(0, 2, 3, 1).unsqueeze(2)  # [b, kv, 1, d, s]
        v = v.permute(0, 2, 1, 3).unsqueeze(2)  # [b, kv, 1, s, d]
        scores = torch.matmul(q, k) * (1.0 / math.sqrt(d))
        # Every row keeps its diagonal, so -inf never yields an all-masked softmax row.
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # [b, kv, g, s, d]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, s, kv * groups * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, masked):
        x = x + self.attn(self.input_norm(x), cos, sin, masked)
        return x + self.mlp(self.post_attn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_table", angles.cos().float(), persistent=False)
        self.register_buffer("sin_table", angles.sin().float(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Positions and mask derive from input_ids' own shape (no Range): see module doc.
        positions = torch.cumsum(torch.ones_like(input_ids), dim=1) - 1  # [b, s]
        cos = nn.functional.embedding(positions, self.cos_table).unsqueeze(2)  # [b, s, 1, d]
        sin = nn.functional.embedding(positions, self.sin_table).unsqueeze(2)
        masked = positions.unsqueeze(1) > positions.unsqueeze(2)  # [b, s_q, s_k]: key after query
        masked = masked.unsqueeze(1).unsqueeze(1)  # [b, 1, 1, s, s]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, masked)
        return self.lm_head(self.norm(x))


def build_torch_model(config: TinyLlamaConfig = TinyLlamaConfig()) -> torch.nn.Module:
    """Weights depend only on ``config.seed``; the caller's global RNG state is restored."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = TinyLlama(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:  # embeddings and linears; 0.02 keeps logits O(1) at this depth
                    param.normal_(0.0, 0.02)
    return model.eval()


def export_onnx(path: str | os.PathLike, config: TinyLlamaConfig = TinyLlamaConfig()) -> pathlib.Path:
    """Legacy (TorchScript) exporter, opset 17: its graph imports into TVM with symbolic dims."""
    return export_torch_onnx(
        build_torch_model(config), (torch.zeros((1, 4), dtype=torch.int64),), path,
        input_names=["input_ids"], output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})


def default_model_path() -> pathlib.Path:
    """Cached export, so callers (CLI, tests, benches) share one file."""
    return cached("tiny_llama.onnx", export_onnx)
