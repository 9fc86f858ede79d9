"""Passes, devices: a program names only the device type it runs on, and runs only kernels that
device has.

The trace runs on the model's own tensors -- a model built on meta on fake CPU tensors, as its
CPU build (compiler/trace.py, compiler/repeat.py) -- so every device its code names while
tracing (an arange's, a `.to(x.device)`'s, a rotary table's) is written into the graph as
that tensor's device, and the passes copy devices from the traced values (expert parallel's
arange of received rows). `on_device` makes each of them the program's device type (a run
binds it to its rank's device: runtime/bind.py); `foreign_devices` lists what still names
another (the verifier's check, passes/verify.py `check_devices`).

`check_kernels`: an op whose kernel on the program's device takes fewer dtypes than the trace
let through -- torch._grouped_mm runs on CUDA in bfloat16 only -- is a ParallelizeError at
parallelize naming the dtype and what to change, not a crash at the first step. (transformers'
experts trace to its fallback GEMM in any other dtype, and torch's meta rule for _grouped_mm
takes bfloat16 only today; the check holds where either changes, or a model calls it directly.)
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.core import meta
from fxtron.errors import ParallelizeError

aten = torch.ops.aten
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast    # (device_type: str, dtype, enabled, cache, fn, *args)


def _graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """gm and every graph nested in it (a higher-order op's body, a recomputed region)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def on_device(gm: fx.GraphModule, device_type: str) -> fx.GraphModule:
    """Every device gm (and every graph nested in it) names made `torch.device(device_type)`
    (no index: the rank's comes at binding), and an autocast region's device type made
    `device_type`. Edits gm in place and returns it."""
    device = torch.device(device_type)
    for g in _graphs(gm):
        for node in g.graph.nodes:
            if node.op != "call_function":
                continue
            node.args, node.kwargs = pytree.tree_map(
                lambda a: device if isinstance(a, torch.device) else a, (node.args, node.kwargs))
            if node.target is _AUTOCAST and isinstance(node.args[0], str):
                node.args = (device_type, *node.args[1:])
        g.recompile()
    return gm


def foreign_devices(gm: fx.GraphModule, device_type: str) -> list[tuple[fx.Node, str]]:
    """(node, the device it names) for every node of gm or a graph nested in it whose arguments
    name a device of another type than `device_type` (an autocast region's type included)."""
    out = []
    for g in _graphs(gm):
        for node in g.graph.nodes:
            named = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                     if isinstance(a, torch.device) and a.type != device_type]
            if node.target is _AUTOCAST and isinstance(node.args[0], str) and node.args[0] != device_type:
                named.append(node.args[0])
            out.extend((node, str(d)) for d in named[:1])
    return out


def check_kernels(gm: fx.GraphModule, device_type: str) -> None:
    """ParallelizeError for an op with no kernel on `device_type` for the dtype the program
    computes it in: torch._grouped_mm (a mixture of experts' GEMMs, transformers' default
    experts_implementation) takes only bfloat16 on CUDA."""
    if device_type != "cuda":
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten._grouped_mm.default:
            dtypes = [a.meta["val"].dtype for a in node.args[:2]
                      if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            wrong = next((d for d in dtypes if d != torch.bfloat16), None)
            if wrong is not None:
                module = meta.get(node, meta.MODULE)
                raise ParallelizeError(
                    f"%{node.name} (torch._grouped_mm, the experts' grouped GEMM{' of ' + module if module else ''}) "
                    f"computes in {wrong}, but on CUDA torch._grouped_mm takes only bfloat16 inputs: the program "
                    f"would fail at its first step. Parallelize with dtype='bf16' (the experts' GEMMs in bfloat16, "
                    f"the optimizer's parameters and gradients still float32), or for a {wrong} program device='cpu'")
