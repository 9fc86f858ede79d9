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


def _linear_args(node: fx.Node) -> tuple | None:
    """fxtron::linear's arguments (x, w, b, weight_in_out) for a linear with a parameter weight;
    None for any other node."""
    if node.op != "call_function":
        return None
    t, a = node.target, node.args
    if t == aten.linear.default and meta.is_param(a[1]):
        return (a[0], a[1], a[2] if len(a) > 2 else None, False)
    if t == aten.addmm.default and meta.is_param(a[2]) and len(a) == 3 and not node.kwargs:
        return (a[1], a[2], a[0], True)
    if t in (aten.mm.default, aten.matmul.default) and meta.is_param(a[1]) and a[1].meta["val"].dim() == 2:
        return (a[0], a[1], None, True)
    return None


def fuse_linears(gm: fx.GraphModule, *, device: torch.device, in_regions: bool = False,
                 master: torch.dtype | None = None, fp32_to_autograd: bool = False) -> fx.GraphModule:
    """Rewrite linears with parameter weights to fxtron::linear and record in node.meta which
    weight-gradient kernel each uses on `device`. `in_regions` (compile=True's regions hold the
    linears: compiler/passmanager.py linears_in_regions): the fp32 ones stay aten ops, their
    weight gradients autograd's; under `master` (the 16-bit compute dtype: the program passes
    compute copies) each becomes fxtron::master_linear instead, which takes the fp32 weight and
    returns its fp32-accumulated gradient (ops/linear.py), and the weight's other readers (a tied
    embedding) read a cast to `master` made in the graph. Any other linear is fused as without
    them (a model held in 16 bits has fp32 masters too: runtime/build.py). `fp32_to_autograd` (an uncompiled
    program where nothing defers a weight gradient: compiler/passmanager.py linears_to_autograd):
    the linears whose input and weight are fp32 stay aten ops. Edits gm in place and returns it."""
    g = gm.graph
    for node in list(g.nodes):
        args = _linear_args(node)      # (read as the loop reaches it: an earlier rewrite is its input)
        if args is None:
            continue
        t = node.target
        if "cp" in meta.graph_axes(gm) and "cp" not in (meta.get(args[1], meta.GRAD_REDUCE) or ()):
            continue     # a weight whose gradient is whole on every cp rank: its share is scaled (runtime/grads.py)
        x, w = args[0].meta["val"], args[1].meta["val"]
        if x.dtype not in _FUSED_DTYPES:
            continue     # float64: autograd's own linear (the kernels accumulate 16/32-bit into fp32)
        op = torch.ops.fxtron.linear.default
        if (in_regions or fp32_to_autograd) and not master and x.dtype == w.dtype == torch.float32:
            continue     # an aten op (of the compiled region), its weight gradient autograd's
        # (under compute copies the graph's values carry the compute dtype; the weight is the fp32
        # parameter the program passes as it is)
        if in_regions and master is not None and meta.is_param(args[1]):
            op = torch.ops.fxtron.master_linear.default
        with g.inserting_before(node):
            new = g.call_function(op, args)
        new.meta.update(node.meta)
        if t == aten.addmm.default:   # what propagate expects of (b, x, w), now (x, w, b)
            for axis in meta.graph_axes(gm):
                e = meta.expects(node, axis)
                if len(e) == 3:
                    meta.set_expects(new, axis, (e[1], e[2], e[0]))
        if op == torch.ops.fxtron.linear.default:
            meta.set(new, meta.KERNEL, kernel_name(device, x.dtype))
            meta.set(new, meta.PROVENANCE, meta.Provenance("fuse_linears", "weight gradient into main_grad"))
        else:
            meta.set(new, meta.PROVENANCE, meta.Provenance("fuse_linears", "the fp32 master weight into a compiled "
                                                                           "region, its fp32 weight gradient out"))
        node.replace_all_uses_with(new)
        g.erase_node(node)
    if in_regions and master is not None:
        _cast_other_reads(gm, master)
    gm.recompile()
    return gm


def _cast_other_reads(gm: fx.GraphModule, dtype: torch.dtype) -> None:
    """A weight fxtron::master_linear takes arrives as the fp32 parameter: its other readers
    read a `dtype` copy made in the graph (the compute copy the program would have passed)."""
    master = torch.ops.fxtron.master_linear.default
    weights = {n.args[1] for n in gm.graph.nodes if n.target == master}
    for w in weights:
        others = [u for u in w.users if not (u.target == master and u.args[1] is w)]
        if not others:
            continue
        with gm.graph.inserting_after(w):
            cast = gm.graph.call_function(aten._to_copy.default, (w,), {"dtype": dtype})
        cast.meta.update({k: v for k, v in w.meta.items() if k != "fxtron_input"})
        cast.meta["val"] = w.meta["val"].to(dtype)
        meta.set(cast, meta.PROVENANCE, meta.Provenance("fuse_linears", "the compute copy of a weight "
                                                                        "fxtron::master_linear takes in fp32"))
        for u in others:
            u.replace_input_with(w, cast)


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
