"""Passes: write each node's local symbolic shape (node.meta fxtron_local_shape).

Runs last in the per-rank pipeline, after every pass that changes what a rank holds; shapes
are sympy expressions in the batch and sequence symbols B and S, with the tp division applied
to the sharded dim.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.compiler import meta
from fxtron.compiler.trace import info
from fxtron.passes.placement import Shard


def annotate_local_shapes(gm: fx.GraphModule, *, tp: int = 1) -> fx.GraphModule:
    """Edits gm in place and returns it: every tensor node gets its local shape, from the
    global `val` and its placement."""
    ti = info(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = list(ti.shape(val))
            pl = meta.get(node, meta.PLACEMENT)
            if isinstance(pl, Shard) and tp > 1:
                shape[pl.dim] = shape[pl.dim] / tp
            meta.set(node, meta.LOCAL_SHAPE, tuple(shape))
    return gm
