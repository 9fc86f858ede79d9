"""Ops: statistics of the global batch in a rank's graph (passes/statistics.py places them).

A rank computes its loss on one piece of the global batch: its data-parallel slice, cut into
microbatches. The runtime averages what the pieces give (the gradients over dp, the losses over
microbatches), which is the one-process loss only where the loss is a mean over equal pieces.
Anything else the model computes over its batch is made the global batch's by these ops:

    op (schema)                                forward                           backward
    batch_all_reduce(Tensor x, str group)      all-reduce SUM over the group     all-reduce SUM
    batch_scale(Tensor x)                      x * pieces                        grad * pieces
    global_statistic(Tensor x, str key)        the step's value for `key`        none
    batch_gather(Tensor x, int dim, int world, all-gather along dim               reduce-scatter
                 str group)
    batch_offset(Tensor x, str group)          x + the rank's place x len(x)     the same

`batch_all_reduce` makes a statistic the loss uses nonlinearly (a load-balancing loss's
tokens per expert and mean router probabilities, a batch norm's mean and variance) the sum over
the data-parallel ranks. The
rank's loss then holds the same term as every other rank's, and its backward sums the ranks'
gradients of that term: after the gradient sync averages over dp, each parameter has the
gradient of the term once, through every rank's tokens.

`batch_scale` multiplies a sum over the rank's tokens that reaches the loss linearly by the
number of pieces (dp x microbatches), so that their average is the sum over the global batch.

`global_statistic` replaces a statistic of the inputs alone (the count of tokens a loss
divides by: labels other than ignore_index) with its value over the whole global batch divided
by the pieces -- computed by the runtime from the global batch before the step, since every
rank has it. A token mean A / count then averages, over the pieces, to sum(A) / global count:
the one-process mean however the ignored tokens spread over ranks and microbatches.

Two more make a loss over in-batch negatives (an InfoNCE loss: q @ k.T against arange(B)) the
global batch's, as CLIP's gathered negatives do: `batch_gather(x, dim, world, group)` all-gathers
the negatives over the data-parallel ranks (backward: a reduce-scatter of the gradient), and
`batch_offset(targets, group)` moves the rank's arange(n) targets to its rows' place among them.

Outside a step (`BatchContext` not active: a plain forward on a rank's own batch) the ops are
the rank's own: batch_scale is the identity and global_statistic returns its input.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register


class BatchContext:
    """One step's view of the global batch: `pieces` (data-parallel ranks x microbatches) and
    the global value of each input statistic by key, each divided by the pieces."""

    def __init__(self, pieces: int, values: dict[str, Tensor] | None = None):
        self.pieces = pieces
        self.values = dict(values or {})

    @contextlib.contextmanager
    def active(self):
        token = _CONTEXT.set(self)
        try:
            yield self
        finally:
            _CONTEXT.reset(token)


_CONTEXT: contextvars.ContextVar[BatchContext | None] = contextvars.ContextVar("fxtron_batch_context", default=None)


# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("fxtron::batch_all_reduce", mutates_args=())
def batch_all_reduce(x: Tensor, group: str) -> Tensor:
    """A statistic of the rank's tokens summed over the data-parallel `group`. Backward: the
    gradient summed over the group (every rank's loss holds the summed statistic)."""
    return T.summed(x, T.resolve(group))


@batch_all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _batch_all_reduce_bwd(ctx, grad):
    return T.summed(grad, T.resolve(ctx.group)), None


def _setup_group(ctx, inputs, output):
    ctx.group = inputs[-1]


batch_all_reduce.register_autograd(_batch_all_reduce_bwd, setup_context=_setup_group)


class _BatchAllReduce(torch.autograd.Function):
    """batch_all_reduce as a program runs it (no trips through the custom-op dispatcher)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return T.summed(x, T.resolve(group))

    backward = staticmethod(_batch_all_reduce_bwd)


def batch_all_reduce_eager(x: Tensor, group: str) -> Tensor:
    return _BatchAllReduce.apply(x, group)


# ---------------------------------------------------------------------------------------------
def _pieces() -> int:
    ctx = _CONTEXT.get()
    return 1 if ctx is None else ctx.pieces


@torch.library.custom_op("fxtron::batch_scale", mutates_args=())
def batch_scale(x: Tensor) -> Tensor:
    """x times the step's pieces (dp x microbatches; 1 outside a step). Backward: the same."""
    return x * _pieces()


@batch_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _batch_scale_setup(ctx, inputs, output):
    ctx.pieces = _pieces()


def _batch_scale_bwd(ctx, grad):
    return grad * ctx.pieces


batch_scale.register_autograd(_batch_scale_bwd, setup_context=_batch_scale_setup)


@torch.library.custom_op("fxtron::global_statistic", mutates_args=())
def global_statistic(x: Tensor, key: str) -> Tensor:
    """The global batch's value of the input statistic `key` divided by the pieces, as the
    runtime computed it before the step (x, the rank's own value, outside a step)."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x.clone()
    if key not in ctx.values:     # (the step's context made from another graph's statistics)
        raise RuntimeError(f"fxtron: the step's batch context has no global value of statistic {key!r} "
                           f"(it has {sorted(ctx.values)}): it was made for another graph")
    return ctx.values[key].to(device=x.device, dtype=x.dtype).reshape(x.shape).clone()


@global_statistic.register_fake
def _(x, key):
    return torch.empty_like(x)


def _global_statistic_bwd(ctx, grad):
    return None, None     # a statistic of the inputs alone: no gradient reaches them


global_statistic.register_autograd(_global_statistic_bwd)


# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("fxtron::batch_gather", mutates_args=())
def batch_gather(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """Every data-parallel rank's `x` concatenated along `dim` in rank order (the `world` ranks
    of `group`): the in-batch negatives of every rank. Backward: the gradient summed over the
    group, this rank's slice (a reduce-scatter): every rank's loss reads this rank's samples."""
    return _gathered(x, dim, world, group)


def _gathered(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    pg = T.resolve(group)
    T.check_world(pg, world, "batch_gather", group)
    return x.clone(memory_format=torch.contiguous_format) if pg is None else T.gather(x, dim, pg)


@batch_gather.register_fake
def _(x, dim, world, group):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)


def _batch_gather_bwd(ctx, grad):
    pg = T.resolve(ctx.group)
    return (grad.clone() if pg is None else T.reduce_scatter(grad, ctx.dim, pg)), None, None, None


def _batch_gather_setup(ctx, inputs, output):
    ctx.dim, ctx.group = inputs[1], inputs[3]


batch_gather.register_autograd(_batch_gather_bwd, setup_context=_batch_gather_setup)


class _BatchGather(torch.autograd.Function):
    """batch_gather as a program runs it."""

    @staticmethod
    def forward(ctx, x, dim, world, group):
        ctx.dim, ctx.group = dim, group
        return _gathered(x, dim, world, group)

    backward = staticmethod(_batch_gather_bwd)


def batch_gather_eager(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    return _BatchGather.apply(x, dim, world, group)


@torch.library.custom_op("fxtron::batch_offset", mutates_args=())
def batch_offset(x: Tensor, group: str) -> Tensor:
    """Indices of the rank's own rows `x` (0 .. n-1, an arange over its batch) as indices into
    every rank's rows gathered in rank order: x + the rank's place in `group` x n. Backward: the
    gradient as it is (a constant added)."""
    pg = T.resolve(group)
    return x + (0 if pg is None else pg.rank()) * x.shape[0]


@batch_offset.register_fake
def _(x, group):
    return torch.empty_like(x)


batch_offset.register_autograd(lambda ctx, grad: (grad, None))


register(OpSpec("batch_gather", axis_arg=3, forward=Comm("all_gather", "input"),
                backward=Comm("reduce_scatter", "grad_output"), eager=batch_gather_eager, sums_grad=True))
register(OpSpec("batch_offset", axis_arg=1))
register(OpSpec("batch_all_reduce", axis_arg=1, forward=Comm("all_reduce", "input"),
                backward=Comm("all_reduce", "grad_output"), eager=batch_all_reduce_eager))
register(OpSpec("batch_scale"))
register(OpSpec("global_statistic"))

__all__ = ["BatchContext", "batch_all_reduce", "batch_gather", "batch_offset", "batch_scale", "global_statistic"]
