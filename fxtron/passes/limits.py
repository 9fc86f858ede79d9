"""Passes: how long a sequence the model itself can take, read from its graph -- a learned
position table looked up by positions the model makes (`wpe(arange(S))`), or a table sliced
to the sequence (`rope_cos[:S]`). The step refuses a longer sequence before it runs, instead
of an index error deep in an embedding or a shape error in a multiply."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxtron.core import meta

aten = torch.ops.aten


@dataclass(frozen=True)
class SeqLimit:
    """The longest sequence the model takes, and what sets it (for the message)."""

    tokens: int
    why: str


def _is_seq_size(node, gm: fx.GraphModule) -> bool:
    """Is `node` the run-time size of a user input's sequence dim?"""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.sym_size.int):
        return False
    spec = meta.get(node.args[0], meta.INPUT)
    return spec is not None and spec.kind == "user" and node.args[1] < len(spec.dims) and spec.dims[node.args[1]] == "seq"


def _from_positions(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Does `node` derive from an arange over the sequence length (positions the model makes)?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in (aten.arange.default, aten.arange.start, aten.arange.start_step) \
                and any(_is_seq_size(a, gm) for a in n.args):
            return True
        stack.extend(n.all_input_nodes)
    return False


def seq_limit(gm: fx.GraphModule) -> SeqLimit | None:
    """The tightest limit the graph sets on the sequence length, or None (rotary angles computed
    from positions, say, take any length)."""
    best: SeqLimit | None = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = None
        if node.target == aten.embedding.default and meta.is_param(node.args[0]) and _from_positions(node.args[1], gm):
            found = SeqLimit(int(node.args[0].meta["val"].shape[0]),
                             f"the position table {meta.param_name(node.args[0])} has "
                             f"{int(node.args[0].meta['val'].shape[0])} rows")
        elif node.target == aten.slice.Tensor and len(node.args) > 3 and _is_seq_size(node.args[3], gm) \
                and node.args[0].op == "placeholder":
            src = node.args[0]
            spec = meta.get(src, meta.INPUT)
            if spec is not None and spec.kind in ("buffer", "parameter"):
                size = int(src.meta["val"].shape[node.args[1]])
                found = SeqLimit(size, f"{spec.kind} {spec.target} is cut to the sequence from {size} positions")
        if found is not None and (best is None or found.tokens < best.tokens):
            best = found
    return best


__all__ = ["SeqLimit", "seq_limit"]
