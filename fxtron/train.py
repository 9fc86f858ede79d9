"""The main job: train a shipped model on real text over several processes, then prove it
equal to the same training in one process.

Text is byte-level (every shipped preset has a vocabulary of at least 256), read from a file
the user names or, by default, from the sources of Python's standard library, which every
machine with Python has offline.

The run is described by one `fxtron.config.TrainConfig`: parallelize's sections (tensor,
pipeline, data_parallel, ..., debug) and the trainer's own (mesh, model, data, optimizer,
training); `fxtron train` generates its flags from it and reads it from TOML.
"""
from __future__ import annotations

import sysconfig
import time
from pathlib import Path

import torch

from fxtron.config import TrainConfig
from fxtron.errors import ParallelizeError


def load_text(path: str | None, max_bytes: int) -> torch.Tensor:
    """Bytes of `path`, or of the standard library's .py files (sorted, so every process and
    every run reads the same), as a uint8 tensor."""
    if path:
        data = Path(path).read_bytes()[:max_bytes]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for f in sorted(root.glob("*.py")):
            b = f.read_bytes()
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise ValueError(f"training text has only {len(data)} bytes; give a longer file")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def batch_at(data: torch.Tensor, step: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: the same on every rank and in the reference run."""
    seq = cfg.data.seq
    g = torch.Generator().manual_seed(cfg.training.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (cfg.data.batch,), generator=g)
    idx = torch.stack([data[s:s + seq] for s in starts.tolist()]).long()
    tgt = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()]).long()
    return idx, tgt


def _optimizer(params, cfg: TrainConfig):
    o = cfg.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             weight_decay=o.weight_decay)


def train_rank(rank: int, cfg: TrainConfig) -> dict:
    """One rank of the parallel run (fxtron.launch calls it). Rank 0 shows the progress bar."""
    import fxtron
    from fxtron.models import build
    from tqdm import tqdm

    data = load_text(cfg.data.path, cfg.data.max_bytes)
    model = build(cfg.model.name, seed=cfg.training.seed)
    pm = fxtron.parallelize(model, cfg.mesh.mesh(), example_inputs=batch_at(data, 0, cfg), config=cfg.parallel())
    prog = pm.program(rank, seed=cfg.training.seed)
    opt = _optimizer(prog.parameters(), cfg)
    losses = []
    steps, trace = cfg.training.steps, cfg.training.trace
    bar = tqdm(range(steps), desc=f"{cfg.model.name} on {pm.mesh.world_size} ranks", disable=rank != 0,
               unit="step", dynamic_ncols=True)
    tokens = cfg.data.batch * cfg.data.seq
    imbalance = []                 # per step: the worst layer's busiest expert over the mean (1: balanced)
    t0 = time.perf_counter()
    for step in bar:
        start = time.perf_counter()
        prog.track_memory = trace is not None and step == steps - 1
        loss = prog.train_step(batch_at(data, step, cfg), opt)
        losses.append(loss)
        shown = {"loss": f"{loss:.4f}", "tok_s": f"{tokens / (time.perf_counter() - start):,.0f}"}
        load = prog.expert_load()            # with expert parallel: every rank joins its all-reduce
        if load:
            imbalance.append(max(float(c.max()) / max(float(c.float().mean()), 1e-9) for c in load.values()))
            shown["experts_max/mean"] = f"{imbalance[-1]:.2f}"
        bar.set_postfix(shown)
    out = {"losses": losses, "seconds": time.perf_counter() - t0, "imbalance": imbalance}
    if trace is not None:
        out.update(timeline=prog.timeline(), memory=prog.memory_timeline())
    return out


def train_reference(cfg: TrainConfig) -> list[float]:
    """The same training in this one process with the unmodified model: each global batch in
    the pieces the parallel run's data-parallel ranks and microbatches take, their losses
    averaged (gradient accumulation) -- the same arithmetic, and for a mixture of experts the
    same load-balancing loss, which each piece computes over its own tokens."""
    from fxtron.models import build

    data = load_text(cfg.data.path, cfg.data.max_bytes)
    model = build(cfg.model.name, seed=cfg.training.seed)
    opt = _optimizer(model.parameters(), cfg)
    clip = cfg.data_parallel.clip_grad
    losses = []
    dp, m = cfg.mesh.mesh().dp, cfg.pipeline.microbatches
    for step in range(cfg.training.steps):
        opt.zero_grad(set_to_none=True)
        idx, tgt = batch_at(data, step, cfg)
        parts = _pieces(idx, tgt, dp, m, local=cfg.experts.aux_loss == "local")
        loss = sum(model(i, t) for i, t in parts) / len(parts)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _pieces(idx: torch.Tensor, tgt: torch.Tensor, dp: int, m: int, *, local: bool) -> list:
    """What one process trains a step as: the global batch's m microbatches (microbatch i is
    every dp rank's i-th; batch statistics such as the load-balancing loss per microbatch, as
    gradient accumulation computes them), or with moe_aux_loss='local' every dp rank's own
    microbatches (each its own statistics)."""
    idx_parts, tgt_parts = idx.chunk(dp * m), tgt.chunk(dp * m)
    if local:
        return list(zip(idx_parts, tgt_parts))
    return [(torch.cat([idx_parts[r * m + i] for r in range(dp)]), torch.cat([tgt_parts[r * m + i] for r in range(dp)]))
            for i in range(m)]


def reference_differs(cfg: TrainConfig) -> list[str]:
    """The options under which the one-process reference (train_reference) is another training."""
    out = []
    if cfg.precision.dtype != "fp32":
        out.append(f"dtype={cfg.precision.dtype} (the reference computes in fp32)")
    if cfg.data_parallel.grad_reduce_dtype not in (None, "fp32"):
        out.append(f"grad_reduce_dtype={cfg.data_parallel.grad_reduce_dtype}")
    if cfg.experts.capacity_factor is not None:
        out.append(f"moe_capacity_factor={cfg.experts.capacity_factor} (tokens dropped per rank)")
    return out


def run(cfg: TrainConfig) -> dict:
    """Train on the mesh's local processes; with cfg.training.compare, train again in one
    process and report the largest loss difference. Returns the figures as a dict."""
    import fxtron

    cfg.check()      # every option against the mesh, before any process starts
    if cfg.training.compare:
        unmodeled = reference_differs(cfg)
        if unmodeled:
            raise ParallelizeError(
                f"--compare holds the run to the same training in one fp32 process, which does not model "
                f"{'; '.join(unmodeled)}: its differences would not be round-off. Pass --no-compare (training.compare = false)")
    mesh, steps = cfg.mesh.mesh(), cfg.training.steps
    t0 = time.perf_counter()
    results = fxtron.launch(train_rank, mesh, args=(cfg,), shm_transport=cfg.debug.shm,
                            check_collectives=cfg.debug.check_collectives, flight_dir=cfg.debug.flight_dir)
    wall = time.perf_counter() - t0
    losses = results[0]["losses"]
    out = {"losses": losses, "seconds": results[0]["seconds"], "wall_seconds": wall,
           "tokens_per_s": steps * cfg.data.batch * cfg.data.seq / results[0]["seconds"]}
    print(f"parallel run: {steps} steps on {mesh}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{out['tokens_per_s']:,.0f} tokens/s ({wall:.1f} s with start-up)")
    if cfg.training.trace is not None:
        out["trace"] = write_trace(cfg, results)
    imbalance = results[0]["imbalance"]
    if imbalance:
        out["imbalance"] = imbalance
        print(f"expert load, busiest expert over the mean (worst layer): step 0 {imbalance[0]:.2f}, last step "
              f"{imbalance[-1]:.2f}, worst {max(imbalance):.2f} (1.00: balanced)")
    if cfg.training.compare:
        ref = train_reference(cfg)
        diffs = [abs(a - b) for a, b in zip(losses, ref)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        out.update(reference=ref, max_loss_diff=diffs[worst])
        print(f"one-process run: loss {ref[0]:.4f} -> {ref[-1]:.4f}")
        print(f"loss difference, parallel vs one process: first step {diffs[0]:.2e}, largest over "
              f"{steps} steps {diffs[worst]:.2e} (step {worst}: {losses[worst]:.7f} vs {ref[worst]:.7f}); "
              "float32 round-off of the different reduction order, compounded by AdamW")
    return out


def write_trace(cfg: TrainConfig, results: list[dict]) -> dict[str, str]:
    """The last step of every rank into cfg.training.trace: trace.json (Chrome trace: each rank's passes
    and memory) and schedule.png (the pipeline ranks of the first data-parallel replica, their
    memory below). Returns the paths written."""
    from fxtron import chart

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
