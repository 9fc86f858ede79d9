"""Ops: sharded data parallel's parameter gathers (zero=3, FSDP), as graph ops.

Under zero=3 a rank holds only its 1/d piece of each parameter (flattened, zero-padded; d the
ranks of the parameter's gradient group). The compiler (passes/fsdp.py) puts, before the first
use of each layer's parameters, one

    fxtron::fsdp_gather(str group, str unit, Tensor[] shards, int[] shapes, int[] dims) -> Tensor[]

which all-gathers the pieces of every parameter of `unit` (one collective for the layer) and
returns them whole, shaped like the rank's local (tensor-parallel) parameters; and after their
last use in forward

    fxtron::fsdp_free(str group, str unit, Tensor[] gathered) -> ()

after which the rank no longer holds them: what backward needs of them (the weight of a fused
linear, a norm's weight saved by its multiply) is gathered again there, and each layer's
gradients are reduce-scattered as soon as its backward completes them (runtime/fsdp.py).

With zero=1 or 2 and overlap_param_gather, the same place gets

    fxtron::param_wait(str group, str unit, Tensor[] params) -> Tensor[]

which waits only for the buckets of `unit`'s parameters in the distributed optimizer's
all-gather of the last step's update (Megatron's overlap_param_gather), then gives them in the
compute dtype.

`shapes` is the local shapes of the parameters, concatenated, and `dims` their ranks, so the
fake implementation needs no group. The run-time forms call the program's `FsdpUnits`, which
the pieces' records name (core/records.py FSDP_PIECES, written by the program and kept for its
compute copies); each gathered tensor's record (FSDP_GATHERED: units, unit, index) is the handle
a fused linear (ops/linear.py) keeps, not the whole weight, for its backward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.core import layout
from fxtron.core.records import FSDP_GATHERED, FSDP_PIECES, ZERO_WAITED, FsdpGathered
from fxtron.errors import ParallelizeError
from fxtron.ops.registry import Comm, OpSpec, register

def shapes_of(shapes: list[int], dims: list[int]) -> list[tuple[int, ...]]:
    """The per-parameter shapes of fsdp_gather's flat (shapes, dims) arguments."""
    out, at = [], 0
    for d in dims:
        out.append(tuple(shapes[at:at + d]))
        at += d
    return out


@torch.library.custom_op("fxtron::fsdp_gather", mutates_args=())
def fsdp_gather(group: str, unit: str, shards: list[Tensor], shapes: list[int], dims: list[int]) -> list[Tensor]:
    """The whole local parameters of `unit` from every rank's flat pieces `shards` (zero=3)."""
    if group == "":          # one rank holds everything: the pieces are the tensors, padding aside
        return [s[:layout.numel(shape)].reshape(shape).clone() for s, shape in zip(shards, shapes_of(shapes, dims))]
    raise ParallelizeError(f"fxtron::fsdp_gather of {unit} runs inside a program's step (prog.train_step)")


@fsdp_gather.register_fake
def _(group, unit, shards, shapes, dims):
    return [s.new_empty(shape) for s, shape in zip(shards, shapes_of(shapes, dims))]


@torch.library.custom_op("fxtron::fsdp_free", mutates_args=())
def fsdp_free(group: str, unit: str, gathered: list[Tensor]) -> None:
    """`unit`'s gathered parameters are no longer needed in forward: the rank drops them."""
    return None


@fsdp_free.register_fake
def _(group, unit, gathered):
    return None


@torch.library.custom_op("fxtron::param_wait", mutates_args=())
def param_wait(group: str, unit: str, params: list[Tensor]) -> list[Tensor]:
    """zero=1/2 with overlap_param_gather: `unit`'s parameters once their buckets' all-gather
    of the last step's update has arrived (the graph's form: a copy)."""
    return [p.clone() for p in params]


@param_wait.register_fake
def _(group, unit, params):
    return [p.new_empty(p.shape) for p in params]


def param_wait_eager(group: str, unit: str, params: list[Tensor]) -> list[Tensor]:
    """The run-time form: the distributed optimizer the parameters' records name
    (core/records.py ZERO_WAITED; runtime/zero.py) waits for their buckets and gives them in the
    compute dtype."""
    waited = ZERO_WAITED.get(params[0]) if params else None
    zero = waited.zero if waited is not None else None
    return list(params) if zero is None else zero.ready(unit, params)


class _Gather(torch.autograd.Function):
    """The run-time gather: forward asks the program's units for the whole parameters;
    backward hands their gradients (those autograd computes: all but fused linears', which
    accumulate in place) to the units, which reduce-scatter each layer's once it is complete.
    The pieces get no gradient through autograd: the units add the reduced ones to theirs."""

    @staticmethod
    def forward(ctx, units, unit, *shards):
        ctx.units, ctx.unit, ctx.n = units, unit, len(shards)
        ctx.set_materialize_grads(False)
        return tuple(units.gather(unit, list(shards)))

    @staticmethod
    def backward(ctx, *grads):
        ctx.units.autograd_grads(ctx.unit, list(grads))
        return (None, None) + (None,) * ctx.n


def fsdp_gather_eager(group: str, unit: str, shards: list[Tensor], shapes: list[int], dims: list[int]) -> list[Tensor]:
    # the pieces carry their program's units (a recomputation in backward runs outside the step's
    # context, and on a GPU in autograd's own thread)
    piece = FSDP_PIECES.get(shards[0]) if shards else None
    units = piece.units if piece is not None else None
    if units is None:
        return fsdp_gather(group, unit, shards, shapes, dims)
    out = _Gather.apply(units, unit, *shards)
    out = list(out) if isinstance(out, tuple) else [out]
    for i, t in enumerate(out):
        FSDP_GATHERED.set(t, FsdpGathered(units, unit, i))
    return out


def fsdp_free_eager(group: str, unit: str, gathered: list[Tensor]) -> None:
    h = handle(gathered[0]) if gathered else None
    if h is not None:
        h.units.free(unit)


register(OpSpec("fsdp_gather", axis_arg=0, forward=Comm("all_gather", "params"),
                backward=Comm("reduce_scatter", "params"), eager=fsdp_gather_eager))
register(OpSpec("fsdp_free", eager=fsdp_free_eager))
register(OpSpec("param_wait", eager=param_wait_eager))


def read_in_backward(gather) -> bool:
    """Does backward read the parameters a gather node (fx) gives -- a fused linear's weight,
    a norm's multiply -- so that the layer is gathered again there? Not when embedding lookups
    alone read them (their backward needs no table)."""
    lookup = (torch.ops.aten.embedding.default, torch.ops.fxtron.fsdp_free.default)
    return any(u.target not in lookup for item in gather.users for u in item.users)


def handle(weight: Tensor) -> FsdpGathered | None:
    """The record (units, unit, index: core/records.py FsdpGathered) of a parameter gathered
    by fsdp_gather, or None."""
    return FSDP_GATHERED.get(weight)


__all__ = ["fsdp_free", "fsdp_gather", "handle", "param_wait", "read_in_backward", "shapes_of"]
