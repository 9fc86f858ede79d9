"""Codegen, direct calls: a bound rank graph's Python forward with each aten op called at its
C++ entry point.

torch.fx writes a graph's forward as Python calling `torch.ops.aten.<op>.<overload>(...)`: each
call goes through `OpOverload.__call__`, a Python frame that calls the overload's `_op`, the
dispatcher's entry point. A model's own eager forward calls torch's bindings and pays no such
frame; a world-1 Llama's forward of ~200 aten calls paid ~0.15 ms more a step for it
(benchmarks/bench_host.py, where a GPU waits on the host). `direct_calls(gm)` generates gm's
forward again from fx's own code, each `torch.ops.aten.X.Y(` a global bound to that overload's
`_op`: the same dispatch, the same autograd, the same numbers, one Python frame fewer per op. The
code fx generated stays `gm.code` (what users read); the forward run is registered with
linecache, so a traceback shows its lines. A graph edited and recompiled later gets fx's
forward back. Compiled regions (compile=True) are left as Inductor made them; the graphs inside
recomputed regions that run uncompiled get the same forward.
"""
from __future__ import annotations

import itertools
import linecache
import re

import torch
import torch.fx as fx

from fxtron.codegen.regions import recomputed

_CALL = re.compile(r"\btorch\.ops\.aten\.(\w+)\.(\w+)\(")
_count = itertools.count()


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """gm (edited in place, and returned) running a forward whose aten calls are direct (module
    docstring); the recomputed regions it calls that hold no compiled code too."""
    _regenerate(gm)
    for mod in recomputed(gm):
        if not mod.compiled:
            direct_calls(mod.region)
    return gm


def _regenerate(gm: fx.GraphModule) -> None:
    forward = type(gm).forward
    names: dict[str, object] = {}

    def bind(m: re.Match) -> str:
        op = getattr(getattr(torch.ops.aten, m.group(1), None), m.group(2), None)
        if not isinstance(op, torch._ops.OpOverload):
            return m.group(0)
        name = f"_aten_{m.group(1)}_{m.group(2)}"
        names[name] = op._op
        return name + "("

    src = _CALL.sub(bind, gm.code)
    if not names:
        return
    scope = dict(forward.__globals__)
    scope.update(names)
    key = f"<fxtron-direct-calls-{next(_count)}>"
    linecache.cache[key] = (len(src), None, src.splitlines(True), key)
    exec(compile(src, key, "exec"), scope)       # noqa: S102 - fx's own code, its calls rebound
    type(gm).forward = scope["forward"]          # (each GraphModule has a class of its own)


__all__ = ["direct_calls"]
