"""Passes, sharding rules: reductions."""
from __future__ import annotations

import torch
import torch.fx as fx

import fxtron.ops  # noqa: F401 - torch.ops.fxtron.batch_*

from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.passes.rules.registry import Ctx, ndim, norm, reduced_dims, register_lowering, register_rule

aten = torch.ops.aten
_SUM_OR_MEAN = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}
_MEANS = {aten.mean.dim, aten.mean.default}


@register_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
               aten.amin.default, aten.logsumexp.default)
def _reduce(c: Ctx):
    """A sum or mean is linear: of a partial sum it stays partial, and over a sharded dim it
    becomes one (each rank's part; a mean divides by the whole count, see _mean_over_shards),
    so a norm's statistic over a split width costs an all-reduce of one value per row, not an
    all-gather of the rows. A max, min or logsumexp over other dims keeps the shard (an
    attention's per-head statistics, gpt-oss's sinks); over a sharded dim it gathers first."""
    node, p = c.node, c.p[0]
    t = node.target
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = reduced_dims(node)
    if p.is_partial():
        return (PARTIAL, [None]) if t in _SUM_OR_MEAN else (REPLICATE, [REPLICATE])
    if not isinstance(p, Shard):
        return REPLICATE, [None]
    if p.dim in dims:
        if t in _SUM_OR_MEAN:
            return PARTIAL, [None]
        return REPLICATE, [REPLICATE]
    d = p.dim if keep else p.dim - sum(1 for x in dims if x < p.dim)
    return Shard(d, p.interleave), [None]


@register_rule(aten.var.dim, aten.var.correction, aten.std.dim, aten.std.correction)
def _spread(c: Ctx):
    """A variance or standard deviation over dims the shard is not on (xLSTM's per-head group
    norm over each head's features): each rank's rows on their own, split alike; over the split
    dim, or of a partial sum, the input is gathered first."""
    node, p = c.node, c.p[0]
    if p.is_replicate():
        return REPLICATE, [None]
    dims = reduced_dims(node)
    if not isinstance(p, Shard) or p.dim in dims:
        return REPLICATE, [REPLICATE]
    keep = node.kwargs.get("keepdim", node.args[3] if node.target in (aten.var.dim, aten.std.dim)
                           and len(node.args) > 3 else False)
    d = p.dim if keep else p.dim - sum(1 for x in dims if x < p.dim)
    return Shard(d, p.interleave), [None]


@register_rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _extreme_along(c: Ctx):
    """max / min along a dim (values and indices) and argmax / argmin: over a dim the shard is
    not on, each rank's rows on their own, every output split alike; over the split dim (or
    all dims), or of a partial sum, the input is gathered first."""
    node, p = c.node, c.p[0]
    nd = ndim(c.inputs[0])
    multi = node.target in (aten.max.dim, aten.min.dim)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    whole = (REPLICATE, REPLICATE) if multi else REPLICATE
    if p.is_replicate():
        return whole, [None]
    if not isinstance(p, Shard) or dim is None or norm(dim, nd) == p.dim:
        return whole, [REPLICATE]
    d = p.dim if keep or norm(dim, nd) > p.dim else p.dim - 1
    out = Shard(d, p.interleave)
    return ((out, out) if multi else out), [None]


@register_lowering(*_MEANS)
def _mean_over_shards(node, lower):
    """A mean over a dim split evenly over the axis: this rank's mean divided by the axis size,
    so that the partial values sum to the whole mean."""
    p = lower.placement(node.args[0])
    if not (isinstance(p, Shard) and p.dim in reduced_dims(node)):
        return None
    args = [lower.remap(a) if isinstance(a, fx.Node) else a for a in node.args]
    local = lower.call(node.target, args, node, PARTIAL, f"mean over dim {p.dim}, split over {lower.axis}: this "
                       "rank's part", kwargs=dict(node.kwargs))
    return lower.call(aten.div.Scalar, (local, lower.size), node, PARTIAL,
                      f"... divided by {lower.axis}={lower.size}: a partial sum of the whole mean")


@register_rule(torch.ops.fxtron.batch_all_reduce.default, torch.ops.fxtron.batch_scale.default,
               torch.ops.fxtron.batch_gather.default, torch.ops.fxtron.batch_offset.default)
def _over_the_batch(c: Ctx):
    """A statistic summed over the data-parallel ranks, or scaled by the step's pieces, in-batch
    negatives gathered over dp or targets offset to the rank's rows (passes/statistics.py): over
    the batch, which no other axis splits, so it lies on any other axis as its input does."""
    return c.p[0], [None]


@register_rule(torch.ops.fxtron.global_statistic.default)
def _global_statistic(c: Ctx):
    """An input statistic's global value, which the runtime gives every rank whole."""
    return REPLICATE, [None]
