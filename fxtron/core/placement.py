"""Core: placements -- how a value is laid out over the ranks of each mesh axis.

On one axis (tp, cp, ep, ...) a value is Replicate (every rank of the axis holds the whole
value), Shard(dim, interleave) (each rank holds 1/n of `dim`; with interleave k the dim is k
equal blocks, a fused [q|k|v] projection has k=3, and each rank holds its slice of every
block, so splitting a rank's piece into k gives whole heads of each of q, k and v; with
proportions (2, 1, 1) the blocks differ in size, Phi-3's fused qkv under grouped-query
attention, printed S(d,2:1:1)), or Partial (each rank holds a summand; the value is the sum
over the axis).

A value's placement on the whole mesh is a `PerAxis` of those, one entry per axis the graph
is distributed over, printed `tp:S(0,x3)` (or `tp:S(1) cp:S(2)` on two axes). A multi-output
node (split) holds a tuple of placements on each axis. The same `PerAxis` mapping carries
what each op expects of its inputs, per axis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from fxtron.core.layout import normalize

#: The mesh axes a value can be distributed over, in the order placements print.
AXES = ("tp", "cp", "ep", "dp")
#: A dim split over several axes is split over these outermost first: the sequence over cp,
#: then over tp within each cp rank's tokens (sequence parallel under context parallel).
NESTED = ("cp", "tp")


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
    interleave: int | tuple[int, ...] = 1   # k equal blocks, or block proportions (core/layout.py)
    #: blocks every rank holds whole (a parameter only: a fused projection's single key/value head
    #: under multi-query attention beside its split queries; core/layout.py). Rules never see it:
    #: such a parameter is only read through slices of its blocks (passes/tp.py)
    whole: tuple[int, ...] = ()
    #: a rank-local order (passes/rules/order.py): the rank holds the elements of `dim` that its
    #: own tokens give, in an order of its own -- a sort of its shard by a key, named by the sort
    #: node ("%sort"), or the inverse of one ("inverse %sort": a rank's positions in that order).
    #: No global layout exists, so such a value is never moved; ops that do not depend on the
    #: order across ranks take it, and the sort's inverse permutation undoes it
    order: str = ""

    def __post_init__(self):
        if self.dim < 0:
            raise ValueError("Shard dims are stored non-negative; normalize with the tensor's ndim")
        object.__setattr__(self, "interleave", normalize(self.interleave))
        object.__setattr__(self, "whole", tuple(sorted(self.whole)))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        if self.order:
            return f"S({self.dim},{'by ' if not self.order.startswith('inverse') else ''}{self.order})"
        whole = f",whole {':'.join(map(str, self.whole))}" if self.whole else ""
        if isinstance(self.interleave, tuple):
            return f"S({self.dim},{':'.join(map(str, self.interleave))}{whole})"
        return (f"S({self.dim}{whole})" if self.interleave == 1 else f"S({self.dim},x{self.interleave}{whole})")


@dataclass(frozen=True)
class Partial(Placement):
    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return "P(sum)"


REPLICATE = Replicate()
PARTIAL = Partial()


def describe(p) -> str:
    """Placements of a node on one axis: one placement, or a tuple for multi-output nodes."""
    if isinstance(p, tuple):
        return "(" + ", ".join(describe(x) for x in p) + ")"
    return str(p)


def is_sharded(p) -> bool:
    """Shard or Partial (on one axis; for a multi-output node, any of its outputs)."""
    if isinstance(p, tuple):
        return any(is_sharded(x) for x in p)
    return isinstance(p, (Shard, Partial))


def _axis_key(axis: str) -> tuple[int, str]:
    return (AXES.index(axis) if axis in AXES else len(AXES), axis)


@dataclass(frozen=True)
class PerAxis:
    """An immutable mapping mesh axis -> value (a placement, or what an op expects of its
    inputs), kept in AXES order. `with_axis` returns a new mapping."""

    items: tuple[tuple[str, Any], ...] = ()

    def get(self, axis: str, default: Any = None) -> Any:
        for a, v in self.items:
            if a == axis:
                return v
        return default

    def __contains__(self, axis: str) -> bool:
        return any(a == axis for a, _ in self.items)

    def __iter__(self) -> Iterator[str]:
        return (a for a, _ in self.items)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.items)

    def with_axis(self, axis: str, value: Any) -> "PerAxis":
        rest = {a: v for a, v in self.items if a != axis}
        rest[axis] = value
        return PerAxis(tuple(sorted(rest.items(), key=lambda kv: _axis_key(kv[0]))))

    def __str__(self) -> str:
        return " ".join(f"{a}:{describe(v)}" for a, v in self.items)


__all__ = ["AXES", "NESTED", "PARTIAL", "REPLICATE", "Partial", "PerAxis", "Placement", "Replicate", "Shard", "describe",
           "is_sharded"]
