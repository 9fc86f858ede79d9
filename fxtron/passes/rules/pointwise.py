"""Passes, sharding rules: elementwise ops, factories like x, and export's checks."""
from __future__ import annotations

import torch

from fxtron.core import meta
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.passes.rules.registry import Ctx, expr, is_one, ndim, norm, register_rule, shape

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
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor,  # (XLM)
    aten.maximum.default, aten.minimum.default,
    aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.eq.Scalar, aten.ne.Scalar,
    aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.eq.Tensor, aten.ne.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor,
    aten.bitwise_xor.Tensor, aten.logical_xor.default, aten.dropout.default, aten.gelu_.default,
    aten.tril.default, aten.triu.default, aten.mul_.Tensor, aten.add_.Tensor, aten.div_.Tensor, aten.sub_.Tensor,
    aten.floor_divide.default, aten.div.Tensor_mode, aten.remainder.Scalar, aten.remainder.Tensor,
    aten.square.default, aten.log_sigmoid.default, aten.log1p.default, aten.expm1.default, aten.sign.default, aten.mish.default,
    aten.min.other, aten.max.other, aten.fmin.default, aten.fmax.default,     # (Apertus' xIELU: min(x, eps))
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
    if meta.writes_first(node) and c.p[c.index(node.args[0])].is_replicate():
        # add_ / mul_ / masked_fill_ into a whole value: it stays whole and the others come whole
        # (sharding it would hand the op a slice's copy; the memory's other readers keep the old value)
        return REPLICATE, [None if a is node.args[0] else REPLICATE for a in c.inputs]
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
        if node.target in PARTIAL_THROUGH or _scales_partial(c) or _sums_partials(c):
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


def _scales_partial(c: Ctx) -> bool:
    """partial * w or partial / w with w whole, the partial sum not broadcast bigger: still a
    partial sum, reduced later where it is smaller or needed (a mixture of experts' outputs
    scaled by their routing weights, then combined per token, reduced once per token)."""
    node = c.node
    if node.target not in (aten.mul.Tensor, aten.div.Tensor) or len(c.inputs) != 2:
        return False
    parts = [a for a, p in zip(c.inputs, c.p) if p.is_partial()]
    if len(parts) != 1 or not all(p.is_replicate() for a, p in zip(c.inputs, c.p) if a is not parts[0]):
        return False
    if node.target == aten.div.Tensor and node.args[0] is not parts[0]:
        return False
    return len(parts[0].users) == 1 and shape(parts[0]) == shape(node)


def _sums_partials(c: Ctx) -> bool:
    """p + q of two partial sums read nowhere else: a partial sum of the sum, reduced once (the
    attention and MLP outputs of a parallel residual, GPT-NeoX / Falcon; routed and shared
    experts, DeepSeek): one all-reduce where each alone would take its own."""
    return (c.node.target in (aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor) and len(c.inputs) == 2
            and all(p.is_partial() for p in c.p) and all(len(a.users) == 1 for a in c.inputs))


@register_rule(*_LIKE)
def _like(c: Ctx):
    p = c.p[0]
    return (p if isinstance(p, Shard) else REPLICATE), [None]


@register_rule(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default)
def _new(c: Ctx):
    """A new tensor of the sizes given (the global ones; the input lends only dtype and device).
    Its contents are the same everywhere, so any placement holds them, with no communication:
    sharded like the input where it has the input's size on the input's sharded dim (DeepSeek's
    k_states = k_nope.new_empty(B, heads, S, d), then filled per head), else replicated."""
    p, node = c.p[0], c.node
    if node.target != aten.new_empty_strided.default and isinstance(p, Shard) and p.interleave == 1:
        out = node.meta["val"]
        if out.dim() == ndim(c.inputs[0]) and expr(out.shape[p.dim]) == expr(shape(c.inputs[0])[p.dim]):
            return Shard(p.dim), [None] * len(c.p)
    return REPLICATE, [None] * len(c.p)


@register_rule(aten.copy_.default)
def _copy_(c: Ctx):
    """copy_(dst, src) writes src into dst in place: dst keeps its placement (redistributing it
    would write into a copy) and src comes as dst lies, broadcast dims replicated."""
    dst, src = c.node.args[:2]
    pd = c.p[c.index(dst)]
    if pd.is_partial():
        raise c.fail("writes into a partial sum (each rank's addend): no placement of the source makes that the "
                     "write of one process")
    want = REPLICATE
    if isinstance(pd, Shard):
        d = pd.dim - (ndim(dst) - ndim(src))
        want = REPLICATE if d < 0 or is_one(shape(src)[d]) else Shard(d, pd.interleave)
    return pd, [None if a is dst else want for a in c.inputs]


@register_rule(aten._assert_tensor_metadata.default)
def _check(c: Ctx):
    """Export's metadata asserts: no value; `localize` drops them (they carry global sizes)."""
    return None, [None] * len(c.p)


@register_rule(aten.sym_size.int)
def _sym_size(c: Ctx):
    """A size read at run time is the global one in the graph, also of a sharded dim (the
    sequence length of cp-split tokens): localize multiplies the rank's size back."""
    p = c.p[0]
    if isinstance(p, Shard) and norm(c.node.args[1], ndim(c.inputs[0])) == p.dim and p.interleave != 1:
        raise c.fail(f"reads the size of dim {p.dim}, which is sharded in {p.interleave} blocks")
    return None, [None]
