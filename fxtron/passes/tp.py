"""Passes, tensor parallel: what the tp axis adds to the generic SPMD passes -- its layout (the
plan's parameter placements, the colwise linears whose output is gathered, sequence parallel's
reduce-scatters) and the one rewrite Megatron's row-parallel linear needs before propagation
(its bias added after the all-reduce). The plan itself is passes/tp_plan.py; the vocab-parallel
embedding and cross entropy are lowerings beside their rules (passes/rules/layers.py)."""
from __future__ import annotations

import operator

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


def _fake_call(target, args: tuple, like: fx.Node):
    """A call's fake value, computed on its inputs' fake values in the graph's fake mode."""
    from torch._guards import detect_fake_mode
    import torch.utils._pytree as pytree
    vals = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, args)
    mode = detect_fake_mode([like.meta["val"]])
    with mode:
        return target(*vals)


def _call(g: fx.Graph, target, args: tuple, like: fx.Node, why: str) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["val"] = _fake_call(target, args, like)
    for k in ("stack_trace", "nn_module_stack", meta.MODULE):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    meta.set(n, meta.PROVENANCE, meta.Provenance("split_fused_parts", why))
    return n


def split_fused_parts(gm: fx.GraphModule, plan: TPPlan) -> fx.GraphModule:
    """A fused projection some of whose parts every rank keeps whole (its weight's placement
    holds `whole` blocks: GPTBigCode's key and value head beside its split query heads) becomes
    one linear per run of parts split alike, over a slice of the weight (and bias): the query
    linear column-split, the key/value one whole on every rank; the ops between the linear and
    the split of its parts are replayed on each. The weight stays one parameter, held as its
    split blocks' slices and its whole blocks entire (core/layout.py). Edits gm in place and
    returns it."""
    from fxtron.core import layout
    from fxtron.passes.tp_plan import fused_split
    g = gm.graph
    nodes = {n.name: n for n in g.nodes}
    for path, style in plan.styles.items():
        layer = plan.layers[path]
        pl = plan.params.get(layer.weight)
        if not (isinstance(style, Colwise) and layer.kind == "linear" and getattr(pl, "whole", ())):
            continue
        linear = nodes[layer.node]
        x, w = linear.args[:2]
        b = linear.args[2] if len(linear.args) > 2 else None
        chain, split = fused_split(linear)
        sizes = layout.block_sizes(layer.out_features, pl.interleave)
        runs: list[list[int]] = []              # consecutive parts split alike
        for i in range(len(sizes)):
            if runs and (runs[-1][-1] in pl.whole) == (i in pl.whole):
                runs[-1].append(i)
            else:
                runs.append([i])
        parts: dict[int, fx.Node] = {}
        start = 0
        with g.inserting_before(split):
            for run in runs:
                end = start + sum(sizes[i] for i in run)
                why = f"{path}: parts {run} ({'whole on every rank' if run[0] in pl.whole else 'split over tp'})"
                ws = _call(g, aten.slice.Tensor, (w, 0, start, end), linear, why)
                args = (x, ws) + ((_call(g, aten.slice.Tensor, (b, 0, start, end), linear, why),) if b is not None else ())
                y = _call(g, aten.linear.default, args, linear, why)
                for op in chain:
                    y = _call(g, op.target, (y, *op.args[1:]), op, why)
                if len(run) == 1:
                    parts[run[0]] = y
                else:
                    cut = _call(g, aten.split_with_sizes.default, (y, [sizes[i] for i in run], -1), split, why)
                    for j, i in enumerate(run):
                        parts[i] = _call(g, operator.getitem, (cut, j), split, why)
                start = end
        for user in list(split.users):
            user.replace_all_uses_with(parts[user.args[1]])
            g.erase_node(user)
        for n in [split, *reversed(chain), linear]:
            g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


__all__ = ["AXIS", "split_fused_parts", "split_row_bias", "tp_layout"]
