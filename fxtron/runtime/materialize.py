"""Runtime: real values for the parameters of a model built on the meta device, made module by
module so that no rank ever holds the whole model (each keeps only its shards)."""
from __future__ import annotations

import copy
import zlib

import torch


class MetaMaterializer:
    """Real values for parameters of a model built on the meta device, made module by module:
    the module that owns a parameter is copied to the CPU and initialized with its own
    `reset_parameters()` under a seed derived from (seed, module path), so every rank makes the
    same full tensor and keeps only its shard; the copy is dropped before the next module. A
    module without `reset_parameters` gets GPT-2's init: normal(0, 0.02) for matrices, ones
    for 1-d weights (norm scales), zeros for biases."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model, self.seed = model, seed
        self._owner: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    def full(self, name: str) -> torch.Tensor:
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner != self._owner:
            self._values = self._materialize(owner)
            self._owner = owner
        return self._values[leaf]

    def release(self, name: str) -> None:
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner == self._owner:
            self._values.pop(leaf, None)

    def _materialize(self, owner: str) -> dict[str, torch.Tensor]:
        module = self.model.get_submodule(owner)
        local = {n: p for n, p in module.named_parameters(recurse=False)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + zlib.crc32(owner.encode())) % 2**63)
            if hasattr(module, "reset_parameters"):
                shell = copy.copy(module)           # shallow: children stay shared and untouched
                shell._parameters = {n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                                     for n, p in local.items()}
                shell.reset_parameters()
                return {n: p.detach() for n, p in shell._parameters.items()}
            out = {}
            for n, p in local.items():
                t = torch.empty(p.shape, dtype=p.dtype)
                if p.dim() >= 2:
                    t.normal_(0.0, 0.02)
                elif n.endswith("bias"):
                    t.zero_()
                else:
                    t.fill_(1.0)
                out[n] = t
            return out


__all__ = ["MetaMaterializer"]
