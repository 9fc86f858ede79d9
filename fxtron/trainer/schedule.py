"""Trainer, learning-rate schedule: Megatron's (OptimizerParamScheduler,
megatron/core/optimizer_param_scheduler.py), counted in samples:
with n the samples of the steps taken so far (skipped steps do not count), warmup W and decay
D (steps x the global batch),

    n <= W (W > 0):       lr = max_lr * n / W                 (linear warm-up from 0)
    constant:             lr = max_lr
    n > D:                lr = min_lr
    otherwise, r = (n - W) / (D - W):
      linear:             lr = min_lr + (1 - r) (max_lr - min_lr)
      cosine:             lr = min_lr + 0.5 (cos(pi r) + 1) (max_lr - min_lr)

Step k (from 0) trains with lr(k x GBS): the first step of a warm-up trains with lr 0."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fxtron.errors import ParallelizeError


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: str
    global_batch: int
    num_samples: int = 0            # the samples of the steps taken (Megatron's num_steps)

    def __post_init__(self):
        if self.warmup_steps and self.warmup_steps >= self.decay_steps and self.style != "constant":
            raise ParallelizeError(f"lr_warmup_steps = {self.warmup_steps} is not below the decay's "
                                   f"{self.decay_steps} steps; give fewer warm-up steps or more decay steps")

    def lr_at(self, n: int) -> float:
        warmup, decay = self.warmup_steps * self.global_batch, self.decay_steps * self.global_batch
        if warmup > 0 and n <= warmup:
            return self.max_lr * n / warmup
        if self.style == "constant":
            return self.max_lr
        if n > decay:
            return self.min_lr
        r = (n - warmup) / (decay - warmup)
        c = 1.0 - r if self.style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + c * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.num_samples)

    def step(self) -> None:
        """After a step that updated the weights."""
        self.num_samples += self.global_batch

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict, override: bool = False) -> list[str]:
        """A checkpoint's schedule: its position; its settings must be this run's (Megatron
        asserts the same), or the resume would silently train another schedule -- unless
        `override` (Megatron's --override-opt_param-scheduler): this run's settings are kept.
        Returns the settings that differ ("decay_steps 12 in the checkpoint, 16 now")."""
        settings = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "style", "global_batch")
        if self.style == "constant" and state.get("style") == "constant":     # no decay: its length and floor unused
            settings = tuple(k for k in settings if k not in ("min_lr", "decay_steps"))
        differ = [f"{k} {state[k]} in the checkpoint, {getattr(self, k)} now" for k in settings
                  if k in state and state[k] != getattr(self, k)]
        if differ and not override:
            raise ParallelizeError("the checkpoint's learning-rate schedule differs from this run's: "
                                   + "; ".join(differ) + "; resume with the same --lr, --min-lr, --lr-warmup-steps, "
                                   "--lr-decay-style, --lr-decay-steps and --batch, or give --override-lr-schedule "
                                   "to continue with this run's settings from the checkpoint's position (Megatron's "
                                   "--override-opt_param-scheduler)")
        self.num_samples = int(state["num_samples"])
        return differ

__all__ = ["LRSchedule"]
