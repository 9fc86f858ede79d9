"""Ops: a shared-memory transport for the tensor-parallel collectives of ranks on one host.

gloo moves every collective through TCP sockets on loopback: a 1 MiB all-reduce between two
processes of one machine costs 1-4 ms of syscalls and thread wake-ups, and a Megatron layer
issues four of them per training step (two in forward, two in backward). Frameworks that run
tensor parallel on CPUs (DeepSpeed's shm comm, vLLM's and SGLang's CPU all-reduce) therefore
reduce through shared memory between ranks of one host instead; so does fxtron, for the
groups whose collectives sit on the critical path (tp).

`ShmComm` is one group's channel: a file in /dev/shm mapped by every rank of the group (the
name travels over the group's gloo process group; the creator unlinks it as soon as all ranks
have it mapped, so nothing outlives the job). Layout, per parity p in {0, 1} of the sequence
number:

    header   [size, 8] int64   per rank: seq, then (op code, numel, dtype code) of the op of
                               each parity (one cache line per rank)
    slot     [2, size, CAPACITY bytes]   slot[p][r] = rank r's input of the op with seq % 2 == p

One collective: each rank copies its input into its slot, writes its header (seq last), waits
until every rank's seq has reached this op's, checks that every rank called the same op on the
same numel and dtype (a diverged program raises instead of reading garbage), and reduces the
slots in rank order -- the same additions in the same order on every rank, so every rank gets
bit-identical results, as the replicated parts of the model require. A slot of parity p is
written again two operations later; by then every peer has published the operation in
between, which it does only after it finished reading the slots of this one. Inputs larger
than a slot go in slot-sized pieces.

Ordering relies on x86-64's store order (data stores become visible before the header store
that follows them); `available()` turns the transport off on other machines, and where
/dev/shm is missing or too small, or the group spans hosts, `create` returns None and the
group's gloo process group carries the collectives. Waiting spins for a few microseconds,
then sleeps in short steps, so ranks that outnumber the cores do not starve the peer they
wait for; a wait longer than the collective timeout raises, naming the ranks not yet arrived.

`start_all_reduce` splits an all-reduce in two: publishing now, reducing at `wait()`, so the
weight-gradient GEMMs of Megatron's overlapped backward run while the slower rank catches up,
and data parallel's gradient buckets are published as backward completes them. A channel holds
one such open collective at a time: the next collective on it completes the open one first.
A work whose step failed before waiting for it is `discard()`ed (completed into scratch: the
peers published it too) rather than left for the next collective to complete into a tensor
reused since; a completion that failed fails every later `wait()` too.
"""
from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

CAPACITY = 4 << 20          # bytes per rank and parity; larger inputs go in pieces
_HEADER_WORDS = 8           # int64 words per rank (64 bytes: one cache line)
_SEQ = 0                    # then (op, numel, dtype) for parity 0 at 1..3 and parity 1 at 4..6
_SPIN_S = 50e-6             # busy-wait this long before sleeping
_SLEEP_S = 20e-6

OP_SUM, OP_MAX, OP_GATHER, OP_REDUCE_SCATTER = 1, 2, 3, 4
_OP_NAMES = {OP_SUM: "all_reduce(SUM)", OP_MAX: "all_reduce(MAX)", OP_GATHER: "all_gather",
             OP_REDUCE_SCATTER: "reduce_scatter"}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.int8, torch.int16, torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

# Channels by process-group name, for the fxtron::* collective ops, which receive a group name
# (their schema must be traceable). `ProcessGroups` creates and closes them; see groups.py.
_CHANNELS: dict[str, "ShmComm"] = {}
_DISABLED = [0]


def available() -> bool:
    """True where this transport may be used at all: x86-64 Linux with /dev/shm."""
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def channel(group_name: str) -> "ShmComm | None":
    """The shared-memory channel of the process group named `group_name`, if it has one."""
    if _DISABLED[0]:
        return None
    return _CHANNELS.get(group_name)


@contextmanager
def disabled():
    """Within the block, every collective goes through the process groups (gloo) even where a
    shared-memory channel exists: benchmarks measure the two transports in one job with it.
    All ranks must enter and leave the block at the same point of their programs."""
    _DISABLED[0] += 1
    try:
        yield
    finally:
        _DISABLED[0] -= 1


class _Open:
    """A published collective not yet completed. The channel holds at most one: the next
    collective on it completes this one first (its slots' parity is reused two operations
    later), so split-phase users -- gradient buckets started during backward, a gather inside
    an overlapped backward -- may interleave freely. `wait()` completes it once and returns
    its result every time."""

    def __init__(self, comm: "ShmComm", seq: int):
        self.comm, self.seq, self._done, self._result, self._error = comm, seq, seq < 0, None, None
        if not self._done:
            comm._open = self

    def wait(self):
        if not self._done:
            self._done = True
            if self.comm._open is self:
                self.comm._open = None
            try:
                self._result = self._complete()
            except BaseException as e:      # every later wait() raises it too: the result never came
                self._error = e
                raise
        if self._error is not None:
            raise self._error
        return self._result

    def discard(self) -> None:
        """Complete it into a scratch tensor: the collective's protocol is kept (the peers
        published it too) while the tensor it was started on is left alone -- for a step that
        failed after starting it, whose buffer the next step reuses."""
        raise NotImplementedError

    def _complete(self):
        raise NotImplementedError


class ShmWork(_Open):
    """The second half of `start_all_reduce`; `wait()` writes the sum into the tensor given."""

    def __init__(self, comm: "ShmComm", out: Tensor, seq: int):
        self.out = out
        super().__init__(comm, seq)
        self._result = True

    def _complete(self) -> bool:
        self.comm._finish(self.out, self.seq, OP_SUM)
        return True

    def discard(self) -> None:
        if not self._done:
            self.out = torch.empty_like(self.out)
            self.wait()


class ShmScatterWork(_Open):
    """The second half of `start_reduce_scatter`; `wait()` returns this rank's slice of the sum."""

    def __init__(self, comm: "ShmComm", t: Tensor, dim: int, seq: int):
        self.t, self.dim = t, dim
        super().__init__(comm, seq)
        if seq < 0:
            self._result = t              # reduced already (an input larger than a slot)

    def _complete(self) -> Tensor:
        return self.comm._finish_reduce_scatter(self.t, self.dim, self.seq)

    def discard(self) -> None:
        self.wait()                       # (its result is a new tensor: nothing of the caller's written)


class ShmComm:
    """A shared-memory channel among the `size` ranks of one process group on one host."""

    def __init__(self, path: str, index: int, size: int, group_name: str, timeout_s: float,
                 capacity: int = CAPACITY):
        self.index, self.size, self.group_name, self.timeout_s = index, size, group_name, timeout_s
        self.capacity = capacity
        nbytes = _total_bytes(size, capacity)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        head = size * _HEADER_WORDS * 8
        # the header through numpy: reading one word costs ~0.1 us there, ~3 us as a torch op
        self._header = np.frombuffer(self._map, dtype=np.int64, count=size * _HEADER_WORDS).reshape(size, _HEADER_WORDS)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = raw[head:head + 2 * size * capacity].view(2, size, capacity)
        self._mine = self._header[index]
        self.seq = 0
        self._open: _Open | None = None      # the published collective not yet completed
        self.ops = 0            # collectives carried (a piece of a large input counts once)
        self.bytes = 0          # input bytes carried

    # ---------------------------------------------------------------- set-up
    @classmethod
    def create(cls, pg, timeout_s: float, capacity: int = CAPACITY) -> "ShmComm | None":
        """Collective over `pg` (every rank of it calls this): a channel when all its ranks run
        on this host and a segment can be made, else None on every rank."""
        index, size = dist.get_rank(pg), dist.get_world_size(pg)
        host = [None] * size
        dist.all_gather_object(host, (socket.gethostname(), _boot_id(), available()), group=pg)
        if size < 2 or len(set(host)) != 1 or not host[0][2]:
            return None
        path = None
        if index == 0:
            path = f"/dev/shm/fxtron-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, _total_bytes(size, capacity))  # fails now, not at first write
                finally:
                    os.close(fd)
            except OSError:
                _unlink(path)
                path = None
        mine, comm = path, None
        try:
            box = [path]
            dist.broadcast_object_list(box, group_src=0, group=pg)
            path = box[0]
            if path is not None:
                try:
                    comm = cls(path, index, size, pg.group_name, timeout_s, capacity)
                except OSError:
                    comm = None
            ok = [None] * size
            dist.all_gather_object(ok, comm is not None, group=pg)   # also: every rank has mapped it
        except BaseException:      # a peer failed: this rank's mapping goes now, not at exit
            if comm is not None:
                comm.close()
            raise
        finally:        # (a peer that died or timed out here leaves no segment in /dev/shm)
            if mine is not None:
                _unlink(mine)
        if not all(ok):
            if comm is not None:
                comm.close()
            return None
        return comm

    def close(self) -> None:
        self._header = self._slots = self._mine = None
        try:
            self._map.close()
        except BufferError:   # a tensor view still alive: the mapping goes with it
            pass

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, t: Tensor, op: int = OP_SUM, out: Tensor | None = None) -> Tensor:
        """The sum (or max) over the group of contiguous `t`, written into `out` (a contiguous
        tensor of t's shape and dtype; default: t itself, in place). Returns out."""
        out = t if out is None else out
        flat, dst = t.view(-1), out.view(-1)
        step = self.capacity // t.element_size()
        for lo in range(0, max(flat.numel(), 1), step):
            self._finish(dst[lo:lo + step], self._publish(flat[lo:lo + step], op), op)
        return out

    def start_all_reduce(self, t: Tensor) -> ShmWork:
        """Publish `t` now; the returned work's wait() sums into `t`; the
        channel's next collective completes it first. Inputs larger than one slot reduce at once."""
        flat = t.view(-1)
        if flat.numel() * flat.element_size() > self.capacity:
            self.all_reduce(t)
            return ShmWork(self, flat[:0], -1)
        return ShmWork(self, flat, self._publish(flat, OP_SUM))

    def gather(self, t: Tensor, dim: int) -> Tensor:
        """Every rank's `t` concatenated along `dim` in group-rank order (a new tensor): one
        copy out of the slots, where all_gather + cat would make two."""
        t = t.contiguous()
        flat = t.view(-1)
        if flat.numel() * t.element_size() > self.capacity:
            return torch.cat(self.all_gather(t), dim)
        seq = self._publish(flat, OP_GATHER)
        self._await(seq, flat, OP_GATHER)
        out = torch.cat([s.view(t.shape) for s in self._views(seq, flat)], dim)
        self._done(flat)
        return out

    def start_reduce_scatter(self, t: Tensor, dim: int) -> "ShmScatterWork":
        """Publish `t` now; the work's wait() returns this rank's 1/size slice along `dim` of the
        sum (plain split), read straight from every rank's slot. The
        channel's next collective completes it first."""
        self._check_split(t, dim)
        t = t.contiguous()
        if t.numel() * t.element_size() > self.capacity:
            return ShmScatterWork(self, self.reduce_scatter(t, dim), dim, -1)
        return ShmScatterWork(self, t, dim, self._publish(t.view(-1), OP_REDUCE_SCATTER))

    def _finish_reduce_scatter(self, t: Tensor, dim: int, seq: int) -> Tensor:
        if seq < 0:
            return t                      # reduced already (an input larger than a slot)
        flat = t.view(-1)
        self._await(seq, flat, OP_REDUCE_SCATTER)
        n = t.shape[dim] // self.size
        parts = [s.view(t.shape).narrow(dim, self.index * n, n) for s in self._views(seq, flat)]
        out = torch.empty(parts[0].shape, dtype=t.dtype, device=t.device)
        _reduce(out, parts, OP_SUM)
        self._done(flat)
        return out

    def all_gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's `t` (same shape on every rank), in group-rank order; new tensors."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        flats = [o.view(-1) for o in outs]
        step = self.capacity // t.element_size()
        src = t.view(-1)
        for lo in range(0, max(src.numel(), 1), step):
            piece = src[lo:lo + step]
            seq = self._publish(piece, OP_GATHER)
            self._await(seq, piece, OP_GATHER)
            slots = self._views(seq, piece)
            for r in range(self.size):
                flats[r][lo:lo + step].copy_(slots[r])
            self._done(piece)
        return outs

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        """The sum over the group of `t`, then this rank's 1/size slice along `dim` (plain
        split): a new tensor."""
        if t.numel() * t.element_size() <= self.capacity:
            return self.start_reduce_scatter(t, dim).wait()
        self._check_split(t, dim)
        src = t.movedim(dim, 0).contiguous()                         # (size * n, ...)
        n = src.shape[0] // self.size
        out = src.new_empty((n, *src.shape[1:]))
        per = out.numel()
        rows = src.view(self.size, per)
        dst = out.view(-1)
        step = self.capacity // (self.size * t.element_size())
        for lo in range(0, max(per, 1), step):
            piece = rows[:, lo:lo + step].contiguous().view(-1)     # every rank's part of this piece
            seq = self._publish(piece, OP_REDUCE_SCATTER)
            self._await(seq, piece, OP_REDUCE_SCATTER)
            k = piece.numel() // self.size
            slots = [s.view(self.size, k)[self.index] for s in self._views(seq, piece)]
            _reduce(dst[lo:lo + k], slots, OP_SUM)
            self._done(piece)
        return out.movedim(0, dim).contiguous()

    def _check_split(self, t: Tensor, dim: int) -> None:
        if t.shape[dim] % self.size:      # (the gloo path refuses it too; a slice would drop the rest)
            raise ValueError(f"shared-memory reduce_scatter: dim {dim} of shape {tuple(t.shape)} cannot be "
                             f"split over the {self.size} ranks of group {self.group_name!r}")

    # ---------------------------------------------------------------- mechanism
    def _publish(self, piece: Tensor, op: int) -> int:
        if piece.dtype not in _DTYPE_CODE:
            raise TypeError(f"shared-memory collectives do not carry {piece.dtype}")
        if self._open is not None:          # its slots' parity comes round again after this one
            self._open.wait()
        seq = self.seq + 1
        self.seq = seq
        self._slots[seq % 2, self.index, :piece.numel() * piece.element_size()].view(piece.dtype).copy_(piece)
        mine, f = self._mine, 1 + 3 * (seq % 2)
        # described per parity: a fast peer's next op cannot overwrite what the others check
        mine[f], mine[f + 1], mine[f + 2] = op, piece.numel(), _DTYPE_CODE[piece.dtype]
        mine[_SEQ] = seq                    # last: the data and description are in place
        return seq

    def _await(self, seq: int, piece: Tensor, op: int) -> None:
        seqs = self._header[:, _SEQ]
        if seqs.min() < seq:
            start = time.perf_counter()
            deadline = start + self.timeout_s
            while seqs.min() < seq:
                now = time.perf_counter()
                if now - start > _SPIN_S:
                    if now > deadline:
                        late = [r for r in range(self.size) if seqs[r] < seq]
                        raise TimeoutError(
                            f"shared-memory {_OP_NAMES[op]} #{seq} of group {self.group_name!r} "
                            f"(rank {self.index} of {self.size}): ranks {late} of the group did not "
                            f"arrive within {self.timeout_s:g} s (a peer died or runs a different program)")
                    time.sleep(_SLEEP_S)
        head = self._header
        want, f = (op, piece.numel(), _DTYPE_CODE[piece.dtype]), 1 + 3 * (seq % 2)
        for r in range(self.size):
            got = tuple(int(v) for v in head[r, f:f + 3])
            if got != want:
                raise RuntimeError(
                    f"shared-memory collective #{seq} of group {self.group_name!r} diverged: rank "
                    f"{self.index} called {_OP_NAMES[op]} on {want[1]} x {piece.dtype}, rank {r} "
                    f"{_OP_NAMES.get(got[0], got[0])} on {got[1]} x {_DTYPES[got[2]]}")

    def _views(self, seq: int, piece: Tensor) -> list[Tensor]:
        n = piece.numel() * piece.element_size()
        return [self._slots[seq % 2, r, :n].view(piece.dtype) for r in range(self.size)]

    def _finish(self, out: Tensor, seq: int, op: int) -> None:
        if seq < 0:
            return
        self._await(seq, out, op)
        _reduce(out, self._views(seq, out), op)
        self._done(out)

    def _done(self, piece: Tensor) -> None:
        self.ops += 1
        self.bytes += piece.numel() * piece.element_size()


def _reduce(out: Tensor, parts: list[Tensor], op: int) -> None:
    """out = parts[0] (+|max) parts[1] ... in rank order: identical bits on every rank."""
    if op == OP_MAX:
        torch.maximum(parts[0], parts[1], out=out)
        for p in parts[2:]:
            torch.maximum(out, p, out=out)
        return
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)


def _total_bytes(size: int, capacity: int) -> int:
    return size * _HEADER_WORDS * 8 + 2 * size * capacity


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_channels(pgs: dict[str, object], timeout_s: float) -> dict[str, ShmComm]:
    """Create the channel of each process group (a collective over each group, in the order
    given: every rank must pass its groups in the same global order) and register it under
    the group's name. Returns the channels made."""
    made = {}
    try:
        for pg in pgs.values():
            comm = ShmComm.create(pg, timeout_s)
            if comm is not None:
                _CHANNELS[pg.group_name] = made[pg.group_name] = comm
    except BaseException:       # (those made so far would be registered and never closed)
        close_channels(made)
        raise
    return made


def close_channels(channels: dict[str, ShmComm]) -> None:
    for name, comm in channels.items():
        if _CHANNELS.get(name) is comm:
            del _CHANNELS[name]
        comm.close()
