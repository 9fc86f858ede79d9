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
class FlatShard:
    """Sharded data parallel (zero=3): the rank holds only the `index`-th of `world` equal
    pieces of its local tensor, flattened and zero-padded to `world x chunk` elements, over the
    group kind `group`: the parameter's gradient group (dp, dp-cp, expert-dp), or under hybrid
    sharding (HSDP) a shard group of it, replicated over `replicate`. The graph gathers the
    pieces of every parameter of `unit` (a layer) together just before they are used."""

    world: int
    index: int
    chunk: int
    unit: str
    group: str = ""            # the group kind gathering the pieces (the gradient group's, or an HSDP shard kind)
    replicate: str = ""        # HSDP: the group kind across which the pieces are replicas ("" without)

    @property
    def padded(self) -> int:
        return self.world * self.chunk


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
    position table looked up whole): its share is divided by their size before the sum.
    `takes_grad`: False where no gradient of the loss reaches it (used only under torch.no_grad,
    or not at all): its .grad stays None, as the model's own does, so the optimizer leaves it
    alone (no weight decay)."""

    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[AxisShard, ...] = ()
    partial_grad: tuple[str, ...] = ()
    grad_group: str = "dp"
    grad_whole_on: tuple[str, ...] = ()
    flat: FlatShard | None = None
    takes_grad: bool = True

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the rank holds between steps: its local shape, or its flat
        data-parallel piece under zero=3."""
        return (self.flat.chunk,) if self.flat is not None else self.local_shape

    def held_of(self, local: torch.Tensor) -> torch.Tensor:
        """The rank's held piece of its local tensor (itself without zero=3; a new tensor)."""
        if self.flat is None:
            return local
        f = self.flat
        flat = local.reshape(-1)
        out = flat.new_zeros(f.chunk)
        lo, hi = min(f.index * f.chunk, flat.numel()), min((f.index + 1) * f.chunk, flat.numel())
        out[:hi - lo].copy_(flat[lo:hi])
        return out

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


__all__ = ["AxisShard", "FlatShard", "LocalParam"]
