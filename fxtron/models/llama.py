"""Shipped models: a Llama style decoder (RMSNorm, rotary, grouped-query attention, SwiGLU).

The model knows nothing about parallelism; fxtron finds the tensor-parallel structure on the
traced graph. It is written to trace with `torch.export.export(..., strict=False)` with batch
and sequence dims dynamic: no data-dependent control flow, no `.item()`, no complex numbers,
no in-place ops on inputs, and the sequence length is read from the input shape.

Linear layers (module paths, none with a bias), per layer i:
    layers.{i}.attn.wq   Linear(dim, n_head * hd)
    layers.{i}.attn.wk   Linear(dim, n_kv_head * hd)
    layers.{i}.attn.wv   Linear(dim, n_kv_head * hd)
    layers.{i}.attn.wo   Linear(n_head * hd, dim)
    layers.{i}.mlp.w1    Linear(dim, ffn_dim)   gate
    layers.{i}.mlp.w3    Linear(dim, ffn_dim)   up
    layers.{i}.mlp.w2    Linear(ffn_dim, dim)   down
and `output` Linear(dim, V), not tied to `tok_embeddings`.

Rotary embeddings use the real-valued rotate-half formulation (the pair of dims (j, j + hd/2)
is rotated by angle pos * theta^(-2j/hd)), with cos/sin tables of shape (max_seq_len, hd) kept
as non-persistent buffers `rope_cos` / `rope_sin` on the top module. They are not in the state
dict: after materializing a model built on the meta device, call `reset_rope()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxtron.models.masks import document_mask

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "rope_tables", "apply_rotary"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of `Llama`.

    vocab_size: number of token ids V. max_seq_len: the longest sequence the rotary tables
    cover. n_layer / n_head / n_kv_head / dim: depth, query heads, key-value heads
    (n_head % n_kv_head == 0) and hidden size (dim % n_head == 0, head_dim = dim // n_head).
    ffn_dim: hidden size of the SwiGLU MLP. norm_eps: RMSNorm epsilon. rope_theta: rotary base.
    dropout: probability for attention and residual dropout (0 disables it).
    """

    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.dim % self.n_head != 0:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} is not divisible by n_head={self.n_head}"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"LlamaConfig: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}"
            )
        if (self.dim // self.n_head) % 2 != 0:
            raise ValueError(
                f"LlamaConfig: head_dim={self.dim // self.n_head} must be even for rotary"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


def _dropout(p: float) -> nn.Module:
    """Dropout(p), or Identity when p == 0 so that no dropout node enters the traced graph."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 and cast back, times weight.

    forward: x (..., dim) -> (..., dim), same dtype as x.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(
    seq_len: int, head_dim: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim) float32, for the rotate-half formulation:
    column j and j + head_dim/2 both hold angle pos * theta^(-2j/head_dim)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (hd/2,)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (S,)
    angles = torch.outer(pos, inv_freq)  # (S, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, hd)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (..., hd/2)
    return torch.cat((-x2, x1), dim=-1)  # (..., hd)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hd) by the tables cos, sin (T, hd); returns (B, nh, T, hd)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary q/k and separate wq/wk/wv projections.

    forward(x, cos, sin): x (B, T, dim), cos/sin (T, hd) -> (B, T, dim).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        hd = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_head * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(config.n_head * hd, config.dim, bias=False)
        self.resid_drop = _dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q = apply_rotary(q, cos, sin)  # (B, nh, T, hd)
        k = apply_rotary(k, cos, sin)  # (B, nkv, T, hd)
        n_rep = self.n_head // self.n_kv_head
        if n_rep > 1:
            # query head j reads kv head j // n_rep
            k = k.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
            v = v.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hd); mask: a document mask (B, 1, T, T), causal inside each document
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)  # (B, T, nh*hd)
        return self.resid_drop(self.wo(y))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x), then dropout.

    forward: x (B, T, dim) -> (B, T, dim).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.drop = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x)) * self.w3(x)  # (B, T, ffn)
        return self.drop(self.w2(h))  # (B, T, dim)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(ffn_norm(x)).

    forward(x, cos, sin): x (B, T, dim), cos/sin (T, hd) -> (B, T, dim).
    """

    def __init__(self, config: LlamaConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = mlp if mlp is not None else FeedForward(config)     # another block's (an MoE's)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        x = x + self.mlp(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    """Llama style language model with an untied output projection.

    forward(idx, targets=None, *, position_ids=None, document_ids=None):
        idx: (B, T) int64 token ids < vocab_size, with T <= max_seq_len.
        targets: optional (B, T) int64 next-token ids.
        position_ids: optional (B, T) rotary positions (packed documents: restarting at each one,
            Megatron's --reset-position-ids); default 0..T-1.
        document_ids: optional (B, T) document index of each token: attention stays inside a
            document (Megatron's --reset-attention-mask); default one document.
        returns logits (B, T, V) when targets is None, else the scalar mean cross-entropy loss.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S, hd)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, 0.02) for every Linear and Embedding weight, ones for RMSNorm weights, and
        the rotary tables (a model built on the meta device gets them from here too)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the rotary tables in place on their current device and dtype (needed after
        `to_empty()` on a model built on the meta device: the buffers are not in the state dict)."""
        cfg = self.config
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _, T = idx.shape
        if position_ids is None:
            cos = self.rope_cos[:T]  # (T, hd)
            sin = self.rope_sin[:T]  # (T, hd)
        else:
            cos = self.rope_cos[position_ids].unsqueeze(1)  # (B, 1, T, hd)
            sin = self.rope_sin[position_ids].unsqueeze(1)  # (B, 1, T, hd)
        mask = document_mask(document_ids) if document_ids is not None else None  # (B, 1, T, T)
        x = self.tok_embeddings(idx)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask)  # (B, T, dim)
        logits = self.output(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        V = self.config.vocab_size
        if logits.dtype in (torch.bfloat16, torch.float16):   # the loss in fp32, as Megatron's and transformers'
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))
