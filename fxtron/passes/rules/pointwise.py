"""Passes, sharding rules: elementwise ops, factories like x, and export's checks."""
from __future__ import annotations

import torch

from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.passes.rules.registry import Ctx, is_one, ndim, norm, register_rule, shape

aten = torch.ops.aten

_LINEAR_UNARY = {aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                 aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                 aten.type_as.default, aten.mul.Scalar, aten.div.Scalar, aten.to.device}
#: ops a partial sum passes through unreduced (casts and copies)
PARTIAL_THROUGH = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                   aten.contiguous.default, aten.alias.default, aten.detach.default, aten.to.device}
_POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.rsub.Scalar, aten.rsub.Tensor, aten.gelu.default, aten.silu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.sin.default,
    aten.cos.default, aten.abs.default, aten.erf.default, aten.reciprocal.default, aten.softplus.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.maximum.default, aten.minimum.default,
    aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.eq.Scalar, aten.ne.Scalar,
    aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.eq.Tensor, aten.ne.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.dropout.default, aten.gelu_.default,
    aten.tril.default, aten.triu.default, aten.mul_.Tensor, aten.add_.Tensor,
} | _LINEAR_UNARY
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
         aten.rand_like.default, aten.randn_like.default}


@register_rule(*_POINTWISE)
def _pointwise(c: Ctx):
    node = c.node
    out_nd = ndim(node)
    if node.target in (aten.tril.default, aten.triu.default):
        # the last two dims take part in the mask: they must be whole
        for i, p in enumerate(c.p):
            if p.is_shard() and p.dim >= out_nd - 2:
                return REPLICATE, [REPLICATE]
    shard = None
    for a, p in zip(c.inputs, c.p):
        if isinstance(p, Shard):
            shard = (p.dim + out_nd - ndim(a), p.interleave)
            break
    if shard is not None:
        d, k = shard
        expects = []
        for a, p in zip(c.inputs, c.p):
            ad = d - (out_nd - ndim(a))
            if ad < 0 or is_one(shape(a)[ad]):
                expects.append(REPLICATE)        # broadcast along the sharded dim
            else:
                expects.append(Shard(ad, k))
        return Shard(d, k), expects
    if any(p.is_partial() for p in c.p):
        # Partial sums pass through casts and copies only; anything else reduces them first,
        # right where Megatron's row-parallel linear does (one all-reduce, shared by all users;
        # with sequence parallel a reduce-scatter onto sequence shards)
        if node.target in PARTIAL_THROUGH:
            return PARTIAL, [None] * len(c.p)
        seq = c.seq_shard()
        if seq is not None:
            expects = []
            for a in c.inputs:
                d = seq.dim - (out_nd - ndim(a))
                expects.append(Shard(d) if d >= 0 and not is_one(shape(a)[d]) else REPLICATE)
            return seq, expects
        return REPLICATE, [REPLICATE] * len(c.p)
    return REPLICATE, [None] * len(c.p)


@register_rule(*_LIKE)
def _like(c: Ctx):
    p = c.p[0]
    return (p if isinstance(p, Shard) else REPLICATE), [None]


@register_rule(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default)
def _new(c: Ctx):
    """A new tensor of the sizes given (the global ones; the input lends only dtype and device):
    replicated, whatever the input's placement, and no communication for it."""
    return REPLICATE, [None] * len(c.p)


@register_rule(aten._assert_tensor_metadata.default)
def _check(c: Ctx):
    """Export's metadata asserts: no value; `localize` drops them (they carry global sizes)."""
    return None, [None] * len(c.p)


@register_rule(aten.sym_size.int)
def _sym_size(c: Ctx):
    p = c.p[0]
    if isinstance(p, Shard) and norm(c.node.args[1], ndim(c.inputs[0])) == p.dim:
        raise c.fail(f"reads the size of dim {p.dim}, which is sharded")
    return None, [None]
