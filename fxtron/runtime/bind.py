"""Runtime: a compiled graph bound to this process -- every communicating op names the real
process group of the axis it communicates over, ops run in their run-time forms, tensors the
graph creates land on the process's device, and fused linears record the kernel they run here.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.core import meta
from fxtron.ops import registry
from fxtron.ops.linear import kernel_name
from fxtron.ops.recompute import outline


def bind(gm: fx.GraphModule, groups, device: torch.device, recompute: bool = True) -> fx.GraphModule:
    """A copy of gm for this process. `groups` (runtime.groups.ProcessGroups, or None without
    communication) gives each axis's group: an op's axis argument ("tp", "cp", ...) becomes
    that group's name, or "" where the axis has one rank. Tensors the graph creates (arange,
    zeros, .to(device)) land on `device` whatever device the model was traced on (meta, say),
    and the ops called once per layer run in their run-time forms (the same autograd formulas
    without the custom-op dispatch overhead). Each recomputed region becomes one checkpointed
    call (ops/recompute.py) -- unless `recompute` is False: an eval-mode graph has no backward
    to recompute for, and runs its regions as they are."""
    eager = registry.eager_forms()
    out = meta.copy_graph(gm)
    for node in out.graph.nodes:
        if node.op != "call_function":
            continue
        spec = registry.spec_of(node.target)
        if spec is not None:
            if spec.axis_arg is not None:
                args = list(node.args)
                for i in (spec.axis_arg, *spec.group_args):
                    args[i] = group_name(groups, args[i])
                node.args = tuple(args)
            if node.target == torch.ops.fxtron.linear.default:
                meta.set(node, meta.KERNEL, kernel_name(device, node.args[0].meta["val"].dtype))
            node.target = eager.get(node.target, node.target)
        on_device(node, device)
    out.recompile()
    check_bound(out, device)
    return outline(out) if recompute else out   # recomputed regions (passes/recompute.py) as checkpointed calls


class BindError(AssertionError):
    """bind broke its promise on a graph: a bug in fxtron, not the user's mistake."""


_AXIS = re.compile(r"(tp|cp|ep|dp|pp|dp-cp|expert-dp)(/.*)?")   # a mesh axis's name, as the passes write it


def check_bound(gm: fx.GraphModule, device: torch.device) -> None:
    """What bind promises, checked on its output (the passes' verifier cannot see it: it runs
    before): the graph lints; no communicating op still names a mesh axis where a process
    group belongs; every device the graph names is this process's."""
    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeErrors
        raise BindError(f"bind: the bound graph does not lint: {e}") from e
    of_eager = {form: registry.spec_of(op) for op, form in registry.eager_forms().items()}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        spec = registry.spec_of(node.target) or of_eager.get(node.target)
        if spec is not None and spec.axis_arg is not None:
            for i in (spec.axis_arg, *spec.group_args):
                if isinstance(node.args[i], str) and _AXIS.fullmatch(node.args[i]):
                    raise BindError(f"bind: %{node.name} ({spec.name}) still names the axis {node.args[i]!r}, "
                                    "not a process group")
        for a in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, torch.device) and a != device:
                raise BindError(f"bind: %{node.name} ({node.target}) names {a}, not this process's {device}")


def on_device(node: fx.Node, device: torch.device) -> None:
    """Every device argument of node (arange's, .to's) made `device`."""
    node.args, node.kwargs = pytree.tree_map(
        lambda a: device if isinstance(a, torch.device) else a, (node.args, node.kwargs))


def group_name(groups, axis: str) -> str:
    """The process group name of this rank's group on `axis` ("" when it has one rank or the
    program runs without groups)."""
    if groups is None or groups.size(axis) == 1:
        return ""
    return groups.group(axis).group_name


__all__ = ["BindError", "bind", "check_bound", "group_name", "on_device"]
