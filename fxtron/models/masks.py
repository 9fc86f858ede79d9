"""Masks the shipped models build from their inputs: packed documents (Megatron's
--reset-attention-mask), where a token attends only the tokens of its own document before it."""
from __future__ import annotations

import torch


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool from (B, T) document indices: True where query i may attend key j --
    j <= i and both in the same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids.unsqueeze(2) == document_ids.unsqueeze(1)) & causal).unsqueeze(1)


__all__ = ["document_mask"]
