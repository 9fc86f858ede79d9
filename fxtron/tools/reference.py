"""Tools, one-process reference: a model trained in this one process, unmodified, on the same
global batches as a parallel program -- what every equivalence test (tools/testing.py) and the
trainer's --compare (trainer/compare.py) hold a parallel run to."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def model_loss(model: torch.nn.Module, args: tuple, kwargs: dict, params=None) -> torch.Tensor:
    """The loss `model` returns for (args, kwargs): its output, or transformers' output's
    `.loss`; with `params`, computed with those tensors in place of its own."""
    out = model(*args, **kwargs) if params is None else torch.func.functional_call(model, params, args, kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss   # transformers' outputs carry .loss


def microbatches(item) -> list[tuple[tuple, dict]]:
    """A step's inputs as (args, kwargs) microbatches: a `fxtron.Microbatches` list, an
    (args, kwargs) pair, or a tuple of positional inputs."""
    from fxtron.runtime.batch import Microbatches
    if isinstance(item, Microbatches):
        return [(tuple(a), dict(kw or {})) for a, kw in item]
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict) and isinstance(item[0], (tuple, list)):
        return [(tuple(item[0]), item[1])]
    return [(tuple(item), {})]


def reference_training(model: torch.nn.Module, batches: Iterable, make_optimizer,
                       dtype: torch.dtype | None = None, clip_grad: float | None = None,
                       tokens: Callable[[tuple, dict], int] | None = None, *, schedule=None,
                       skip_nonfinite: bool = False,
                       parts: Callable[[torch.nn.Module, tuple, dict, dict | None], tuple] | None = None) -> dict:
    """Train `model` in this process on `batches` (global batches); return the losses, the
    gradients of the first step (before its optimizer step, after clipping), the global norms
    before clipping (with `clip_grad`) and the final state dict: the single-process reference
    every equivalence test compares a parallel program with.

    Each item of `batches` is a tuple of positional inputs, an (args, kwargs) pair, or a
    `fxtron.Microbatches` list, whose loss is the mean of its microbatches' losses (gradient
    accumulation) -- or, with `tokens(args, kwargs)` (the tokens a microbatch's mean loss
    counts), their mean weighted by those counts: the token mean over the whole batch, as a
    program computes a mean cross entropy over microbatches of different lengths. With `parts`
    too (`parts(model, args, kwargs, params)`: a microbatch's loss as its token mean and the rest,
    a load-balancing loss added to it), only the token means are weighted by the counts and the
    rest is averaged over the microbatches, as gradient accumulation averages a per-microbatch
    term (the programs' statistics pass: passes/statistics.py). With `dtype` (bf16), the same precision policy as a mixed-precision program:
    fp32 parameters updated by the optimizer, forward computed with 16-bit copies of
    parameters and buffers. With `clip_grad`, torch.nn.utils.clip_grad_norm_ before each step.

    `make_optimizer`: a function of the parameters (`testing.adamw(...)`), or the optimizer
    itself (the trainer's, over its parameter groups). The trainer's run also takes, as its
    programs do: `schedule`, a learning-rate schedule (`.lr`, `.step()`) set before each step
    and advanced by each step taken; `skip_nonfinite`, no step where the gradient norm is not
    finite."""
    opt = make_optimizer if isinstance(make_optimizer, torch.optim.Optimizer) else make_optimizer(model.parameters())
    losses, first_grads, norms = [], None, []
    for step, item in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        params = None
        if dtype is not None:
            tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            params = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        mbs = microbatches(item)
        w = [tokens(a, kw) if tokens is not None else 1 for a, kw in mbs]
        if parts is not None and tokens is not None:
            pieces = [parts(model, a, kw, params) for a, kw in mbs]
            loss = (sum(mean * n for (mean, _), n in zip(pieces, w)) / sum(w)
                    + sum(rest for _, rest in pieces) / len(pieces))
        else:
            loss = sum(model_loss(model, a, kw, params) * n for (a, kw), n in zip(mbs, w)) / sum(w)
        loss.backward()
        norm = None
        if clip_grad is not None or skip_nonfinite:
            limit = clip_grad if clip_grad is not None else float("inf")    # inf: the norm alone, nothing clipped
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
            if clip_grad is not None:
                norms.append(float(norm))
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if schedule is not None:
            for g in opt.param_groups:
                g["lr"] = schedule.lr
        if not skip_nonfinite or torch.isfinite(norm):
            opt.step()
            if schedule is not None:
                schedule.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": first_grads, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


__all__ = ["microbatches", "model_loss", "reference_training"]
