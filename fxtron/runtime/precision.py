"""Runtime: mixed precision -- fp32 parameters updated by the optimizer, 16-bit copies for each
forward (Megatron's Float16Module and mixed-precision optimizer), and dynamic loss scaling for
fp16."""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxtron.core.records import FSDP_PIECES, GRAD_REPORTS
from fxtron.errors import ParallelizeError
from fxtron.ops import ledger


def compute_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor a graph computes with: a `dtype` copy of a floating fp32 parameter or buffer
    under mixed precision (a fused linear's weight copy carries the fp32 main_grad its gradient
    accumulates into, and the report that says it is complete), the tensor itself otherwise."""
    if dtype is None or not t.is_floating_point():
        return t
    copy = t.to(dtype)
    piece = FSDP_PIECES.get(t)     # zero=3's pieces: the program's units (ops/fsdp.py, core/records.py)
    if piece is not None:
        FSDP_PIECES.set(copy, piece)
    main_grad = getattr(t, "main_grad", None)
    if main_grad is not None:
        copy.main_grad = main_grad
        reported = GRAD_REPORTS.get(t)
        if reported is not None:
            GRAD_REPORTS.set(copy, reported)
    return copy


#: the largest power of two an fp16 value holds (65504 is its largest finite value)
FP16_MAX_SCALE = 2.0**15


class LossScaler:
    """Loss scaling for fp16 (Megatron's DynamicGradScaler; its start 2^16, torch's GradScaler's,
    and its hysteresis 1 unless configured: the precision section's loss_scale, initial_loss_scale,
    min_loss_scale, loss_scale_window, hysteresis): scale the loss by `scale` before backward; a
    step whose gradients overflow anywhere in the job is skipped, and the `hysteresis`-th such step
    since the scale last grew halves the scale (each one after it too), down to `min_scale`;
    `growth_interval` clean steps in a row double it, up to `max_scale`, and restore the
    hysteresis. A static scale (`static=True`: loss_scale) never changes, its overflowing steps
    skipped alike. Where the
    loss itself is fp16 (a model that does not upcast its logits), or an fp16 value receives its
    gradient whole (an fp16 cross entropy added to an fp32 auxiliary loss, compiler/trace.py
    _loss_gradient_dtype), backward's first gradient there is the scale (a pipeline's stages: scale / microbatches), which must be finite in fp16: the
    program caps the scale at FP16_MAX_SCALE on every rank alike (its trace says the loss's
    dtype, which a pipeline's first stages never see); torch's GradScaler's 2^16 would skip the
    first step and every regrowth to it."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0, max_scale: float = float("inf"), hysteresis: int = 1,
                 static: bool = False):
        self.max_scale = max_scale
        self.scale, self.growth_interval = min(scale, max_scale), growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.hysteresis, self.static = hysteresis, static
        self.hysteresis_left = hysteresis
        self.clean_steps = 0
        self.skipped = 0

    @classmethod
    def for_loss(cls, loss_dtype: torch.dtype | None, precision=None) -> "LossScaler":
        """The scaler of a program whose loss has `loss_dtype` (its trace's), as the precision
        section configures it (config/sections.py PrecisionConfig)."""
        cap = FP16_MAX_SCALE if loss_dtype == torch.float16 else float("inf")
        if precision is None:
            return cls(max_scale=cap)
        if precision.loss_scale is not None:
            if precision.loss_scale > cap:
                raise ParallelizeError(
                    f"loss_scale={precision.loss_scale!r}: the loss itself is fp16 (the model does not upcast it), so "
                    f"backward's first gradient is the scale, which fp16 holds only up to 65504: every step would "
                    f"overflow and be skipped. Give loss_scale <= {cap:g}, or compute the loss in fp32")
            return cls(precision.loss_scale, max_scale=cap, static=True)
        return cls(precision.initial_loss_scale, precision.loss_scale_window, min_scale=precision.min_loss_scale,
                   max_scale=cap, hysteresis=precision.hysteresis)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "max_scale": self.max_scale, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """The saved scale and counts; the cap stays this program's (its loss's dtype), and a
        static scale the configured one."""
        if not self.static:
            self.scale = min(float(state["scale"]), self.max_scale)
        self.clean_steps, self.skipped = int(state["clean_steps"]), int(state["skipped"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))

    def unscale_and_check(self, params: list[torch.Tensor], groups, *, sharded_over_dp: bool = False,
                          dp_kind: str = "dp") -> bool:
        """Divide the gradients by the scale; True when they are finite on every rank. The
        verdict is agreed over the model-parallel group (tp-pp: every piece of the model), and
        over data parallel too when each dp rank holds a different shard of the gradients (the
        distributed optimizer, over `dp_kind`: dp-cp under context parallel); without it every dp
        rank has the same summed gradients."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, device=grads[0].device if grads else groups.device if groups is not None else "cpu")
        for g in grads:
            g.div_(self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
        if groups is not None:
            kinds = ("tp-pp", "tp-ep-pp") if groups.size("ep") > 1 else ("tp-pp",)   # experts differ over ep
            for kind in kinds + ((dp_kind,) if sharded_over_dp else ()):
                if groups.size(kind) > 1:
                    with ledger.collective(groups.group(kind), "all_reduce(max)", found):
                        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=groups.group(kind))
        if found.item():
            self.clean_steps = 0
            self.skipped += 1
            if not self.static:
                self.hysteresis_left -= 1
                if self.hysteresis_left <= 0:
                    self.scale = max(self.scale * self.backoff, self.min_scale)
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0 and not self.static:
            self.scale = min(self.scale * self.growth, self.max_scale)
            self.hysteresis_left = self.hysteresis
        return True


__all__ = ["LossScaler", "compute_copy"]
