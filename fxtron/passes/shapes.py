"""Passes: write each node's local symbolic shape (node.meta fxtron_local_shape).

Runs after every pass that changes what a rank holds; shapes are sympy expressions in the
batch and sequence symbols B and S, the sharded dims divided by their axis's size.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.axes import MeshView
from fxtron.core import layout
from fxtron.core.placement import Shard


def annotate_local_shapes(gm: fx.GraphModule, *, mesh: MeshView) -> fx.GraphModule:
    """Edits gm in place and returns it: every tensor node gets its local shape, from the
    global `val` and its placement on each axis."""
    ti = meta.info(gm)
    axes = meta.graph_axes(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = list(ti.shape(val))
            for axis in axes:
                pl = meta.placement(node, axis)
                if isinstance(pl, Shard) and mesh.size(axis) > 1:
                    shape[pl.dim] = (layout.local_size(int(shape[pl.dim]), mesh.size(axis), pl.interleave, pl.whole)
                                     if pl.whole else shape[pl.dim] / mesh.size(axis))
            meta.set(node, meta.LOCAL_SHAPE, tuple(shape))
    return gm
