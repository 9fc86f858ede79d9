"""Ops: expert parallel -- Megatron's dropless all-to-all token dispatch (megatron/core/transformer/moe/token_dispatcher.py).

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
from fxtron.ops.recompute import recomputing
from fxtron.ops.registry import Comm, OpSpec, register


class DispatchLog:
    """What the dispatches of one step did on this rank: `copies[layer]` the copies its tokens
    routed to each expert (E,), summed over microbatches; `kept[layer]` those each expert took
    (E,: all of them dropless, at most its capacity under a capacity factor); `dropped[layer]`
    how many went over an expert's capacity; `bytes_sent` the bytes it sent to other ranks
    (rows and per-expert counts) in every all-to-all, forward and backward."""

    def __init__(self):
        self.copies: dict[str, Tensor] = {}
        self.kept: dict[str, Tensor] = {}
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
_UNIFORM: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtron_uniform_routing", default=False)


@contextlib.contextmanager
def uniform_routing():
    """Inside, the fake kernels give the rows uniform routing would (a rank receives as many
    copies as it sends; a tp share is 1/t of them) as plain sizes, not unbacked ones: what a
    forward on fake tensors needs to run through (fxtron/tools/activations.py)."""
    token = _UNIFORM.set(True)
    try:
        yield
    finally:
        _UNIFORM.reset(token)


def _rows(uniform: int) -> int:
    """A fake kernel's data-dependent row count: `uniform` inside uniform_routing(), else unbacked."""
    return uniform if _UNIFORM.get() else torch.library.get_ctx().new_dynamic_size()


def _sent(pg, rows_to: list[int], row: Tensor, counts: int = 0) -> None:
    """Log the bytes of rows (and `counts` int64 per-expert counts) sent to other ranks."""
    log = _LOG.get()
    if log is None or recomputing():   # a recomputed layer's all-to-alls: counted once
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


def _capacity(per_expert: Tensor, capacity: float) -> int:
    """C = ceil(capacity x copies / E): the most copies an expert takes from this rank."""
    return math.ceil(capacity * int(per_expert.sum()) / per_expert.numel())


def _routes(offs: Tensor, capacity: float = 0.0, pad: bool = False, j: int = 0,
            t: int = 1) -> tuple[Tensor, Tensor, Tensor | None]:
    """Which of a rank's copies it sends each expert, and where in what it sends.

    Dropless (capacity 0) every copy; with a capacity factor (Switch, GShard) each expert
    takes at most C = ceil(capacity x copies / E) of them, the first in their sorted order
    (token order within an expert), the rest dropped (their output zero: only the residual
    carries the token); of those, share j of t (ep x tp: rows floor(n j/t) .. floor(n (j+1)/t)
    of an expert's n). With `pad` each expert's rows are padded with zeros to ceil(C/t), so
    every all-to-all has the same splits whatever the routing (Megatron's
    moe_pad_expert_input_to_capacity; a convenience for fixed shapes, no change of a number).

    Returns the rows sent per expert (E,), for every copy sent its row among the copies
    (`src`) and its row in what is sent (`dst`; None: in order, no padding)."""
    per_expert = _counts(offs)
    E = per_expert.numel()
    kept = per_expert if capacity <= 0 else per_expert.clamp(max=_capacity(per_expert, capacity))
    lo, hi = kept * j // t, kept * (j + 1) // t
    src = _segments(torch.cumsum(per_expert, 0) - per_expert + lo, hi - lo)
    if not pad:
        return hi - lo, src, None
    if capacity <= 0:
        raise ValueError("fxtron::ep ops: pad=True pads each expert's rows to its capacity, but capacity is 0 (dropless)")
    width = -(-_capacity(per_expert, capacity) // t)
    return torch.full_like(per_expert, width), src, _segments(torch.arange(E) * width, hi - lo)


def _pick(x: Tensor, send: Tensor, src: Tensor, dst: Tensor | None) -> Tensor:
    """What a rank sends (_routes): its copies x[src], at rows dst among zeros."""
    if dst is None:
        return x.index_select(0, src.to(x.device))
    out = x.new_zeros((int(send.sum()), *x.shape[1:]))
    out[dst.to(x.device)] = x.index_select(0, src.to(x.device))
    return out


def _place(got: Tensor, rows: int, src: Tensor, dst: Tensor | None) -> Tensor:
    """The inverse of _pick: (rows, ...) with what came back for each copy sent, zero for the
    copies not sent (dropped over capacity, or another tp rank's share)."""
    out = got.new_zeros((rows, *got.shape[1:]))
    out[src.to(got.device)] = got if dst is None else got.index_select(0, dst.to(got.device))
    return out


def _dispatch(x: Tensor, offs: Tensor, group: str, world: int, layer: str = "",
              capacity: float = 0.0, pad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    pg = T.resolve(group)
    T.check_world(pg, world, "ep_dispatch", group)
    E = offs.numel()
    send, src, dst = _routes(offs, capacity, pad)
    if layer:
        _log(layer, offs, capacity)
    if E % world:
        raise ValueError(f"fxtron::ep_dispatch: {E} experts do not divide over {world} ep ranks")
    x = _pick(x, send, src, dst)
    send = send.view(world, E // world)
    if pg is None:
        return x.clone(), torch.cumsum(send.reshape(-1), 0).to(offs.dtype), send.clone()
    recv = _exchange_counts(send, pg)                                           # (world, L), on the group's device
    rows_to = send.sum(1).tolist()
    if x.shape[0]:
        _sent(pg, rows_to, x[0], counts=E // world)
    rows = T.all_to_all_single(x, recv.sum(1).tolist(), rows_to, pg)
    rows = rows.index_select(0, _regroup(recv.cpu()).to(rows.device))
    return rows, torch.cumsum(recv.sum(0), 0).to(offs.dtype), recv


def _log(layer: str, offs: Tensor, capacity: float) -> None:
    """Enter a layer's routing in the active DispatchLog: its copies per expert, those each
    expert takes (all, dropless; at most its capacity C of this rank's under a capacity
    factor), and how many were dropped."""
    log = _LOG.get()
    if log is not None and not recomputing():
        per_expert = _counts(offs).detach().cpu()
        kept = per_expert if capacity <= 0 else per_expert.clamp(max=_capacity(per_expert, capacity))
        log.copies[layer] = log.copies.get(layer, 0) + per_expert
        log.kept[layer] = log.kept.get(layer, 0) + kept
        log.dropped[layer] = log.dropped.get(layer, 0) + int(per_expert.sum() - kept.sum())


def _combine(y: Tensor, offs: Tensor, counts: Tensor, rows: int, group: str, world: int,
             capacity: float = 0.0, pad: bool = False) -> Tensor:
    pg = T.resolve(group)
    T.check_world(pg, world, "ep_combine", group)
    send, src, dst = _routes(offs, capacity, pad)
    if pg is None:
        got = y
    else:
        back = torch.empty_like(y)
        back[_regroup(counts.cpu()).to(y.device)] = y                           # (source, expert) order
        rows_to = counts.sum(1).tolist()
        if y.shape[0]:
            _sent(pg, rows_to, y[0])
        got = T.all_to_all_single(back, send.view(world, -1).sum(1).tolist(), rows_to, pg)
    return _place(got, rows, src, dst)


@torch.library.custom_op("fxtron::ep_dispatch", mutates_args=())
def ep_dispatch(x: Tensor, offs: Tensor, group: str, world: int, layer: str = "",
                capacity: float = 0.0, pad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """See the module docstring. x (S, h) rows sorted by expert, offs (E,) cumulative ends;
    layer: the layer's name in the DispatchLog; capacity: 0 dropless, else the capacity
    factor c (each expert takes at most ceil(c x S / E) of this rank's copies); pad: each
    expert's rows padded with zeros to that capacity (_routes)."""
    return _dispatch(x, offs, group, world, layer, capacity, pad)


@ep_dispatch.register_fake
def _(x, offs, group, world, layer="", capacity=0.0, pad=False):
    received = _rows(x.shape[0])
    local = offs.shape[0] // world
    return (x.new_empty((received, *x.shape[1:])), offs.new_empty((local,)),
            offs.new_empty((world, local), dtype=torch.int64))


def routing_args(inputs: tuple, at: int) -> tuple[float, bool]:
    """An op's optional (capacity, pad) arguments from index `at` of its inputs, defaults filled."""
    given = tuple(inputs[at:at + 2])
    return given + (0.0, False)[len(given):]


def _dispatch_setup(ctx, inputs, output):
    x, offs, ctx.group, ctx.world = inputs[:4]
    ctx.capacity, ctx.pad = routing_args(inputs, 5)
    ctx.rows = x.shape[0]
    ctx.save_for_backward(offs, output[2])


def _dispatch_bwd(ctx, grad_rows, grad_offs, grad_counts):
    offs, counts = ctx.saved_tensors
    dx = _combine(grad_rows.contiguous(), offs, counts, ctx.rows, ctx.group, ctx.world, ctx.capacity, ctx.pad)
    return dx, None, None, None, None, None, None


ep_dispatch.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


@torch.library.custom_op("fxtron::ep_combine", mutates_args=())
def ep_combine(y: Tensor, offs: Tensor, counts: Tensor, rows: int, group: str, world: int,
               capacity: float = 0.0, pad: bool = False) -> Tensor:
    """See the module docstring. y (R, h) rows of the local experts as ep_dispatch gave them;
    offs and counts as ep_dispatch took and returned them; rows: S, the dispatched x's rows;
    capacity and pad as ep_dispatch took them (dropped copies come back zero)."""
    return _combine(y, offs, counts, rows, group, world, capacity, pad)


@ep_combine.register_fake
def _(y, offs, counts, rows, group, world, capacity=0.0, pad=False):
    return y.new_empty((rows, *y.shape[1:]))


def _combine_setup(ctx, inputs, output):
    _, offs, counts, _, ctx.group, ctx.world = inputs[:6]
    ctx.capacity, ctx.pad = routing_args(inputs, 6)
    ctx.save_for_backward(offs)


def _combine_bwd(ctx, grad):
    (offs,) = ctx.saved_tensors
    rows, _, _ = _dispatch(grad.contiguous(), offs, ctx.group, ctx.world, capacity=ctx.capacity, pad=ctx.pad)
    return rows, None, None, None, None, None, None, None


ep_combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


register(OpSpec("ep_dispatch", axis_arg=2, forward=Comm("all_to_all", "copies", count=2),
                backward=Comm("all_to_all", "copies")))
register(OpSpec("ep_combine", axis_arg=4, forward=Comm("all_to_all", "copies"),
                backward=Comm("all_to_all", "copies", count=2)))


# ---------------------------------------------------------------- shares over tp (Megatron's order)
#
# At ep x tp the tp ranks of an ep rank hold the same copies (the tokens gathered over tp). In
# Megatron each tp rank dispatches only its own part -- its S/tp tokens -- and the rows an expert
# rank receives are all-gathered over tp before the tp-split experts, their partial outputs
# reduce-scattered over tp before the way back. fxtron's copies are whole on every tp rank, so
# tp rank j dispatches *share* j of every expert's copies, rows floor(n j/tp) .. floor(n (j+1)/tp)
# of the expert's n (every tp rank knows every share from the counts):
#
#     ep_share(copies, offs, "tp", t)        -> this tp rank's share and its offsets
#     ep_dispatch(share, share offs, "ep", n) -> the share's rows at the experts' ranks
#     ep_gather(rows, offs, counts, "tp", t) -> every share's rows, grouped by local expert
#     ... the experts, tp-split: a partial sum ...
#     ep_scatter(out, counts, "tp", t)       -> this share's rows, summed over tp
#     ep_combine(.., "ep", n)                -> back at the tokens' rank
#     ep_unshare(.., offs, S, "tp", t)       -> (S, h): this share's rows, zero elsewhere --
#                                               a partial sum over tp, reduced with the layer's
#
# so each all-to-all carries 1/tp of the copies, as Megatron's do. Rows an expert rank holds
# come in (local expert, source rank, share) order: the rows of ep_dispatch without tp.


def _segments(starts: Tensor, sizes: Tensor) -> Tensor:
    """The indices start_i .. start_i + size_i - 1 of every segment i, concatenated."""
    sizes = sizes.to(torch.int64).cpu()
    total = int(sizes.sum())
    first = torch.repeat_interleave(starts.to(torch.int64).cpu() - (torch.cumsum(sizes, 0) - sizes), sizes)
    return first + torch.arange(total, dtype=torch.int64)


def _share_order(counts: Tensor) -> list[Tensor]:
    """counts (t, world, L) [share, source, local expert]: for each share q, the indices into
    the rows grouped (local expert, source, share) of share q's rows in its own (local expert,
    source) order."""
    t, world, local = counts.shape
    flat = counts.permute(2, 1, 0).reshape(-1).to(torch.int64).cpu()     # (l, s, q) order
    starts = (torch.cumsum(flat, 0) - flat).view(local, world, t)
    by = counts.permute(2, 1, 0).to(torch.int64).cpu()
    return [_segments(starts[:, :, q].reshape(-1), by[:, :, q].reshape(-1)) for q in range(t)]


def _gather_shares(rows: Tensor, counts: Tensor, pg) -> Tensor:
    """Every share's rows (each tp rank's `rows`, its counts counts[q]) in (local expert, source,
    share) order: one all-gather, padded to the longest share."""
    order = _share_order(counts)
    sizes = [len(o) for o in order]
    pad = rows.new_zeros((max(sizes), *rows.shape[1:]))
    pad[:rows.shape[0]] = rows
    parts = T.all_gather(pad, pg)
    out = rows.new_empty((sum(sizes), *rows.shape[1:]))
    for q, o in enumerate(order):
        out[o.to(rows.device)] = parts[q][:sizes[q]]
    return out


def _scatter_shares(y: Tensor, counts: Tensor, pg) -> Tensor:
    """The inverse of _gather_shares on partial sums: each share's rows summed over the tp
    ranks, this rank's share kept (one reduce-scatter, padded to the longest share)."""
    order = _share_order(counts)
    sizes = [len(o) for o in order]
    m = max(sizes)
    stacked = y.new_zeros((len(order) * m, *y.shape[1:]))
    for q, o in enumerate(order):
        stacked[q * m:q * m + sizes[q]] = y[o.to(y.device)]
    mine = T.reduce_scatter(stacked, 0, pg)
    return mine[:sizes[dist.get_rank(pg)]].contiguous()


def _gathered_counts(counts: Tensor, pg) -> Tensor:
    """(world, L) this rank's share counts -> (t, world, L) every share's."""
    return torch.stack(T.all_gather(counts.contiguous(), pg))     # on the rows' device: NCCL takes no CPU tensor


def _share_coord(group: str, world: int, op: str) -> tuple[object, int]:
    pg = T.resolve(group)
    T.check_world(pg, world, op, group)
    return pg, (0 if pg is None else dist.get_rank(pg))


@torch.library.custom_op("fxtron::ep_share", mutates_args=())
def ep_share(x: Tensor, offs: Tensor, group: str, world: int, layer: str = "",
             capacity: float = 0.0, pad: bool = False) -> tuple[Tensor, Tensor]:
    """This tp rank's share of every expert's copies (see above): (rows, their offsets (E,)).
    x (S, h) and offs (E,) as ep_dispatch takes them, whole on every rank of `group`;
    capacity and pad as ep_dispatch's (applied here: the share is of the kept copies, each
    expert's padded to ceil(C/t)); layer: the layer's name in the DispatchLog (the whole
    layer's copies, as ep_dispatch logs them)."""
    _, j = _share_coord(group, world, "ep_share")
    send, src, dst = _routes(offs, capacity, pad, j, world)
    if layer:
        _log(layer, offs, capacity)
    return _pick(x, send, src, dst), torch.cumsum(send, 0).to(offs.dtype)


@ep_share.register_fake
def _(x, offs, group, world, layer="", capacity=0.0, pad=False):
    rows = _rows(-(-x.shape[0] // world))
    return x.new_empty((rows, *x.shape[1:])), torch.empty_like(offs)


def _share_setup(ctx, inputs, output):
    x, offs, ctx.group, ctx.world = inputs[:4]
    ctx.capacity, ctx.pad = routing_args(inputs, 5)
    ctx.rows = x.shape[0]
    ctx.save_for_backward(offs)


def _share_bwd(ctx, grad, grad_offs):
    (offs,) = ctx.saved_tensors
    return _unshare(grad, offs, ctx.rows, ctx.group, ctx.world, ctx.capacity, ctx.pad), None, None, None, None, None, None


ep_share.register_autograd(_share_bwd, setup_context=_share_setup)


def _share_routes(offs: Tensor, group: str, world: int, capacity: float, pad: bool):
    _, j = _share_coord(group, world, "ep_share")
    return _routes(offs, capacity, pad, j, world)


def _unshare(y: Tensor, offs: Tensor, rows: int, group: str, world: int, capacity: float, pad: bool) -> Tensor:
    _, src, dst = _share_routes(offs, group, world, capacity, pad)
    return _place(y, rows, src, dst)


@torch.library.custom_op("fxtron::ep_unshare", mutates_args=())
def ep_unshare(y: Tensor, offs: Tensor, rows: int, group: str, world: int, capacity: float = 0.0,
               pad: bool = False) -> Tensor:
    """The inverse of ep_share: (rows, h) with this tp rank's share in place and zeros
    elsewhere (its sum over the group is every share). Backward: the share of the gradient."""
    return _unshare(y, offs, rows, group, world, capacity, pad)


@ep_unshare.register_fake
def _(y, offs, rows, group, world, capacity=0.0, pad=False):
    return y.new_empty((rows, *y.shape[1:]))


def _unshare_setup(ctx, inputs, output):
    _, offs, _, ctx.group, ctx.world = inputs[:5]
    ctx.capacity, ctx.pad = routing_args(inputs, 5)
    ctx.save_for_backward(offs)


def _unshare_bwd(ctx, grad):
    (offs,) = ctx.saved_tensors
    send, src, dst = _share_routes(offs, ctx.group, ctx.world, ctx.capacity, ctx.pad)
    return _pick(grad, send, src, dst), None, None, None, None, None, None


ep_unshare.register_autograd(_unshare_bwd, setup_context=_unshare_setup)


@torch.library.custom_op("fxtron::ep_gather", mutates_args=())
def ep_gather(rows: Tensor, offs: Tensor, counts: Tensor, group: str, world: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every tp rank's dispatched share at this expert rank: rows, local offsets and counts
    (world, L) as ep_dispatch returned them for this rank's share -> all shares' rows in
    (local expert, source, share) order, their local offsets (L,) and every share's counts
    (t, world, L) for ep_scatter. Backward: the gradient's share rows summed over the group
    (its parts are partial sums: the gradients of tp-split experts' inputs)."""
    pg, _ = _share_coord(group, world, "ep_gather")
    if pg is None:
        return rows.clone(), offs.clone(), counts.unsqueeze(0).clone()
    every = _gathered_counts(counts, pg)
    return _gather_shares(rows, every, pg), torch.cumsum(every.sum((0, 1)), 0).to(offs.dtype), every


@ep_gather.register_fake
def _(rows, offs, counts, group, world):
    n = _rows(rows.shape[0] * world)
    return rows.new_empty((n, *rows.shape[1:])), torch.empty_like(offs), counts.new_empty((world, *counts.shape))


def _gather_setup(ctx, inputs, output):
    ctx.group, ctx.world = inputs[3], inputs[4]
    ctx.save_for_backward(output[2])


def _gather_bwd(ctx, grad, grad_offs, grad_counts):
    (every,) = ctx.saved_tensors
    pg = T.resolve(ctx.group)
    dx = grad.clone() if pg is None else _scatter_shares(grad.contiguous(), every, pg)
    return dx, None, None, None, None


ep_gather.register_autograd(_gather_bwd, setup_context=_gather_setup)


@torch.library.custom_op("fxtron::ep_scatter", mutates_args=())
def ep_scatter(y: Tensor, counts: Tensor, group: str, world: int) -> Tensor:
    """The way back of ep_gather: y (R, h), partial sums over the group in (local expert,
    source, share) order, counts (t, world, L) as ep_gather gave them -> this tp rank's share's
    rows, summed over the group. Backward: the gradient gathered as ep_gather gathers rows."""
    pg, _ = _share_coord(group, world, "ep_scatter")
    return y.clone() if pg is None else _scatter_shares(y.contiguous(), counts, pg)


@ep_scatter.register_fake
def _(y, counts, group, world):
    n = _rows(y.shape[0] // world)
    return y.new_empty((n, *y.shape[1:]))


def _scatter_setup(ctx, inputs, output):
    ctx.group, ctx.world = inputs[2], inputs[3]
    ctx.save_for_backward(inputs[1])


def _scatter_bwd(ctx, grad):
    (every,) = ctx.saved_tensors
    pg = T.resolve(ctx.group)
    return (grad.clone() if pg is None else _gather_shares(grad.contiguous(), every, pg)), None, None, None


ep_scatter.register_autograd(_scatter_bwd, setup_context=_scatter_setup)


register(OpSpec("ep_share", axis_arg=2))                  # no communication: a rank's pick of its share
register(OpSpec("ep_unshare", axis_arg=3))
register(OpSpec("ep_gather", axis_arg=3, forward=Comm("all_gather", "shares", count=2),
                backward=Comm("reduce_scatter", "shares"), sums_grad=True))
register(OpSpec("ep_scatter", axis_arg=2, forward=Comm("reduce_scatter", "input"),
                backward=Comm("all_gather", "grad_input")))

__all__ = ["DispatchLog", "ep_combine", "ep_dispatch", "ep_gather", "ep_scatter", "ep_share", "ep_unshare", "routing_args"]
