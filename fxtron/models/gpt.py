"""Shipped models: a GPT-2 style decoder (nanoGPT layout) in plain PyTorch.

The model knows nothing about parallelism; fxtron finds the tensor-parallel structure on the
traced graph. It is written to trace with `torch.export.export(..., strict=False)` with batch
and sequence dims dynamic: no data-dependent control flow, no `.item()`, no in-place ops on
inputs, and the sequence length is read from the input shape.

Linear layers (module paths), per block i:
    blocks.{i}.attn.qkv   Linear(h, 3h)  fused, output laid out [q | k | v]
    blocks.{i}.attn.proj  Linear(h, h)
    blocks.{i}.mlp.fc1    Linear(h, 4h)
    blocks.{i}.mlp.fc2    Linear(4h, h)
and `lm_head` Linear(h, V, bias=False), whose weight IS `wte.weight` (tied).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxtron.models.masks import document_mask

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of `GPT`.

    vocab_size: number of token ids V. block_size: the longest sequence the position table
    covers. n_layer / n_head / n_embd: depth, attention heads, hidden size h (h % n_head == 0).
    dropout: probability for embedding, attention and residual dropout (0 disables it).
    bias: whether Linear and LayerNorm layers carry a bias.
    flash: attention by F.scaled_dot_product_attention (default), or written out as nanoGPT's
    fallback and Megatron's unfused core attention: softmax(q k^T / sqrt(d), causal) with its
    dropout, then @ v, keeping the s x s scores (Korthikanti et al.'s 5as/h term).
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )


def _dropout(p: float) -> nn.Module:
    """Dropout(p), or Identity when p == 0 so that no dropout node enters the traced graph."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection.

    forward: x (B, T, h) -> (B, T, h).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = _dropout(config.dropout)
        self.flash = config.flash
        if not config.flash:
            self.attn_drop = _dropout(config.dropout)
            future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1)
            self.register_buffer("future", future, persistent=False)   # True where a key comes after the query

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=-1)  # 3 x (B, T, h)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
            )  # (B, nh, T, hd); mask: a document mask (B, 1, T, T), causal inside each document
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
            hidden = self.future[:T, :T] if mask is None else ~mask
            att = att.masked_fill(hidden, float("-inf")).softmax(dim=-1)
            y = self.attn_drop(att) @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)  # (B, T, h)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """fc1 -> GELU (tanh approximation, as GPT-2) -> fc2 -> dropout.

    forward: x (B, T, h) -> (B, T, h).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x), approximate="tanh")  # (B, T, 4h)
        return self.drop(self.fc2(x))  # (B, T, h)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    forward: x (B, T, h) -> (B, T, h).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """GPT-2 style language model with learned positions and an lm_head tied to wte.

    forward(idx, targets=None, *, position_ids=None, document_ids=None):
        idx: (B, T) int64 token ids < vocab_size, with T <= block_size.
        targets: optional (B, T) int64 next-token ids.
        position_ids: optional (B, T) positions of the learned table (packed documents:
            restarting at each one, Megatron's --reset-position-ids); default 0..T-1.
        document_ids: optional (B, T) document index of each token: attention stays inside a
            document (Megatron's --reset-attention-mask); default one document.
        returns logits (B, T, V) when targets is None, else the scalar mean cross-entropy loss.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = _dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, counted once
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: normal(0, 0.02) for Linear and Embedding weights, zero biases, and the
        residual output projections (attn.proj, mlp.fc2) scaled by 1/sqrt(2 * n_layer)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=resid_std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids  # (T,) or (B, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h)
        mask = document_mask(document_ids) if document_ids is not None else None  # (B, 1, T, T)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)  # (B, T, h)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        V = self.config.vocab_size
        if logits.dtype in (torch.bfloat16, torch.float16):   # the loss in fp32, as Megatron's and transformers'
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))
