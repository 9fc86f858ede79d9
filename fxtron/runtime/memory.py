"""Runtime: where a rank's memory goes during a step -- the bytes saved for backward that are
alive after every forward (F), backward (B) and weight-gradient (W) pass of every microbatch,
the gradient bytes, and on CUDA what the allocator holds.

Saved activations are seen as autograd saves them (torch.autograd.graph.saved_tensors_hooks):
every tensor a pass saves for backward, parameters and buffers excluded (under a 16-bit dtype their compute
copies count: a rank holds them), each storage counted once for as long as a tensor saved on it
is alive. A sample is taken after each pass of the step, so the list is the step's
memory timeline phase by phase; `fxtron.tools.chart` draws it and writes it, with the passes, as a
Chrome trace. `rank_bytes` sums what the rank holds by kind (parameters, gradients, the
optimizer's state, the step's peak activations) for the trainer's log.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch

from fxtron.runtime import optim


@dataclass(frozen=True)
class MemorySample:
    """The rank's memory right after one pass of a step: `phase` "start", "F", "B" or "W"
    (of `microbatch`, model chunk `chunk`), `time` in seconds from the step's start;
    `activations` the bytes saved for backward then alive (with the output gradients that
    deferred weight-gradient passes hold, their linears' inputs and output gradients, between B and W), `grads` the gradient bytes (the
    fp32 gradient buffers and any .grad of the rank's parameters), `allocated` what the CUDA
    allocator holds (None on CPU)."""

    phase: str
    microbatch: int
    chunk: int
    time: float
    activations: int
    grads: int
    allocated: int | None


class MemoryTracker:
    """Records one step's samples (`samples`); `saving()` is the context in which forward
    passes run so that what they save is seen, `sample(...)` takes a sample now."""

    def __init__(self, params: list[torch.Tensor], grad_bytes):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._grad_bytes = grad_bytes              # () -> int
        self._saved: dict[int, tuple[int, list]] = {}   # storage ptr -> (bytes, weakrefs to tensors on it)
        self.samples: list[MemorySample] = []
        self._t0 = time.perf_counter()

    def start(self) -> None:
        """A new step: samples from now, time 0 here."""
        self.samples = []
        self._saved = {}
        self._t0 = time.perf_counter()
        self.sample("start", -1, 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # autograd keeps a tensor of its own (as it does without hooks): an output saved by its
        # own grad_fn is then no cycle, and releasing a sent output's data (executor._deallocate)
        # changes nothing autograd reads
        t = t.detach()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._params:
            entry = self._saved.get(ptr)
            if entry is None or not any(r() is not None for r in entry[1]):   # new, or an address reused
                entry = self._saved[ptr] = (storage.nbytes(), [])
            entry[1].append(weakref.ref(t))
        return t

    def saving(self):
        """The context a forward pass runs in for its saved tensors to be seen."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def live_activations(self) -> int:
        """Bytes of the storages some saved tensor alive is still on."""
        total = 0
        for ptr in list(self._saved):
            nbytes, refs = self._saved[ptr]
            alive = [r for r in refs if (t := r()) is not None and t.untyped_storage().data_ptr() == ptr]
            if alive:
                self._saved[ptr] = (nbytes, alive)
                total += nbytes
            else:
                del self._saved[ptr]
        return total

    def sample(self, phase: str, microbatch: int, chunk: int, held: int = 0) -> None:
        """A sample now; `held`: bytes held for backward that no saved tensor accounts for."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.samples.append(MemorySample(phase, microbatch, chunk, time.perf_counter() - self._t0,
                                         self.live_activations() + held, int(self._grad_bytes()),
                                         torch.cuda.memory_allocated() if cuda else None))


def _storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage once (views of one flat buffer share it)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in seen.items() if ptr)


def rank_bytes(prog, optimizer=None) -> dict[str, int | None]:
    """This rank's memory by kind, measured on the tensors it holds now: `param_bytes` (the
    parameters' storages: zero=3's flat pieces, zero=0's whole shards), `grad_bytes` (the
    gradient buffers and any .grad outside them, zero=2's shard copies included, runtime/grads.py), `optimizer_bytes` (every
    tensor of the optimizer state the rank holds (runtime/optim.py held_state): Adam's moments and
    steps, its shards' under zero=1/2, the owned whole tensors' of Adafactor or Muon), `activation_bytes` (the most bytes
    saved for backward alive after a pass of the last step, when its memory was tracked
    (`prog.track_memory`), else None)."""
    state = optim.held_state(prog, optimizer) if optimizer is not None else ()
    tracker = prog._memory if prog.track_memory else None
    return {"param_bytes": _storage_bytes(prog.parameters()),
            "grad_bytes": int(prog.grads.bytes(also=prog.zero.shards if prog.zero is not None else ())),
            "optimizer_bytes": _storage_bytes(v for s in state for v in s.values()),
            "activation_bytes": max((s.activations for s in tracker.samples), default=0) if tracker else None}


def tracking(tracker: MemoryTracker | None):
    """`tracker.saving()`, or nothing without a tracker."""
    return tracker.saving() if tracker is not None else contextlib.nullcontext()


__all__ = ["MemorySample", "MemoryTracker", "rank_bytes", "tracking"]
