"""The trainer's run: `fxtron train` (and `torchrun ... -m fxtron train`).

One rank's run (`train_rank`): the model built on meta and compiled for the mesh, its weights
loaded shard by shard from its directory or initialized; AdamW over two groups (no weight decay
on biases and 1-d weights, Megatron's default) under Megatron's learning-rate schedule; each
step trains global batch k (samples [k GBS, (k+1) GBS)) -- a step whose gradient norm is not
finite leaves the weights as they were on every rank, is counted and logged, and
--max-skipped of them in a row stop the run naming the step -- then evaluates, logs and saves
as configured. With --save (or --load) it resumes from the latest complete checkpoint, on any
mesh: model, optimizer, schedule, data position, random streams, step. `run` starts the mesh's
local processes, or under torchrun is one of them (RANK / WORLD_SIZE from the environment).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from fxtron.trainer.config import TrainConfig
from fxtron.errors import ParallelizeError
from fxtron.trainer import checkpoint as checkpoints
from fxtron.trainer.data import TrainData
from fxtron.trainer.metrics import Metrics, step_flops
from fxtron.trainer.models import TrainModel, key_values, resolve
from fxtron.trainer.schedule import LRSchedule


def param_groups(named, dims: dict[str, int] | None = None) -> list[dict]:
    """AdamW's groups: weight decay on the matrices, none on biases and 1-d weights (norms).
    `dims`: each parameter's number of dims in the model, where the tensor is not shaped like
    it (zero=3's flat pieces)."""
    decay, plain = [], []
    for n, p in named:
        ndim = (dims or {}).get(n, p.dim())
        (plain if n.endswith(".bias") or ndim <= 1 else decay).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def optimizer(named, cfg: TrainConfig, dims: dict[str, int] | None = None) -> torch.optim.AdamW:
    o = cfg.optimizer
    return torch.optim.AdamW(param_groups(named, dims), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             weight_decay=o.weight_decay)


def schedule(cfg: TrainConfig) -> LRSchedule:
    o = cfg.optimizer
    return LRSchedule(o.lr, o.min_lr, o.lr_warmup_steps, o.lr_decay_steps or cfg.training.steps, o.lr_decay_style,
                      cfg.data.batch)


def _set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def _writer(groups) -> bool:
    """The rank that writes metrics: the first rank of the last pipeline stage."""
    if groups is None:
        return True
    return groups.index("pp") == groups.size("pp") - 1 and all(
        groups.index(a) == 0 for a in ("tp", "cp", "ep", "dp"))


def train_rank(rank: int, cfg: TrainConfig, groups=None) -> dict:
    """One rank of the run (fxtron.launch calls it; under torchrun, `run` does)."""
    import fxtron
    t = cfg.training
    mesh = cfg.mesh.mesh()
    tm = resolve(cfg.model.name, t.seed, key_values(cfg.model.config), cfg.data)
    data = TrainData(cfg, tm.vocab_size)
    args, kw = tm.inputs(data.train_batch(0))
    config = cfg.parallel()
    if mesh.cp > 1 and config.context.documents is None and tm.documents is not None:
        config = config.replace(cp_documents=tm.documents)     # packed documents: THD, each rank a share of each
    pm = fxtron.parallelize(tm.model, mesh, example_inputs=args, example_kwargs=kw, config=config)
    prog = pm.program(rank, groups, seed=t.seed)
    prog.skip_nonfinite = True
    if tm.pretrained:
        prog.load_pretrained(tm.pretrained)
    opt = optimizer(prog.named_parameters(), cfg, {n: len(lp.full_shape) for n, lp in prog.local.items()})
    sched = schedule(cfg)
    state = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0, "skipped_iterations": 0}
    source = t.load or t.save
    resumed_from = None
    if source is not None:
        it = checkpoints.latest(source)
        if it is not None:
            saved = checkpoints.read_state(source, it)
            if saved.get("global_batch") != cfg.data.batch or saved.get("seq") != cfg.data.seq:
                raise ParallelizeError(
                    f"{checkpoints.iter_dir(source, it)} was trained with --batch {saved.get('global_batch')} --seq "
                    f"{saved.get('seq')}; resume with the same (the data position counts samples)")
            prog.load(checkpoints.iter_dir(source, it), opt)
            sched.load_state_dict(saved["scheduler"])
            state = {k: saved[k] for k in state}
            resumed_from = it
        elif t.load is not None:
            raise ParallelizeError(f"--load {t.load}: no complete checkpoint there (no iter_NNNNNNN with its commit "
                                   "marker); give the directory --save wrote")
    metrics = Metrics(cfg, writer=_writer(prog.groups), world=mesh.world_size, flops=step_flops(pm.traced),
                      resumed_from=resumed_from)
    in_a_row = 0
    imbalance: dict[int, float] = {}     # per step: the worst layer's busiest expert over the mean (1: balanced)
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    try:
        while state["iteration"] < t.steps:
            step = state["iteration"] + 1
            tokens = data.train_batch(state["consumed_train_samples"])
            lr = sched.lr
            _set_lr(opt, lr)
            start = time.perf_counter()
            a, k = tm.inputs(tokens)
            prog.track_memory = t.trace is not None and step == t.steps
            loss = prog.train_step(a, opt, kwargs=k)
            elapsed = time.perf_counter() - start
            load = prog.expert_load()            # with expert parallel: every rank joins its all-reduce
            if load:
                imbalance[step] = max(float(c.max()) / max(float(c.float().mean()), 1e-9) for c in load.values())
            state["iteration"] = step
            state["consumed_train_samples"] += cfg.data.batch
            skipped = prog.last_step_skipped
            if skipped:
                state["skipped_iterations"] += 1
                in_a_row += 1
            else:
                sched.step()
                in_a_row = 0
            losses[step] = loss
            metrics.step({"step": step, "loss": loss, "lr": lr, "grad_norm": prog.last_grad_norm,
                          "step_time": elapsed, "consumed_samples": state["consumed_train_samples"],
                          "skipped": state["skipped_iterations"], "step_skipped": skipped})
            if in_a_row >= t.max_skipped:
                raise ParallelizeError(
                    f"step {step}: {in_a_row} steps in a row had a non-finite loss or gradient norm (loss {loss}, "
                    f"grad norm {prog.last_grad_norm}); each was skipped. Lower --lr, clip (--clip-grad), or resume "
                    "from an earlier checkpoint")
            if t.eval_interval and step % t.eval_interval == 0:
                total = 0.0
                for _ in range(t.eval_iters):
                    va, vk = tm.inputs(data.valid_batch(state["consumed_valid_samples"]))
                    total += prog.eval_step(va, kwargs=vk)
                    state["consumed_valid_samples"] += cfg.data.batch
                evals[step] = total / t.eval_iters
                metrics.eval(evals[step])
            if t.save and ((t.save_interval and step % t.save_interval == 0) or step == t.steps):
                save(prog, opt, cfg, state, sched)
            metrics.flush()                      # the step's JSON line, its evaluation included
        if t.export_hf:
            prog.save_pretrained(t.export_hf)
    finally:
        metrics.close()
    out = {"losses": losses, "evals": evals, "resumed_from": resumed_from, "skipped": state["skipped_iterations"],
           "documents": config.context.documents if mesh.cp > 1 else None,
           "imbalance": imbalance, "tokens_per_s": metrics.tokens_per_s()}
    if t.trace is not None and losses:
        out.update(timeline=prog.timeline(), memory=prog.memory_timeline())
    return out


def save(prog, opt, cfg: TrainConfig, state: dict, sched: LRSchedule) -> str:
    """Save iteration state['iteration'] into --save (every rank), then the tracker and the
    pruning (rank 0)."""
    import torch.distributed as dist
    root, it = cfg.training.save, state["iteration"]
    path = checkpoints.iter_dir(root, it)
    extra = {**state, "scheduler": sched.state_dict(), "global_batch": cfg.data.batch, "seq": cfg.data.seq,
             "model": cfg.model.name, "mesh": str(cfg.mesh.mesh())}
    os.makedirs(root, exist_ok=True)
    prog.save(path, opt, extra=extra)
    alone = prog.groups is None or not dist.is_initialized()
    if alone or dist.get_rank() == 0:
        checkpoints.write_tracker(root, it)
        checkpoints.prune(root, cfg.training.keep_last)
    if not alone:
        dist.barrier()
    return path


# ----------------------------------------------------------------------------- the one-process reference
def reference(cfg: TrainConfig) -> list[float]:
    """The same run in this one process with the unmodified model, from the same initial
    weights (a meta build's, made whole; or its directory's), batches, schedule, groups and
    clipping: each global batch in the pieces the run's dp ranks and microbatches take, their
    losses averaged (gradient accumulation)."""
    t = cfg.training
    tm = resolve(cfg.model.name, t.seed, key_values(cfg.model.config), cfg.data)
    data = TrainData(cfg, tm.vocab_size)
    model = _whole(tm, t.seed)
    opt = optimizer(model.named_parameters(), cfg)
    sched = schedule(cfg)
    clip = cfg.data_parallel.clip_grad
    dp, m = cfg.mesh.mesh().dp, cfg.pipeline.microbatches
    out = []
    for step in range(t.steps):
        opt.zero_grad(set_to_none=True)
        tokens = data.train_batch(step * cfg.data.batch)
        parts = _pieces(tokens, dp, m, local=cfg.experts.aux_loss == "local")
        loss = sum(_loss(model, *tm.inputs(p)) for p in parts) / len(parts)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        _set_lr(opt, sched.lr)
        if torch.isfinite(norm):
            opt.step()
            sched.step()
        out.append(float(loss.detach()))
    return out


def _whole(tm: TrainModel, seed: int) -> torch.nn.Module:
    """The model on the CPU holding what the run starts from: its directory's weights read by
    transformers itself, or the meta build's initialization made whole."""
    import copy

    from fxtron.runtime.materialize import MetaMaterializer
    if tm.pretrained:
        return type(tm.model).from_pretrained(tm.pretrained)
    meta = tm.model
    m = MetaMaterializer(meta, seed)
    memo = {}
    for n, p in meta.named_parameters():
        memo[id(p)] = torch.nn.Parameter(m.local(n, (), {}, {}), p.requires_grad)
    for n, b in meta.named_buffers():
        if id(b) not in memo:
            memo[id(b)] = m.buffer(n) if b.device.type == "meta" else b.clone()
    return copy.deepcopy(meta, memo)


def _loss(model, args, kwargs) -> torch.Tensor:
    out = model(*args, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _pieces(tokens: torch.Tensor, dp: int, m: int, *, local: bool) -> list[torch.Tensor]:
    """What one process trains a step as: the global batch's m microbatches (microbatch i is
    every dp rank's i-th), or with moe_aux_loss='local' every dp rank's own microbatches."""
    parts = tokens.chunk(dp * m)
    if local:
        return list(parts)
    return [torch.cat([parts[r * m + i] for r in range(dp)]) for i in range(m)]


def reference_differs(cfg: TrainConfig) -> list[str]:
    """The options under which the one-process reference (trainer.loop.reference) is another training."""
    out = []
    if cfg.precision.dtype != "fp32":
        out.append(f"dtype={cfg.precision.dtype} (the reference computes in fp32)")
    if cfg.data_parallel.grad_reduce_dtype not in (None, "fp32"):
        out.append(f"grad_reduce_dtype={cfg.data_parallel.grad_reduce_dtype}")
    if cfg.experts.capacity_factor is not None:
        out.append(f"moe_capacity_factor={cfg.experts.capacity_factor} (tokens dropped per rank)")
    return out


def write_trace(cfg: TrainConfig, results: list[dict]) -> dict[str, str]:
    """The last step of every rank into cfg.training.trace: trace.json (Chrome trace: each rank's passes
    and memory) and schedule.png (the pipeline ranks of the first data-parallel replica, their
    memory below). Returns the paths written."""
    from fxtron.tools import chart

    out = Path(cfg.training.trace)
    out.mkdir(parents=True, exist_ok=True)
    mesh = cfg.mesh.mesh()
    paths = {"trace": chart.write_trace(str(out / "trace.json"), [r["timeline"] for r in results],
                                        [r["memory"] for r in results])}
    first = [r for r in range(mesh.world_size)
             if all(v == 0 for k, v in mesh.coords(r).items() if k not in ("pp", "ep", "edp", "etp"))]
    first = sorted(first, key=lambda r: mesh.coords(r)["pp"])[:mesh.pp]
    paths["picture"] = chart.draw_timelines([results[r]["timeline"] for r in first], str(out / "schedule.png"),
                                            title=f"{cfg.model.name}, " + " ".join(f"{a}={getattr(mesh, a)}" for a in
                                                                             ("tp", "pp", "dp", "cp", "ep")
                                                                             if getattr(mesh, a) > 1) + ", last step",
                                            memory=[results[r]["memory"] for r in first])
    peak = max(s.activations for r in results for s in r["memory"])
    print(f"trace of the last step: {paths['trace']} (Perfetto, chrome://tracing), {paths['picture']}; "
          f"peak activations saved for backward on a rank: {peak / 2**20:.2f} MiB")
    return paths


# ----------------------------------------------------------------------------- the command
def torchrun_world() -> int | None:
    """WORLD_SIZE when this process is one rank of a torchrun job."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def run(cfg: TrainConfig) -> dict:
    """Train the run `cfg`: under torchrun as this process's rank, else on the mesh's local
    processes; with --compare, again in one process, and the largest loss difference."""
    import fxtron
    world = torchrun_world()
    if world is not None:
        if cfg.mesh.world_size not in (None, world):
            raise ParallelizeError(f"--world-size {cfg.mesh.world_size} but torchrun started WORLD_SIZE={world} "
                                   "processes; omit --world-size under torchrun or make them agree")
        cfg = cfg.replace(world_size=world)
    cfg.check()
    mesh = cfg.mesh.mesh()
    if cfg.training.compare:
        unmodeled = reference_differs(cfg)
        if unmodeled:
            raise ParallelizeError(
                f"--compare holds the run to the same training in one fp32 process, which does not model "
                f"{'; '.join(unmodeled)}: its differences would not be round-off. Drop --compare")
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
        ref = reference(cfg)
        diffs = {s: abs(losses[s] - ref[s - 1]) for s in losses}
        worst = max(diffs, key=diffs.get)
        out.update(reference=ref, max_loss_diff=diffs[worst])
        print(f"one-process run: loss {ref[0]:.4f} -> {ref[-1]:.4f}; loss difference, parallel vs one process: "
              f"largest {diffs[worst]:.2e} (step {worst}); float32 round-off of the different reduction order")
    return out


__all__ = ["optimizer", "param_groups", "reference", "reference_differs", "run", "schedule", "train_rank",
           "write_trace"]
