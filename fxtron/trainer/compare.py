"""Trainer, comparison (--compare): the run again in this one process with the unmodified
model (tools/reference.py's one-process training), from the same initial weights, batches,
schedule, groups and clipping, and the largest loss difference from the parallel run."""
from __future__ import annotations

import torch

from fxtron.trainer.config import TrainConfig
from fxtron.errors import ParallelizeError
from fxtron.runtime.batch import Microbatches, split_batch
from fxtron.tools.reference import reference_training
from fxtron.trainer.data import TrainData
from fxtron.trainer.models import TrainModel, key_values, resolve
from fxtron.trainer.optim import optimizer, schedule


#: the largest loss difference --compare calls round-off, relative to the loss (float32's over a
#: few hundred steps of AdamW on the shipped tiny models: ~1e-6)
TOLERANCE = 1e-4


def dropout_of(model: torch.nn.Module) -> list[str]:
    """Where `model` drops out in training: nn.Dropout modules with p > 0, and dropout rates of
    its configuration (transformers' attention_dropout, resid_pdrop, ...) above 0."""
    out = [f"{n} (p={m.p})" for n, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
           and m.p > 0]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        out += [f"config.{k}={v}" for k, v in config.to_dict().items()
                if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0]
    return out


def reference_differs(cfg: TrainConfig, model: torch.nn.Module | None = None) -> list[str]:
    """The options under which the one-process reference (`reference`) is another training
    (`model`: the run's, whose dropout the reference would draw otherwise)."""
    out = []
    if cfg.training.load is not None:
        out.append(f"--load {cfg.training.load} (the reference trains from the initial weights, not from the checkpoint)")
    dropped = dropout_of(model) if model is not None else []
    if dropped:
        out.append(f"dropout ({', '.join(dropped[:3])}: the reference draws other masks; set it to 0)")
    if cfg.precision.dtype != "fp32":
        out.append(f"dtype={cfg.precision.dtype} (the reference computes in fp32)")
    if cfg.data_parallel.grad_reduce_dtype not in (None, "fp32"):
        out.append(f"grad_reduce_dtype={cfg.data_parallel.grad_reduce_dtype}")
    if cfg.experts.capacity_factor is not None:
        out.append(f"moe_capacity_factor={cfg.experts.capacity_factor} (tokens dropped per rank)")
    return out


def check(cfg: TrainConfig, model: torch.nn.Module | None = None) -> None:
    """A ParallelizeError, before the run starts, where --compare could not hold it to round-off
    (`model`: the run's, resolved already; else resolved here)."""
    if model is None:
        t = cfg.training
        model = resolve(cfg.model.name, t.seed, key_values(cfg.model.config), cfg.data).model
    unmodeled = reference_differs(cfg, model)
    if unmodeled:
        raise ParallelizeError(
            f"--compare holds the run to the same training in one fp32 process, which does not model "
            f"{'; '.join(unmodeled)}: its differences would not be round-off. Drop --compare")


def reference(cfg: TrainConfig) -> list[float]:
    """The same run in this one process with the unmodified model, from the same initial
    weights (a meta build's, made whole; or its directory's), batches, schedule, groups and
    clipping: each global batch in the pieces the run's dp ranks and microbatches take, their
    losses averaged weighted by the labels each counts (gradient accumulation of a token mean:
    the token mean over the global batch, as the program computes it, however unevenly
    --eod-mask-loss leaves labels), and what the model adds to its token mean (an MoE's
    load-balancing loss) averaged over the pieces, as the program averages it; a step whose
    gradient norm is not finite skipped."""
    t = cfg.training
    tm = resolve(cfg.model.name, t.seed, key_values(cfg.model.config), cfg.data)
    data = TrainData(cfg, tm.vocab_size)
    model = _whole(tm, t.seed)
    dp, m = cfg.mesh.mesh().dp, cfg.pipeline.microbatches
    local = cfg.experts.aux_loss == "local"
    batches = (Microbatches(tm.inputs(p) for p in _pieces(data.train_batch(step * cfg.data.batch), dp, m, local=local))
               for step in range(t.steps))
    # where pieces count different labels (--eod-mask-loss), a term the model adds to its token mean
    # (an MoE's load-balancing loss) is averaged over them, not weighted by their labels
    uneven = cfg.data.eod_mask_loss and (m > 1 or (local and dp > 1))
    return reference_training(model, batches, optimizer(model.named_parameters(), cfg),
                              clip_grad=cfg.data_parallel.clip_grad, tokens=tm.counted, schedule=schedule(cfg),
                              skip_nonfinite=True, parts=tm.loss_parts if uneven else None)["losses"]


def compare(cfg: TrainConfig, losses: dict[int, float]) -> dict:
    """Run `reference` and print the largest difference from the run's `losses` (by step);
    returns reference (its losses) and max_loss_diff."""
    ref = reference(cfg)
    diffs = {s: abs(losses[s] - ref[s - 1]) for s in losses}
    worst = max(diffs, key=diffs.get)
    agrees = diffs[worst] <= TOLERANCE * max(1.0, abs(ref[worst - 1]))
    print(f"one-process run: loss {ref[0]:.4f} -> {ref[-1]:.4f}; loss difference, parallel vs one process: "
          f"largest {diffs[worst]:.2e} (step {worst}); "
          + ("float32 round-off of the different reduction order" if agrees else
             f"DIFFERS: more than float32 round-off ({TOLERANCE:g} of the loss) -- not the same training"))
    return {"reference": ref, "max_loss_diff": diffs[worst], "agrees": agrees}


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


def _pieces(tokens: torch.Tensor, dp: int, m: int, *, local: bool) -> list[torch.Tensor]:
    """What one process trains a step as (runtime/batch.py's split): the global batch's m
    microbatches (microbatch i is every dp rank's i-th), or with moe_aux_loss='local' every dp
    rank's own microbatches."""
    ranks = split_batch(tokens, dp, m)
    if local:
        return [p for pieces in ranks for p in pieces]
    return [torch.cat([ranks[r][i] for r in range(dp)]) for i in range(m)]


__all__ = ["check", "compare", "reference", "reference_differs"]
