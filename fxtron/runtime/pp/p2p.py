"""Runtime: point-to-point communication between pipeline stages (Megatron's
p2p_communication), over the mesh's pp group.

A message carries the boundary tensors of one microbatch between two adjacent stages:
activations forward ("act", to the next stage) or their gradients backward ("grad", to the
previous one). `exchange(sends, recvs)` posts every send of one step of the schedule and every
receive of the next in one `batch_isend_irecv`; `wait(key)` returns a received message. The
combined calls Megatron's schedules use (send_forward_recv_backward, ...) are thin wrappers.

Shapes: when a boundary tensor's shape is symbolic (the batch or sequence length may differ
between microbatches), each message is preceded by a shape message (int64, the dims of each of
its tensors), as Megatron's variable_seq_lengths does; static shapes are not exchanged.
Transfers pair up by order, as NCCL pairs them (see P2P); each carries a tag as well (stage,
microbatch, direction, tensor), which gloo checks.

Scatter/gather (Narayanan et al. 2021, section 4.1): with `scatter_gather=True` and tensor
parallel, a boundary tensor that every tp rank holds whole (placement Replicate) is sent as
its 1/tp slice by each tp rank and all-gathered over tp on the receiving stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxtron.config import DebugConfig
from fxtron.core.stage import MAX_BOUNDARY_TENSORS
from fxtron.ops import ledger, transport
from fxtron.runtime.groups import ProcessGroups

_DIRS = {"act": 0, "grad": 1}
MAX_TENSORS = MAX_BOUNDARY_TENSORS + 2   # tag slots per message: the tensors, and their shapes


@dataclass(frozen=True)
class Slot:
    """What a boundary tensor looks like before it arrives: its dtype, number of dims, the
    static shape when no dim is symbolic, and whether the tp ranks hold it whole (then it may
    travel as 1/tp slices)."""

    dtype: torch.dtype
    ndim: int
    shape: tuple[int, ...] | None
    replicated: bool


@dataclass
class _Recv:
    slots: list[Slot]
    peer: int
    tags: list[int]
    note: str
    shape_buf: torch.Tensor | None = None
    shape_work: object = None
    bufs: list[torch.Tensor] = field(default_factory=list)
    works: list = field(default_factory=list)
    full_shapes: list[tuple[int, ...]] | None = None
    posted: bool = False


def match_by_tag_default() -> bool:
    """config.DebugConfig.p2p_tags (FXTRON_P2P_TAGS=0: transfers matched by order alone, as NCCL does)."""
    return DebugConfig().p2p_tags


class P2P:
    """Send and receive boundary tensors to the neighbouring pipeline stages of this rank.

    Stage j of a pp*v-stage chain lives on pipeline rank j % pp, or where `rank_of(j)` says
    (ZB-V's V); its neighbours are the ranks of stages j-1 and j+1 (around the ring for the
    interleaved schedule's chunks). A transfer between two stages of one rank never comes here:
    the executor hands it over in memory.

    Transfers between two ranks pair up in the order they are posted, as NCCL pairs them (tags
    are ignored there): the schedules post a pair's sends and receives in the same order, the
    data receives from a peer are posted in the order their messages were (a message whose
    shape is still unknown holds back those behind it), and shape messages travel on a gloo
    twin of the pp group, so they never interleave with the data. Tags are passed as well
    (gloo honours them) unless `match_by_tag` is False (default: FXTRON_P2P_TAGS=0 turns them
    off), which is how tests run the schedules under NCCL's rule on gloo.
    """

    def __init__(self, groups: ProcessGroups, *, scatter_gather: bool = False, match_by_tag: bool | None = None,
                 rank_of=None):
        self.groups = groups
        self._rank_of = rank_of
        self.pp_ranks = groups.ranks("pp")
        self.pp = len(self.pp_ranks)
        self.pp_index = groups.index("pp")
        self.group = groups.group("pp")
        self.meta = groups.meta("pp")
        self.tp = groups.size("tp")
        self.tp_index = groups.index("tp")
        self.scatter_gather = scatter_gather and self.tp > 1
        self.match_by_tag = match_by_tag_default() if match_by_tag is None else match_by_tag
        self._recvs: dict[tuple, _Recv] = {}
        self._order: dict[int, list[_Recv]] = {}       # per peer: receives whose data is not posted, in order
        self._sends: list[tuple[list, list[torch.Tensor]]] = []
        self.device = groups.device
        self.bytes_sent = 0
        self.messages_sent = 0

    # ------------------------------------------------------------------ addressing
    def rank_of_stage(self, stage: int) -> int:
        return self.pp_ranks[stage % self.pp if self._rank_of is None else self._rank_of(stage)]

    def is_local(self, stage: int) -> bool:
        """Does this rank run `stage`'s neighbour itself? (ZB-V: stages pp-1 and pp.)"""
        return self.rank_of_stage(stage) == self.pp_ranks[self.pp_index]

    def _tag(self, kind: str, microbatch: int, stage: int, index: int, shape: bool) -> int:
        if index >= MAX_TENSORS - 2 and not (shape and index == MAX_TENSORS - 2):
            raise ValueError(f"a pipeline boundary carries at most {MAX_TENSORS - 2} tensors "
                             "(split_stages refuses more)")
        if not self.match_by_tag:
            return 0
        return ((((stage * 4096 + microbatch) * 2 + _DIRS[kind]) * MAX_TENSORS + index) * 2) + (0 if shape else 1)

    def _split(self, t: torch.Tensor, slot: Slot) -> bool:
        return self.scatter_gather and slot.replicated and t.numel() % self.tp == 0

    # ------------------------------------------------------------------ the batched exchange
    def exchange(self, sends: list[tuple[str, int, int, list[torch.Tensor], list[Slot]]],
                 recvs: list[tuple[str, int, int, list[Slot]]]) -> None:
        """Post in one batch_isend_irecv: each send (kind, microbatch, to_stage, tensors, slots)
        and each receive (kind, microbatch, at_stage, slots) this rank will wait for next.
        kind is "act" (forward, from stage-1) or "grad" (backward, from stage+1)."""
        meta_ops: list[dist.P2POp] = []
        meta_notes: list[str] = []
        ops: list[dist.P2POp] = []
        notes: list[str] = []
        keep: list[torch.Tensor] = []
        for kind, mb, stage, tensors, slots in sends:
            peer = self.rank_of_stage(stage)
            note = f"{kind} of microbatch {mb} for stage {stage}"
            if any(s.shape is None for s in slots):
                shape = torch.tensor([d for t in tensors for d in t.shape], dtype=torch.int64)
                meta_ops.append(dist.P2POp(dist.isend, shape, peer, self.meta, self._tag(kind, mb, stage, MAX_TENSORS - 2, True)))
                meta_notes.append(note + ", shapes")
                keep.append(shape)
            for i, (t, slot) in enumerate(zip(tensors, slots)):
                t = t.detach().contiguous()
                if self._split(t, slot):
                    t = t.reshape(-1).chunk(self.tp)[self.tp_index].contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, self.group, self._tag(kind, mb, stage, i, False)))
                notes.append(f"{note}, tensor {i}")
                keep.append(t)
                self.bytes_sent += t.numel() * t.element_size()
            self.messages_sent += 1
        for kind, mb, stage, slots in recvs:
            key = (kind, mb, stage)
            if key in self._recvs:
                continue
            peer = self.rank_of_stage(stage - 1 if kind == "act" else stage + 1)
            r = _Recv(slots, peer, [self._tag(kind, mb, stage, i, False) for i in range(len(slots))],
                      f"{kind} of microbatch {mb} for stage {stage}")
            if any(s.shape is None for s in slots):
                r.shape_buf = torch.empty(sum(s.ndim for s in slots), dtype=torch.int64)
                meta_ops.append(dist.P2POp(dist.irecv, r.shape_buf, peer, self.meta,
                                           self._tag(kind, mb, stage, MAX_TENSORS - 2, True)))
                meta_notes.append(r.note + ", shapes")
                r.shape_work = len(meta_ops) - 1
            else:
                r.full_shapes = [s.shape for s in slots]
            self._order.setdefault(peer, []).append(r)
            self._recvs[key] = r
        for peer in {self.rank_of_stage(st - 1 if k == "act" else st + 1) for k, _, st, _ in recvs}:
            queue = self._order.get(peer, [])
            while queue and queue[0].full_shapes is not None:     # data in the order the messages were posted
                self._post_data(queue.pop(0), ops, notes)
        meta_works = transport.batch_isend_irecv(meta_ops, meta_notes) if meta_ops else []
        works = transport.batch_isend_irecv(ops, notes) if ops else []
        for r in self._recvs.values():       # bind this batch's works to the receives posted in it
            if isinstance(r.shape_work, int):
                r.shape_work = meta_works[r.shape_work]
            r.works = [works[w] if isinstance(w, int) else w for w in r.works]
        # a gloo receive may be waited for once only: keep just the sends for finish()
        sent = [w for w, op in zip(meta_works, meta_ops) if op.op is dist.isend]
        sent += [w for w, op in zip(works, ops) if op.op is dist.isend]
        if sent:
            self._sends.append((sent, keep))

    def _post_data(self, r: _Recv, ops: list | None, notes: list | None = None) -> None:
        r.posted = True
        for i, (shape, slot, tag) in enumerate(zip(r.full_shapes, r.slots, r.tags)):
            numel = 1
            for d in shape:
                numel *= d
            split = self.scatter_gather and slot.replicated and numel % self.tp == 0
            buf = torch.empty(numel // self.tp if split else shape, dtype=slot.dtype, device=self.device)
            r.bufs.append(buf)
            if ops is not None:
                ops.append(dist.P2POp(dist.irecv, buf, r.peer, self.group, tag))
                notes.append(f"{r.note}, tensor {i}")
                r.works.append(len(ops) - 1)
            else:
                r.works.append(transport.irecv(buf, r.peer, self.group, tag, f"{r.note}, tensor {i}"))

    def _learn_shapes(self, r: _Recv) -> None:
        r.shape_work.wait()
        dims, shapes, at = r.shape_buf.tolist(), [], 0
        for s in r.slots:
            shapes.append(tuple(dims[at:at + s.ndim]))
            at += s.ndim
        r.full_shapes = shapes

    def wait(self, kind: str, microbatch: int, stage: int) -> list[torch.Tensor]:
        """The tensors of a receive posted by `exchange`, full shape, once they have arrived."""
        r = self._recvs.pop((kind, microbatch, stage))
        queue = self._order.get(r.peer, [])
        while not r.posted:              # post the data of this message and of those before it, in order
            first = queue.pop(0)
            if first.full_shapes is None:
                self._learn_shapes(first)
            self._post_data(first, None)
        for w in r.works:
            w.wait()
        out = []
        for buf, shape in zip(r.bufs, r.full_shapes):
            if tuple(buf.shape) != tuple(shape):     # a 1/tp slice: gather the whole tensor over tp
                pieces = [torch.empty_like(buf) for _ in range(self.tp)]
                with ledger.collective(self.groups.group("tp"), "all_gather", buf):
                    dist.all_gather(pieces, buf, group=self.groups.group("tp"))
                buf = torch.cat(pieces).view(shape)
            out.append(buf)
        return out

    def finish(self) -> None:
        """Wait for every send posted so far (their buffers are then free)."""
        sends, self._sends = self._sends, []
        for works, _ in sends:
            for w in works:
                w.wait()
        if self._recvs:
            raise RuntimeError(f"pipeline receives posted but never waited for: {sorted(self._recvs)}")

    # ------------------------------------------------------------------ Megatron's names
    def send_forward(self, tensors, slots, microbatch: int, to_stage: int) -> None:
        self.exchange([("act", microbatch, to_stage, tensors, slots)], [])

    def recv_forward(self, slots, microbatch: int, stage: int) -> list[torch.Tensor]:
        self.exchange([], [("act", microbatch, stage, slots)])
        return self.wait("act", microbatch, stage)

    def send_backward(self, grads, slots, microbatch: int, to_stage: int) -> None:
        self.exchange([("grad", microbatch, to_stage, grads, slots)], [])

    def recv_backward(self, slots, microbatch: int, stage: int) -> list[torch.Tensor]:
        self.exchange([], [("grad", microbatch, stage, slots)])
        return self.wait("grad", microbatch, stage)

    def send_forward_recv_backward(self, tensors, slots, microbatch: int, stage: int,
                                   grad_slots, grad_microbatch: int) -> list[torch.Tensor]:
        """Send stage's output of `microbatch` on and receive the gradient of stage's output
        of `grad_microbatch`, in one batch."""
        self.exchange([("act", microbatch, stage + 1, tensors, slots)], [("grad", grad_microbatch, stage, grad_slots)])
        return self.wait("grad", grad_microbatch, stage)

    def send_backward_recv_forward(self, grads, slots, microbatch: int, stage: int,
                                   act_slots, act_microbatch: int) -> list[torch.Tensor]:
        """Send the gradient of stage's input of `microbatch` back and receive the next input."""
        self.exchange([("grad", microbatch, stage - 1, grads, slots)], [("act", act_microbatch, stage, act_slots)])
        return self.wait("act", act_microbatch, stage)
