"""Test support: run a function on N gloo ranks with bounded time and every failure surfaced,
and the single-process reference that every equivalence test compares against."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from fxtron.errors import LaunchError
from fxtron.mesh import Mesh
from fxtron.runtime.launch import launch


def run_on_ranks(fn: Callable[..., Any], mesh: Mesh | int, *args, timeout_s: float = 300.0) -> list[Any]:
    """`fxtron.launch` for tests: gloo, one thread per rank, a job-wide timeout; a failing rank
    fails the test with that rank's traceback (pytest shows LaunchError's message whole)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    return launch(fn, mesh, args=args, backend="gloo", timeout_s=timeout_s,
                  collective_timeout_s=min(60.0, timeout_s / 2), threads_per_rank=1)


def reference_training(model: torch.nn.Module, batches: Iterable[tuple], make_optimizer,
                       dtype: torch.dtype | None = None) -> dict:
    """Train `model` in this process on `batches` (global batches); return the losses, the
    gradients of the first step (before its optimizer step) and the final state dict. With
    `dtype` (bf16), the same precision policy as a mixed-precision program: fp32 parameters
    updated by the optimizer, forward computed with 16-bit copies of parameters and buffers."""
    opt = make_optimizer(model.parameters())
    losses, first_grads = [], None
    for step, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if dtype is None:
            loss = model(*batch)
        else:
            tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            cast = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
            loss = torch.func.functional_call(model, cast, batch)
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": first_grads,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest elementwise difference over matching keys, and where it is. Keys must match."""
    if set(a) != set(b):
        raise AssertionError(f"keys differ: only left {sorted(set(a) - set(b))}, only right {sorted(set(b) - set(a))}")
    worst, where = 0.0, ""
    for k in a:
        if a[k].shape != b[k].shape:
            raise AssertionError(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        d = (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


__all__ = ["run_on_ranks", "reference_training", "max_abs_diff", "LaunchError"]
