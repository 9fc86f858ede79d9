"""Passes: propagate placements on one mesh axis through every op.

`propagate(gm, layout, mesh=...)` seeds the graph's inputs with their placement on the axis --
parameters and user inputs as `layout` says, everything else Replicate -- and gives every node
the placement its op's rule (passes/rules) computes from its inputs' placements, and the
placement each input must have (`meta.expects`); `insert_redistributions` then emits the
collective where an input's placement differs from what its consumer expects. Shapes are the
global ones from export (`val`); rules never run tensors. The pass knows no axis: tensor
parallel is one `AxisLayout` (passes/tp.py), context and expert parallel others.

An op whose inputs are all Replicate is computed redundantly on every rank of the axis and
stays Replicate: that is always correct. An op that receives a Shard or Partial input and has
no rule falls back to the same: its inputs are made whole (gathered, all-reduced), it runs
replicated and its consumers re-shard what they need. Correct, but communication Megatron would
not issue: the node is marked (meta.FALLBACK) for the summary and a warning, and with
`strict` (parallelize(..., strict=True)) it raises ParallelizeError naming the node, its module
and shapes, and how to add the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.axes import MeshView
from fxtron.errors import ParallelizeError
from fxtron.core.placement import REPLICATE, Placement, Replicate, Shard
from fxtron.passes.rules import order as local_order
from fxtron.passes.rules import Ctx, no_rule, rule_for, tensor_inputs

aten = torch.ops.aten


@dataclass(frozen=True)
class AxisLayout:
    """How a graph's inputs lie over one mesh axis, and the axis's choices.

    params: parameter name -> placement (the others are Replicate); inputs: user input index
    -> placement; gather_outputs: names of nodes whose consumers see the value Replicate
    (a colwise linear with gather_output); partials_to_sequence: a partial sum that feeds a
    token-wise op is reduce-scattered onto sequence shards instead of all-reduced (sequence
    parallel); strict: an op with no rule for its inputs' placements raises rather than fall
    back to running replicated; balanced: a shard is a rank's load-balanced chunks (cp: chunks
    r and 2n-1-r of 2n, ops/cp/layout.py) and the collectives reorder around the transfer; options:
    the axis's choices its rules read (ctx.options: cp_comm_type)."""

    axis: str
    params: Mapping[str, Placement] = field(default_factory=dict)
    inputs: Mapping[int, Placement] = field(default_factory=dict)
    gather_outputs: frozenset[str] = frozenset()
    partials_to_sequence: bool = False
    strict: bool = False     # an op with no rule for sharded inputs raises instead of running replicated
    balanced: bool = False   # shards are load-balanced chunks (cp), not contiguous slices
    options: Mapping[str, object] = field(default_factory=dict)   # the axis's choices rules read (cp_comm_type)


def _seed(node: fx.Node, layout: AxisLayout) -> Placement:
    spec = meta.get(node, meta.INPUT)
    if spec is None:
        return REPLICATE
    if spec.kind == "parameter":
        return layout.params.get(spec.target, REPLICATE)
    if spec.kind == "user":
        return layout.inputs.get(spec.index, REPLICATE)
    return REPLICATE


def propagate(gm: fx.GraphModule, layout: AxisLayout, *, mesh: MeshView) -> fx.GraphModule:
    """Give every node its placement on `layout.axis` and every call the placements it
    expects of its tensor inputs there. Edits gm in place and returns it.

    With `partials_to_sequence` (sequence parallel), partial sums that feed token-wise ops
    (residual adds, norms, dropout) are reduce-scattered onto sequence shards instead of
    all-reduced, and those ops run on 1/n of the tokens (Korthikanti et al. 2022); a colwise
    linear then gathers them."""
    axis, size = layout.axis, mesh.size(layout.axis)
    ti = meta.info(gm)
    placements: dict[fx.Node, object] = {}
    grad = meta.carries_grad(gm)

    def ctx(node: fx.Node) -> Ctx:
        return Ctx(node, placements, axis=axis, size=size, trace=ti,
                   partials_to_sequence=layout.partials_to_sequence, balanced=layout.balanced,
                   options=layout.options, grad=grad)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placements[node] = _seed(node, layout)
            meta.set_placement(node, axis, placements[node])
            continue
        if node.op == "output":
            meta.set_expects(node, axis, tuple(REPLICATE for _ in ctx(node).p))
            continue
        if node.op != "call_function":
            if node.op == "get_attr":
                placements[node] = REPLICATE
            continue
        c = ctx(node)
        rule = rule_for(node.target)
        ruled = rule(c) if rule is not None else None     # a rule returns None for placements it has no way for
        if ruled is not None and not local_order.is_aware(node.target):
            ruled = local_order.carry(c, *ruled)           # a rank-local order: carried, or an error
        if ruled is None:
            if any(local_order.ordered(p) for p in c.p):
                raise local_order.refused(c, "has no rule that keeps the order of")
            replicated = all(isinstance(p, Replicate) for p in c.p)
            if not replicated and layout.strict:
                raise no_rule(node, c.p, axis=axis)
            if not replicated:       # the fallback: inputs made whole, the op run replicated
                meta.set(node, meta.FALLBACK, axis)
            val = node.meta.get("val")
            out = tuple(REPLICATE for _ in val) if isinstance(val, (list, tuple)) else REPLICATE
            expects = [None if replicated else REPLICATE] * len(c.p)
        else:
            out, expects = ruled
        if node.name in layout.gather_outputs and isinstance(out, Shard):
            meta.set_redistribute_out(node, axis, REPLICATE)
            placements[node] = REPLICATE       # what every consumer sees
        else:
            placements[node] = out
        if out is not None:
            meta.set_placement(node, axis, out)
        meta.set_expects(node, axis, tuple(expects))
    _shard_params_cut_at_every_use(gm, axis, lambda node, placed: Ctx(
        node, placed, axis=axis, size=size, trace=ti, partials_to_sequence=layout.partials_to_sequence,
        balanced=layout.balanced, options=layout.options, grad=grad))
    meta.add_graph_axis(gm, axis)
    if layout.balanced:
        meta.add_balanced_axis(gm, axis)
    if layout.options:
        meta.set_axis_options(gm, axis, layout.options)
    return gm


def _shard_params_cut_at_every_use(gm: fx.GraphModule, axis: str, ctx) -> None:
    """A parameter the layout leaves whole but whose every use wants the same shard of it (a
    norm's weight over the features of a column-split projection, OLMo2's q_norm) is held
    sharded: each rank stores and updates its slice, with no scatter in forward and no
    all-gather of its gradient in backward. The same through ops that read the parameter alone
    and keep a shard of it (casts, exp, neg, squeeze / unsqueeze, transposes: Mamba's
    -exp(A_log.float()), conv1d.weight.squeeze(1) ... unsqueeze(1), dt_proj.bias[:, None]):
    those ops then run on the rank's slice, as their rules say they may."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not meta.is_param(node) or not node.users:
            continue
        if not isinstance(meta.placement(node, axis), Replicate):
            continue
        direct = {e for u in node.users if u.op == "call_function"
                  for a, e in zip(tensor_inputs(u), meta.expects(u, axis)) if a is node and isinstance(e, Shard)}
        nd = node.meta["val"].dim()
        for want in [*direct, *(Shard(d, k, w) for d in range(nd) for k, w in _layouts_wanted(node, axis))]:
            cut = _cut_through(node, want, axis, ctx)
            if cut is not None:
                _hold_sharded(node, want, cut, axis)
                break


def _layouts_wanted(param: fx.Node, axis: str, hops: int = 8) -> list[tuple]:
    """The (interleave, whole) of every shard the ops a few steps after `param` want of what
    they read (a fused projection's blocks the conv over its channels wants its weight in),
    the plain contiguous split first."""
    out, frontier, seen = [(1, ())], [param], {param}
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.op != "call_function" or user in seen:
                    continue
                seen.add(user)
                for a, e in zip(tensor_inputs(user), meta.expects(user, axis)):
                    if a is n and isinstance(e, Shard) and (e.interleave, e.whole) not in out:
                        out.append((e.interleave, e.whole))
                nxt.append(user)
        frontier = nxt
    return out


def _cut_through(param: fx.Node, want: Shard, axis: str, ctx):
    """Placed `want`, does every use of `param` -- directly or through ops reading it alone --
    end at an op that expects exactly that shard of what it reads? Then ({op reading the
    parameter alone: (its placement, its expects)}, [(terminal op, the value it reads)]), else
    None."""
    hyp: dict[fx.Node, Placement] = {param: want}
    chain: dict[fx.Node, tuple] = {}
    ends: list[tuple[fx.Node, fx.Node]] = []
    stack = [param]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in chain:
                continue
            if user.op != "call_function":
                return None
            inputs = tensor_inputs(user)
            expects = meta.expects(user, axis)
            mine = [i for i, a in enumerate(inputs) if a is n]
            if all(i < len(expects) and expects[i] == hyp[n] for i in mine):
                ends.append((user, n))
                continue
            if not all(a in hyp for a in inputs) or not isinstance(user.meta.get("val"), torch.Tensor):
                return None
            rule = rule_for(user.target)
            c = ctx(user, {**{a: hyp[a] for a in inputs}})
            try:
                ruled = rule(c) if rule is not None else None
            except ParallelizeError:
                return None
            if ruled is None or any(e is not None and e != hyp[a] for a, e in zip(inputs, ruled[1])):
                return None             # it would move the shard: not a use that keeps it
            if not isinstance(ruled[0], Shard):
                if ruled[0] != meta.placement(user, axis):   # reads only its dtype (new_zeros): unchanged
                    return None
                ends.append((user, n))
                continue
            hyp[user] = ruled[0]
            chain[user] = ruled
            stack.append(user)
    return (chain, ends) if ends else None


def _hold_sharded(param: fx.Node, want: Shard, cut, axis: str) -> None:
    chain, ends = cut
    meta.set_placement(param, axis, want)
    for n, (out, expects) in chain.items():
        meta.set_placement(n, axis, out)
        meta.set_expects(n, axis, tuple(expects))
    for user, n in ends:
        inputs = tensor_inputs(user)
        meta.set_expects(user, axis, tuple(None if a is n else e for a, e in zip(inputs, meta.expects(user, axis))))
