"""Core: how one rank's parameter relates to the full one -- per mesh axis whether and how it is
sharded, over which axes its gradient is a partial sum, and which group of ranks holding
replicas of it reduces its gradient. The compiler writes these records (parameter sharding,
the last pass); the runtime slices full tensors with them, gathers full ones back, reduces
gradients and writes checkpoints by them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from fxtron.core import layout


@dataclass(frozen=True)
class AxisShard:
    """Sharded over `axis` along `dim`, with the interleave of a fused projection's parts."""

    axis: str
    dim: int
    interleave: layout.Interleave = 1
    whole: tuple[int, ...] = ()       # blocks every rank holds whole (core/layout.py)


@dataclass(frozen=True)
class LocalParam:
    """One parameter of a rank. `shards`: the axes it is split over (none: whole on this
    rank), applied in order. `partial_grad`: axes over which each rank's gradient is a partial
    sum although the weight is whole there (a norm weight on sequence shards: ("tp",)); it is
    summed over them once per step, after backward. `grad_group`: the group kind (Mesh.groups)
    whose ranks hold the same piece and reduce their gradients: "dp", or "dp-cp" with context
    parallel, whose cp ranks each hold the partial gradient of their tokens (summed over cp,
    averaged over dp, in one collective: Megatron's dp-cp buffer). `grad_whole_on`: axes of
    the grad group over which every rank computes the whole gradient, not a partial sum (a
    position table looked up whole): its share is divided by their size before the sum."""

    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[AxisShard, ...] = ()
    partial_grad: tuple[str, ...] = ()
    grad_group: str = "dp"
    grad_whole_on: tuple[str, ...] = ()

    def shard_on(self, axis: str) -> AxisShard | None:
        return next((s for s in self.shards if s.axis == axis), None)

    @property
    def sharded(self) -> bool:
        return bool(self.shards)

    def local_of(self, full: torch.Tensor, sizes: Mapping[str, int], coords: Mapping[str, int]) -> torch.Tensor:
        """This rank's piece of the full tensor (a new tensor) at mesh `coords`."""
        out = full
        for s in self.shards:
            out = layout.shard(out, s.dim, sizes[s.axis], coords[s.axis], s.interleave, s.whole)
        return out if out is not full else full.clone()


__all__ = ["AxisShard", "LocalParam"]
