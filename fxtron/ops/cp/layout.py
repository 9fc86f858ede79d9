"""Ops, context parallel, the layout: which tokens a cp rank holds under Megatron's load balancing.

A sequence of F tokens over n cp ranks is viewed as 2n equal chunks and rank r holds chunks r
and 2n-1-r, in that order (Megatron's get_batch_on_this_cp_rank): under a causal mask chunk i
attends to i+1 chunks, so every rank's queries see 2n+1 chunks of keys (`score_elements`).
`positions` gives a rank's tokens; `document_order` and `document_positions` the same split of
packed documents, each row reordered by the chunk of its document a token falls in (Megatron's
THD load balancing, passes/cp_documents.py). The op `zigzag` reorders a dim so that a plain
split over n ranks gives this layout (chunks in the order 0, 2n-1, 1, 2n-2, ...), and its
inverse restores the natural order after an all-gather. A dim of k blocks (batch and sequence
folded into one) is reordered block by block. It moves no data between ranks.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.ops.registry import OpSpec, register


def chunk_order(world: int) -> list[int]:
    """The chunks of a load-balanced dim in the order the ranks hold them: rank r's pair
    (r, 2*world-1-r) at position 2r, 2r+1. world=2: [0, 3, 1, 2]."""
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


def positions(seq: int, world: int, rank: int) -> Tensor:
    """The global positions of the tokens cp rank `rank` of `world` holds of a sequence of
    `seq`: chunks rank and 2*world-1-rank of 2*world. seq=8, world=2, rank=0: [0, 1, 6, 7]."""
    if seq % (2 * world):
        raise ValueError(f"a sequence of {seq} does not split into 2 x cp = {2 * world} chunks")
    c = seq // (2 * world)
    a, b = rank * c, (2 * world - 1 - rank) * c
    return torch.cat([torch.arange(a, a + c), torch.arange(b, b + c)])


def document_order(documents: Tensor, world: int) -> Tensor:
    """(B, S) int64: each row of token positions reordered by the chunk of its document a token
    falls in, stably (Megatron's THD load balancing without padding, passes/cp_documents.py). A
    token at offset o of a document of L tokens (the tokens of the row with its id) is in chunk
    floor(2 world o / L); the load-balanced split of the reordered row then gives rank r about
    chunks r and 2 world - 1 - r of every document. documents=[[0, 0, 0, 0, 1, 1, 1, 1]],
    world=2: [[0, 4, 1, 5, 2, 6, 3, 7]]."""
    rows = []
    for row in documents:
        _, doc, counts = torch.unique(row, return_inverse=True, return_counts=True)
        grouped = torch.argsort(doc, stable=True)                 # each document's tokens, in order
        start = (torch.cumsum(counts, 0) - counts)[doc[grouped]]
        offset = torch.empty_like(grouped)
        offset[grouped] = torch.arange(row.numel(), device=row.device) - start
        chunk = torch.div(2 * world * offset, counts[doc], rounding_mode="floor")
        rows.append(torch.argsort(chunk, stable=True))
    return torch.stack(rows) if rows else documents.new_zeros(documents.shape, dtype=torch.long)


def document_positions(documents: Tensor, world: int, rank: int) -> Tensor:
    """(B, S / world): the row positions of the tokens cp rank `rank` holds when each row is
    reordered by its documents (`document_order`), in the order the rank holds them."""
    pick = positions(documents.shape[1], world, rank).to(documents.device)
    return document_order(documents, world)[:, pick]


def _reorder(x: Tensor, dim: int, blocks: int, world: int, order: list[int]) -> Tensor:
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % (blocks * 2 * world):
        raise ValueError(f"fxtron::zigzag: dim {dim} of size {size} does not split into {blocks} block(s) of "
                         f"2 x cp = {2 * world} chunks")
    idx = torch.tensor(order, device=x.device)
    y = x.unflatten(dim, (blocks, 2 * world, size // (blocks * 2 * world)))
    return y.index_select(dim + 1, idx).flatten(dim, dim + 2)


def _order(world: int, inverse: bool) -> list[int]:
    order = chunk_order(world)
    if not inverse:
        return order
    back = [0] * len(order)
    for i, c in enumerate(order):
        back[c] = i
    return back


@torch.library.custom_op("fxtron::zigzag", mutates_args=())
def zigzag(x: Tensor, dim: int, blocks: int, world: int, inverse: bool) -> Tensor:
    """Reorder `dim` (k=`blocks` blocks, each 2*world chunks) so that a plain split over
    `world` ranks gives the load-balanced layout (inverse=False), or back to natural order
    (inverse=True). Backward: the opposite reordering of the gradient."""
    if world == 1:
        return x.clone()
    return _reorder(x, dim, blocks, world, _order(world, inverse))


@zigzag.register_fake
def _(x, dim, blocks, world, inverse):
    return torch.empty_like(x)


def _zigzag_bwd(ctx, grad):
    return zigzag(grad, ctx.dim, ctx.blocks, ctx.world, not ctx.inverse), None, None, None, None


def _zigzag_setup(ctx, inputs, output):
    _, ctx.dim, ctx.blocks, ctx.world, ctx.inverse = inputs


zigzag.register_autograd(_zigzag_bwd, setup_context=_zigzag_setup)
register(OpSpec("zigzag"))


def score_elements(seq: int, world: int, rank: int, *, balanced: bool = True) -> int:
    """The causal attention scores cp rank `rank` of `world` needs per (batch, head) over a
    sequence of `seq`: a query at position p attends p + 1 keys. Under the load-balanced split
    every rank needs the same; under a contiguous split (`balanced=False`, rank r holds block r
    of seq/world tokens) the last rank needs about 2*world-1 times what the first does."""
    if balanced:
        pos = positions(seq, world, rank).tolist()
    else:
        b = seq // world
        pos = range(rank * b, (rank + 1) * b)
    return sum(p + 1 for p in pos)


__all__ = ["chunk_order", "document_order", "document_positions", "positions", "score_elements", "zigzag"]
