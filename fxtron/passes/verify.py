"""Passes: the verifier run between passes -- on by default (config.debug.verify; FXTRON_VERIFY=0 or
`--no-verify` skips it, for huge graphs).

It checks what the passes so far promise: the graph lints; once placements were propagated on
an axis, every tensor node has a placement on it; once redistributions were inserted, every
input of every op has on every axis the placement the op's rule expects of it (so every
producer/consumer mismatch has a redistribution between them); a parameter whose gradient is
summed over an axis after backward (meta.GRAD_REDUCE: each rank's part is partial) is used
whole on that axis, never scattered first (its gradient would then be complete on each rank,
and the sum would count it axis-size times); no reduction (sum, mean, var, amax, softmax, ...)
runs over a dim its input holds only part of, or over a partial sum, except a sum that stays
partial; every communicating op
names an axis the graph is distributed over; and, after global_statistics, every batch statistic
the loss depends on was made the global batch's or left per rank at the user's request (jax shard_map's check of which axes a value varies
over, tinygrad's spec between rewrites). `check_devices`, run on every compiled graph: a graph built
for one device type names no other (passes/devices.py).
"""
from __future__ import annotations


import torch
import torch.fx as fx

from fxtron.config import DebugConfig
from fxtron.core import meta, opsets
from fxtron.core.placement import Partial, Shard
from fxtron.errors import ParallelizeError
from fxtron.passes.devices import foreign_devices
from fxtron.ops import registry
from fxtron.passes.rules import reduced_dims, tensor_inputs


aten = torch.ops.aten
#: ops that reduce their first input over the dims in args[1] (all dims when absent): a sum or
#: a mean (lowered to this rank's part) are the only ones a rank may compute over its own shard of a
#: reduced dim (its output then Partial)
_SUMS = opsets.SUMS
_REDUCTIONS = opsets.REDUCTIONS


class VerifyError(AssertionError):
    """A pass broke an invariant of the graph: a bug in fxtron, not the user's mistake."""


def enabled() -> bool:
    """config.DebugConfig.verify's default (FXTRON_VERIFY)."""
    return DebugConfig().verify


def _tensor_valued(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and bool(val)
                                             and all(isinstance(v, torch.Tensor) for v in val))


def verify(gm: fx.GraphModule, *, after: str, redistributed: bool = False) -> None:
    """Raise VerifyError naming the pass `after` which the first broken invariant follows."""
    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeErrors
        raise VerifyError(f"after {after}: the graph does not lint: {e}") from e
    axes = meta.graph_axes(gm)
    for node in gm.graph.nodes:
        if node.op == "output" or not _tensor_valued(node):
            continue
        for axis in axes:
            if meta.placement(node, axis) is None:
                raise VerifyError(f"after {after}: %{node.name} ({node.target}) has no placement on axis {axis}")
        if node.op == "call_function" and redistributed:
            # (before the redistributions a graph may be propagated over some of its axes only:
            # expert parallel's ops over ep and tp come before either propagation)
            axis = registry.axis_of(node)
            # dp is no placement axis (each dp rank's batch is its own, sliced by the runtime): an
            # op over dp sums a statistic of every rank's batch (the global aux loss's counts), or
            # gathers zero=3's parameter pieces over a gradient group (dp, dp-cp, expert-dp; or an HSDP
            # shard group of one, "dp/shard:2")
            base = axis.partition("/")[0] if axis is not None else None     # "cp/shard:2": a split of cp
            if axis is not None and axes and base not in axes and base not in ("dp", "dp-cp", "expert-dp"):
                raise VerifyError(f"after {after}: %{node.name} communicates over {axis!r}, which the graph "
                                  f"is not distributed over ({', '.join(axes)})")
    if after == "global_statistics":
        from fxtron.passes.statistics import check_statistics
        wrong = check_statistics(gm)
        if wrong:
            raise VerifyError(f"after {after}: {wrong}")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _REDUCTIONS:
            _check_reduction(node, axes, after)
    if not redistributed:
        return
    for node in gm.graph.nodes:
        for axis in meta.get(node, meta.GRAD_REDUCE) or ():
            sliced = [u for u in node.users if u.op == "call_function" and registry.axis_of(u) == axis]
            if sliced:
                raise VerifyError(
                    f"after {after}: parameter %{node.name}'s gradient is summed over {axis} after backward, "
                    f"but %{sliced[0].name} ({sliced[0].target}) takes it apart over {axis}: each rank's "
                    f"gradient is already whole, and the sum would multiply it by the axis size")
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        inputs = tensor_inputs(node)
        for axis in axes:
            expects = meta.expects(node, axis)
            for a, want in zip(inputs, expects):
                if want is None:
                    continue
                have = meta.placement(a, axis)
                if have != want:
                    raise VerifyError(
                        f"after {after}: %{node.name} ({node.target}) expects {axis}:{want} of %{a.name}, which is "
                        f"{axis}:{have}, with no redistribution between them")


def check_devices(gm: fx.GraphModule, device_type: str, *, where: str = "") -> None:
    """ParallelizeError naming the first node of gm (or of a graph nested in it) that names a
    device of another type than `device_type`, the one the program was built for: it would pin
    its tensors there whatever device the rank runs on."""
    wrong = foreign_devices(gm, device_type)
    if wrong:
        node, device = wrong[0]
        raise ParallelizeError(
            f"{where + ': ' if where else ''}%{node.name} ({node.target}) names the device {device}, but the program "
            f"is built for {device_type} ({len(wrong)} node{'s' if len(wrong) > 1 else ''} of the graph name another "
            f"device type); every device a program names must be its own")


def _check_reduction(node: fx.Node, axes, after: str) -> None:
    """No reduction over a dim a rank holds only part of, and none of a partial sum, unless it
    is a sum that stays partial: such a statistic would be this rank's alone (a norm's variance
    over a split width, a softmax over split logits), silently wrong."""
    x = node.args[0]
    if not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor):
        return
    for axis in axes:
        want = meta.expects(node, axis)
        have = want[0] if want and want[0] is not None else meta.placement(x, axis)   # what it will see
        out = meta.placement(node, axis)
        if have is None:
            continue
        if node.target in _SUMS and isinstance(out, Partial):
            continue
        if node.target == aten.cumsum.default and isinstance(have, Shard) and out == have:
            continue        # a scan of the split dim: lowered to shard_cumsum (passes/rules/scans.py)
        bad = (isinstance(have, Shard) and have.dim in reduced_dims(node)) or isinstance(have, Partial)
        if bad and not isinstance(out, Partial):
            raise VerifyError(
                f"after {after}: %{node.name} ({node.target}) reduces %{x.name} over dims {reduced_dims(node)}, which "
                f"is {axis}:{have} there: each rank would compute its own part's statistic as if it were the whole")


__all__ = ["VerifyError", "check_devices", "enabled", "verify"]
