"""Ops, context parallel, a2a+p2p (Megatron's hierarchical cp): Ulysses inside groups of k
consecutive cp ranks, the ring across the groups.

`hierarchical_attention`: the all-to-all of ulysses.py inside each group turns the rank's
chunks of every head into the group's tokens of 1/k of the heads, in the ring's load-balanced
layout over the groups (layout.py's reorder); ring.py's ring runs over the groups, and the
inverse all-to-all brings the rank's chunks back. Backward is the ring's between the two.
"""
from __future__ import annotations

import types

import torch
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.cp.blocks import _acc, sdpa_like_output
from fxtron.ops.cp.layout import _order, _reorder, positions
from fxtron.ops.cp.pieces import batched
from fxtron.ops.cp.ring import _draw_seed, _drop, _ring_backward, _ring_forward
from fxtron.ops.cp.ulysses import _a2a
from fxtron.ops.registry import Comm, OpSpec, register
from fxtron.ops.rng import draws_at


def _to_heads(x: Tensor, k: int, pg) -> Tensor:
    """(B, H, 2c, D) of this rank's chunks -> (B, H/k, 2kc, D): all the group's tokens of 1/k
    of the heads, in the ring's layout over the groups. Group g of k consecutive ranks holds
    chunks gk..gk+k-1 and 2n-k-gk..2n-1-gk of 2n; the all-to-all joins them in the order
    0, 2k-1, 1, 2k-2, ... of those 2k, which zigzag's inverse over k puts in order: super-chunk
    g then super-chunk 2m-1-g of 2m (m = n/k groups), the load-balanced layout of the ring
    over the groups."""
    return _reorder(_a2a(x.contiguous(), 1, 2, k, pg), 2, 1, k, _order(k, True))


def _from_heads(x: Tensor, k: int, pg) -> Tensor:
    return _a2a(_reorder(x, 2, 1, k, _order(k, False)).contiguous(), 2, 1, k, pg)


def _group_mask(mask: Tensor | None, heads: int, k: int, inner: int, m: int, outer: int) -> Tensor | None:
    """The whole mask's rows of the group's queries (super-chunks `outer` and 2m-1-outer), and
    its heads of this rank's 1/k where it has a head per query head (a mask of any shape that
    broadcasts to the scores: 4-d, `batched`)."""
    if mask is None:
        return None
    rows = batched(mask).index_select(-2, positions(mask.shape[-2], m, outer).to(mask.device))
    if rows.shape[1] == heads and heads > 1:
        rows = rows.narrow(1, inner * heads // k, heads // k)
    return rows


@torch.library.custom_op("fxtron::hierarchical_attention", mutates_args=())
def hierarchical_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool,
                           a2a_size: int, world: int, group: str, inner: str, outer: str, dropout_p: float = 0.0,
                           *, rng_region: str | None = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """cp_comm_type="a2a+p2p" over `world` cp ranks (`group`): inside each group of `a2a_size`
    consecutive ranks (`inner`) an all-to-all turns q, k and v (the rank's load-balanced chunks
    of every head, grouped-query keys un-repeated) into the group's tokens of 1/a2a_size of the
    heads; the ring of ring_attention runs over the world / a2a_size groups (`outer`: the
    ranks at this one's place in every group), and the inverse all-to-all brings this rank's
    chunks of every head back. `mask`: the whole mask (every query against every key, in
    natural order), or None. `dropout_p`: attention dropout inside the ring, as ring_attention
    draws it. Returns the output, laid out as scaled_dot_product_attention's, and what backward
    reuses: the rows' log-sum-exp, q, k, v and the output in the head split, and the dropout
    seed."""
    pin, pout = T.resolve(inner), T.resolve(outer)
    T.check_world(T.resolve(group), world, "hierarchical_attention", group)
    T.check_world(pin, a2a_size, "hierarchical_attention", inner)
    m = world // a2a_size
    T.check_world(pout, m, "hierarchical_attention", outer)
    q2, k2, v2 = (_to_heads(t, a2a_size, pin) for t in (q, k, v))
    rows = _group_mask(mask, q.shape[1], a2a_size, pin.rank() if pin is not None else 0, m,
                       pout.rank() if pout is not None else 0)
    seed = _draw_seed(dropout_p, rng_region, q.device)
    out2, lse = _ring_forward(q2, k2, v2, rows, scale, causal, m, outer, _drop(dropout_p, seed))
    result = sdpa_like_output(q, v)
    result.copy_(_from_heads(out2, a2a_size, pin))
    return result, lse, q2, k2, v2, out2, seed


def _split_heads(x: Tensor, k: int) -> Tensor:
    shape = list(x.shape)
    shape[1] //= k
    shape[2] *= k
    return x.new_empty(shape)


@hierarchical_attention.register_fake
def _(q, k, v, mask, scale, causal, a2a_size, world, group, inner, outer, dropout_p=0.0, *, rng_region=None):
    q2 = _split_heads(q, a2a_size)
    return (sdpa_like_output(q, v), q2.new_empty(q2.shape[:-1], dtype=_acc(q)), q2,
            _split_heads(k, a2a_size), _split_heads(v, a2a_size), _split_heads(sdpa_like_output(q, v), a2a_size),
            q.new_empty((1,), dtype=torch.int64))


def _hierarchical_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, scale, causal, a2a_size, world, group, inner, outer, dropout_p = inputs
    _, lse, q2, k2, v2, out2, seed = output
    ctx.save_for_backward(q2, k2, v2, mask, out2, lse, seed)
    ctx.dropout_p = dropout_p
    ctx.scale, ctx.causal, ctx.world, ctx.group = scale, causal, world // a2a_size, outer
    ctx.a2a_size, ctx.inner, ctx.heads = a2a_size, inner, q.shape[1]


def _hierarchical_backward(ctx, dout, *_):
    q2, k2, v2, mask, out2, lse, seed = ctx.saved_tensors
    pin, pout = T.resolve(ctx.inner), T.resolve(ctx.group)
    k = ctx.a2a_size
    rows = _group_mask(mask, ctx.heads, k, pin.rank() if pin is not None else 0, ctx.world,
                       pout.rank() if pout is not None else 0)
    ring = types.SimpleNamespace(saved_tensors=(q2, k2, v2, rows, out2, lse, seed), scale=ctx.scale,
                                 causal=ctx.causal, world=ctx.world, group=ctx.group, dropout_p=ctx.dropout_p)
    dq2, dk2, dv2, *_ = _ring_backward(ring, _to_heads(dout, k, pin), None)
    dq, dk, dv = (_from_heads(t, k, pin) for t in (dq2, dk2, dv2))
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


hierarchical_attention.register_autograd(_hierarchical_backward, setup_context=_hierarchical_setup)
draws_at(11)(torch.ops.fxtron.hierarchical_attention.default)
register(OpSpec("hierarchical_attention", axis_arg=8, group_args=(9, 10), forward=Comm("all_to_all", "hierarchical"),
                backward=Comm("all_to_all", "hierarchical")))


__all__ = ["hierarchical_attention"]
