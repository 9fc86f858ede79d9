"""Ops: context parallel -- the sequence split over the cp ranks with Megatron's load balancing,
and attention across the split.

The layout. A sequence of F tokens over n cp ranks is viewed as 2n equal chunks and rank r
holds chunks r and 2n-1-r, in that order (Megatron's get_batch_on_this_cp_rank): under a causal
mask chunk i attends to i+1 chunks, so every rank's queries see 2n+1 chunks of keys. `zigzag`
reorders a dim so that a plain split over n ranks gives this layout (chunks in the order 0,
2n-1, 1, 2n-2, ...), and its inverse restores the natural order after an all-gather. A dim of
k blocks (batch and sequence folded into one) is reordered block by block. It moves no data
between ranks.

Attention with the keys gathered (cp_comm_type="all_gather", Llama 3's choice):
`attention_all_gather(q, k, v, ...)` takes this rank's queries (its two chunks) and the whole
sequence's keys and values in natural order, and computes causal attention of each query chunk
against only the keys before it: the rank's score elements are (2n+1) c^2 for chunks of c
tokens, equal on every rank. Its backward is autograd's; the keys' gather before it is
`gather_from_sequence`, whose backward reduce-scatters dK and dV.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
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


def _causal_block_mask(rows: int, cols: int, offset: int, device) -> Tensor:
    """Query rows at positions offset + a against keys 0..cols-1: True where key <= query."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(offset)


def attention_all_gather(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None,
                         enable_gqa: bool, rank: int, world: int) -> Tensor:
    """Causal attention of this cp rank's queries against the whole sequence.

    In: q (B, H, 2c, D), the rank's two chunks (rank and 2*world-1-rank of 2*world, each c
    tokens); k, v (B, Hkv, 2*world*c, D), every position in natural order. Out: (B, H, 2c, D),
    equal to those rows of causal attention over the whole sequence. Each query chunk i is
    computed against keys [0, (i+1)c) only, under its block of the causal mask."""
    c = q.shape[-2] // 2
    out = sdpa_like_output(q, v)
    for half, chunk in enumerate((rank, 2 * world - 1 - rank)):
        qi = q.narrow(-2, half * c, c)
        n_keys = (chunk + 1) * c
        mask = _causal_block_mask(c, n_keys, chunk * c, q.device)
        out.narrow(-2, half * c, c).copy_(F.scaled_dot_product_attention(
            qi, k.narrow(-2, 0, n_keys), v.narrow(-2, 0, n_keys), attn_mask=mask, dropout_p=dropout_p,
            scale=scale, enable_gqa=enable_gqa))
    return out


def sdpa_like_output(q: Tensor, v: Tensor) -> Tensor:
    """An empty (B, H, Sq, Dv) output laid out as scaled_dot_product_attention lays out its own
    ((B, Sq, H, Dv) in memory): the graph may view its transpose without a copy."""
    b, h, s, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)


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


__all__ = ["attention_all_gather", "chunk_order", "positions", "score_elements", "zigzag"]
