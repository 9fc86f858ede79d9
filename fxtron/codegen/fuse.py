"""Codegen: linears rewritten to `fxtron::linear` (ops/linear.py), whose weight gradient
accumulates straight into an fp32 `main_grad` (Megatron's gradient_accumulation_fusion) and can
be deferred behind the communication of the input gradient; each records the weight-gradient
kernel it uses on the programs' device (`pm.graph` shows it)."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.ops.linear import kernel_name

aten = torch.ops.aten


def fuse_linears(gm: fx.GraphModule, *, device: torch.device, only_16bit: bool = False) -> fx.GraphModule:
    """Rewrite linears with parameter weights to fxtron::linear and record in node.meta which
    weight-gradient kernel each uses on `device`; `only_16bit`: those with 16-bit inputs only,
    the fp32 ones left to autograd (compile=True's regions hold them: compiler/passmanager.py
    linears_in_regions). Edits gm in place and returns it."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        t, a = node.target, node.args
        if t == aten.linear.default and meta.is_param(a[1]):
            args = (a[0], a[1], a[2] if len(a) > 2 else None, False)
        elif t == aten.addmm.default and meta.is_param(a[2]) and len(a) == 3 and not node.kwargs:
            args = (a[1], a[2], a[0], True)
        elif t in (aten.mm.default, aten.matmul.default) and meta.is_param(a[1]) and a[1].meta["val"].dim() == 2:
            args = (a[0], a[1], None, True)
        else:
            continue
        if "cp" in meta.graph_axes(gm) and "cp" not in (meta.get(args[1], meta.GRAD_REDUCE) or ()):
            continue     # a weight whose gradient is whole on every cp rank: its share is scaled (runtime/grads.py)
        if args[0].meta["val"].dtype not in _FUSED_DTYPES:
            continue     # float64: autograd's own linear (the kernels accumulate 16/32-bit into fp32)
        if only_16bit and args[0].meta["val"].dtype == args[1].meta["val"].dtype == torch.float32:
            continue
        x = args[0]
        with g.inserting_before(node):
            new = g.call_function(torch.ops.fxtron.linear.default, args)
        new.meta.update(node.meta)
        if t == aten.addmm.default:   # what propagate expects of (b, x, w), now (x, w, b)
            for axis in meta.graph_axes(gm):
                e = meta.expects(node, axis)
                if len(e) == 3:
                    meta.set_expects(new, axis, (e[1], e[2], e[0]))
        meta.set(new, meta.KERNEL, kernel_name(device, x.meta["val"].dtype))
        meta.set(new, meta.PROVENANCE, meta.Provenance("fuse_linears", "weight gradient into main_grad"))
        node.replace_all_uses_with(new)
        g.erase_node(node)
    gm.recompile()
    return gm


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_weights(gm: fx.GraphModule) -> list[str]:
    """Names of the parameters whose gradients the fused linears accumulate into main_grad."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.fxtron.linear.default:
            from fxtron.passes.fsdp import param_of
            name = param_of(node.args[1])       # (under zero=3, a gathered one)
            if name is not None and name not in out:
                out.append(name)
    return out


__all__ = ["fuse_linears", "fused_weights"]
