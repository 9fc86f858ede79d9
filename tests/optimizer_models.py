"""Optimizers for tests/test_optimizers.py: torch's Muon with its Newton-Schulz iteration in
float32, a class fxtron does not know (so it steps whole matrices)."""
from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr


def _orthogonalize(g: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's _zeropower_via_newtonschulz in float32 (torch's casts to bfloat16)."""
    a, b, c = coefficients
    x = g.float()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon's algorithm (momentum, Nesterov, orthogonalized update, decoupled weight
    decay, its lr adjustment) with the orthogonalization in float32: torch's bfloat16 one turns
    gradients that differ by float32 rounding (summed in another order) into updates that differ
    by bfloat16's 2^-8, which hides a layout error of the same size."""
    fxtron_reads = "parameter"

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = _orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return None


class NormalizedSGD(torch.optim.Optimizer):
    """A user's optimizer fxtron does not know (it steps whole matrices), whose constructor
    requires its lr: p -= lr * (g + momentum * buffer) / ||g + momentum * buffer||, the norm over
    the whole parameter."""

    def __init__(self, params, lr, momentum=0.5, eps=1e-8):
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf / (buf.norm() + group["eps"]), alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """An update that reads every parameter: p -= lr * g / ||all gradients||, the norm over the
    whole model (as an optimizer that normalizes, or Prodigy's sums, reads them). Stepped per
    parameter on owner ranks, each owner's norm would be over its own parameters alone."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in grads)).float() if grads else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])
        return None


class DeclaredGlobalNormSGD(GlobalNormSGD):
    """GlobalNormSGD, saying what it reads (runtime/optim.py optimizer_reads)."""
    fxtron_reads = "all"


class ScaledNormSGD(torch.optim.Optimizer):
    """p -= lr * scale * g / ||g|| (the norm over the parameter): a setting its constructor keeps
    outside `defaults` (`self.scale`), which fxtron's own optimizer of the class must take from the
    user's, not from the constructor's default."""
    fxtron_reads = "parameter"

    def __init__(self, params, lr, scale=1.0):
        self.scale = scale
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-8), alpha=-group["lr"] * self.scale)
        return None
