"""Passes: activation recomputation, as Megatron's --recompute-granularity / --recompute-method /
--recompute-num-layers (Korthikanti et al. 2022).

`mark_recompute(gm, granularity, method, layers)` marks the regions of one rank's graph (a
pipeline stage's, or the whole per-rank graph) whose activations are dropped after forward and
computed again in backward; it writes node.meta `fxtron_recompute` (the region's label) and
moves nothing but independent nodes, so `pm.graph(rank)` shows every recomputed node where it
runs. The program's binding turns each region into one checkpointed call (ops/recompute.py).

- "selective": each attention core -- from the scores' matmul to the matmul with V (scores,
  softmax, its dropout and mask, the probabilities), or one attention op (scaled dot-product,
  context parallel's ring) -- whose activations grow with s^2 (the 5as/h term), recomputed from
  q, k and v, which the layer keeps anyway.
- "full": whole transformer layers keep only their input. method "uniform": the graph's layers
  in groups of `layers` consecutive ones, one region per group (its input kept); "block": the
  first `layers` layers of the graph, one region each, the rest not recomputed. A pipeline
  stage's graph is one model chunk, so both count from the stage's first layer, as Megatron's
  TransformerBlock does.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxtron.core import meta, opsets
from fxtron.errors import ParallelizeError
from fxtron.ops.rng import rng_call, takes_region
from fxtron.passes.rules import CASTS
from fxtron.passes.pp import classify, find_layer_list

aten = torch.ops.aten

_MATMULS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
_VIEWS = opsets.RESHAPES | opsets.EXPANDS | opsets.UNSQUEEZES
_SCORE_OPS = CASTS | _VIEWS | {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.masked_fill.Scalar,
                               aten.where.self, aten.sub.Tensor, aten.tanh.default}   # tanh: softcapped scores (Gemma 2)
_PROB_OPS = CASTS | _VIEWS | {aten.dropout.default, aten.native_dropout.default, aten.mul.Tensor, operator.getitem}
_ATTENTION_OPS = {aten.scaled_dot_product_attention.default}


def _target(node: fx.Node):
    """The op a node runs (the random op itself for an rng_call)."""
    if node.op == "call_function" and node.target is rng_call:
        return node.args[1]
    return node.target if node.op == "call_function" else None


def _single_user(node: fx.Node) -> fx.Node | None:
    users = [u for u in node.users if not (_target(u) is operator.getitem and not u.users)]
    return users[0] if len(users) == 1 else None


def _attention_core(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(first, last) node of the attention core around `node`, if it is one: an attention op
    (with the getitems of its outputs), or a softmax over scores from a matmul whose
    probabilities (cast, dropped out) go into a matmul."""
    t = _target(node)
    if t in _ATTENTION_OPS or takes_region(node) or t == torch.ops.fxtron.ring_attention.default:
        last, pending = node, {u for u in node.users if _target(u) is operator.getitem}
        while pending:                     # its outputs' getitems, up to the last in graph order
            last = last.next
            pending.discard(last)
        return node, last
    if t not in _SOFTMAX:
        return None
    first = _scores(node.args[0])
    if first is None:
        return None
    last = node
    while (nxt := _single_user(last)) is not None and _target(nxt) in _PROB_OPS:
        last = nxt
    nxt = _single_user(last)
    if nxt is None or _target(nxt) not in _MATMULS:
        return None
    return first, nxt


def _scores(node, depth: int = 8) -> fx.Node | None:
    """The matmul that computed the scores `node` is made of (through scaling, masking, casts and
    views, each used once), if any."""
    if not isinstance(node, fx.Node) or depth == 0:
        return None
    if _target(node) in _MATMULS:
        return node
    if _target(node) not in _SCORE_OPS or len(node.users) != 1:
        return None
    for a in node.args:
        if (found := _scores(a, depth - 1)) is not None:
            return found
    return None


def _mark(gm: fx.GraphModule, first: fx.Node, last: fx.Node, label: str, *, hoist: bool) -> None:
    """Mark the run of nodes first..last as region `label`. With `hoist`, the nodes of the run
    that do not depend on `first` move before it (the value, mask or view computations that
    merely sit between): the region keeps what it computes from its first node, and reads the
    rest as inputs."""
    nodes, on = [], False
    for n in gm.graph.nodes:
        on = on or n is first
        if on:
            nodes.append(n)
        if n is last:
            break
    if hoist:
        dependent = {first}
        for n in nodes[1:]:
            if any(a in dependent for a in n.all_input_nodes):
                dependent.add(n)
        for n in nodes:
            if n not in dependent:
                first.prepend(n)
        nodes = [n for n in nodes if n in dependent]
    for n in nodes:
        if n.op != "call_function":
            raise ParallelizeError(f"recompute region {label!r} would hold %{n.name} ({n.op}); fxtron recomputes runs "
                                   "of operations only")
        meta.set(n, meta.RECOMPUTE, label)


def _layer_spans(gm: fx.GraphModule, prefix: str | None) -> list[tuple[str, fx.Node, fx.Node]]:
    """(layer, first node, last node) of each of the graph's transformer layers (the entries of
    `prefix`, the model's layer list; found on gm when None), in order: the first and last
    activation each layer computes (a value of parameters or constants that a pipeline stage
    copies from an earlier layer does not start that layer there)."""
    try:
        found, units = find_layer_list(gm)
    except ParallelizeError:
        raise ParallelizeError("recompute='full' recomputes whole transformer layers (the entries of a ModuleList "
                               "such as blocks.0, blocks.1, ...), and this graph has none: use recompute='selective' "
                               "or None") from None
    prefix = prefix or found
    kind = classify(gm)
    spans: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        path = meta.get(n, meta.MODULE) or ""
        if n.op == "call_function" and kind.get(n) == "act" and path.startswith(prefix + "."):
            layer = f"{prefix}.{path[len(prefix) + 1:].split('.', 1)[0]}"
            span = spans.setdefault(layer, [n, n])
            span[1] = n
    return sorted(((u, *sp) for u, sp in spans.items()), key=lambda t: int(t[0].rsplit(".", 1)[1]))


def mark_recompute(gm: fx.GraphModule, granularity: str, method: str | None = None,
                   layers: int | None = None, *, prefix: str | None = None) -> list[str]:
    """Mark gm's recomputed regions (see the module docstring); returns their labels in order.
    `prefix`: the model's layer list (a pipeline stage's graph may not show which it is).
    Edits gm in place."""
    labels: list[str] = []
    if granularity == "selective":
        for node in list(gm.graph.nodes):
            if meta.get(node, meta.RECOMPUTE) is not None:
                continue
            core = _attention_core(node)
            if core is not None:
                module = meta.get(node, meta.MODULE)
                label = f"{module} core attention" if module else f"core attention %{node.name}"
                if label in labels:
                    label = f"{label} ({node.name})"
                _mark(gm, *core, label, hoist=True)
                labels.append(label)
    else:
        spans = _layer_spans(gm, prefix)
        groups = ([spans[i:i + layers] for i in range(0, len(spans), layers)] if method == "uniform"
                  else [[s] for s in spans[:layers]])
        for group in groups:
            label = group[0][0] if len(group) == 1 else f"{group[0][0]}..{group[-1][0].rsplit('.', 1)[-1]}"
            _mark(gm, group[0][1], group[-1][2], label, hoist=False)
            labels.append(label)
    gm.recompile()
    return labels


def region_labels(gm: fx.GraphModule) -> list[str]:
    """The labels of gm's recomputed regions, in order."""
    out: dict[str, None] = {}
    for n in gm.graph.nodes:
        label = meta.get(n, meta.RECOMPUTE)
        if label is not None:
            out.setdefault(label)
    return list(out)


__all__ = ["mark_recompute", "region_labels"]
