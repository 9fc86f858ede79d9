"""Ops: expert parallel -- Megatron's dropless all-to-all token dispatch (MEGATRON.md 6).

E experts over the `world` ranks of an ep group: rank r holds experts [r*L, (r+1)*L), L = E /
world (Megatron's local_expert_indices, contiguous). A rank's token copies arrive sorted by
expert with cumulative ends `offs` (E,) -- what a grouped GEMM over all E experts would take.

    ep_dispatch(x, offs, group, world) -> (rows, local_offs, counts)
        the per-expert counts are exchanged (an all-to-all of E ints), every copy goes to the
        rank of its expert (all_to_all_single, uneven splits, zeros allowed), and the rows a
        rank receives -- grouped by source rank, then by expert -- are re-sorted by local expert
        (Megatron's sort_chunks_by_idxs): rows (R, h) and local_offs (L,) are what the grouped
        GEMM of the L local experts takes; counts (world, L) [source, local expert] is what
        ep_combine needs. Backward: ep_combine of the gradient.
    ep_combine(y, offs, counts, group, world) -> (S, h)
        the inverse: rows back in (source, expert) order, the reverse all-to-all, the copies in
        the order they were dispatched (rows past offs[-1] zero). Backward: dispatch.

The received row count depends on the routing, so the fake kernels return an unbacked size.
With world 1 (no group) both are the identity on the rows.

What the routing really did is seen through a `DispatchLog` made active around a step: the
copies each layer's tokens sent to each expert (ep_dispatch's `layer` names the layer), and the
bytes this rank sent to other ranks in every all-to-all, forward and backward.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register


class DispatchLog:
    """What the dispatches of one step did on this rank: `copies[layer]` the copies its tokens
    sent to each expert (E,), summed over microbatches; `dropped[layer]` how many of them went
    over an expert's capacity (capacity-factor routing only); `bytes_sent` the bytes it sent to
    other ranks (rows and per-expert counts) in every all-to-all, forward and backward."""

    def __init__(self):
        self.copies: dict[str, Tensor] = {}
        self.dropped: dict[str, int] = {}     # copies over an expert's capacity (capacity-factor routing)
        self.bytes_sent = 0

    @contextlib.contextmanager
    def active(self):
        token = _LOG.set(self)
        try:
            yield self
        finally:
            _LOG.reset(token)


_LOG: contextvars.ContextVar[DispatchLog | None] = contextvars.ContextVar("fxtron_dispatch_log", default=None)


def _sent(pg, rows_to: list[int], row: Tensor, counts: int = 0) -> None:
    """Log the bytes of rows (and `counts` int64 per-expert counts) sent to other ranks."""
    log = _LOG.get()
    if log is None:
        return
    me = dist.get_rank(pg)
    elsewhere = sum(n for r, n in enumerate(rows_to) if r != me)
    log.bytes_sent += elsewhere * row.numel() * row.element_size() + counts * (len(rows_to) - 1) * 8


def _counts(offs: Tensor) -> Tensor:
    """Rows per expert from cumulative ends."""
    ends = offs.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _regroup(counts: Tensor) -> Tensor:
    """For rows grouped by (source, local expert) with counts (world, L): the row indices that
    group them by (local expert, source) instead."""
    world, local = counts.shape
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    starts = starts.view(world, local)
    pieces = [torch.arange(int(starts[s, j]), int(starts[s, j] + counts[s, j]))
              for j in range(local) for s in range(world)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _exchange_counts(send: Tensor, pg) -> Tensor:
    """send (world, L): row r the counts for rank r's experts; returns (world, L), row s the
    counts rank s sends this one."""
    world = send.shape[0]
    out = T.all_to_all_single(send.reshape(world, -1), [1] * world, [1] * world, pg)
    return out.view_as(send)


def _kept(per_expert: Tensor, capacity: float) -> tuple[Tensor, Tensor | None]:
    """Capacity-factor routing (Switch, GShard): each expert takes at most C = ceil(capacity x
    copies / E) of this rank's copies, the first in their sorted order (token order within an
    expert); the rest are dropped (their output zero: only the residual carries the token).
    Returns the kept count per expert and the row indices of the kept copies (None: all kept,
    dropless, capacity 0)."""
    if capacity <= 0:
        return per_expert, None
    E = per_expert.numel()
    cap = math.ceil(capacity * int(per_expert.sum()) / E)
    kept = per_expert.clamp(max=cap)
    starts = torch.cumsum(per_expert, 0) - per_expert
    idx = [torch.arange(int(s), int(s) + int(k)) for s, k in zip(starts.tolist(), kept.tolist())]
    return kept, (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(per_expert.device)


def _dispatch(x: Tensor, offs: Tensor, group: str, world: int, layer: str = "",
              capacity: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    pg = T.resolve(group)
    T.check_world(pg, world, "ep_dispatch", group)
    per_expert = _counts(offs)
    E = per_expert.numel()
    kept, idx = _kept(per_expert, capacity)
    log = _LOG.get()
    if layer and log is not None:
        log.copies[layer] = log.copies.get(layer, 0) + per_expert.detach().cpu()
        log.dropped[layer] = log.dropped.get(layer, 0) + int((per_expert - kept).sum())
    if E % world:
        raise ValueError(f"fxtron::ep_dispatch: {E} experts do not divide over {world} ep ranks")
    send = kept.view(world, E // world)
    x = x[:int(per_expert.sum())] if idx is None else x.index_select(0, idx)
    if pg is None:
        return x.clone(), torch.cumsum(kept, 0).to(offs.dtype), send.clone()
    recv = _exchange_counts(send.cpu(), pg).to(send.device)                    # (world, L)
    rows_to = send.sum(1).tolist()
    if x.shape[0]:
        _sent(pg, rows_to, x[0], counts=E // world)
    rows = T.all_to_all_single(x, recv.sum(1).tolist(), rows_to, pg)
    rows = rows.index_select(0, _regroup(recv.cpu()).to(rows.device))
    return rows, torch.cumsum(recv.sum(0), 0).to(offs.dtype), recv


def _combine(y: Tensor, offs: Tensor, counts: Tensor, rows: int, group: str, world: int,
             capacity: float = 0.0) -> Tensor:
    pg = T.resolve(group)
    T.check_world(pg, world, "ep_combine", group)
    kept, idx = _kept(_counts(offs), capacity)
    send = kept.view(world, -1)
    out = y.new_zeros((rows, *y.shape[1:]))
    if pg is None:
        got = y
    else:
        back = torch.empty_like(y)
        back[_regroup(counts.cpu()).to(y.device)] = y                           # (source, expert) order
        rows_to = counts.sum(1).tolist()
        if y.shape[0]:
            _sent(pg, rows_to, y[0])
        got = T.all_to_all_single(back, send.sum(1).tolist(), rows_to, pg)
    if idx is None:
        out[:got.shape[0]] = got
    else:
        out[idx] = got                                                          # dropped copies stay zero
    return out


@torch.library.custom_op("fxtron::ep_dispatch", mutates_args=())
def ep_dispatch(x: Tensor, offs: Tensor, group: str, world: int, layer: str = "",
                capacity: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """See the module docstring. x (S, h) rows sorted by expert, offs (E,) cumulative ends;
    layer: the layer's name in the DispatchLog; capacity: 0 dropless, else the capacity
    factor c (each expert takes at most ceil(c x S / E) of this rank's copies)."""
    return _dispatch(x, offs, group, world, layer, capacity)


@ep_dispatch.register_fake
def _(x, offs, group, world, layer="", capacity=0.0):
    ctx = torch.library.get_ctx()
    received = ctx.new_dynamic_size()
    local = offs.shape[0] // world
    return (x.new_empty((received, *x.shape[1:])), offs.new_empty((local,)),
            offs.new_empty((world, local), dtype=torch.int64))


def _dispatch_setup(ctx, inputs, output):
    x, offs, ctx.group, ctx.world = inputs[:4]
    ctx.capacity = inputs[5] if len(inputs) > 5 else 0.0
    ctx.rows = x.shape[0]
    ctx.save_for_backward(offs, output[2])


def _dispatch_bwd(ctx, grad_rows, grad_offs, grad_counts):
    offs, counts = ctx.saved_tensors
    dx = _combine(grad_rows.contiguous(), offs, counts, ctx.rows, ctx.group, ctx.world, ctx.capacity)
    return dx, None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


@torch.library.custom_op("fxtron::ep_combine", mutates_args=())
def ep_combine(y: Tensor, offs: Tensor, counts: Tensor, rows: int, group: str, world: int,
               capacity: float = 0.0) -> Tensor:
    """See the module docstring. y (R, h) rows of the local experts as ep_dispatch gave them;
    offs and counts as ep_dispatch took and returned them; rows: S, the dispatched x's rows;
    capacity as ep_dispatch took it (dropped copies come back zero)."""
    return _combine(y, offs, counts, rows, group, world, capacity)


@ep_combine.register_fake
def _(y, offs, counts, rows, group, world, capacity=0.0):
    return y.new_empty((rows, *y.shape[1:]))


def _combine_setup(ctx, inputs, output):
    _, offs, counts, _, ctx.group, ctx.world = inputs[:6]
    ctx.capacity = inputs[6] if len(inputs) > 6 else 0.0
    ctx.save_for_backward(offs)


def _combine_bwd(ctx, grad):
    (offs,) = ctx.saved_tensors
    rows, _, _ = _dispatch(grad.contiguous(), offs, ctx.group, ctx.world, capacity=ctx.capacity)
    return rows, None, None, None, None, None, None


ep_combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


register(OpSpec("ep_dispatch", axis_arg=2, forward=Comm("all_to_all", "copies", count=2),
                backward=Comm("all_to_all", "copies")))
register(OpSpec("ep_combine", axis_arg=4, forward=Comm("all_to_all", "copies"),
                backward=Comm("all_to_all", "copies", count=2)))

__all__ = ["DispatchLog", "ep_combine", "ep_dispatch"]
