"""Runtime: run one training step's pipeline schedule on this rank.

The schedule is a list of Actions (runtime/pp/schedules.py); each F runs a stage's GraphModule on
one microbatch, each B runs autograd from the stage's outputs (the loss, scaled by
1/microbatches, on the last stage; the received output gradients elsewhere), each W (zb-h1)
runs the weight-gradient GEMMs its B deferred. After every action, the sends it produced and
the receive the next action needs go out in one batch (P2P.exchange): Megatron's
send_forward_recv_backward and send_backward_recv_forward fall out of the order.

Every action is recorded with its start and end (seconds from the step's start), and so is
every wait for a message, so the timeline of the step can be drawn and its bubble measured.

A stage's outputs, once posted to the next stage, are kept only as autograd's roots: their data
is released (Megatron's deallocate_pipeline_outputs), so a rank holds each in-flight
microbatch's boundary activation once -- in the send buffer until it is sent -- not again in
`saved` until its backward; the backward runs the engine from those roots with the received
gradients (which have the outputs' shapes), as Megatron's custom_backward does.

Two neighbouring stages on one rank (ZB-V's stages pp-1 and pp) hand their activations and
gradients over in memory: no message, and the output is not released (its data is the next
stage's input).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.placement import REPLICATE, Replicate
from fxtron.core.stage import Stage
from fxtron.ops.linear import WgradQueue
from fxtron.runtime.grads import check_differentiable
from fxtron.runtime.memory import tracking
from fxtron.runtime.pp.p2p import P2P, Slot
from fxtron.runtime.pp.schedules import Action


@dataclass(frozen=True)
class Event:
    """One span of a rank's step: kind F, B, W (compute), "recv" (waiting for a message to
    arrive) or "send" (posting this rank's sends with the next receives)."""

    kind: str
    microbatch: int
    chunk: int
    stage: int
    start: float
    end: float


def slots(stage: Stage, names: list[str]) -> list[Slot]:
    out = []
    for name in names:
        node = stage.values[name]
        val = node.meta["val"]
        local = meta.get(node, meta.LOCAL_SHAPE)
        static = None
        if local is not None and all(not sympy.sympify(d).free_symbols for d in local):
            static = tuple(int(d) for d in local)
        whole = isinstance(meta.placement(node, "tp", REPLICATE), Replicate)   # scatter/gather splits over tp
        out.append(Slot(val.dtype, val.dim(), static, whole))
    return out


class StageRunner:
    """This rank's model chunks and the schedule it runs them in."""

    def __init__(self, stages: list[Stage], call, actions: list[Action], *, num_stages: int, microbatches: int,
                 p2p: P2P | None, zero_bubble: bool, before_last_backward=None, quiet=None, peers=None,
                 forward_only: bool = False):
        self.stages = stages                    # chunk c -> Stage
        self.call = call                        # (stage, flat user inputs, received) -> outputs
        self.actions = actions
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.p2p = p2p
        self.zero_bubble = zero_bubble
        self.forward_only = forward_only        # an evaluation: F passes alone, nothing kept for a backward
        self.before_last_backward = before_last_backward   # chunk -> None, before its last microbatch's B
        self.quiet = quiet    # a context in which gradient reports do not count (earlier microbatches' W)
        self.in_slots = [slots(s, s.inputs) for s in stages]
        self.out_slots = [slots(s, s.outputs) for s in stages]
        self.kept = [_used_by_itself(s) for s in stages]   # outputs whose data must outlive the send
        self.events: list[Event] = []
        # what each neighbour sends this rank, in its order: receives are posted in that order
        # (NCCL pairs a peer's sends with this rank's receives by order alone), even where this
        # rank consumes them in another (ZB-V: activations and gradients share both directions)
        self._from_peer: dict[int, list[tuple]] = {}      # pp rank -> receive keys, in its send order
        self._recv_slots: dict[tuple, list[Slot]] = {}
        if peers is not None:
            self._sent_to_me(*peers)
        self.peak_in_flight = 0
        self.freed_bytes = 0      # output data released once sent, last step
        self.memory = None        # a runtime.memory.MemoryTracker sampling after every pass, or None

    def _needs(self, a: Action) -> list[tuple]:
        st = self.stages[a.chunk]
        if a.kind == "F" and st.inputs and not self._local(st.index - 1):
            return [("act", a.microbatch, st.index, self.in_slots[a.chunk])]
        if a.kind == "B" and st.outputs and not self._local(st.index + 1):
            return [("grad", a.microbatch, st.index, _floating(self.out_slots[a.chunk]))]
        return []

    def _sent_to_me(self, orders: list[list[Action]], stage_of) -> None:
        """From every pipeline rank's order (`orders[r]`, `stage_of(r, chunk)`): the messages
        each sends this rank, in the order it sends them, as this rank's receive keys."""
        mine = {st.index: c for c, st in enumerate(self.stages)}
        for r, order in enumerate(orders):
            for a in order:
                s = stage_of(r, a.chunk)
                kind, at = ("act", s + 1) if a.kind == "F" else ("grad", s - 1) if a.kind == "B" else (None, None)
                if kind is None or at not in mine or s in mine:
                    continue
                need = self._needs(Action("F" if kind == "act" else "B", a.microbatch, mine[at]))
                if need:
                    key = (need[0][0], need[0][1], need[0][2])
                    self._from_peer.setdefault(r, []).append(key)
                    self._recv_slots[key] = need[0][3]

    def _in_sender_order(self, needs: list[tuple], posted: set) -> list[tuple]:
        """The receives to post for `needs`: each preceded by those its sender sends earlier."""
        out = []
        for kind, mb, stage, slots in needs:
            key = (kind, mb, stage)
            for order in self._from_peer.values():
                if key in order:
                    for k in order[:order.index(key) + 1]:
                        if k not in posted:
                            posted.add(k)
                            out.append((*k, self._recv_slots[k]))
                    break
            else:
                if key not in posted:
                    posted.add(key)
                    out.append((kind, mb, stage, slots))
        return out

    def _local(self, stage: int) -> bool:
        return self.p2p is None or self.p2p.is_local(stage)

    def _recv(self, kind: str, mb: int, chunk: int, t0: float) -> list[torch.Tensor]:
        index = self.stages[chunk].index
        if self._local(index - 1 if kind == "act" else index + 1):
            return self._handed.pop((kind, mb, index))
        start = time.perf_counter() - t0
        out = self.p2p.wait(kind, mb, index)
        self.events.append(Event("recv", mb, chunk, self.stages[chunk].index, start, time.perf_counter() - t0))
        return out

    def run(self, microbatches: list[list[torch.Tensor]], loss_scale: float = 1.0) -> torch.Tensor | None:
        """Run the step on this rank's microbatches (flat user inputs each); the sum over
        microbatches of loss / microbatches on the rank holding the last stage, else None."""
        self.events = []
        self.freed_bytes = 0
        self._handed: dict[tuple[str, int, int], list[torch.Tensor]] = {}   # in-memory transfers
        t0 = time.perf_counter()
        saved: dict[tuple[int, int], tuple] = {}
        deferred: dict[tuple[int, int], WgradQueue] = {}
        live: set[tuple[int, int]] = set()
        self.peak_in_flight = 0
        loss_sum = None
        m = self.microbatches
        posted: set[tuple] = set()
        if self.p2p is not None:
            self.p2p.exchange([], self._in_sender_order(self._needs(self.actions[0]), posted))
        for i, a in enumerate(self.actions):
            st, key = self.stages[a.chunk], (a.microbatch, a.chunk)
            sends = []
            if a.kind == "F":
                ins = self._recv("act", a.microbatch, a.chunk, t0) if st.inputs else []
                if not self.forward_only:
                    ins = [x.requires_grad_() if x.is_floating_point() else x for x in ins]
                start = time.perf_counter() - t0
                with tracking(self.memory):
                    outs = list(self.call(st, microbatches[a.microbatch], ins))
                scaled = None
                if st.has_loss:
                    loss = outs.pop()
                    scaled = loss * (loss_scale / m)
                    part = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)) / m
                    loss_sum = part if loss_sum is None else loss_sum + part
                if not self.forward_only:
                    saved[key] = (ins, outs, scaled)
                    live.add(key)
                self.peak_in_flight = max(self.peak_in_flight, len(live))
                if st.outputs:
                    sends.append(("act", a.microbatch, st.index + 1, outs, self.out_slots[a.chunk]))
            elif a.kind == "B":
                ins, outs, scaled = saved.pop(key)
                grads = self._recv("grad", a.microbatch, a.chunk, t0) if st.outputs else []
                start = time.perf_counter() - t0
                if a.microbatch == m - 1 and self.before_last_backward is not None:
                    self.before_last_backward(a.chunk)
                queue = WgradQueue(deferred=self.zero_bubble)
                with queue.active():
                    if scaled is not None:
                        check_differentiable(scaled)
                        scaled.backward()
                    else:
                        pairs = [(o, g) for o, g in zip(_floating_values(outs), grads) if o.requires_grad]
                        if pairs:
                            _backward([o for o, _ in pairs], [g for _, g in pairs])
                if self.zero_bubble:
                    deferred[key] = queue
                else:
                    live.discard(key)
                if st.inputs:
                    dx = [x.grad if x.grad is not None else torch.zeros_like(x) for x in _floating_values(ins)]
                    sends.append(("grad", a.microbatch, st.index - 1, dx, _floating(self.in_slots[a.chunk])))
                del ins, outs, scaled
            else:   # W: the weight gradients the B of this microbatch deferred
                start = time.perf_counter() - t0
                with self.quiet() if self.quiet is not None and a.microbatch != m - 1 else contextlib.nullcontext():
                    deferred.pop(key).run()
                live.discard(key)
            self.events.append(Event(a.kind, a.microbatch, a.chunk, st.index, start, time.perf_counter() - t0))
            handed = [s for s in sends if self._local(s[2])]
            for kind, mb, to, tensors, _ in handed:          # the next stage runs here: no message
                self._handed[(kind, mb, to)] = [t.detach() for t in tensors]
            sends = [s for s in sends if not self._local(s[2])]
            if self.p2p is not None:
                nxt = self._in_sender_order(self._needs(self.actions[i + 1]), posted) if i + 1 < len(self.actions) else []
                if sends or nxt:
                    start = time.perf_counter() - t0
                    self.p2p.exchange(sends, nxt)
                    if sends:
                        self.events.append(Event("send", a.microbatch, a.chunk, st.index, start,
                                                 time.perf_counter() - t0))
                if a.kind == "F" and st.outputs and sends and not self.forward_only:   # posted: the send holds the data, autograd the root
                    self.freed_bytes += sum(_deallocate(o) for j, o in enumerate(saved[key][1])
                                            if j not in self.kept[a.chunk])
            if self.memory is not None:   # the output gradients deferred W passes hold count too
                self.memory.sample(a.kind, a.microbatch, a.chunk, held=sum(q.held_bytes for q in deferred.values()))
        if self.p2p is not None:
            self.p2p.finish()
        assert not saved and not deferred and not self._handed, "schedule left microbatches unfinished"
        return loss_sum


def _used_by_itself(stage: Stage) -> set[int]:
    """The boundary outputs a stage also uses itself (a cut inside a layer sends x on and feeds
    x to its own linear, whose backward still reads it): releasing one after its send would
    leave that backward a 1-element tensor. By the stage graph: an output node with a user
    other than the output."""
    if stage.gm is None:
        return set()
    out = stage.gm.graph.output_node()
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return {i for i, n in enumerate(values) if isinstance(n, fx.Node) and any(u is not out for u in n.users)}


def _deallocate(out: torch.Tensor) -> int:
    """Release a sent output's data, keeping the tensor as autograd's root (Megatron's
    deallocate_output_tensor): only an output that owns its storage (not a view, which would
    free nothing) and carries a gradient. The bytes released."""
    if not (out.is_floating_point() and out.requires_grad and out._base is None and out.numel() > 1):
        return 0
    freed = out.numel() * out.element_size()
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
    return freed


def _backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Backward from the stage's outputs with the received gradients: the engine itself, as
    Megatron's custom_backward calls it -- torch.autograd.backward would compare each gradient
    with its output's shape, whose data is released (the engine checks the shape the output
    had when it was made)."""
    from torch.autograd.graph import _engine_run_backward   # what torch.autograd.backward calls after its checks
    _engine_run_backward(tuple(outs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _floating(slot_list: list[Slot]) -> list[Slot]:
    return [s for s in slot_list if s.dtype.is_floating_point]


def _floating_values(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v for v in values if v.is_floating_point()]
