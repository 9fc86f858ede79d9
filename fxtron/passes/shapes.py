"""Passes: write each node's local symbolic shape (node.meta fxtron_local_shape).

Runs last in the per-rank pipeline, after every pass that changes what a rank holds; shapes
are sympy expressions in the batch and sequence symbols B and S, with any division applied.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.compiler import meta
from fxtron.compiler.trace import info


def annotate_local_shapes(gm: fx.GraphModule) -> fx.GraphModule:
    """Edits gm in place and returns it: every tensor node gets its local shape from `val`."""
    ti = info(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            meta.set(node, meta.LOCAL_SHAPE, ti.shape(val))
    return gm
