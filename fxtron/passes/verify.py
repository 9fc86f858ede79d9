"""Passes: the verifier run between passes -- in the tests, and on request with FXTRON_VERIFY=1.

It checks what the passes so far promise: the graph lints; once placements were propagated on
an axis, every tensor node has a placement on it; once redistributions were inserted, every
input of every op has on every axis the placement the op's rule expects of it (so every
producer/consumer mismatch has a redistribution between them); a parameter whose gradient is
summed over an axis after backward (meta.GRAD_REDUCE: each rank's part is partial) is used
whole on that axis, never scattered first (its gradient would then be complete on each rank,
and the sum would count it axis-size times); and every communicating op
names an axis the graph is distributed over (jax shard_map's check of which axes a value varies
over, tinygrad's spec between rewrites).
"""
from __future__ import annotations

import os

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.ops import registry
from fxtron.passes.rules import tensor_inputs

ENV = "FXTRON_VERIFY"


class VerifyError(AssertionError):
    """A pass broke an invariant of the graph: a bug in fxtron, not the user's mistake."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


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
        if node.op == "call_function":
            axis = registry.axis_of(node)
            if axis is not None and axes and axis not in axes:
                raise VerifyError(f"after {after}: %{node.name} communicates over {axis!r}, which the graph "
                                  f"is not distributed over ({', '.join(axes)})")
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


__all__ = ["ENV", "VerifyError", "enabled", "verify"]
