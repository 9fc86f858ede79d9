"""Ops: activation recomputation -- a region of a program's graph whose activations are not kept
for backward but computed again from the region's inputs when backward needs them (Megatron's
tensor_parallel.checkpoint, torch.utils.checkpoint).

The compiler marks the nodes of each region (node.meta `fxtron_recompute`, passes/recompute.py);
`outline(gm)` turns every marked region of a program's graph into a call of a `Recomputed`
module: the region's nodes as their own GraphModule, run under PyTorch's non-reentrant
checkpoint, which drops what the region's ops save and recomputes them on first use in
backward. Two things make the second run the first one's twin:
- random ops draw what they drew the first time: the program's random streams (ops/rng.py) are
  set back to where they were when the region began, and put back after (the default generators
  too: the checkpoint's preserve_rng_state), as Megatron's CheckpointFunction does with its
  RNG tracker's states;
- a collective inside the region (the all-reduce of a recomputed layer's row-parallel linear)
  runs again, on every rank of its group at the same point of backward, as in Megatron.
`recomputing()` says whether the ops now run a recomputation (they then log nothing twice).
The checkpoint keeps the region's inputs as saved tensors, so what saved-tensor hooks see (the
memory timeline, the activation benchmark) is what a region keeps: its inputs, not its insides.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from fxtron.core import meta
from fxtron.ops import rng

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtron_recomputing", default=False)


def recomputing() -> bool:
    """Is the graph now running a region again in backward?"""
    return _RECOMPUTING.get()


def checkpointed(region: fx.GraphModule, *args, compiled: bool = False):
    """Run `region(*args)` keeping only its inputs (saved as saved tensors are: hooks see them);
    its insides are recomputed in backward with the random streams it began with. The
    recomputation stops once it has what backward reads (torch's checkpoint raises through the
    region's frames to stop it), unless the region holds `compiled` code: the raise would cross
    it, and a compiled graph runs whole anyway. The parameters are not the checkpoint's inputs:
    both runs read the Parameters themselves (the checkpoint hands its inputs back as plain
    tensors where saved-tensor hooks are on, and compiled code, guarding on the type, would run
    another graph in the recomputation, saving other tensors)."""
    streams = rng.active_streams()
    start = streams.snapshot() if streams is not None else None
    first = True
    params = {i: a for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)}
    saved = [a for i, a in enumerate(args) if i not in params]

    def run(*xs):
        nonlocal first
        if params:
            rest = iter(xs)
            xs = tuple(params[i] if i in params else next(rest) for i in range(len(args)))
        if first:
            first = False
            return region(*xs)
        token = _RECOMPUTING.set(True)
        try:
            with streams.replaying(start) if streams is not None else contextlib.nullcontext():
                return region(*xs)
        finally:
            _RECOMPUTING.reset(token)

    return checkpoint(run, *saved, use_reentrant=False, preserve_rng_state=True, early_stop=not compiled)


class Recomputed(torch.nn.Module):
    """One recomputed region of a program's graph: `region` (a GraphModule of the region's
    nodes, called with the region's inputs, returning its outputs as a tuple) run under
    `checkpointed`; `compiled`: its region holds compiled code (codegen/regions.py Compiler)."""

    def __init__(self, region: fx.GraphModule, label: str):
        super().__init__()
        self.region = region
        self.label = label
        self.compiled = False

    def forward(self, *args):
        return checkpointed(self.region, *args, compiled=self.compiled)

    def extra_repr(self) -> str:
        return self.label


def regions(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The marked regions of gm, each its nodes in graph order, regions in order of their first node."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        label = meta.get(node, meta.RECOMPUTE)
        if label is not None and node.op == "call_function":
            out.setdefault(label, []).append(node)
    return out


def outline(gm: fx.GraphModule) -> fx.GraphModule:
    """Every marked region of gm becomes one call of a `Recomputed` submodule (`recompute_<i>`)
    taking the values the region reads from outside and returning those read after it. A region
    is a run of consecutive nodes (the pass marks them so). Edits gm in place and returns it."""
    g = gm.graph
    for i, (label, nodes) in enumerate(regions(gm).items()):
        inside = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        position = {n: k for k, n in enumerate(g.nodes)}
        late = [a for a in inputs if position[a] > position[nodes[0]]]
        if late:
            raise ValueError(f"recompute region {label!r} is not a run of consecutive nodes: it reads "
                             f"%{late[0].name}, computed after its first node %{nodes[0].name}")
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            env[a] = sub.placeholder(a.name)
            env[a].meta.update(a.meta)
        for n in nodes:
            env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(tuple(env[o] for o in outputs))
        name = f"recompute_{i}"
        gm.add_submodule(name, Recomputed(fx.GraphModule(gm, sub, class_name=f"Recompute{i}"), label))
        with g.inserting_before(nodes[0]):
            call = g.call_module(name, tuple(inputs))
            meta.set(call, meta.RECOMPUTE, label)
            for k, o in enumerate(outputs):
                got = g.call_function(operator.getitem, (call, k))
                got.meta.update(o.meta)
                o.replace_all_uses_with(got)
        for n in reversed(nodes):
            g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


__all__ = ["Recomputed", "checkpointed", "outline", "recomputing", "regions"]
