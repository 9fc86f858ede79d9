"""Passes, sharding rules: reductions."""
from __future__ import annotations

import torch

from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.passes.rules.registry import Ctx, reduced_dims, register_rule

aten = torch.ops.aten


@register_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default)
def _reduce(c: Ctx):
    node, p = c.node, c.p[0]
    t = node.target
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = reduced_dims(node)
    if p.is_partial():
        return REPLICATE, [REPLICATE]
    if not isinstance(p, Shard):
        return REPLICATE, [None]
    if p.dim in dims:
        if t in (aten.sum.dim_IntList, aten.sum.default):
            return PARTIAL, [None]
        return REPLICATE, [REPLICATE]
    d = p.dim if keep else p.dim - sum(1 for x in dims if x < p.dim)
    return Shard(d, p.interleave), [None]
