"""The trainer's checkpoints in Megatron's layout (megatron/training/checkpointing.py):
DIR/iter_0000004 (the iteration: completed steps) and DIR/latest_checkpointed_iteration.txt,
the iteration as text, written by rank 0 after every rank finished. Each iter_ directory is an
fxtron checkpoint (prog.save: atomic, loads on any mesh) holding with the model and optimizer
the trainer's state: iteration, consumed train and valid samples, skipped steps, the
learning-rate schedule. --keep-last K removes older iterations after a save; nothing is
removed by default."""
from __future__ import annotations

import os
import re
import shutil

from fxtron.errors import ParallelizeError
from fxtron.runtime.checkpoint.dcp import COMMIT, read_extra

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7})$")


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete(root: str) -> list[int]:
    """The iterations of `root` whose save completed, in order."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ITER.match(name)
        if m and os.path.isfile(os.path.join(root, name, COMMIT)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest(root: str) -> int | None:
    """The iteration to resume from: the tracker's when that checkpoint is complete, else the
    newest complete one (a save killed after the tracker was written cannot happen: the tracker
    comes last; one killed before leaves the previous tracker and checkpoint)."""
    done = complete(root)
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text.isdigit() and int(text) in done:
            return int(text)
    return done[-1] if done else None


def read_state(root: str, iteration: int) -> dict:
    state = read_extra(iter_dir(root, iteration))
    if not isinstance(state, dict) or "iteration" not in state:
        raise ParallelizeError(f"{iter_dir(root, iteration)} is an fxtron checkpoint without the trainer's state; "
                               "load it with prog.load, or resume from a directory `fxtron train --save` wrote")
    return state


def write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def prune(root: str, keep_last: int | None) -> list[int]:
    """Remove all but the newest `keep_last` complete iterations; returns the removed."""
    if keep_last is None:
        return []
    done = complete(root)
    gone = done[:-keep_last] if len(done) > keep_last else []
    for it in gone:
        shutil.rmtree(iter_dir(root, it), ignore_errors=True)
    return gone


__all__ = ["TRACKER", "complete", "iter_dir", "latest", "prune", "read_state", "write_tracker"]
