"""Rules: prefix ops along a split dim -- `diff` and `cumsum` over the sequence that a model
derives its packed documents from (transformers' find_packed_sequence_indices: the position
ids' diff, then `(diff != 1).cumsum(-1)`). Along another dim each shard scans on its own; along
the split dim they lower to ops/scan.py's shard_prev / shard_cumsum, which exchange only the
chunks' edges (the ids are not gathered). The rules alone decide: values that take a gradient
there, `n > 1`, `append`, a diff without `prepend` and a cumsum with `dtype=` run replicated as
ops without a rule do (a warning; strict mode refuses), and the lowerings split only what the
rules split."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.ops import scan  # noqa: F401 - registers fxtron::shard_prev / shard_cumsum
from fxtron.passes.rules import order
from fxtron.passes.rules.registry import Ctx, ndim, norm, register_lowering, register_rule

aten = torch.ops.aten


def _diff_args(node: fx.Node):
    args = list(node.args) + [None] * (5 - len(node.args))
    n = node.kwargs.get("n", args[1] if args[1] is not None else 1)
    dim = node.kwargs.get("dim", args[2] if args[2] is not None else -1)
    return n, norm(dim, ndim(node.args[0])), node.kwargs.get("prepend", args[3]), node.kwargs.get("append", args[4])


@register_rule(aten.diff.default)
def _diff(c: Ctx):
    n, dim, prepend, append = _diff_args(c.node)
    p = c.p[0]
    if not isinstance(p, Shard) or p.interleave != 1:
        return None if any(not q.is_replicate() for q in c.p) else (REPLICATE, [None] * len(c.p))
    if p.dim != dim:                    # along another dim: each shard on its own, the edges split alike
        return p, [None] + [Shard(p.dim)] * (len(c.p) - 1)
    if n != 1 or append is not None or prepend is None or c.carries_grad(c.node.args[0]):
        return None                      # (without prepend the result is one position short: no split holds it)
    return p, [None] + [REPLICATE] * (len(c.p) - 1)      # the prepended slice: whole, it is one position


@register_rule(aten.cumsum.default)
def _cumsum(c: Ctx):
    p = c.p[0]
    if p.is_partial():
        return PARTIAL, [None]           # linear: the running sums of the summands sum to the whole's
    if not isinstance(p, Shard) or p.interleave != 1:
        return None if not p.is_replicate() else (REPLICATE, [None])
    if norm(c.node.args[1], ndim(c.node.args[0])) == p.dim and (c.node.kwargs.get("dtype") is not None
                                                                 or c.carries_grad(c.node.args[0])):
        return None                      # (a dtype= or a gradient, which the split scan does not take: replicated)
    return p, [None]


@register_lowering(aten.diff.default)
def _lower_diff(node: fx.Node, lower):
    n, dim, prepend, _ = _diff_args(node)
    p = meta.placement(node, lower.axis)          # the rule's choice: split along the dim, or not
    if not (isinstance(p, Shard) and p.dim == dim and n == 1):
        return None
    x = lower.remap(node.args[0])
    prev = lower.call(torch.ops.fxtron.shard_prev.default, (x, dim, lower.remap(prepend), lower.balanced, lower.size,
                                                          lower.axis),
                      node, p, f"the position before each of this rank's (over {lower.axis}): the chunks' edges "
                               "all-gathered")
    return lower.call(aten.sub.Tensor, (x, prev), node, p, "diff: each position less the one before it")


@register_lowering(aten.cumsum.default)
def _lower_cumsum(node: fx.Node, lower):
    dim = norm(node.args[1], ndim(node.args[0]))
    p = meta.placement(node, lower.axis)          # the rule's choice: split along the dim, or not
    if not (isinstance(p, Shard) and p.dim == dim):
        return None
    return lower.call(torch.ops.fxtron.shard_cumsum.default,
                      (lower.remap(node.args[0]), dim, lower.balanced, lower.size, lower.axis), node, p,
                      f"the running sum of the whole dim: each chunk's own plus the totals before it (over "
                      f"{lower.axis})")


def _along(node: fx.Node, at: int) -> int:
    args = list(node.args) + [None] * (at + 1 - len(node.args))
    d = node.kwargs.get("dim", args[at] if args[at] is not None else -1)
    return norm(d, ndim(node.args[0]))


@register_rule(aten.topk.default, aten.sort.default, aten.sort.stable)
def _select_along(c: Ctx):
    """topk and sort along one dim (a router's top-k experts of each token): along another dim
    than the split one each shard selects on its own, values and indices split alike; along
    the split dim of a 1-D value whose order the graph undoes, each rank sorts its own (a mixture of
    experts' copies by expert, rules/order.py); any other there (or of a partial sum) has no rule:
    the op runs replicated."""
    p = c.p[0]
    at = {aten.topk.default: 2, aten.sort.default: 1}.get(c.node.target)
    dim = _along(c.node, at) if at is not None else norm(c.node.kwargs.get("dim", -1), ndim(c.node.args[0]))
    if p.is_replicate():
        return (REPLICATE, REPLICATE), [None]
    if isinstance(p, Shard) and p.dim != dim:
        return (p, p), [None]
    return order.sort_rule(c, dim)      # along the split dim: each rank's own order, where the graph undoes it
