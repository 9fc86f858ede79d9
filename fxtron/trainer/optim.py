"""Trainer, optimizer: AdamW over two groups (no weight decay on biases and 1-d weights,
Megatron's default) and Megatron's learning-rate schedule (schedule.py) from the optimizer
section of the configuration -- what the run and its one-process reference (compare.py) both
train with."""
from __future__ import annotations

import torch

from fxtron.trainer.config import TrainConfig
from fxtron.trainer.schedule import LRSchedule


def param_groups(named, dims: dict[str, int] | None = None) -> list[dict]:
    """AdamW's groups: weight decay on the matrices, none on biases and 1-d weights (norms).
    `dims`: each parameter's number of dims in the model, where the tensor is not shaped like
    it (zero=3's flat pieces): for a program, `original_dims(prog)`."""
    decay, plain = [], []
    for n, p in named:
        ndim = (dims or {}).get(n, p.dim())
        (plain if n.endswith(".bias") or ndim <= 1 else decay).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def original_dims(prog) -> dict[str, int]:
    """Each parameter's number of dims in the original model (Program.original_shape), by the
    names of `prog.named_parameters()`: what the grouping rules read at every zero level."""
    return {n: len(prog.original_shape(n)) for n, _ in prog.named_parameters()}


def optimizer(named, cfg: TrainConfig, dims: dict[str, int] | None = None) -> torch.optim.AdamW:
    """AdamW over `named` (name, parameter) pairs in param_groups' two groups, with the
    configuration's learning rate, betas, eps and weight decay."""
    o = cfg.optimizer
    return torch.optim.AdamW(param_groups(named, dims), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             weight_decay=o.weight_decay)


def schedule(cfg: TrainConfig) -> LRSchedule:
    """The configuration's learning-rate schedule (decay over the run's steps unless given)."""
    o = cfg.optimizer
    return LRSchedule(o.lr, o.min_lr, o.lr_warmup_steps, o.lr_decay_steps or cfg.training.steps, o.lr_decay_style,
                      cfg.data.batch)


def set_lr(opt, lr: float) -> None:
    """Every group of `opt` at learning rate `lr` (the schedule's, before a step)."""
    for g in opt.param_groups:
        g["lr"] = lr


__all__ = ["optimizer", "original_dims", "param_groups", "schedule", "set_lr"]
