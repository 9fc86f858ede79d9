"""Ops, sequence parallel: Megatron's pair for a sequence split over tp, as traceable custom ops.

    op (schema)                                                    forward           backward
    reduce_scatter(Tensor x, int dim, int world, str group)        reduce-scatter    all-gather  (SP g)
    gather_from_sequence(Tensor x, int dim, int world, str group)  all-gather        reduce-scatter (SP f)

Where tensor parallel all-reduces a partial sum, sequence parallel reduce-scatters it along the
sequence (norms, dropout and residual adds then run on 1/tp of the tokens) and all-gathers the
sequence before the next column-split linear. The gathered tensor records its shard
(core/records.py SEQUENCE_GATHERED), so the linears it feeds save the shard and gather it again
in backward (ops/linear.py Regather). `group` and `world` are as in ops/tp.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.core.layout import check_divisible
from fxtron.core.records import SEQUENCE_GATHERED, SequenceGathered
from fxtron.ops import transport as T
from fxtron.ops.linear import Regather, active_queue
from fxtron.ops.registry import Comm, OpSpec, register
from fxtron.ops.tp import _gathered_shape, _sliced_shape, all_gather

_group = T.resolve
_norm = T.norm_dim


@torch.library.custom_op("fxtron::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """Megatron's SP g. In: this rank's partial sum, dim divisible by world. Out: this rank's
    1/world slice along dim (plain split, no interleave) of the sum over `group`. Backward:
    all-gather along dim."""
    pg = _group(group)
    T.check_world(pg, world, "reduce_scatter", group)
    dim = _norm(dim, x.dim())
    check_divisible(x.shape[dim], world, 1, f"fxtron::reduce_scatter input dim {dim} of shape {tuple(x.shape)}")
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return T.reduce_scatter(x, dim, pg)


@reduce_scatter.register_fake
def _(x, dim, world, group):
    return x.new_empty(_sliced_shape(x, dim, [1], world, "reduce_scatter"))


def _setup_dim_world(ctx, inputs, output):
    ctx.dim, ctx.world, ctx.group = inputs[1:]


def _reduce_scatter_bwd(ctx, grad):
    return all_gather(grad, ctx.dim, [1], ctx.world, ctx.group), None, None, None


reduce_scatter.register_autograd(_reduce_scatter_bwd, setup_context=_setup_dim_world)


@torch.library.custom_op("fxtron::gather_from_sequence", mutates_args=())
def gather_from_sequence(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """Megatron's SP f (`gather_from_sequence_parallel_region`). In: this rank's slice along dim
    (e.g. [s/tp, b, h]). Out: the full tensor (dim world times larger). Backward: reduce-scatter
    SUM along dim (the consumers' gradients are partial sums)."""
    pg = _group(group)
    T.check_world(pg, world, "gather_from_sequence", group)
    dim = _norm(dim, x.dim())
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return T.gather(x, dim, pg)


@gather_from_sequence.register_fake
def _(x, dim, world, group):
    return x.new_empty(_gathered_shape(x, dim, world))


def _gather_from_sequence_bwd(ctx, grad):
    queue, pg = active_queue(), _group(ctx.group)
    if pg is None or queue is None or not queue.jobs:
        return reduce_scatter(grad, ctx.dim, ctx.world, ctx.group), None, None, None
    # the reduce-scatter of the input gradient runs while the queued weight-gradient GEMMs
    # compute (Megatron's async reduce-scatter under sequence parallel)
    work = T.start_reduce_scatter(grad, _norm(ctx.dim, grad.dim()), pg)
    queue.drain()
    return work.wait(), None, None, None


gather_from_sequence.register_autograd(_gather_from_sequence_bwd, setup_context=_setup_dim_world)


class _GatherFromSequence(torch.autograd.Function):
    """gather_from_sequence as a program runs it (see _CopyToRegion); its output carries the
    shard (ops/linear.py Regather), so the linears it feeds save the shard, not the whole."""

    @staticmethod
    def forward(ctx, x, dim, world, group):
        ctx.dim, ctx.world, ctx.group = dim, world, group
        out = gather_from_sequence(x, dim, world, group)
        pg = _group(group)
        if pg is not None:
            d = _norm(dim, x.dim())
            SEQUENCE_GATHERED.set(out, SequenceGathered(x.detach(), Regather(lambda shard: T.start_gather(shard, d, pg))))
        return out

    backward = staticmethod(_gather_from_sequence_bwd)


def gather_from_sequence_eager(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """The run-time form of gather_from_sequence."""
    return _GatherFromSequence.apply(x, dim, world, group)



class _GatherFromSequenceTraced(torch.autograd.Function):
    """gather_from_sequence as a compiled region holds it (codegen/regions.py, where the region
    holds the linears around it; see ops/tp.py _CopyToRegionTraced): the all-gather a call
    inside the compiled forward, its reduce-scatter one inside the compiled backward. The region
    keeps the gathered input for its linears' backward, where a fused linear keeps the shard
    and gathers it again."""

    @staticmethod
    def forward(ctx, x, dim, world, group):
        ctx.dim, ctx.world, ctx.group = dim, world, group
        return torch.ops.fxtron.gather_from_sequence.default(x, dim, world, group)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.fxtron.reduce_scatter.default(grad, ctx.dim, ctx.world, ctx.group), None, None, None


def gather_from_sequence_traced(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """The form of gather_from_sequence a compiled region traces."""
    return _GatherFromSequenceTraced.apply(x, dim, world, group)


register(OpSpec("reduce_scatter", axis_arg=3, forward=Comm("reduce_scatter", "input"),
                backward=Comm("all_gather", "grad_input")))
register(OpSpec("gather_from_sequence", axis_arg=3, forward=Comm("all_gather", "output"),
                backward=Comm("reduce_scatter", "grad_output"), eager=gather_from_sequence_eager))

__all__ = ["gather_from_sequence", "gather_from_sequence_traced", "reduce_scatter"]
