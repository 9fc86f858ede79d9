"""Trainer, checkpoints: the run's saves and its resume (`Checkpointer`) in Megatron's layout
(megatron/training/checkpointing.py):
DIR/iter_0000004 (the iteration: completed steps) and DIR/latest_checkpointed_iteration.txt,
the iteration as text, written by rank 0 after every rank finished. Each iter_ directory is an
fxtron checkpoint (prog.save: atomic, loads on any mesh) holding with the model and optimizer
the trainer's state: iteration, consumed train and valid samples, skipped steps, the
learning-rate schedule. --keep-last K removes older iterations after a save; nothing is
removed by default. With --save (or --load) a run resumes from the latest complete
checkpoint, on any mesh: model, optimizer, schedule, data position, random streams, step; the
schedule's settings must be the checkpoint's unless --override-lr-schedule. Each save and the
resume are events the trainer logs (`saved`, `loaded`: path, iteration, seconds)."""
from __future__ import annotations

import os
import re
import shutil
import time

import torch.distributed as dist

from fxtron.errors import ParallelizeError
from fxtron.runtime.checkpoint.dcp import COMMIT, REPLACED, STAGING, read_extra

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(rf"^iter_(\d{{7}})({re.escape(STAGING)}|{re.escape(REPLACED)})?$")


#: an optimizer group's settings the learning-rate schedule sets every step (not the configuration's)
_SCHEDULED = ("params", "lr", "initial_lr")
#: the trainer's state a checkpoint of an earlier version lacks, and its value then
_LATER_STATE = {"skipped_in_a_row": 0}


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete(root: str) -> list[int]:
    """The iterations of `root` whose save completed, in order."""
    if not os.path.isdir(root):
        return []
    found = {int(m.group(1)) for m in map(_ITER.match, os.listdir(root)) if m}
    return sorted(it for it in found if committed(root, it) is not None)


def committed(root: str, iteration: int) -> str | None:
    """Where iteration `iteration`'s complete checkpoint is (None where there is none): its
    directory, or -- a save over it killed between putting the old one aside and the new one in
    place (runtime/checkpoint/dcp.py) -- the new one, complete, still at `.saving`, else the old
    one at `.replaced` (no failure loses a checkpoint: before, the resume fell back to an older
    iteration)."""
    path = iter_dir(root, iteration)
    if os.path.exists(path):
        return path if os.path.isfile(os.path.join(path, COMMIT)) else None
    return next((p for p in (path + STAGING, path + REPLACED) if os.path.isfile(os.path.join(p, COMMIT))), None)


def latest(root: str) -> int | None:
    """The iteration to resume from: the tracker's when that checkpoint is complete, else the
    newest complete one (a save killed after the tracker was written cannot happen: the tracker
    comes last; one killed before leaves the previous tracker and checkpoint)."""
    done = complete(root)
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text.isdigit() and int(text) in done:
            return int(text)
    return done[-1] if done else None


def read_state(root: str, iteration: int) -> dict:
    path = committed(root, iteration) or iter_dir(root, iteration)
    state = read_extra(path)
    if not isinstance(state, dict) or "iteration" not in state:
        raise ParallelizeError(f"{path} is an fxtron checkpoint without the trainer's state; "
                               "load it with prog.load, or resume from a directory `fxtron train --save` wrote")
    return state


def write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def prune(root: str, keep_last: int | None, saved: int | None = None) -> list[int]:
    """Remove all but the newest `keep_last` complete iterations up to `saved` (the one just
    saved: the run's own trajectory); returns the removed. Iterations after it are another
    trajectory's -- a run rolled back (its tracker set to an earlier one) -- and are left: by
    number they are the newest, and pruning them in would remove the save just made and send
    the next restart to the abandoned run (the run replaces each as it reaches it)."""
    if keep_last is None:
        return []
    done = [it for it in complete(root) if saved is None or it <= saved]
    gone = done[:-keep_last] if len(done) > keep_last else []
    for it in gone:
        for place in ("", STAGING, REPLACED):
            shutil.rmtree(iter_dir(root, it) + place, ignore_errors=True)
    return gone


# ----------------------------------------------------------------------------- the run's saves and resume
def check_resumable(cfg, path: str, saved: dict) -> None:
    """ParallelizeError where the run `cfg` cannot resume the checkpoint at `path` (its state
    `saved`): another --batch or --seq (the data position counts samples)."""
    if saved.get("global_batch") != cfg.data.batch or saved.get("seq") != cfg.data.seq:
        raise ParallelizeError(f"{path} was trained with --batch {saved.get('global_batch')} --seq {saved.get('seq')}; "
                               "resume with the same (the data position counts samples)")


def source_of(t) -> str | None:
    """The directory a run of training section `t` resumes from: --load, unless --save (another
    directory) holds a newer complete checkpoint -- this run's own progress, as after a torchrun
    restart of a run that began from --load (torchtitan's initial_load_path: the run's folder
    first)."""
    if t.load is None or t.save is None or os.path.abspath(t.load) == os.path.abspath(t.save):
        return t.load or t.save
    mine, theirs = latest(t.save), latest(t.load)
    return t.save if mine is not None and (theirs is None or mine > theirs) else t.load


def no_checkpoint(load: str) -> ParallelizeError:
    """--load names a directory without a complete checkpoint."""
    return ParallelizeError(f"--load {load}: no complete checkpoint there (no iter_NNNNNNN with its commit marker); "
                            "give the directory --save wrote")


class Checkpointer:
    """The run's checkpoints: `resume` loads the latest complete one of --load (else --save;
    --save's where it is newer: `source`) into the program, optimizer, schedule and the trainer's state; `maybe_save` saves every
    --save-interval steps and at the last."""

    def __init__(self, cfg, prog, opt, sched, sample_order=None):
        self.cfg, self.prog, self.opt, self.sched = cfg, prog, opt, sched
        self.sample_order = sample_order      # the train data's (trainer/data.py TrainData.sample_order)
        self.loaded: dict | None = None       # the resume's event (resume)
        self.saved: dict | None = None        # the last save's event (save)

    def source(self) -> str | None:
        """The directory resumed from (`source_of`)."""
        return source_of(self.cfg.training)

    def resume(self, state: dict) -> int | None:
        """Load the latest complete checkpoint into the program, optimizer, schedule and
        `state` (updated in place); the iteration resumed from, or None (a fresh run)."""
        t, cfg = self.cfg.training, self.cfg
        source = self.source()
        if source is None:
            return None
        it = latest(source)
        if it is None:
            if t.load is not None:
                raise no_checkpoint(t.load)
            return None
        saved = read_state(source, it)
        path = committed(source, it)
        check_resumable(cfg, path, saved)
        start = time.perf_counter()
        configured = [{k: v for k, v in g.items() if k not in _SCHEDULED} for g in self.opt.param_groups]
        self.prog.load(path, self.opt)
        # loading an optimizer's state replaces its groups' settings with the checkpoint's (torch's
        # load_state_dict); this run's configuration is the user's word for them (the schedule's own
        # are the schedule's, below): kept, and each difference said
        changed = []
        for i, (group, mine) in enumerate(zip(self.opt.param_groups, configured)):
            for k, v in mine.items():
                if group.get(k) != v:
                    changed.append(f"{k} {group.get(k)} -> {v}" + (f" (group {i})" if len(configured) > 1 else ""))
                    group[k] = v
        overridden = self.sched.load_state_dict(saved["scheduler"], override=cfg.optimizer.override_lr_schedule)
        state.update({k: saved[k] if k in saved or k not in _LATER_STATE else _LATER_STATE[k] for k in state})
        #: what the resume did, for the log and the JSONL (metrics.py Metrics.loaded)
        self.loaded = {"path": path, "iteration": it, "mesh": str(cfg.mesh.mesh()),
                       "continued": t.load is not None and source != t.load,
                       "saved_mesh": saved.get("mesh"), "seconds": time.perf_counter() - start,
                       "overridden": overridden, "optimizer_changed": changed,
                       "rng_restored": getattr(self.prog, "rng_restored", None),
                       "sample_order_changed": self._order_changed(saved, state),
                       "seed_changed": self._seed_changed(saved)}
        return it

    def _seed_changed(self, saved: dict) -> str | None:
        """Why the train data after the checkpoint is not the saved run's, or None: another
        --seed, which draws (or shuffles) the samples (a checkpoint older than the record: None)."""
        before, now = saved.get("seed"), self.cfg.training.seed
        if before is None or before == now:
            return None
        return (f"--seed {now}, where the checkpoint's run had --seed {before}: the train samples from here on are "
                f"drawn for seed {now}, not those that run would have read next; resume with --seed {before} to "
                "continue it")

    def _order_changed(self, saved: dict, state: dict) -> str | None:
        """Why the train samples after the checkpoint come in another order than the saved run's
        would have, or None: its shuffle was built for another number of samples (--steps x
        --batch) that needs other epochs -- Megatron's index depends on train_iters x the global
        batch alike. Some samples are then seen again, others skipped."""
        before, now = saved.get("sample_order"), self.sample_order
        if before is None or now is None or before == now or not state.get("consumed_train_samples"):
            return None
        t = self.cfg.training
        return (f"--steps {t.steps} x --batch {self.cfg.data.batch} asks {t.steps * self.cfg.data.batch} train samples, "
                f"whose shuffle (epochs, last epoch apart: {now}) is not the saved run's ({before}): the samples after "
                f"its {state['consumed_train_samples']} come in another order than that run's would have, some seen "
                "again, others skipped, as Megatron's index does; keep the saved run's --steps to keep its order")

    def maybe_save(self, state: dict) -> str | None:
        """Save after step state['iteration'] when --save is given and the step is a multiple
        of --save-interval or the last; the path written, or None."""
        t, step = self.cfg.training, state["iteration"]
        if t.save and ((t.save_interval and step % t.save_interval == 0) or step == t.steps):
            return self.save(state)
        return None

    def save(self, state: dict) -> str:
        """Save iteration state['iteration'] into --save (every rank), then the tracker and the
        pruning (rank 0)."""
        cfg, prog = self.cfg, self.prog
        root, it = cfg.training.save, state["iteration"]
        path = iter_dir(root, it)
        extra = {**state, "scheduler": self.sched.state_dict(), "global_batch": cfg.data.batch, "seq": cfg.data.seq,
                 "sample_order": self.sample_order, "seed": cfg.training.seed,
                 "model": cfg.model.name, "mesh": str(cfg.mesh.mesh())}
        start = time.perf_counter()
        os.makedirs(root, exist_ok=True)
        prog.save(path, self.opt, extra=extra)
        alone = prog.groups is None or not dist.is_initialized()
        if alone or dist.get_rank() == 0:
            write_tracker(root, it)
            prune(root, cfg.training.keep_last, saved=it)
        if not alone:
            dist.barrier()
        self.saved = {"path": path, "iteration": it, "seconds": time.perf_counter() - start}
        return path


__all__ = ["TRACKER", "Checkpointer", "committed", "complete", "iter_dir", "latest", "no_checkpoint", "prune", "read_state",
           "source_of", "write_tracker"]
