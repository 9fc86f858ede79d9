"""Shipped models: named presets of the GPT and Llama models, built reproducibly.

    build("gpt-tiny")                   -> GPT with seeded weights on the default device
    build("llama-7b", device="meta")    -> Llama with shapes only, no memory allocated
    example_inputs("gpt-tiny", 4, 32)   -> (idx, targets), both (4, 32) int64 token ids

Presets: gpt-tiny, gpt-small, gpt2-124m, llama-tiny, llama-small, llama-7b, moe-tiny,
mixtral-8x7b, deepseek-moe-16b.
"""
from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn

from fxtron.errors import ParallelizeError
from fxtron.models.gpt import GPT, GPTConfig
from fxtron.models.llama import Llama, LlamaConfig
from fxtron.models.moe import MoEConfig, MoETransformer

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MoEConfig",
    "MoETransformer",
    "PRESETS",
    "build",
    "config",
    "example_inputs",
    "list_presets",
    "num_parameters",
]

ModelConfig = Union[GPTConfig, LlamaConfig, MoEConfig]

PRESETS: dict[str, Callable[[], ModelConfig]] = {
    # byte-level vocabulary: the demo trains it on real text
    "gpt-tiny": lambda: GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64),
    "gpt-small": lambda: GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128),
    # GPT-2's 50257 tokens padded to a multiple of 128, as Megatron does
    "gpt2-124m": lambda: GPTConfig(
        vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768
    ),
    "llama-tiny": lambda: LlamaConfig(
        vocab_size=256, max_seq_len=128, n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_dim=176
    ),
    "llama-small": lambda: LlamaConfig(
        vocab_size=256, max_seq_len=256, n_layer=4, n_head=8, n_kv_head=4, dim=256, ffn_dim=688
    ),
    "llama-7b": lambda: LlamaConfig(
        vocab_size=32000,
        max_seq_len=4096,
        n_layer=32,
        n_head=32,
        n_kv_head=32,
        dim=4096,
        ffn_dim=11008,
    ),
    # mixtures of experts (fxtron/models/moe.py): 4 experts, top-2, a shared expert
    "moe-tiny": lambda: MoEConfig(
        vocab_size=256, max_seq_len=128, n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_dim=96,
        n_experts=4, top_k=2, shared_ffn_dim=64,
    ),
    "mixtral-8x7b": lambda: MoEConfig(
        vocab_size=32000, max_seq_len=32768, n_layer=32, n_head=32, n_kv_head=8, dim=4096,
        ffn_dim=14336, n_experts=8, top_k=2, rope_theta=1e6, aux_loss_coef=0.02,
    ),
    # DeepSeekMoE-16B's shape: 64 fine-grained experts, top-6, two experts' worth shared
    # (its attention is plain multi-head; DeepSeek-V3's MLA is not this model's)
    "deepseek-moe-16b": lambda: MoEConfig(
        vocab_size=102400, max_seq_len=4096, n_layer=28, n_head=16, n_kv_head=16, dim=2048,
        ffn_dim=1408, n_experts=64, top_k=6, shared_ffn_dim=2816, aux_loss_coef=0.001,
    ),
}


def list_presets() -> list[str]:
    """The preset names, in registry order."""
    return list(PRESETS)


def config(name: str) -> ModelConfig:
    """The config of preset `name`; raises ParallelizeError naming the presets if unknown."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise ParallelizeError(
            f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
    return make()


def build(
    name: str, *, device: torch.device | str | None = None, seed: int | None = 0
) -> nn.Module:
    """Construct the model of preset `name`.

    device: where parameters are created; "meta" gives shapes without allocating memory.
    seed: when not None, torch is seeded before construction, so the same name, seed and
    device type give identical weights in every process.
    """
    cfg = config(name)
    model_cls = GPT if isinstance(cfg, GPTConfig) else MoETransformer if isinstance(cfg, MoEConfig) else Llama
    if seed is not None:
        torch.manual_seed(seed)
    if device is None:
        return model_cls(cfg)
    with torch.device(device):
        return model_cls(cfg)


def example_inputs(
    name: str,
    batch: int = 2,
    seq: int = 16,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (idx, targets), each (batch, seq) int64 ids < vocab, targets = idx shifted by one.

    Drawn from a private generator seeded with `seed` (the global RNG is untouched), so every
    process gets the same batch.
    """
    cfg = config(name)
    max_seq = cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_seq_len
    if not 1 <= seq <= max_seq:
        raise ParallelizeError(f"example_inputs({name!r}): seq={seq} must be in [1, {max_seq}]")
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=gen)  # (B, T+1)
    idx = data[:, :-1].contiguous()  # (B, T)
    targets = data[:, 1:].contiguous()  # (B, T)
    if device is not None:
        idx, targets = idx.to(device), targets.to(device)
    return idx, targets


def num_parameters(model: nn.Module) -> int:
    """Number of parameter elements, counting a shared (tied) Parameter once; works on meta."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
