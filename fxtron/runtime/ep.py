"""Runtime, expert parallel: what a step's all-to-alls did -- the dispatch log a step records
(ops/ep.py DispatchLog, kept as `prog.last_dispatch`) and the experts' load over the global
batch (`expert_load`, Program.expert_load; the trainer's metrics read it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxtron.ops import ledger
from fxtron.ops.ep import DispatchLog


def dispatch_log(prog, evaluation: bool = False):
    """A fresh DispatchLog as `prog.last_dispatch` (an evaluation's as `prog.last_eval_dispatch`:
    `expert_load` stays the last training step's); the context returned makes it the one the
    step's dispatches write to."""
    log = DispatchLog()
    setattr(prog, "last_eval_dispatch" if evaluation else "last_dispatch", log)
    return log.active()


def expert_load(prog) -> dict[str, torch.Tensor]:
    """The copies each expert received in the last training step (an evaluation's dispatch is
    `last_eval_dispatch`; under a capacity factor those within
    its capacity, the dropped ones not: `last_dispatch.copies` has them routed), per mixture-of-experts layer of
    `prog`'s stages: {layer: (E,) int64} over the whole global batch (every data-
    parallel rank's tokens, and under context parallel every cp rank's, which routes its own: one
    all-reduce over dp, or dp-cp; every rank of the group calls it).
    Empty without expert parallel. `last_dispatch.bytes_sent`: the bytes this rank sent
    to other ranks in the step's all-to-alls."""
    log = getattr(prog, "last_dispatch", None)
    if log is None or not log.kept:
        return {}
    names = sorted(log.kept)
    stacked = torch.stack([log.kept[n].to(torch.int64) for n in names])
    kind = "dp-cp" if prog.groups is not None and prog.groups.size("cp") > 1 else "dp"
    if prog.groups is not None and prog.groups.size(kind) > 1:
        stacked = stacked.to(prog.groups.device)
        with ledger.collective(prog.groups.group(kind), "all_reduce", stacked):
            dist.all_reduce(stacked, group=prog.groups.group(kind))
    return {n: stacked[i].cpu() for i, n in enumerate(names)}


__all__ = ["dispatch_log", "expert_load"]
