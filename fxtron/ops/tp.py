"""Ops, tensor parallel: Megatron's conjugate communication pairs as traceable torch custom ops (fxtron::*), over
any mesh axis.

Each op is registered with torch.library, so it appears in a per-rank FX graph as
`torch.ops.fxtron.<name>.default`, has a fake (meta) implementation that computes shapes with
no process group, and an autograd formula whose backward is the conjugate op (Megatron's
tensor_parallel/mappings.py; sequence parallel's pair is ops/sp.py):

    op (schema)                                                    forward           backward
    copy_to_region(Tensor x, str group)                            identity          all-reduce  (f)
    all_reduce(Tensor x, str group)                                all-reduce SUM    identity    (g)
    all_gather(Tensor x, int dim, int[] interleave, int world, str group)
                                                                   all-gather        slice
    scatter(Tensor x, int dim, int[] interleave, int world, str group)
                                                                   slice             all-gather

`group` names the mesh axis in a compiled graph ("tp"; the registry's `axis_arg` says which
argument it is) and the process group (`ProcessGroup.group_name`) in a program's graph, bound
by runtime/bind.py; the empty string "" or a group of one rank means no communication: the op
is then the identity (or a plain slice), and ops that take `world` require world == 1.
`world` is the group's size, passed explicitly so the fake implementation needs no group.
Gathered and sliced dims use the interleaved layout of `fxtron.core.layout` (rank = the
rank's index in the group; `interleave` is [k] for k equal blocks or the blocks' proportions,
layout.to_list). Outputs never alias inputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.core.layout import check_divisible, from_list, shard, unshard
from fxtron.ops import transport as T
from fxtron.ops.linear import active_queue
from fxtron.ops.registry import Comm, OpSpec, register

_group = T.resolve
_norm = T.norm_dim


# ---------------------------------------------------------------------------------------------
# f and g


@torch.library.custom_op("fxtron::copy_to_region", mutates_args=())
def copy_to_region(x: Tensor, group: str) -> Tensor:
    """Megatron's f (enter a tp region). In: x, replicated. Out: a copy of x. Backward:
    all-reduce SUM of the gradient over `group`."""
    return x.clone()


@copy_to_region.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_to_region_bwd(ctx, grad):
    queue, pg = active_queue(), _group(ctx.group)
    if pg is None or queue is None or not queue.jobs:
        return all_reduce(grad, ctx.group), None
    # the input gradient's all-reduce runs while the queued weight-gradient GEMMs compute
    # (Megatron's async dgrad all-reduce overlapping the wgrad GEMM)
    out = grad.clone(memory_format=torch.contiguous_format)
    work = T.start_all_reduce(out, pg)
    queue.drain()
    work.wait()
    return out, None


def _setup_group(ctx, inputs, output):
    ctx.group = inputs[-1]


copy_to_region.register_autograd(_copy_to_region_bwd, setup_context=_setup_group)


@torch.library.custom_op("fxtron::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    """Megatron's g (leave a tp region). In: x, this rank's partial sum. Out: a new tensor, the
    sum over `group`. Backward: identity."""
    return T.summed(x, _group(group))


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_bwd(ctx, grad):
    return grad, None


all_reduce.register_autograd(_all_reduce_bwd)


class _CopyToRegion(torch.autograd.Function):
    """copy_to_region as a program runs it: the op's forward and backward without the
    dispatcher's trips through Python (see ops/linear.py _Linear). Forward is a view, not
    a copy: a program's graph is functional, nothing writes into it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    backward = staticmethod(_copy_to_region_bwd)


class _AllReduce(torch.autograd.Function):
    """all_reduce as a program runs it (see _CopyToRegion)."""

    @staticmethod
    def forward(ctx, x, group):
        return T.summed(x, _group(group))

    backward = staticmethod(_all_reduce_bwd)


class _CopyToRegionTraced(torch.autograd.Function):
    """copy_to_region as a compiled region holds it (codegen/regions.py, where the region holds
    the linears around it): an identity forward, a backward that calls fxtron::all_reduce, both
    traced by Dynamo into the region's forward and backward graphs (the collective an opaque
    call inside them, between fused kernels). The forward is a copy, not a view: a region that
    returns both a value and this function's view of it would have the view rebuilt outside the
    compiled graph as a plain view (AOTAutograd's output-alias handling), and this backward's
    all-reduce skipped -- the gradient reaching x through the view left a partial sum. Inductor
    drops the copy wherever the output is not a region's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.fxtron.all_reduce.default(grad, ctx.group), None


def copy_to_region_traced(x: Tensor, group: str) -> Tensor:
    """The form of copy_to_region a compiled region traces."""
    return _CopyToRegionTraced.apply(x, group)


def copy_to_region_eager(x: Tensor, group: str) -> Tensor:
    """The run-time form of copy_to_region (a program's graph calls it; runtime/bind.py)."""
    return _CopyToRegion.apply(x, group)


def all_reduce_eager(x: Tensor, group: str) -> Tensor:
    """The run-time form of all_reduce."""
    return _AllReduce.apply(x, group)


# ---------------------------------------------------------------------------------------------
# gather / slice along a dim (interleaved layout of shard.py)


def _gathered_shape(x: Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[_norm(dim, x.dim())] *= world
    return shape


def _sliced_shape(x: Tensor, dim: int, interleave: list[int], world: int, op: str) -> list[int]:
    shape = list(x.shape)
    d = _norm(dim, x.dim())
    if isinstance(shape[d], int):
        check_divisible(shape[d], world, from_list(interleave), f"fxtron::{op} input dim {d} of shape {tuple(shape)}")
    shape[d] //= world
    return shape


@torch.library.custom_op("fxtron::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, interleave: list[int], world: int, group: str) -> Tensor:
    """In: this rank's shard (dim of size k*part). Out: the full tensor, dim world times larger,
    assembled with the interleave (shard.unshard of every rank's x). Backward: this rank's shard
    of the gradient (a slice, no communication)."""
    pg = _group(group)
    T.check_world(pg, world, "all_gather", group)
    dim = _norm(dim, x.dim())
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return unshard(T.all_gather(x, pg), dim, from_list(interleave))


@all_gather.register_fake
def _(x, dim, interleave, world, group):
    return x.new_empty(_gathered_shape(x, dim, world))


def _all_gather_bwd(ctx, grad):
    return scatter(grad, ctx.dim, ctx.interleave, ctx.world, ctx.group), None, None, None, None


def _setup_dim(ctx, inputs, output):
    ctx.dim, ctx.interleave, ctx.world, ctx.group = inputs[1:]


all_gather.register_autograd(_all_gather_bwd, setup_context=_setup_dim)


@torch.library.custom_op("fxtron::scatter", mutates_args=())
def scatter(x: Tensor, dim: int, interleave: list[int], world: int, group: str) -> Tensor:
    """In: the full tensor, the same on every rank. Out: this rank's shard along dim (shard.shard
    with rank = this rank's index in `group`), a new tensor. Backward: all-gather."""
    pg = _group(group)
    T.check_world(pg, world, "scatter", group)
    dim = _norm(dim, x.dim())
    check_divisible(x.shape[dim], world, from_list(interleave), f"fxtron::scatter input dim {dim} of shape {tuple(x.shape)}")
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return shard(x, dim, world, dist.get_rank(pg), from_list(interleave))


@scatter.register_fake
def _(x, dim, interleave, world, group):
    return x.new_empty(_sliced_shape(x, dim, interleave, world, "scatter"))


def _scatter_bwd(ctx, grad):
    return all_gather(grad, ctx.dim, ctx.interleave, ctx.world, ctx.group), None, None, None, None


scatter.register_autograd(_scatter_bwd, setup_context=_setup_dim)


# ---------------------------------------------------------------------------------------------
# what each op communicates (the collective report and the program's binding read this)

register(OpSpec("copy_to_region", axis_arg=1, backward=Comm("all_reduce", "grad_output"),
                eager=copy_to_region_eager))
register(OpSpec("all_reduce", axis_arg=1, forward=Comm("all_reduce", "input"), eager=all_reduce_eager))
register(OpSpec("all_gather", axis_arg=4, forward=Comm("all_gather", "output")))
register(OpSpec("scatter", axis_arg=4, backward=Comm("all_gather", "grad_input")))

__all__ = ["all_gather", "all_reduce", "copy_to_region", "copy_to_region_traced", "scatter"]
