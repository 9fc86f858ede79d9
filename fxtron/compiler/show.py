"""Compiler: readable renderings of per-rank graphs (`pm.graph(rank)`, dumps); placements print per
mesh axis (`tp:S(0,x3)`)."""
from __future__ import annotations

import torch
import torch.fx as fx
from tabulate import tabulate

from fxtron.core import meta


def _target(node: fx.Node) -> str:
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "rng_call":
        return f"{str(node.args[1]).replace('aten.', '').replace('.default', '')} [{node.args[0]} rng]"
    if node.op == "call_function":
        t = node.target
        name = getattr(t, "__name__", str(t))
        if hasattr(t, "_schema") or isinstance(t, torch._ops.OpOverload):
            name = str(t).replace("aten.", "").replace(".default", "")
        if "rng_region" in node.kwargs:          # draws inside, from this stream (ops/rng.py)
            name += f" [{node.kwargs['rng_region']} rng]"
        return name
    return node.op if node.op != "call_module" else str(node.target)


def _args(node: fx.Node) -> str:
    def fmt(a):
        if isinstance(a, fx.Node):
            return "%" + a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in a) + "]"
        return repr(a) if not isinstance(a, torch.SymInt) else str(a)
    parts = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) < 60 else text[:57] + "..."


class _Shifted:
    """A random op's node seen without the (region, op) arguments `rng_call` adds."""

    def __init__(self, node: fx.Node):
        self.args, self.kwargs = node.args[2:], node.kwargs


def format_graph(gm: fx.GraphModule, *, title: str = "") -> str:
    """One row per node: name, op, local symbolic shape, placement, kernel, source module, and
    the recomputed region it belongs to when the graph has any."""
    rows = []
    recomputed = any(meta.get(n, meta.RECOMPUTE) is not None for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        shape = meta.get(node, meta.LOCAL_SHAPE)
        shape_s = "(" + ", ".join(str(s) for s in shape) + ")" if shape is not None else ""
        spec = meta.get(node, meta.INPUT)
        where = spec.target if spec is not None and spec.kind != "user" else (meta.get(node, meta.MODULE) or "")
        placement = meta.get(node, meta.PLACEMENT)
        shown = node if getattr(node.target, "__name__", "") != "rng_call" else _Shifted(node)
        rows.append(["%" + node.name, _target(node), _args(shown) if node.op != "placeholder" else "",
                     shape_s, "" if placement is None else str(placement),
                     meta.get(node, meta.KERNEL) or "", where]
                    + ([meta.get(node, meta.RECOMPUTE) or ""] if recomputed else []))
    headers = ["node", "op", "args", "local shape", "placement", "kernel", "module / param"]
    table = tabulate(rows, headers=headers + (["recompute"] if recomputed else []), tablefmt="simple")
    return (title + "\n" if title else "") + table
