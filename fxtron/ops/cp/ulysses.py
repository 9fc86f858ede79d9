"""Ops, context parallel, attention over a head split (cp_comm_type="a2a", DeepSpeed-Ulysses).

`cp_all_to_all` turns q, k and v from the rank's sequence chunks of every head into every token
of 1/n of the heads; the sequence is put in natural order (zigzag, layout.py), attention runs
as the model wrote it, and the inverse all-to-all brings the rank's chunks of every head back.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register


@torch.library.custom_op("fxtron::cp_all_to_all", mutates_args=())
def cp_all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, world: int, group: str) -> Tensor:
    """DeepSpeed-Ulysses' all-to-all over the cp group: x cut into `world` equal parts along
    `scatter_dim`, part j sent to rank j; the parts every rank sent this one, in rank order,
    joined along `gather_dim`. (B, H, S/n, D) with scatter 1, gather 2 -> (B, H/n, S, D), the
    sequence in the ranks' order (load-balanced chunks: zigzag restores it). Backward: the
    inverse all-to-all (the dims swapped)."""
    pg = T.resolve(group)
    T.check_world(pg, world, "cp_all_to_all", group)
    return _a2a(x, scatter_dim, gather_dim, world, pg)


def _a2a(x: Tensor, scatter_dim: int, gather_dim: int, world: int, pg) -> Tensor:
    if pg is None:
        return x.clone()
    parts = torch.stack(x.chunk(world, dim=scatter_dim))          # (world, ...) in rank order
    got = T.all_to_all_single(parts, [1] * world, [1] * world, pg)
    out = _laid_out(x, scatter_dim, gather_dim, world)
    return out.copy_(torch.cat(got.unbind(0), dim=gather_dim))


def _laid_out(x: Tensor, scatter_dim: int, gather_dim: int, world: int) -> Tensor:
    """The empty output: x's shape with scatter_dim / world and gather_dim x world. Heads
    gathered back (gather_dim before scatter_dim) lie in memory after the sequence, as
    attention's own output (B, H, S, D) lies over (B, S, H, D): the model's transpose and view
    after the attention rely on it."""
    shape = list(x.shape)
    shape[scatter_dim] //= world
    shape[gather_dim] *= world
    order = list(range(x.dim()))
    if gather_dim < scatter_dim:
        order[gather_dim], order[scatter_dim] = scatter_dim, gather_dim
    back = [order.index(d) for d in range(x.dim())]
    return x.new_empty([shape[d] for d in order]).permute(back)


@cp_all_to_all.register_fake
def _(x, scatter_dim, gather_dim, world, group):
    return _laid_out(x, scatter_dim, gather_dim, world)


def _a2a_bwd(ctx, grad):
    return cp_all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.world, ctx.group), None, None, None, None


def _a2a_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.world, ctx.group = inputs


cp_all_to_all.register_autograd(_a2a_bwd, setup_context=_a2a_setup)
register(OpSpec("cp_all_to_all", axis_arg=4, forward=Comm("all_to_all", "input"),
                backward=Comm("all_to_all", "grad_output")))


__all__ = ["cp_all_to_all"]
