"""Passes: sharded data parallel (zero=3, FSDP) as graph nodes.

Each parameter is held as the rank's 1/d flat piece (core.params.FlatShard; d the ranks of its
gradient group: dp, dp-cp under context parallel, expert-dp for experts). The parameters are
grouped into units, one per layer (the model's path up to its layer index: `blocks.3`,
`model.layers.3`; every other module its own unit, and a layer's experts apart from its dense
weights, since they shard over another group). Per graph (each pipeline stage's):

- `fxtron::fsdp_gather(group, unit, pieces...)` just before the first use of any of the unit's
  parameters, every use then reading its outputs (the whole local parameters);
- `fxtron::fsdp_free(group, unit, gathered...)` just after their last use in forward.

A recomputed region reads the gathered parameters as its inputs, which its checkpoint keeps
as saved tensors: packed as their place in the unit like any other (runtime/fsdp.py), so the
recomputation gathers them again. What the runtime does at these nodes (prefetching the next unit,
gathering again in backward, reduce-scattering each unit's gradients) is runtime/fsdp.py's.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.params import FlatShard, LocalParam
from fxtron.errors import ParallelizeError
from fxtron.ops import fsdp as _ops  # noqa: F401 - registers torch.ops.fxtron.fsdp_*

_GATHER = torch.ops.fxtron.fsdp_gather.default
_FREE = torch.ops.fxtron.fsdp_free.default
_WAIT = torch.ops.fxtron.param_wait.default
#: the ops whose outputs stand for parameters (param_of)
STANDS_FOR_PARAMS = (_GATHER, _WAIT)


def unit_of(name: str) -> str:
    """The unit (layer) a parameter belongs to: its path up to and including the first index
    (`model.layers.3`), else its module's path (`lm_head`; a top-level tensor: its name)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if re.fullmatch(r"\d+", p):
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def _units(gm: fx.GraphModule, local: dict[str, LocalParam], group_of) -> dict[tuple[str, str], list[fx.Node]]:
    """(group kind, unit label) -> the parameter placeholders of that unit the graph uses, for
    the kinds of more than one rank; units in order of first use (placeholder order)."""
    units: dict[tuple[str, str], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        name = meta.param_name(node)
        if name is None or not node.users or name not in local:
            continue
        kind = local[name].grad_group
        if group_of(kind)[0] == 1:
            continue
        units.setdefault((kind, unit_of(name) + ("" if kind != "expert-dp" else " (experts)")), []).append(node)
    return units


def _before_first_use(gm: fx.GraphModule, op, args: tuple, params: list[fx.Node], label: str, why: str) -> list[fx.Node]:
    """Insert `op(*args)` (its outputs standing for `params`) just before the first use of any
    of them -- before the recomputed region holding it, whose input it becomes -- and route
    every use to its outputs. Returns the output nodes (getitems)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min((u for p in params for u in p.users), key=position.__getitem__)
    region = meta.get(first, meta.RECOMPUTE)
    while region is not None and meta.get(first.prev, meta.RECOMPUTE) == region:
        first = first.prev
    g = gm.graph
    with g.inserting_before(first):
        node = g.call_function(op, args)
        outs = []
        for i, p in enumerate(params):
            item = g.call_function(operator.getitem, (node, i))
            item.meta.update({k: v for k, v in p.meta.items() if k != meta.INPUT})
            outs.append(item)
    node.meta["val"] = [o.meta.get("val") for o in outs]
    for axis in meta.graph_axes(gm):      # each output placed as its parameter
        meta.set_placement(node, axis, tuple(meta.placement(p, axis) for p in params))
    meta.set(node, meta.MODULE, label)
    meta.set(node, meta.PROVENANCE, meta.Provenance("shard_data_parallel", why))
    for p, item in zip(params, outs):
        p.replace_all_uses_with(item, delete_user_cb=lambda u, node=node: u is not node)
    return outs


def shard_data_parallel(graphs: list[fx.GraphModule], local: dict[str, LocalParam],
                        group_of, split=None) -> dict[str, LocalParam]:
    """Insert each unit's gather and free into `graphs` (edited in place) and return `local`
    with every parameter's flat piece. `group_of(kind)` gives the rank's (world, index) in a
    group kind; a gradient group of one rank shards nothing. `split(kind)`, given, names the
    (shard, replicate) kinds a gradient group is hybrid-sharded into (HSDP), or None."""
    out = dict(local)
    seen: dict[str, int] = {}
    for gi, gm in enumerate(graphs):
        for (kind, label), params in _units(gm, local, group_of).items():
            if seen.setdefault(label, gi) != gi:
                raise ParallelizeError(f"zero=3: layer {label} is used by two pipeline chunks of this rank (a tied "
                                       "embedding and LM head on zb-v's first and last stage?); fxtron gathers a "
                                       "layer's parameters within one chunk: use zero<=2, another schedule, or untie "
                                       "the weights")
            shard, replicate = (split(kind) if split is not None else None) or (kind, "")
            world, index = group_of(shard)
            position = {n: i for i, n in enumerate(gm.graph.nodes)}
            last = max((u for p in params for u in p.users), key=position.__getitem__)
            shapes, dims = [], []
            for p in params:
                lp = local[meta.param_name(p)]
                shapes += list(lp.local_shape)
                dims.append(len(lp.local_shape))
                chunk = -(-math.prod(int(d) for d in lp.local_shape) // world)
                out[lp.name] = dataclasses.replace(lp, flat=FlatShard(world, index, chunk, label, shard, replicate))
            outs = _before_first_use(gm, _GATHER, (shard, label, list(params), shapes, dims), params, label,
                                     f"gather {label} (zero=3)")
            g = gm.graph
            with g.inserting_after(last):
                free = g.call_function(_FREE, (kind, label, outs))
            meta.set(free, meta.MODULE, label)
            meta.set(free, meta.PROVENANCE, meta.Provenance("shard_data_parallel", f"free {label} (zero=3)"))
            if meta.get(last, meta.RECOMPUTE) is not None:      # (inside the region, which stays one run)
                meta.set(free, meta.RECOMPUTE, meta.get(last, meta.RECOMPUTE))
            for p in params:       # the placeholder is the flat piece now
                lp = out[meta.param_name(p)]
                val = p.meta.get("val")
                if isinstance(val, torch.Tensor):
                    p.meta["val"] = torch.empty((lp.flat.chunk,), dtype=val.dtype, device="meta")
                meta.set(p, meta.LOCAL_SHAPE, (lp.flat.chunk,))
        gm.graph.lint()
        gm.recompile()
    return out


def wait_for_params(graphs: list[fx.GraphModule], local: dict[str, LocalParam], group_of) -> None:
    """zero=1/2 with overlap_param_gather: a `fxtron::param_wait` of each layer's parameters
    just before their first use, every use then reading its outputs (the parameters once their
    buckets' all-gather has arrived, in the compute dtype). Edits `graphs` in place."""
    for gm in graphs:
        for (kind, label), params in _units(gm, local, group_of).items():
            _before_first_use(gm, _WAIT, (kind, label, list(params)), params, label,
                              f"wait for {label}'s gathered update (overlap_param_gather)")
        gm.graph.lint()
        gm.recompile()


def param_of(node) -> str | None:
    """The parameter `node` stands for: a parameter placeholder, or one output of a gather."""
    if meta.is_param(node):
        return meta.param_name(node)
    if (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].target in STANDS_FOR_PARAMS):
        return meta.param_name(node.args[0].args[2][node.args[1]])
    return None


def is_free(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == _FREE


__all__ = ["STANDS_FOR_PARAMS", "is_free", "param_of", "shard_data_parallel", "unit_of", "wait_for_params"]
