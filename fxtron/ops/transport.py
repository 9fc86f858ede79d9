"""Ops: the transport primitives the communicating ops are written with -- the only place that
calls torch.distributed's collectives for them. A group is named by its process group's name
(`ProcessGroup.group_name`, resolved with torch.distributed's `_resolve_process_group`); "" or a
group of one rank means no communication. Where a group has a shared-memory channel (ops/shm.py,
ranks of one host under gloo) the primitives go through it. Every operation is entered in the
ledger (ops/ledger.py: the flight recorder, and the order check across the group when on).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.core.layout import shard, unshard
from fxtron.ops import ledger, shm


def resolve(group: str):
    """The ProcessGroup named `group`, or None when no communication is needed ("" or 1 rank)."""
    if not group:
        return None
    pg = dist.distributed_c10d._resolve_process_group(group)
    return None if pg.size() == 1 else pg


def group_size(group: str) -> int:
    pg = resolve(group)
    return 1 if pg is None else pg.size()


def check_world(pg, world: int, op: str, group: str) -> None:
    size = 1 if pg is None else pg.size()
    if world != size:
        raise ValueError(f"fxtron::{op}: world={world} but group {group!r} has {size} rank(s); "
                         f"pass the group's size as world")


def all_reduce(t: Tensor, pg, op=dist.ReduceOp.SUM, out: Tensor | None = None) -> Tensor:
    """All-reduce contiguous `t` over `pg` into `out` (a contiguous tensor of t's shape; default
    t itself, which must then be a fresh tensor); returns out. Through the group's shared-memory
    channel where it has one, which reads t directly: no copy of t first."""
    with ledger.collective(pg, "all_reduce(max)" if op == dist.ReduceOp.MAX else "all_reduce", t):
        comm = shm.channel(pg.group_name)
        if comm is not None:
            return comm.all_reduce(t, shm.OP_MAX if op == dist.ReduceOp.MAX else shm.OP_SUM, out=out)
        if out is not None:
            t = out.copy_(t)
        dist.all_reduce(t, op=op, group=pg)
        return t


def summed(x: Tensor, pg) -> Tensor:
    """A new contiguous tensor: the sum of x over pg (a copy of x without a group)."""
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    return all_reduce(x, pg, out=torch.empty_like(x))


def start_all_reduce(t: Tensor, pg):
    """Begin an all-reduce SUM of contiguous `t` in place; returns a work whose wait()
    completes it. Other collectives may run before the wait (through a shared-memory channel
    the next one completes this one first)."""
    e = ledger.issue(pg, "all_reduce", t)
    comm = shm.channel(pg.group_name)
    try:
        work = comm.start_all_reduce(t) if comm is not None else dist.all_reduce(t, group=pg, async_op=True)
    except Exception as exc:  # noqa: BLE001 - a backend's error, whatever its type
        raise ledger.failure(e, exc) from exc
    return ledger.started(e, work)


def all_gather(t: Tensor, pg) -> list[Tensor]:
    """Every rank's `t` (same shape everywhere), in group-rank order."""
    with ledger.collective(pg, "all_gather", t):
        comm = shm.channel(pg.group_name)
        if comm is not None:
            return comm.all_gather(t)
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(pg.size())]
        dist.all_gather(out, t, group=pg)
        return out


def gather(t: Tensor, dim: int, pg) -> Tensor:
    """Every rank's `t` concatenated along `dim` in group-rank order (a new tensor)."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        with ledger.collective(pg, "all_gather", t):
            return comm.gather(t, dim)
    return unshard(all_gather(t, pg), dim, 1)


class _Done:
    """A collective already complete: wait() returns its result."""

    def __init__(self, out: Tensor):
        self._out = out

    def wait(self) -> Tensor:
        return self._out


def start_gather(t: Tensor, dim: int, pg):
    """Begin `gather(t, dim, pg)`; returns a work whose wait() returns the whole tensor. Only
    local computation may run before the wait (a linear's input-gradient GEMM while its
    sequence-parallel input is gathered again: Megatron's overlap). Through the shared-memory
    channel the gather completes here."""
    if shm.channel(pg.group_name) is not None:
        return _Done(gather(t, dim, pg))
    world = pg.size()
    src = t.movedim(dim, 0).contiguous()
    e = ledger.issue(pg, "all_gather", t)
    try:
        if dist.get_backend(pg) == "nccl":
            out = src.new_empty((world * src.shape[0], *src.shape[1:]))
            work = dist.all_gather_into_tensor(out, src, group=pg, async_op=True)
            finish = lambda: out.movedim(0, dim).contiguous()  # noqa: E731
        else:
            parts = [torch.empty_like(src) for _ in range(world)]
            work = dist.all_gather(parts, src, group=pg, async_op=True)
            finish = lambda: torch.cat(parts, 0).movedim(0, dim).contiguous()  # noqa: E731
    except Exception as exc:  # noqa: BLE001 - a backend's error, whatever its type
        raise ledger.failure(e, exc) from exc
    return _Started(ledger.started(e, work), finish)


def reduce_scatter(t: Tensor, dim: int, pg) -> Tensor:
    """Sum of `t` over the ranks, then this rank's 1/world slice along `dim` (a new tensor)."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        with ledger.collective(pg, "reduce_scatter", t):
            return comm.reduce_scatter(t, dim)
    return start_reduce_scatter(t, dim, pg).wait()


class _Started:
    """A split-phase collective: `wait()` completes it and returns its result."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> Tensor:
        self._work.wait()
        return self._finish()


def start_reduce_scatter(t: Tensor, dim: int, pg):
    """Begin a reduce-scatter of `t` along `dim` (as `reduce_scatter`); returns a work whose
    wait() returns this rank's slice. Other collectives may run before the wait, as for
    `start_all_reduce`."""
    world, rank = pg.size(), dist.get_rank(pg)
    comm = shm.channel(pg.group_name)
    if comm is not None:
        # shared memory: the tensor is published now, each rank sums its slice at wait()
        e = ledger.issue(pg, "reduce_scatter", t)
        return ledger.started(e, comm.start_reduce_scatter(t, dim))
    if dist.get_backend(pg) == "nccl":
        src = t.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // world, *src.shape[1:]))
        e = ledger.issue(pg, "reduce_scatter", t)
        work = dist.reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return _Started(ledger.started(e, work), lambda: out.movedim(0, dim).contiguous())
    # gloo has no reduce_scatter_tensor on every build: all-reduce the whole tensor, keep a slice
    total = t.clone(memory_format=torch.contiguous_format)
    work = start_all_reduce(total, pg)
    return _Started(work, lambda: shard(total, dim, world, rank))


def all_to_all_single(x: Tensor, out_splits: list[int], in_splits: list[int], pg) -> Tensor:
    """Rows x[sum(in_splits[:r]) : ...] to group rank r; returns the rows every rank sent this
    one, in group-rank order (sum(out_splits) of them). Splits may differ between ranks and be
    zero. Entered in the ledger with the row count left open (it differs between ranks)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    row = x[:1].numel() * x.element_size()
    kept = in_splits[dist.get_rank(pg)] if pg is not None and in_splits else 0    # the rows it sends itself
    with ledger.collective(pg, "all_to_all", x.new_empty((0, *x.shape[1:])),
                           sent=(x.numel() * x.element_size(), (sum(in_splits) - kept) * row)):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=pg)
    return out


def norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % max(ndim, 1)


__all__ = ["all_gather", "all_reduce", "all_to_all_single", "batch_isend_irecv", "check_world", "gather", "group_size",
           "irecv", "norm_dim", "reduce_scatter", "resolve", "start_all_reduce", "start_reduce_scatter",
           "start_ring_exchange", "summed"]


def start_ring_exchange(tensors: list[Tensor], pg) -> tuple[list, list[Tensor]]:
    """Begin sending each of `tensors` (contiguous) to the next rank of `pg` and receiving as
    many tensors of the same shapes from the previous one (a ring step), in one
    batch_isend_irecv; returns (works, receive buffers), filled once every work has waited."""
    n, me = pg.size(), pg.rank()
    nxt, prv = dist.get_global_rank(pg, (me + 1) % n), dist.get_global_rank(pg, (me - 1) % n)
    tensors = [t.contiguous() for t in tensors]
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, pg) for t in tensors] + [dist.P2POp(dist.irecv, b, prv, pg) for b in bufs]
    return batch_isend_irecv(ops, ["ring"] * len(ops)), bufs


def batch_isend_irecv(ops: list, notes: list[str] | None = None) -> list:
    """torch.distributed.batch_isend_irecv of `ops` (P2POps, peers as global ranks), each
    entered in the ledger with its note (what the message is); returns the works."""
    notes = notes or [""] * len(ops)
    entries = [ledger.issue(op.group, "send" if op.op is dist.isend else "recv", op.tensor, peer=op.peer, note=n)
               for op, n in zip(ops, notes)]
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as exc:  # noqa: BLE001 - a backend's error, whatever its type
        raise ledger.failure(entries[0], exc) from exc
    if len(works) == len(ops):
        return [ledger.Tracked(w, e) for w, e in zip(works, entries)]
    every = _AllWorks(works)           # coalesced (NCCL): the batch completes as one
    return [ledger.Tracked(every, e) for e in entries]


class _AllWorks:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def irecv(buf: Tensor, peer: int, pg, tag: int = 0, note: str = ""):
    """torch.distributed.irecv into buf from global rank `peer`, entered in the ledger."""
    e = ledger.issue(pg, "recv", buf, peer=peer, note=note)
    try:
        return ledger.Tracked(dist.irecv(buf, peer, pg, tag), e)
    except Exception as exc:  # noqa: BLE001 - a backend's error, whatever its type
        raise ledger.failure(e, exc) from exc
