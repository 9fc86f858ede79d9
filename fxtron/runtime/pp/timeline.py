"""Runtime, pipeline parallel: a program's timelines -- the last step's passes (F, B, W, the
waits and sends of a schedule) and, when asked for, its memory after every pass.

Program.timeline / memory_timeline read them (trainer/loop.py, tools/chart.py draw them); the
step starts the memory tracker (`memory_tracker`) when `prog.track_memory` is set.
"""
from __future__ import annotations

from fxtron.runtime.memory import MemoryTracker


def timeline(prog) -> list:
    """The last step's events on `prog`'s rank (runtime/pp/executor.py Event: F, B, W and, with a
    schedule, the waits for messages and the sends, with start and end in seconds from the
    step's start; an evaluation's forward-only schedule has F, its waits and sends alone)."""
    run = prog._last_runner
    return list(run.events) if run is not None else list(prog._events)


def memory_timeline(prog) -> list:
    """The last step's memory on `prog`'s rank, after every pass (runtime.memory.MemorySample:
    the bytes saved for backward then alive, the gradient bytes, CUDA's allocated bytes),
    recorded when `prog.track_memory = True` was set before the step."""
    if prog._memory is None or not prog.track_memory:
        raise RuntimeError("no memory timeline recorded: set prog.track_memory = True before the step")
    return list(prog._memory.samples)


def memory_tracker(prog):
    """This step's MemoryTracker, started (None unless track_memory)."""
    if prog.fsdp is not None:      # zero=3's own saved-tensor hook passes the rest to the tracker
        prog.fsdp.memory = None
    if not prog.track_memory:
        return None
    if prog._memory is None:
        prog._memory = MemoryTracker([*prog.parameters(), *prog.buffers()], prog.grads.bytes)
    prog._memory.start()
    if prog.fsdp is not None:
        prog.fsdp.memory = prog._memory
    return prog._memory


__all__ = ["memory_timeline", "memory_tracker", "timeline"]
