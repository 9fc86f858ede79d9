"""Runtime: a rank's program — an nn.Module holding that rank's parameters and running its graph.

The module tree mirrors the original model's (`prog.named_parameters()` yields
`blocks.0.attn.qkv.weight`, ...), so optimizers, clipping and state dicts see familiar names.
Forward calls the per-rank GraphModule with (parameters, buffers, flattened inputs) in the
order the trace fixed. `train_step` does one whole step of data-parallel training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxtron.compiler.trace import TraceInfo
from fxtron.errors import ParallelizeError
from fxtron.runtime.groups import ProcessGroups
from fxtron.codegen.linear import WgradQueue
from fxtron.runtime.rng import RNGStreams


@dataclass(frozen=True)
class LocalParam:
    """How a rank's parameter relates to the full one. `gather(local, groups)` rebuilds the
    full tensor from every holder's local piece (identity when the parameter is whole)."""

    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    gather: Callable[[torch.Tensor, ProcessGroups], torch.Tensor] | None = None


def _set_by_path(root: nn.Module, path: str, value: torch.Tensor, *, parameter: bool, persistent: bool = True) -> None:
    *mods, leaf = path.split(".")
    node = root
    for m in mods:
        if not hasattr(node, m) or not isinstance(getattr(node, m), nn.Module):
            node.add_module(m, nn.Module())
        node = getattr(node, m)
    if parameter:
        node.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        node.register_buffer(leaf, value, persistent=persistent)


def _get_by_path(root: nn.Module, path: str) -> torch.Tensor:
    *mods, leaf = path.split(".")
    node = root
    for m in mods:
        node = getattr(node, m)
    return getattr(node, leaf)


class LossScaler:
    """Dynamic loss scaling for fp16 (Megatron's DynamicGradScaler defaults): scale the loss
    by `scale` before backward; a step whose gradients overflow anywhere in the job is skipped
    and halves the scale; `growth_interval` clean steps in a row double it."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0):
        self.scale, self.growth_interval = scale, growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, params: list[torch.Tensor], groups: ProcessGroups | None) -> bool:
        """Divide the gradients by the scale; True when they are finite on every rank."""
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros(1, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.div_(self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
        if groups is not None and groups.mesh.world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)   # every rank skips the same steps
        if found.item():
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth
        return True


class Program(nn.Module):
    """One rank's share of the model, ready for an optimizer.

    params: name -> this rank's tensor (a shard or the whole parameter); buffers likewise.
    groups: the rank's process groups (None for a program that is only inspected or run
    without communication, e.g. on a 1-rank mesh).
    """

    def __init__(self, gm: fx.GraphModule, info: TraceInfo, params: dict[str, torch.Tensor],
                 buffers: dict[str, torch.Tensor], persistent: set[str], local: dict[str, LocalParam],
                 rank: int, groups: ProcessGroups | None, aliases: dict[str, str], rng: RNGStreams | None = None,
                 fused: list[str] | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        for name in info.params:
            _set_by_path(self, name, nn.Parameter(params[name]), parameter=True)
        for name in info.buffers:
            _set_by_path(self, name, buffers[name], parameter=False, persistent=name in persistent)
        object.__setattr__(self, "graph_module", gm)  # not a submodule: keep the tree the model's
        self._info = info
        self._local = local
        self._aliases = aliases
        self.rank = rank
        self.groups = groups
        self.rng = rng
        # mixed precision: parameters stay fp32 (the optimizer's main parameters); each forward
        # computes with 16-bit copies (Megatron's Float16Module + mixed-precision optimizer)
        self.dtype = dtype if dtype not in (None, torch.float32) else None
        self.scaler = LossScaler() if self.dtype == torch.float16 else None
        # fp32 gradient buffers of the weights whose fused linears accumulate into them
        self._main_grads = {n: torch.zeros(_get_by_path(self, n).shape, dtype=torch.float32,
                                           device=_get_by_path(self, n).device) for n in (fused or [])}

    # ---------------------------------------------------------------- running
    def _flat_inputs(self, inputs: tuple, kwargs: dict | None) -> list:
        """The tensor leaves of (inputs, kwargs), checked against the traced structure."""
        flat, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs or {})))
        if spec != self._info.in_spec:
            raise ParallelizeError(f"inputs have structure {spec}, but the model was traced with {self._info.in_spec}; "
                                   "pass the same positional and keyword inputs as example_inputs")
        return [x for x in flat if isinstance(x, torch.Tensor)]

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        """The loss of this rank's program on these (already local) inputs."""
        flat = self._flat_inputs(inputs, kwargs)
        args = [self._compute_copy(_get_by_path(self, n)) for n in self._info.params]
        args += [self._compute_copy(_get_by_path(self, n)) for n in self._info.buffers]
        with self.rng.active() if self.rng is not None else contextlib.nullcontext():
            outs = self.graph_module(*args, *flat)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = None
        for i, out in enumerate(outs):
            if i in self._info.buffer_mutations:
                with torch.no_grad():
                    _get_by_path(self, self._info.buffer_mutations[i]).copy_(out)
            else:
                loss = out
        return loss

    def _compute_copy(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the graph computes with: a 16-bit copy of a floating fp32 parameter or
        buffer under mixed precision (a fused linear's weight copy carries the fp32 main_grad
        its gradient accumulates into), the tensor itself otherwise."""
        if self.dtype is None or not t.is_floating_point():
            return t
        copy = t.to(self.dtype)
        main_grad = getattr(t, "main_grad", None)
        if main_grad is not None:
            copy.main_grad = main_grad
        return copy

    def local_batch(self, inputs: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """This rank's data-parallel slice of a global batch (dim 'batch' of every input)."""
        dp, index = self._dp()
        if dp == 1:
            return tuple(inputs), dict(kwargs or {})
        flat = self._flat_inputs(inputs, kwargs)
        out = []
        for x, dims in zip(flat, self._info.user_dims):
            if isinstance(x, torch.Tensor) and "batch" in dims:
                d = dims.index("batch")
                if x.shape[d] % dp:
                    raise ParallelizeError(f"global batch {x.shape[d]} (dim {d} of an input of shape "
                                           f"{tuple(x.shape)}) is not divisible by dp={dp}; use a batch "
                                           f"that is a multiple of {dp}")
                x = x.chunk(dp, dim=d)[index]
            out.append(x)
        it = iter(out)
        leaves = [next(it) if s is None else s for s in self._info.statics]
        args, kw = pytree.tree_unflatten(leaves, self._info.in_spec)
        return args, kw

    def train_step(self, inputs: tuple, optimizer: torch.optim.Optimizer, *, kwargs: dict | None = None) -> float:
        """One training step on the global batch `inputs` (the same tensors on every rank):
        forward and backward on this rank's slice, gradient sync, optimizer step. Returns the
        global batch's loss."""
        args, kw = self.local_batch(inputs, kwargs)
        optimizer.zero_grad(set_to_none=True)
        with self._main_grad_accumulation():
            loss = self(*args, **kw)
            scaled = loss * self.scaler.scale if self.scaler is not None else loss
            with WgradQueue().active():   # weight-gradient GEMMs overlap tp all-reduces
                scaled.backward()
        self.sync_grads()
        if self.scaler is None or self.scaler.unscale_and_check(list(self.parameters()), self.groups):
            optimizer.step()
        return self._global_loss(loss.detach().float())

    @contextlib.contextmanager
    def _main_grad_accumulation(self):
        """During one step, fused linears accumulate weight gradients into fp32 main_grad
        (zeroed here); afterwards each weight's .grad is its main_grad plus whatever plain
        autograd added (a tied embedding's part), as Megatron's DDP hook adds them."""
        params = {n: _get_by_path(self, n) for n in self._main_grads}
        for n, p in params.items():
            self._main_grads[n].zero_()
            p.main_grad = self._main_grads[n]
        try:
            yield
        finally:
            for n, p in params.items():
                del p.main_grad
                g = self._main_grads[n]
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g if p.dtype == torch.float32 else g.to(p.dtype)

    # ---------------------------------------------------------------- communication
    def _dp(self) -> tuple[int, int]:
        if self.groups is None:
            return 1, 0
        return self.groups.size("dp"), self.groups.index("dp")

    def sync_grads(self) -> None:
        """Average every gradient over the data-parallel group: one all-reduce of one flat
        buffer (buckets overlapped with backward are the data-parallel issue's)."""
        dp, _ = self._dp()
        if dp == 1:
            return
        params = list(self.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(dp)
        dist.all_reduce(flat, group=self.groups.group("dp"))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    def _global_loss(self, loss: torch.Tensor) -> float:
        dp, _ = self._dp()
        if dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.groups.group("dp"))
            loss /= dp
        return float(loss)

    # ---------------------------------------------------------------- full tensors
    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        spec = self._local.get(name)
        if spec is None or spec.gather is None:
            return local
        return spec.gather(local, self.groups)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients under the original parameter names (tied weights once)."""
        out = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = self._full(name, g.detach()).clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape parameters and persistent buffers under the original names, tied aliases
        included, so `model.load_state_dict(prog.full_state_dict())` restores the model."""
        out = {}
        for name, p in self.named_parameters():
            out[name] = self._full(name, p.detach()).clone()
        persistent = set(self.state_dict(keep_vars=True))
        for name, b in self.named_buffers():
            if name in persistent:
                out[name] = b.detach().clone()
        for alias, name in self._aliases.items():
            out[alias] = out[name]
        return out
