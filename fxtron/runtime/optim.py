"""Runtime, optimizer step: the checks on the optimizer a program is given, and its step --
skipped when the global gradient norm is not finite (`prog.skip_nonfinite`), under fp16 after
the loss scaler (runtime/precision.py) unscales and checks the gradients, through the
distributed optimizer (runtime/zero.py) under zero=1/2."""
from __future__ import annotations

import math

import torch

from fxtron.errors import ParallelizeError


def check_optimizer(prog, optimizer) -> None:
    """ParallelizeError for an optimizer that would not train `prog`: not an
    optimizer, or holding tensors that are not its parameters (the original model's,
    whose gradients the step never fills)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ParallelizeError(f"train_step needs a torch.optim.Optimizer over prog.parameters(), got "
                               f"{type(optimizer).__name__}")
    mine = {id(p) for p in prog.parameters()}
    foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if foreign:
        raise ParallelizeError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not this program's parameters (the first "
            f"of shape {foreign[0]}): build it over prog.parameters() -- the rank's shards -- not over the "
            "original model's")


def optimizer_step(prog, optimizer: torch.optim.Optimizer) -> None:
    """`optimizer`'s step on `prog`'s finalized gradients, or none: a non-finite norm under
    skip_nonfinite (`prog.last_step_skipped`), an fp16 overflow (the scaler's)."""
    if prog.skip_nonfinite and prog.scaler is None:      # (fp16's scaler skips such steps itself)
        norm = prog.grads.last_norm if prog.grads.config.clip_grad is not None else float(prog.grads.norm())
        prog.grads.last_norm = norm
        prog.last_step_skipped = not math.isfinite(norm)
        if prog.last_step_skipped:
            return
    if prog.zero is not None:
        params = prog.zero.optimizer_for(optimizer)
        grads_ok = prog.scaler is None or prog.scaler.unscale_and_check(params, prog.groups, sharded_over_dp=True,
                                                                           dp_kind=prog.grads.dense_group)
        if grads_ok:
            prog.zero.step(optimizer)
        return
    if prog.scaler is None or prog.scaler.unscale_and_check(
            list(prog.parameters()), prog.groups, sharded_over_dp=prog.fsdp is not None,
            dp_kind=prog.grads.dense_group):
        optimizer.step()


__all__ = ["check_optimizer", "optimizer_step"]
