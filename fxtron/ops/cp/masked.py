"""Ops, context parallel, all_gather under an explicit mask (a document mask): the ring's blocks,
without the ring.

`masked_attention`: this rank's queries against the gathered keys and values, block by block
as the ring computes them (ring.py's steps: the keys of each rank's chunks in turn), so that
the blocks a document mask leaves empty are not computed; attention dropout as the ring draws
it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.ops.cp.blocks import _acc, sdpa_like_output
from fxtron.ops.cp.layout import positions
from fxtron.ops.cp.ring import _draw_seed, _drop, _normed, _step_backward, _step_forward
from fxtron.ops.registry import OpSpec, register
from fxtron.ops.rng import draws_at


@torch.library.custom_op("fxtron::masked_attention", mutates_args=())
def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, world: int, rank: int,
                     dropout_p: float = 0.0, *, rng_region: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """This cp rank's queries (its load-balanced chunks, B, H, 2c, D) against the whole
    sequence's keys and values (gathered, natural order; grouped-query heads un-repeated) under
    `mask` (the rows of the rank's queries against every key), block by block as the ring
    computes them -- the keys of each rank's chunks in turn -- so that the blocks a document
    mask leaves empty are not computed. `dropout_p`: attention dropout, each block's mask as
    the ring draws it (`keep_mask`). Returns the output, laid out as
    scaled_dot_product_attention's, the rows' log-sum-exp and the dropout seed, which backward
    reuses."""
    seed = _draw_seed(dropout_p, rng_region, q.device)
    drop = _drop(dropout_p, seed)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
    seq = k.shape[-2]
    for src in range(world):
        at = positions(seq, world, src).to(q.device)
        _step_forward(q, [k.index_select(-2, at), v.index_select(-2, at)], rank, src, world, False, mask, scale,
                      out, lse, drop)
    result = sdpa_like_output(q, v)
    result.copy_(_normed(out, mask, lse))
    return result, lse, seed


@masked_attention.register_fake
def _(q, k, v, mask, scale, world, rank, dropout_p=0.0, *, rng_region=None):
    return sdpa_like_output(q, v), q.new_empty(q.shape[:-1], dtype=_acc(q)), q.new_empty((1,), dtype=torch.int64)


def _masked_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, scale, world, rank, dropout_p = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.scale, ctx.world, ctx.rank, ctx.dropout_p = scale, world, rank, dropout_p


def _masked_backward(ctx, dout, *_):
    q, k, v, mask, out, lse, seed = ctx.saved_tensors
    drop = _drop(ctx.dropout_p, seed)
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=_acc(q), device=t.device) for t in (k, v))
    seq = k.shape[-2]
    for src in range(ctx.world):
        at = positions(seq, ctx.world, src).to(q.device)
        dkv = [torch.zeros(k.shape[:-2] + (len(at), k.shape[-1]), dtype=_acc(q), device=q.device),
               torch.zeros(v.shape[:-2] + (len(at), v.shape[-1]), dtype=_acc(q), device=q.device)]
        _step_backward(dout, q, [k.index_select(-2, at), v.index_select(-2, at)], out, lse, ctx.rank, src, ctx.world,
                       False, mask, ctx.scale, dq, dkv, drop)
        dk.index_add_(-2, at, dkv[0])
        dv.index_add_(-2, at, dkv[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


masked_attention.register_autograd(_masked_backward, setup_context=_masked_setup)
draws_at(7)(torch.ops.fxtron.masked_attention.default)
register(OpSpec("masked_attention"))


__all__ = ["masked_attention"]
