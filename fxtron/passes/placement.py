"""Passes: placements — how a value is laid out over the tp axis.

Replicate: every tp rank holds the whole value. Shard(dim, interleave): each rank holds 1/tp of
`dim`; with interleave k the dim is k equal blocks (a fused [q|k|v] projection: k=3) and each
rank holds its slice of every block, so splitting the local value into k gives whole heads of
each of q, k and v; with proportions (2, 1, 1) the blocks differ in size (Phi-3's fused qkv
under grouped-query attention) and the rank still holds its slice of each, printed S(d,2:1:1).
Partial: each rank holds a summand; the value is the sum over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxtron.runtime.shard import normalize


class Placement:
    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Replicate(Placement):
    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard(Placement):
    dim: int
    interleave: int | tuple[int, ...] = 1   # k equal blocks, or block proportions (runtime/shard.py)

    def __post_init__(self):
        if self.dim < 0:
            raise ValueError("Shard dims are stored non-negative; normalize with the tensor's ndim")
        object.__setattr__(self, "interleave", normalize(self.interleave))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        if isinstance(self.interleave, tuple):
            return f"S({self.dim},{':'.join(map(str, self.interleave))})"
        return f"S({self.dim})" if self.interleave == 1 else f"S({self.dim},x{self.interleave})"


@dataclass(frozen=True)
class Partial(Placement):
    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return "P(sum)"


REPLICATE = Replicate()
PARTIAL = Partial()


def describe(p) -> str:
    """Placements of a node: one placement, or a tuple for multi-output nodes (split)."""
    if isinstance(p, tuple):
        return "(" + ", ".join(describe(x) for x in p) + ")"
    return str(p)
