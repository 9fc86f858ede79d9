"""Passes: random ops draw from the right stream -- the same numbers on every rank that holds a
replica of their output, independent ones where the output is sharded (ops/rng.py)."""
from __future__ import annotations

import torch.fx as fx

from fxtron.core import meta
from fxtron.core.placement import Shard
from fxtron.ops.rng import REPLICATED, is_random, rng_call, sharded_region, takes_region


def assign_rng_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Wrap every random op in `rng_call(region, op, ...)`: "sharded:<axes>" when its output
    is sharded over those axes (independent draws per rank), "replicated" otherwise (the same
    draws on every rank). Edits gm in place and returns it."""
    for node in list(gm.graph.nodes):
        if not is_random(node):
            continue
        axes = tuple(a for a in meta.graph_axes(gm) if _sharded(meta.placement(node, a)))
        region = sharded_region(axes) if axes else REPLICATED
        if takes_region(node):           # an op that draws inside (cp attention): told its stream
            node.kwargs = {**node.kwargs, "rng_region": region}
        else:
            node.args = (region, node.target) + tuple(node.args)
            node.target = rng_call
        meta.set(node, meta.PROVENANCE, meta.Provenance("assign_rng_regions", f"{region} random stream"))
    gm.recompile()
    return gm


def _sharded(p) -> bool:
    """Is the op's output sharded (a multi-output op's: its first, the value it draws for --
    the ring's output beside its replicated seed)?"""
    return isinstance(p[0] if isinstance(p, tuple) else p, Shard)


__all__ = ["assign_rng_regions"]
