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
Messages are matched by tag (stage, microbatch, direction, tensor), so sends never wait for
receives and no ordering between the two neighbours can deadlock a valid schedule.

Scatter/gather (Narayanan et al. 2021, section 4.1): with `scatter_gather=True` and tensor
parallel, a boundary tensor that every tp rank holds whole (placement Replicate) is sent as
its 1/tp slice by each tp rank and all-gathered over tp on the receiving stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxtron.core.stage import MAX_BOUNDARY_TENSORS
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
    shape_buf: torch.Tensor | None = None
    shape_work: object = None
    bufs: list[torch.Tensor] = field(default_factory=list)
    works: list = field(default_factory=list)
    full_shapes: list[tuple[int, ...]] = field(default_factory=list)


class P2P:
    """Send and receive boundary tensors to the neighbouring pipeline stages of this rank.

    Stage j of a pp*v-stage chain lives on pipeline rank j % pp; its neighbours are the ranks
    of stages j-1 and j+1 (around the ring for the interleaved schedule's chunks).
    """

    def __init__(self, groups: ProcessGroups, *, scatter_gather: bool = False):
        self.groups = groups
        self.pp_ranks = groups.ranks("pp")
        self.pp = len(self.pp_ranks)
        self.pp_index = groups.index("pp")
        self.group = groups.group("pp")
        self.tp = groups.size("tp")
        self.tp_index = groups.index("tp")
        self.scatter_gather = scatter_gather and self.tp > 1
        self._recvs: dict[tuple, _Recv] = {}
        self._sends: list[tuple[object, list[torch.Tensor]]] = []
        self.device = groups.device
        self.bytes_sent = 0
        self.messages_sent = 0

    # ------------------------------------------------------------------ addressing
    def rank_of_stage(self, stage: int) -> int:
        return self.pp_ranks[stage % self.pp]

    @staticmethod
    def _tag(kind: str, microbatch: int, stage: int, index: int, shape: bool) -> int:
        if index >= MAX_TENSORS - 2 and not (shape and index == MAX_TENSORS - 2):
            raise ValueError(f"a pipeline boundary carries at most {MAX_TENSORS - 2} tensors "
                             "(split_stages refuses more)")
        return ((((stage * 4096 + microbatch) * 2 + _DIRS[kind]) * MAX_TENSORS + index) * 2) + (0 if shape else 1)

    def _split(self, t: torch.Tensor, slot: Slot) -> bool:
        return self.scatter_gather and slot.replicated and t.numel() % self.tp == 0

    # ------------------------------------------------------------------ the batched exchange
    def exchange(self, sends: list[tuple[str, int, int, list[torch.Tensor], list[Slot]]],
                 recvs: list[tuple[str, int, int, list[Slot]]]) -> None:
        """Post in one batch_isend_irecv: each send (kind, microbatch, to_stage, tensors, slots)
        and each receive (kind, microbatch, at_stage, slots) this rank will wait for next.
        kind is "act" (forward, from stage-1) or "grad" (backward, from stage+1)."""
        ops: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        for kind, mb, stage, tensors, slots in sends:
            peer = self.rank_of_stage(stage)
            if any(s.shape is None for s in slots):
                shape = torch.tensor([d for t in tensors for d in t.shape], dtype=torch.int64, device=self.device)
                ops.append(dist.P2POp(dist.isend, shape, peer, self.group, self._tag(kind, mb, stage, MAX_TENSORS - 2, True)))
                keep.append(shape)
            for i, (t, slot) in enumerate(zip(tensors, slots)):
                t = t.detach().contiguous()
                if self._split(t, slot):
                    t = t.reshape(-1).chunk(self.tp)[self.tp_index].contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, self.group, self._tag(kind, mb, stage, i, False)))
                keep.append(t)
                self.bytes_sent += t.numel() * t.element_size()
            self.messages_sent += 1
        for kind, mb, stage, slots in recvs:
            key = (kind, mb, stage)
            if key in self._recvs:
                continue
            peer = self.rank_of_stage(stage - 1 if kind == "act" else stage + 1)
            r = _Recv(slots, peer, [self._tag(kind, mb, stage, i, False) for i in range(len(slots))])
            if any(s.shape is None for s in slots):
                r.shape_buf = torch.empty(sum(s.ndim for s in slots), dtype=torch.int64, device=self.device)
                op = dist.P2POp(dist.irecv, r.shape_buf, peer, self.group, self._tag(kind, mb, stage, MAX_TENSORS - 2, True))
                ops.append(op)
                r.shape_work = len(ops) - 1
            else:
                r.full_shapes = [s.shape for s in slots]
                self._post_data(r, ops)
            self._recvs[key] = r
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for r in self._recvs.values():       # bind this batch's works to the receives posted in it
            if isinstance(r.shape_work, int):
                r.shape_work = works[r.shape_work]
            r.works = [works[w] if isinstance(w, int) else w for w in r.works]
        # a gloo receive may be waited for once only: keep just the sends for finish()
        self._sends.append(([w for w, op in zip(works, ops) if op.op is dist.isend], keep))

    def _post_data(self, r: _Recv, ops: list | None) -> None:
        for shape, slot, tag in zip(r.full_shapes, r.slots, r.tags):
            numel = 1
            for d in shape:
                numel *= d
            split = self.scatter_gather and slot.replicated and numel % self.tp == 0
            buf = torch.empty(numel // self.tp if split else shape, dtype=slot.dtype, device=self.device)
            r.bufs.append(buf)
            if ops is not None:
                ops.append(dist.P2POp(dist.irecv, buf, r.peer, self.group, tag))
                r.works.append(len(ops) - 1)
            else:
                r.works.append(dist.irecv(buf, r.peer, self.group, tag))

    def wait(self, kind: str, microbatch: int, stage: int) -> list[torch.Tensor]:
        """The tensors of a receive posted by `exchange`, full shape, once they have arrived."""
        r = self._recvs.pop((kind, microbatch, stage))
        if r.shape_buf is not None:
            r.shape_work.wait()
            dims, shapes, at = r.shape_buf.tolist(), [], 0
            for s in r.slots:
                shapes.append(tuple(dims[at:at + s.ndim]))
                at += s.ndim
            r.full_shapes = shapes
            self._post_data(r, None)
        for w in r.works:
            w.wait()
        out = []
        for buf, shape in zip(r.bufs, r.full_shapes):
            if tuple(buf.shape) != tuple(shape):     # a 1/tp slice: gather the whole tensor over tp
                pieces = [torch.empty_like(buf) for _ in range(self.tp)]
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
