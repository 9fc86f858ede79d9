"""Trainer, loop: `fxtron train` (and `torchrun ... -m fxtron train`).

One rank's run (`Trainer`): the model built on meta and compiled for the mesh, its weights
loaded shard by shard from its directory or initialized; AdamW and Megatron's learning-rate
schedule (optim.py); resumed from the latest complete checkpoint when there is one
(checkpoint.py). Each iteration is a step -- global batch k (samples [k GBS, (k+1) GBS)); a
step whose gradient norm is not finite leaves the weights as they were on every rank, is
counted and logged, and --max-skipped of them in a row stop the run naming the step -- then an
evaluation, a checkpoint and the step's metrics (metrics.py: with the rank's memory by kind and
the checkpoint events) as configured; --export-hf copies the model directory's tokenizer
along; rank 0 says what start-up does (tracing, compiling, the first step, with their times).
`run` checks the run first (`preflight_run`: the options, preflight.py's model, data and
heads), then starts the mesh's local processes, or under torchrun is one of them
(runtime/launch.py's `torchrun_world`); with --compare it trains again in one process
(compare.py).
"""
from __future__ import annotations

import os
import time
import warnings

import torch.distributed as dist

from fxtron.ops import ledger
from fxtron.trainer.config import TrainConfig
from fxtron.errors import ParallelizeError
from fxtron.runtime.checkpoint.hf import copy_tokenizer
from fxtron.runtime.launch import torchrun_world
from fxtron.runtime.memory import rank_bytes
from fxtron.trainer import compare, preflight
from fxtron.trainer.checkpoint import Checkpointer
from fxtron.trainer.data import TrainData
from fxtron.trainer.metrics import Metrics, step_flops, write_trace, writes_metrics
from fxtron.trainer.models import key_values, resolve
from fxtron.trainer.optim import optimizer, original_dims, schedule, set_lr


def _longer_than_the_model(tm, first, cfg: TrainConfig) -> ParallelizeError | None:
    """Where tracing at --seq failed, the refusal to give instead when the model cannot take
    --seq tokens at all (a learned position table of fewer rows, a rotary cache sliced to the
    sequence: torch.export's words are a size mismatch), found by tracing it on 8 tokens and
    reading its limit (passes/limits.py seq_limit, as `fxtron inspect` does); None otherwise.
    Only a failed start pays for the second trace."""
    from fxtron.compiler.trace import trace
    from fxtron.passes.limits import seq_limit
    seq = cfg.data.seq
    if seq <= 8:
        return None
    args, kw = tm.inputs(first[:, :9])
    try:
        limit = seq_limit(trace(tm.model, args, example_kwargs=kw))
    except Exception:  # noqa: BLE001 - the model fails at 8 tokens too: the first refusal stands
        return None
    if limit is None or seq <= limit.tokens:
        return None
    return ParallelizeError(f"--seq {seq}: {cfg.model.name} takes at most {limit.tokens} tokens ({limit.why}); "
                            f"give --seq {limit.tokens} or less")


class Trainer:
    """One rank's run of `cfg` (`groups`: its process groups under torchrun; else the
    program finds those fxtron.launch made)."""

    def __init__(self, rank: int, cfg: TrainConfig, groups=None):
        import fxtron
        t = cfg.training
        self.cfg, self.rank = cfg, rank
        mesh = cfg.mesh.mesh()
        self.model = tm = resolve(cfg.model.name, t.seed, key_values(cfg.model.config), cfg.data)
        self.data = TrainData(cfg, tm.vocab_size)
        first = self.data.train_batch(0)
        args, kw = tm.inputs(first)
        config = cfg.parallel()
        if mesh.cp > 1 and config.context.documents is None and tm.documents is not None:
            config = config.replace(cp_documents=tm.documents)     # packed documents: THD, each rank a share of each
        self.documents = config.context.documents if mesh.cp > 1 else None
        # start-up takes seconds to a minute before the first step: say what it is doing (rank 0)
        self.says = rank == 0
        self._started = start = time.perf_counter()
        self.say(f"start-up: tracing {cfg.model.name} (torch.export) ...")
        try:
            pm = fxtron.parallelize(tm.model, mesh, example_inputs=args, example_kwargs=kw, config=config)
        except ParallelizeError as e:
            too_long = _longer_than_the_model(tm, first, cfg)
            if too_long is None:
                raise
            raise too_long from e
        traced = time.perf_counter()
        self.say(f"start-up: traced in {traced - start:.1f} s; compiling rank {rank}'s program for {mesh} ...")
        self.prog = prog = pm.program(rank, groups, seed=t.seed)
        self.say(f"start-up: compiled in {time.perf_counter() - traced:.1f} s; running the first step"
                 + (" (Inductor compiles its regions)" if prog.compiled is not None else "") + " ...")
        prog.skip_nonfinite = True     # (under cuda_graphs such a step cannot be skipped: an error, runtime/graphs.py)
        if config.codegen.cuda_graphs:
            w = config.codegen.cuda_graph_warmup
            self.say(f"start-up: cuda_graphs: steps 1-{w} run eagerly on a side stream (warm-up), step {w + 1} is "
                     "captured in one CUDA graph and replayed from then on")
        if tm.pretrained:
            prog.load_pretrained(tm.pretrained)
        self.opt = optimizer(prog.named_parameters(), cfg, original_dims(prog))
        self.sched = schedule(cfg)
        # (skipped_in_a_row: the streak --max-skipped counts, saved so that a run restarted in the
        # middle of one stops where the uninterrupted run would)
        self.state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0,
                      "skipped_iterations": 0, "skipped_in_a_row": 0}
        self.checkpointer = Checkpointer(cfg, prog, self.opt, self.sched, self.data.sample_order)
        self.resumed_from = self.checkpointer.resume(self.state)
        self.data.cover_valid(cfg, self.state["iteration"], self.state["consumed_valid_samples"])
        self.metrics = Metrics(cfg, writer=writes_metrics(prog.groups), world=mesh.world_size,
                               flops=step_flops(pm.traced), resumed_from=self.resumed_from)
        if self.checkpointer.loaded is not None:
            self.metrics.loaded(self.checkpointer.loaded)
        self.imbalance: dict[int, float] = {}   # per step: the worst layer's busiest expert over the mean (1: balanced)
        self.losses: dict[int, float] = {}
        self.evals: dict[int, float] = {}

    def say(self, text: str) -> None:
        """A start-up line in the trainer's log (rank 0's output), beside the progress bar if any."""
        if not self.says:
            return
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics._print(text)
        else:
            print(text, flush=True)

    def train(self) -> dict:
        """Every step up to --steps, each evaluated, saved and logged as configured; then
        --export-hf. Returns what `run` reports."""
        t = self.cfg.training
        try:
            if self.state["iteration"] >= t.steps:
                self.say(f"nothing to train: the checkpoint loaded is at iteration {self.state['iteration']}, "
                         f"--steps is {t.steps} (raise --steps to go on)")
            while self.state["iteration"] < t.steps:
                step = self.train_step()
                # every --eval-interval steps, and after the last (Megatron's evaluation at the end of
                # training, which its valid split's size counts: eval_iters x (steps // interval + 1)),
                # that one after the checkpoint, as Megatron's: a run extended later (a higher --steps)
                # evaluates as the run that never stopped does, not on the valid samples after it
                if t.eval_interval and step % t.eval_interval == 0:
                    self.evaluate()
                if self.checkpointer.maybe_save(self.state):
                    self.metrics.saved(self.checkpointer.saved)
                if t.eval_interval and step == t.steps and step % t.eval_interval:
                    self.evaluate()
                self.metrics.flush()                      # the step's JSON line, its evaluation included
            if t.export_hf:
                self.prog.save_pretrained(t.export_hf)
                if self.rank == 0:                 # the model directory's tokenizer, as transformers' users load it
                    copy_tokenizer(self.cfg.model.name, t.export_hf)
                    if not self.model.transformers:
                        warnings.warn(f"--export-hf {t.export_hf}: {self.cfg.model.name} is not a transformers "
                                      "model, so the directory holds its weights (safetensors under the model's own "
                                      "names: model.safetensors, or shards listed in model.safetensors.index.json) "
                                      "without a config.json transformers could load; export an hf:<architecture> "
                                      "or a transformers directory's model for one", stacklevel=2)
            self.finish()
        finally:
            self.metrics.close()
        return self.results()

    def finish(self) -> None:
        """The run's work is done on this rank: the program's collectives still in flight
        complete (zero=1/2's all-gathers for a next step, zero=3's gathers), then every rank
        waits for every other (a barrier), so that no rank destroys its process groups while a
        peer still sends or receives through them; `run` (or fxtron.launch) destroys them."""
        self.prog.settle()
        if self.prog.groups is not None and dist.is_initialized():
            with ledger.collective(dist.group.WORLD, "barrier"):
                dist.barrier(group=dist.group.WORLD)

    def train_step(self) -> int:
        """Train the next global batch at the schedule's learning rate; the step's number."""
        cfg, t, state, prog = self.cfg, self.cfg.training, self.state, self.prog
        step = state["iteration"] + 1
        start = time.perf_counter()          # the batch's reading counted, as in Megatron's iteration time
        tokens = self.data.train_batch(state["consumed_train_samples"])
        lr = self.sched.lr
        set_lr(self.opt, lr)
        a, k = self.model.inputs(tokens)
        # the memory tracker on the steps that log (their activations) and --trace's last step
        prog.track_memory = step == t.steps or step % t.log_interval == 0
        loss = prog.train_step(a, self.opt, kwargs=k)
        elapsed = time.perf_counter() - start
        load = prog.expert_load()            # with expert parallel: every rank joins its all-reduce
        if load:
            self.imbalance[step] = max(float(c.max()) / max(float(c.float().mean()), 1e-9) for c in load.values())
        state["iteration"] = step
        state["consumed_train_samples"] += cfg.data.batch
        skipped = prog.last_step_skipped
        if skipped:
            state["skipped_iterations"] += 1
            # fp16's overflow skips are its scaler searching down for a scale that fits; they
            # count towards --max-skipped once it cannot back off further
            scaler = prog.scaler
            if scaler is None or scaler.static or scaler.scale <= scaler.min_scale:
                state["skipped_in_a_row"] += 1
        else:
            self.sched.step()
            state["skipped_in_a_row"] = 0
        self.losses[step] = loss
        if not self.losses.keys() - {step}:          # this process's first step
            self.say(f"start-up: first step in {elapsed:.1f} s; ready {time.perf_counter() - self._started:.1f} s "
                     "after tracing began")
            if prog.compiled is not None:
                self.say(f"start-up: {prog.compiled.line()}")
        if prog.captured is not None and prog.captured.captured_at == prog.captured.steps:    # the capture's step
            self.say(f"start-up: {prog.captured.line()}")
        # the logged learning rate is the schedule's after the step, the next step's, as Megatron's
        # training_log reads it from the optimizer once its scheduler stepped (`lr` trained this one)
        self.metrics.step({"step": step, "loss": loss, "lr": self.sched.lr, "grad_norm": prog.last_grad_norm,
                           "step_time": elapsed, "consumed_samples": state["consumed_train_samples"],
                           "skipped": state["skipped_iterations"], "step_skipped": skipped,
                           "loss_scale": prog.scaler.scale if prog.scaler is not None else None,   # (fp16's, after the step)
                           **rank_bytes(prog, self.opt)})
        if state["skipped_in_a_row"] >= t.max_skipped:
            raise ParallelizeError(
                f"step {step}: {state['skipped_in_a_row']} steps in a row had a non-finite loss or gradient norm (loss "
                f"{loss}, grad norm {prog.last_grad_norm}); each was skipped. Lower --lr, clip (--clip-grad), or "
                "resume from an earlier checkpoint")
        return step

    def evaluate(self) -> float:
        """The loss of the next --eval-iters validation batches, logged with the step: the token
        mean over all of them, as Megatron's evaluate sums the losses and the counted tokens of
        every iteration and divides once (each batch's mean weighted by the labels it counts)."""
        t, state = self.cfg.training, self.state
        total = tokens = 0.0
        for _ in range(t.eval_iters):
            va, vk = self.model.inputs(self.data.valid_batch(state["consumed_valid_samples"]))
            n = self.model.counted(va, vk)
            loss = self.prog.eval_step(va, kwargs=vk)
            if n:                     # (a batch whose every label is ignored adds nothing)
                total, tokens = total + loss * n, tokens + n
            state["consumed_valid_samples"] += self.cfg.data.batch
        if not self.evals and self.prog.compiled is not None and self.prog.compiled.eval_regions:
            self.say(f"first evaluation: {self.prog.compiled.line()}")
        self.evals[state["iteration"]] = loss = total / tokens if tokens else float("nan")
        self.metrics.eval(loss)
        return loss

    def results(self) -> dict:
        out = {"losses": self.losses, "evals": self.evals, "resumed_from": self.resumed_from,
               "skipped": self.state["skipped_iterations"], "documents": self.documents,
               "imbalance": self.imbalance, "tokens_per_s": self.metrics.tokens_per_s()}
        if self.cfg.training.trace is not None and self.losses:
            out.update(timeline=self.prog.timeline(), memory=self.prog.memory_timeline())
        return out


def train_rank(rank: int, cfg: TrainConfig, groups=None) -> dict:
    """One rank of the run (fxtron.launch calls it; under torchrun, `run` does)."""
    return Trainer(rank, cfg, groups).train()


# ----------------------------------------------------------------------------- the command
def preflight_run(cfg: TrainConfig) -> TrainConfig:
    """The run's checks before any process starts (torchrun's world, every option against the
    mesh, --compare's, preflight.py's model, data and heads); the configuration with
    torchrun's world size. A ParallelizeError raised here is marked `refused` (nothing ran
    yet: under torchrun rank 0 alone says it, cli.py)."""
    try:
        world = torchrun_world()
        if world is not None:
            if cfg.mesh.world_size not in (None, world):
                raise ParallelizeError(f"--world-size {cfg.mesh.world_size} but torchrun started WORLD_SIZE={world} "
                                       "processes; omit --world-size under torchrun or make them agree")
            cfg = cfg.replace(world_size=world)
        cfg.check()
        tm = preflight.check(cfg)
        if cfg.training.compare:
            compare.check(cfg, tm.model)
    except ParallelizeError as e:
        e.refused = True
        raise
    return cfg


def run(cfg: TrainConfig, *, checked: bool = False) -> dict:
    """Train the run `cfg`: under torchrun as this process's rank, else on the mesh's local
    processes; with --compare, again in one process, and the largest loss difference. Its
    checks (`preflight_run`) come first, before any process starts (`checked`: the caller
    ran them, as `fxtron train` does)."""
    import fxtron
    world = torchrun_world()
    if not checked:
        cfg = preflight_run(cfg)
    mesh = cfg.mesh.mesh()
    t0 = time.perf_counter()
    if world is not None:
        groups = fxtron.init_distributed(mesh, shm_transport=cfg.debug.shm, check_collectives=cfg.debug.check_collectives)
        from fxtron.runtime.groups import destroy
        try:
            results = [train_rank(groups.rank, cfg, groups)]
        finally:
            destroy()
    else:
        results = fxtron.launch(train_rank, mesh, args=(cfg,), shm_transport=cfg.debug.shm,
                                check_collectives=cfg.debug.check_collectives, flight_dir=cfg.debug.flight_dir)
    wall = time.perf_counter() - t0
    losses = results[0]["losses"]
    out = {"losses": losses, "evals": results[0]["evals"], "wall_seconds": wall,
           "resumed_from": results[0]["resumed_from"], "tokens_per_s": results[0]["tokens_per_s"]}
    if losses and (world is None or int(os.environ["RANK"]) == 0):
        first, last = min(losses), max(losses)
        print(f"trained steps {first}..{last} on {mesh}: loss {losses[first]:.4f} -> {losses[last]:.4f} "
              f"({wall:.1f} s with start-up)" + (f", resumed from step {out['resumed_from']}"
                                                  if out["resumed_from"] is not None else ""))
        if results[0].get("documents"):
            print(f"context parallel: packed documents balanced document by document (Megatron's THD): each row "
                  f"reordered by {results[0]['documents']} before the cp split")
    if cfg.training.trace is not None and world is None and losses:
        out["trace"] = write_trace(cfg, results)
    imbalance = results[0]["imbalance"]
    if imbalance:
        out["imbalance"] = list(imbalance.values())
        steps = sorted(imbalance)
        print(f"expert load, busiest expert over the mean (worst layer): step {steps[0]} {imbalance[steps[0]]:.2f}, "
              f"last step {imbalance[steps[-1]]:.2f}, worst {max(imbalance.values()):.2f} (1.00: balanced)")
    if cfg.training.compare and world is None:
        out.update(compare.compare(cfg, losses))
    return out


__all__ = ["Trainer", "preflight_run", "run", "train_rank"]
