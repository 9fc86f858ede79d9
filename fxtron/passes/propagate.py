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

import torch.fx as fx

from fxtron.core import meta
from fxtron.core.axes import MeshView
from fxtron.core.placement import REPLICATE, Placement, Replicate, Shard
from fxtron.passes.rules import order as local_order
from fxtron.passes.rules import Ctx, no_rule, rule_for, tensor_inputs


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
    _shard_params_through_views(gm, axis, placements, ctx)
    _shard_params_cut_at_every_use(gm, axis)
    meta.add_graph_axis(gm, axis)
    if layout.balanced:
        meta.add_balanced_axis(gm, axis)
    if layout.options:
        meta.set_axis_options(gm, axis, layout.options)
    return gm


def _wants(node: fx.Node, axis: str) -> set:
    """The placements `node`'s users expect of it on `axis` (None: as it comes)."""
    wants = set()
    for user in node.users:
        inputs = tensor_inputs(user)
        expects = meta.expects(user, axis) if user.op == "call_function" else ()
        wants |= {expects[i] if i < len(expects) else None for i, a in enumerate(inputs) if a is node}
    return wants


def _shard_params_through_views(gm: fx.GraphModule, axis: str, placements: dict, ctx) -> None:
    """A whole parameter passed through a chain of ops of one tensor input and one user each
    (squeezed, unsqueezed, cast, negated, exponentiated) before the one use that wants it split
    -- Qwen3-Next's depthwise conv weight, squeezed and unsqueezed again, under a conv on split
    channels; its A_log, `-A_log.float().exp()`, times a value split by heads -- is held split
    on the dim whose shard the chain's own rules carry, each op on its shard alone, to that
    want: each rank stores its slice, no scatter in forward, no all-gather of its gradient."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not meta.is_param(node) or not isinstance(placements.get(node), Replicate):
            continue
        chain, cur = [], node
        while len(cur.users) == 1:
            (user,) = cur.users
            if user.op != "call_function" or rule_for(user.target) is None or tensor_inputs(user) != [cur]:
                break
            chain.append(user)
            cur = user
        wants = _wants(cur, axis) if chain else set()
        if len(wants) != 1 or not isinstance(next(iter(wants)), Shard):
            continue
        want, saved = next(iter(wants)), {n: placements[n] for n in (node, *chain)}
        for d in range(node.meta["val"].dim()):      # (the chain's ops keep the want's blocks)
            placements[node], ruled = Shard(d, want.interleave), []
            for n in chain:
                rule = rule_for(n.target)
                r = rule(ctx(n)) if rule is not None else None
                if r is None or not isinstance(r[0], Shard) or any(
                        e is not None and e != placements[a] for a, e in zip(tensor_inputs(n), r[1])):
                    break       # (the op on its shard alone: it expects its input as it comes)
                placements[n] = r[0]
                ruled.append(r)
            if len(ruled) == len(chain) and placements[cur] == want:
                for n, (out, expects) in zip((node, *chain), [(placements[node], None), *ruled]):
                    meta.set_placement(n, axis, out)
                    if expects is not None:
                        meta.set_expects(n, axis, tuple(expects))
                for user in cur.users:
                    meta.set_expects(user, axis, tuple(None if a is cur else e
                                                       for a, e in zip(tensor_inputs(user), meta.expects(user, axis))))
                break
            placements.update(saved)


def _shard_params_cut_at_every_use(gm: fx.GraphModule, axis: str) -> None:
    """A parameter the layout leaves whole but whose every use wants the same shard of it (a
    norm's weight over the features of a column-split projection, OLMo2's q_norm) is held
    sharded: each rank stores and updates its slice, with no scatter in forward and no
    all-gather of its gradient in backward."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not meta.is_param(node) or not node.users:
            continue
        if not isinstance(meta.placement(node, axis), Replicate):
            continue
        wants = _wants(node, axis)
        if len(wants) != 1 or not isinstance(next(iter(wants)), Shard):
            continue
        want = next(iter(wants))
        meta.set_placement(node, axis, want)
        for user in node.users:
            inputs = tensor_inputs(user)
            meta.set_expects(user, axis, tuple(None if a is node else e
                                               for a, e in zip(inputs, meta.expects(user, axis))))
