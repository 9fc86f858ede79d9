"""Runtime, pipeline parallel: the runner of a program's schedule -- its chunks, actions and p2p
built once (`runner`), and one step run by it over microbatches (`pipelined_step`).

A program with pipeline stages, or with microbatches > 1 on one stage, steps here
(Program.train_step / eval_step): the rank's microbatches (runtime/batch.py) run through the
schedule's actions (runtime/pp/schedules.py) by the StageRunner (runtime/pp/executor.py), each
stage's forward being the program's own (`Program._call_stage`); then the gradient sync
(runtime/grads.py), the optimizer step (runtime/optim.py) and the loss summed over pp and dp.
An evaluation (`evaluate`) runs the eval-mode stages by the same schedule's forwards alone.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fxtron.core.stage import Stage
from fxtron.ops import ledger
from fxtron.runtime import ep, optim
from fxtron.runtime.pp import schedules, timeline
from fxtron.runtime.pp.executor import StageRunner
from fxtron.runtime.pp.p2p import P2P


def _build(prog, stages: list | None, call, keep=lambda action: True, microbatches: int | None = None,
           **options) -> StageRunner:
    """A StageRunner of `prog`'s rank over `stages` (None: the whole graph as one stage) running
    each rank's schedule actions that `keep` keeps, with the p2p between pipeline ranks, over
    `microbatches` (the program's count unless given)."""
    opts = prog.pipeline
    m = opts.microbatches if microbatches is None else microbatches
    pp = prog.groups.size("pp") if prog.groups is not None else 1
    pp_rank = prog.groups.index("pp") if prog.groups is not None else 0
    whole = Stage(index=0, gm=None, params=[], buffers=[], user_inputs=[], has_loss=True)

    def order(r: int) -> list:
        return [a for a in schedules.actions(opts.schedule, pp, m, r, opts.virtual_stages) if keep(a)]
    p2p = (P2P(prog.groups, scatter_gather=opts.scatter_gather, match_by_tag=prog.config.debug.p2p_tags,
               rank_of=functools.partial(schedules.rank_of, opts.schedule, pp))
           if pp > 1 else None)
    peers = ([order(r) for r in range(pp)], functools.partial(schedules.stage_of, opts.schedule, pp))
    return StageRunner(stages if stages is not None else [whole], call, order(pp_rank), num_stages=pp * opts.chunks,
                       peers=peers, microbatches=m, p2p=p2p, **options)


def runner(prog) -> StageRunner:
    """The schedule runner of `prog`'s rank (built once, kept as `prog._runner`): its chunks,
    actions and p2p."""
    if prog._runner is None:
        prog._runner = _build(prog, prog._stages, prog._call_stage, zero_bubble=prog.pipeline.split_backward,
                              before_last_backward=prog.grads.last_backward, quiet=prog.grads.quiet)
    return prog._runner


def pipelined_step(prog, inputs, optimizer, kwargs) -> float:
    """One training step of `prog` on the global batch `inputs` run by its schedule, then
    `optimizer`'s step. Returns the global batch's loss."""
    mbs = prog.microbatches(inputs, kwargs)
    batch = prog._batch.context(inputs, kwargs)
    run = runner(prog)
    optim.zero_grad(optimizer)
    run.memory = timeline.memory_tracker(prog)
    prog._last_runner = run
    with prog.grads.accumulation(), ep.dispatch_log(prog), batch.active():
        loss = run.run(mbs, loss_scale=prog.scaler.scale if prog.scaler is not None else 1.0)
    prog.grads.finalize(loss_scale=prog.scaler.scale if prog.scaler is not None else None)
    optim.optimizer_step(prog, optimizer)
    return _global_loss(prog, loss)


def eval_runner(prog, evaluation, m: int) -> StageRunner:
    """The forward-only runner of `prog`'s rank over its eval-mode stages in `m` microbatches
    (built once for each count, kept in `prog._eval_runners`): every rank's schedule with its B
    and W passes dropped -- each F keeps its place, so the order still runs without deadlock (an
    F never waits for a B) -- and no backward, no gradient buffer."""
    if m not in prog._eval_runners:
        prog._eval_runners[m] = _build(prog, evaluation.stages, functools.partial(_call_eval_stage, prog, evaluation),
                                       keep=lambda a: a.kind == "F", microbatches=m, zero_bubble=False,
                                       forward_only=True)
    return prog._eval_runners[m]


def _call_eval_stage(prog, evaluation, stage, flat, received):
    return prog._call_stage(stage, flat, received, evaluation)


def evaluate(prog, inputs, kwargs, evaluation) -> float:
    """The global batch's loss of `prog`'s eval-mode graph (`evaluation`, Program.eval_graphs)
    run by the forward-only schedule under no_grad: no backward, no gradient touched. On one
    stage, a rank's share of the batch that does not divide into the program's microbatches
    runs as the most that divide it (batch.py fitting_microbatches)."""
    m = prog.pipeline.microbatches if prog._stages is not None else prog._batch.fitting_microbatches(inputs, kwargs)
    mbs = prog._batch.microbatches(inputs, kwargs, m)
    batch = prog._batch.context(inputs, kwargs, evaluation.info.statistics, microbatches=m)
    run = eval_runner(prog, evaluation, m)
    run.memory = timeline.memory_tracker(prog)
    prog._last_runner = run
    with torch.no_grad(), ep.dispatch_log(prog, evaluation=True), batch.active():
        loss = run.run(mbs)
    return _global_loss(prog, loss)


def _global_loss(prog, loss) -> float:
    """The last stage's loss summed over pp (only it holds one), then the global batch's over dp."""
    if prog.groups is not None and prog.groups.size("pp") > 1:
        # float64 on every pp rank: the last stage's loss keeps a float64 model's precision
        loss = (loss.double().clone() if loss is not None
                else torch.zeros((), dtype=torch.float64, device=prog.groups.device))
        with ledger.collective(prog.groups.group("pp"), "all_reduce", loss):   # only the last stage's is non-zero
            dist.all_reduce(loss, group=prog.groups.group("pp"))
    out = prog._global_loss(loss)
    ledger.step_end(prog.groups)
    return out


__all__ = ["eval_runner", "evaluate", "pipelined_step", "runner"]
