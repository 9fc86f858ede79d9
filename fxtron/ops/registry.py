"""Ops: the registry of fxtron's graph ops. Each op module declares, beside the op's
definition, which argument names the mesh axis it communicates over (a token such as "tp" in a
compiled graph, the process group's name in a program), what it communicates in forward and in
backward, and its run-time form. The collective report, the binding of groups into a program
and the verifier all read this table, so none of them can drift from the ops.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Literal

import torch.fx as fx

CommKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
#: the tensor whose size is the payload of a collective: the op's input or output in forward,
#: the gradient of its input or output in backward, "rows" (one float32 per row of the input),
#: or "ring" (the op's keys and values, args 1 and 2, sent to the next rank of a ring: world-1
#: times in forward; in backward world-1 times again and their gradients world times), or
#: "copies" (expert parallel: the token copies sorted by expert -- the dispatch's input, the
#: combine's output --, of which a rank keeps 1/world under uniform routing; with count 2 the
#: first collective carries the E per-expert counts, int64), or "shares" (ep x tp: the rows a
#: rank's experts received from every tp rank's share; with count 2 the first carries every
#: share's counts, int64), or "hierarchical" (cp's a2a+p2p: all-to-alls of q, k, v and the
#: output inside the a2a group, the keys and values of the head split around the ring of the
#: groups), or "edges" (a scan of a split dim: the last element of each of the rank's chunks
#: along it, every rank's gathered)
Payload = Literal["input", "output", "grad_input", "grad_output", "rows", "ring", "copies", "shares", "params",
                  "hierarchical", "edges"]


@dataclass(frozen=True)
class Comm:
    """One phase's communication: `count` collectives of `kind`, each carrying `payload`."""

    kind: CommKind
    payload: Payload
    count: int = 1


@dataclass(frozen=True)
class OpSpec:
    """What a graph op `fxtron::<name>` communicates, over the axis named by its argument
    `axis_arg` (None: it does not communicate), and the function a program's graph calls in
    its place (`eager`: the same values and gradients without the custom-op dispatch)."""

    name: str
    axis_arg: int | None = None
    #: further arguments naming group kinds of sub-groups of the axis (a split kind such as
    #: "cp/shard:2"), bound to their process groups' names like the axis argument
    group_args: tuple[int, ...] = ()
    forward: Comm | None = None
    backward: Comm | None = None
    eager: Callable | None = None
    #: its output's gradient may come back as partial sums over its axis (its backward sums
    #: them: an all-gather whose backward reduce-scatters), so a split computation may read it
    #: with no copy_to_region between
    sums_grad: bool = False


_OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"fxtron::{spec.name} is registered twice")
    _OPS[spec.name] = spec
    return spec


def specs() -> dict[str, OpSpec]:
    """Every registered op, by name."""
    return dict(_OPS)


def op_name(target) -> str | None:
    """'all_reduce' for torch.ops.fxtron.all_reduce.default; None for any other target."""
    text = str(target)
    if not text.startswith("fxtron."):
        return None
    return text.split(".")[1]


def spec_of(target) -> OpSpec | None:
    name = op_name(target)
    return None if name is None else _OPS.get(name)


def axis_of(node: fx.Node) -> str | None:
    """The mesh axis a graph node of a registered op communicates over (its axis argument)."""
    if node.op != "call_function":
        return None
    spec = spec_of(node.target)
    if spec is None or spec.axis_arg is None or spec.axis_arg >= len(node.args):
        return None
    return node.args[spec.axis_arg]


def sums_grad(node: fx.Node, axis: str) -> bool:
    """Does `node` (or the op whose output it picks) sum its gradient's partial parts over
    `axis` in backward (OpSpec.sums_grad)?"""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    spec = spec_of(node.target) if node.op == "call_function" else None
    return spec is not None and spec.sums_grad and axis_of(node) == axis


def eager_forms() -> dict:
    """op overload -> the function a program calls instead (ops that have one)."""
    import torch
    return {getattr(torch.ops.fxtron, s.name).default: s.eager for s in _OPS.values() if s.eager is not None}


__all__ = ["Comm", "OpSpec", "axis_of", "eager_forms", "op_name", "register", "spec_of", "specs", "sums_grad"]
