"""Ops: the prefix ops of a sequence split over ranks -- what a model computes along its
sequence from one token to the next (transformers' packed documents: the position ids'
`diff`, then `(diff != 1).cumsum(-1)`, the document index of every token).

A rank holds chunks of the dim: one (block r of n, a plain split) or, load-balanced (cp,
ops/cp/layout.py), two (chunks r and 2n-1-r of 2n). Each op does the local part on every chunk and
exchanges only what crosses a chunk's edge: the last element of each chunk along the dim,
all-gathered (n x chunks values per row, where gathering the ids would move the whole
sequence).

  shard_prev(x, dim, fill, ...)   x shifted by one along dim (x[i-1]), `fill` before the first:
                                  diff(x, prepend=p) = x - shard_prev(x, dim, p)
  shard_cumsum(x, dim, ...)       the running sum of the whole dim: each chunk's own running sum
                                  plus the totals of every chunk before it

Both compute values that take no gradient (integer ids, the masks made from them); a split
value that does is refused by the lowering (passes/rules/scans.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register


def _chunks(world: int, balanced: bool, rank: int) -> list[int]:
    """The global chunk indices a rank holds, in its local order."""
    return [rank, 2 * world - 1 - rank] if balanced else [rank]


def _edges(x: Tensor, dim: int, pieces: int) -> Tensor:
    """The last element along dim of each of the `pieces` local chunks: (pieces, ...)."""
    c = x.shape[dim] // pieces
    return torch.stack([x.narrow(dim, (i + 1) * c - 1, 1) for i in range(pieces)])


def _every_edge(x: Tensor, dim: int, balanced: bool, world: int, pg) -> dict[int, Tensor]:
    """Global chunk index -> the last element along dim of that chunk, from every rank."""
    pieces = 2 if balanced else 1
    mine = _edges(x, dim, pieces)
    got = T.all_gather(mine.contiguous(), pg) if pg is not None else [mine]
    out = {}
    for r, e in enumerate(got):
        for i, chunk in enumerate(_chunks(world, balanced, r)):
            out[chunk] = e[i]
    return out


def _rank(pg) -> int:
    return pg.rank() if pg is not None else 0


@torch.library.custom_op("fxtron::shard_prev", mutates_args=())
def shard_prev(x: Tensor, dim: int, fill: Tensor, balanced: bool, world: int, group: str) -> Tensor:
    """This rank's chunks of the whole dim shifted by one: out[i] = x[i-1] along `dim`, and
    `fill` (size 1 along dim) at position 0 of the whole."""
    pg = T.resolve(group)
    T.check_world(pg, world, "shard_prev", group)
    dim = dim % x.dim()
    edges = _every_edge(x, dim, balanced, world, pg)
    pieces = 2 if balanced else 1
    c = x.shape[dim] // pieces
    fill = fill.to(x.dtype).expand_as(x.narrow(dim, 0, 1))
    parts = []
    for i, chunk in enumerate(_chunks(world, balanced, _rank(pg))):
        before = fill if chunk == 0 else edges[chunk - 1]
        parts += [before, x.narrow(dim, i * c, c - 1)]
    return torch.cat(parts, dim)


@shard_prev.register_fake
def _(x, dim, fill, balanced, world, group):
    return torch.empty_like(x)


@torch.library.custom_op("fxtron::shard_cumsum", mutates_args=())
def shard_cumsum(x: Tensor, dim: int, balanced: bool, world: int, group: str) -> Tensor:
    """This rank's chunks of cumsum(whole, dim): its chunks' own running sums plus the totals
    of every chunk before each (in the dtype torch's cumsum gives: bool and integers as int64)."""
    pg = T.resolve(group)
    T.check_world(pg, world, "shard_cumsum", group)
    dim = dim % x.dim()
    pieces = 2 if balanced else 1
    c = x.shape[dim] // pieces
    local = torch.cat([x.narrow(dim, i * c, c).cumsum(dim) for i in range(pieces)], dim)
    totals = _every_edge(local, dim, balanced, world, pg)
    parts = []
    for i, chunk in enumerate(_chunks(world, balanced, _rank(pg))):
        own = local.narrow(dim, i * c, c)
        before = sum((totals[j] for j in range(chunk)), torch.zeros_like(totals[0]))
        parts.append(own + before)
    return torch.cat(parts, dim)


@shard_cumsum.register_fake
def _(x, dim, balanced, world, group):
    return torch.empty_like(x, dtype=torch.int64 if not (x.is_floating_point() or x.is_complex()) else x.dtype)


register(OpSpec("shard_prev", axis_arg=5, forward=Comm("all_gather", "edges")))
register(OpSpec("shard_cumsum", axis_arg=4, forward=Comm("all_gather", "edges")))

__all__ = ["shard_cumsum", "shard_prev"]
