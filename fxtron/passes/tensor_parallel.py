"""Passes, tensor parallel: what the tp axis adds to the generic SPMD passes -- its layout (the
plan's parameter placements, the colwise linears whose output is gathered, sequence parallel's
reduce-scatters) and the one rewrite Megatron's row-parallel linear needs before propagation
(its bias added after the all-reduce). The plan itself is passes/tp_plan.py; the vocab-parallel
embedding and cross entropy are lowerings beside their rules (passes/rules/layers.py)."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.passes.tp_plan import Colwise, Rowwise, TPPlan
from fxtron.passes.propagate import AxisLayout

aten = torch.ops.aten
AXIS = "tp"


def tp_layout(plan: TPPlan, *, sequence_parallel: bool = False, strict: bool = False) -> AxisLayout:
    """The tp axis's AxisLayout: parameters placed as the plan says, the outputs of colwise
    linears with gather_output seen whole, sequence parallel's partial sums reduce-scattered;
    `strict`: an op with no rule raises instead of running replicated."""
    return AxisLayout(AXIS, params=plan.params, gather_outputs=plan.nodes(Colwise, gather_output=True),
                      partials_to_sequence=sequence_parallel, strict=strict)


def split_row_bias(gm: fx.GraphModule, plan: TPPlan) -> fx.GraphModule:
    """Rowwise linears add their bias after the all-reduce (Megatron 2.4): rewrite
    linear(x, W, b) -> add(linear(x, W), b) and addmm(b, x, W) -> add(mm(x, W), b).
    Edits gm in place and returns it; the plan is not changed (the rowwise layer's node is
    gone, and nothing later looks rowwise layers up by node)."""
    g = gm.graph
    nodes = {n.name: n for n in g.nodes}
    for path, style in plan.styles.items():
        layer = plan.layers[path]
        if not isinstance(style, Rowwise) or layer.bias is None or layer.kind != "linear":
            continue
        node = nodes[layer.node]
        if node.target == aten.linear.default:
            x, w, b = node.args[:3]
            new_args, target = (x, w), aten.linear.default
        elif node.target == aten.addmm.default:
            b, x, w = node.args[:3]
            new_args, target = (x, w), aten.mm.default
        else:
            continue
        with g.inserting_before(node):
            mm = g.call_function(target, new_args)
            mm.meta.update({k: v for k, v in node.meta.items()})
            meta.set(mm, meta.PROVENANCE, meta.Provenance("split_row_bias", f"rowwise {path}: bias after the all-reduce"))
            add = g.call_function(aten.add.Tensor, (mm, b))
            add.meta.update({k: v for k, v in node.meta.items()})
            meta.set(add, meta.PROVENANCE, meta.Provenance("split_row_bias", f"bias of {path}"))
        node.replace_all_uses_with(add)
        g.erase_node(node)
    gm.recompile()
    return gm


__all__ = ["AXIS", "split_row_bias", "tp_layout"]
