"""Runtime: a program's gradients -- accumulated into one bucketed fp32 buffer during backward
(runtime/buffers.py), then Megatron's finalize_model_grads: the data-parallel sync of the
buckets, the sums over the axes where a whole weight's gradient is partial (norm weights under
sequence parallel), the sums over the pipeline ranks that share a tied weight, the global norm
and clipping; full-shape gradients on request.

`GradientSync` is mixed into runtime.program.Program: it reads the program's parameters
(`named_parameters`), its parameter descriptions (`_local`), groups, gradient buffer
(`grad_buffer`, `_grad_views`), distributed optimizer (`_zero`), shared weights (`_shared`) and
data-parallel options.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fxtron.core.layout import unshard
from fxtron.core.params import LocalParam
from fxtron.ops import ledger

#: the model-parallel axes a parameter may be sharded over inside a pipeline stage: the gradient
#: norm counts a replica once (on the axis's rank 0) and sums over the group "tp-pp" (a new axis
#: joins this tuple and that group)
NORM_AXES = ("tp",)


def get_by_path(root: torch.nn.Module, path: str) -> torch.Tensor:
    *mods, leaf = path.split(".")
    node = root
    for m in mods:
        node = getattr(node, m)
    return getattr(node, leaf)


def gather_full(local: torch.Tensor, spec: LocalParam, groups) -> torch.Tensor:
    """The full tensor from every rank's piece of a parameter (or a gradient, or an optimizer
    state shaped like it): all-gathered over each axis it is sharded on, last shard first."""
    out = local
    for s in reversed(spec.shards):
        if groups is None or groups.size(s.axis) == 1:
            continue
        pieces = [torch.empty_like(out) for _ in range(groups.size(s.axis))]
        with ledger.collective(groups.group(s.axis), "all_gather", out):
            dist.all_gather(pieces, out.contiguous(), group=groups.group(s.axis))
        out = unshard(pieces, s.dim, s.interleave)
    return out


class GradientSync:
    """Gradient accumulation, finalize and norms of a Program (see the module docstring)."""

    # ---------------------------------------------------------------- accumulation
    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            """Autograd finished this parameter's gradient for one backward: move it into the
            buffer (Megatron's DDP hook) and report it."""
            if not self._in_step or p.grad is None:
                return
            p.main_grad.add_(p.grad, alpha=self._grad_share.get(name, 1.0))
            p.grad = None
            self._buffer_of[name].report(name)
        return hook

    def _report(self, name: str):
        buf = self._buffer_of[name]
        return lambda: buf.report(name)

    @contextlib.contextmanager
    def _quiet_grads(self):
        """Gradient reports inside do not count, in every buffer (GradBuffer.suspended)."""
        with contextlib.ExitStack() as stack:
            for buf in self.grad_buffers.values():
                stack.enter_context(buf.suspended())
            yield

    @contextlib.contextmanager
    def _grad_accumulation(self):
        """During one step every parameter's gradient accumulates into its `main_grad`, a view
        of the bucketed buffer: fused linears write there directly (and report when their
        deferred GEMM has run), autograd's gradients are moved there by a hook."""
        if self._zero is not None:
            self._zero.wait_params()
        for buf in self.grad_buffers.values():
            buf.reset()
        params = dict(self.named_parameters())
        for n, p in params.items():
            p.main_grad = self._grad_views[n]
            p.fxtron_report = self._report(n)
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            for p in params.values():
                del p.main_grad, p.fxtron_report

    def _last_backward(self, chunk: int | None) -> None:
        """The next backward is the step's last for `chunk` (None: all parameters): bucket
        collectives may start as their gradients complete."""
        if self.data_parallel.overlap_grad_reduce:
            names = None if chunk is None or self._chunk_params is None else self._chunk_params[chunk]
            for buf in self.grad_buffers.values():
                buf.start_reporting(names)

    # ---------------------------------------------------------------- finalize
    def finalize_grads(self) -> None:
        """Megatron's finalize_model_grads, in order: finish the data-parallel sync of the
        buckets (all-reduce, or reduce-scatter under zero=1); sum over their axes the gradients
        that are partial there although the weight is whole (norm weights under sequence
        parallel: Megatron's _allreduce_layernorm_grads); sum tied weights over the pipeline
        ranks that hold them (the embedding group); then clip the global norm. Afterwards every
        parameter's .grad is its gradient (the rank's shard under zero=1)."""
        for buf in self.grad_buffers.values():
            buf.finish()
        if self._zero is not None:
            self._zero.set_grads()
        else:
            for n, p in self.named_parameters():
                g = self._grad_views[n]
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        self.sync_partial_grads()
        self.sync_shared_grads()
        if self.data_parallel.clip_grad is not None:
            self.last_grad_norm = float(self.clip_grad_norm_(self.data_parallel.clip_grad))

    def sync_partial_grads(self) -> None:
        """Sum over each axis the gradients of the weights whole there but used on shards of
        the data (LocalParam.partial_grad: norms under sequence parallel, over tp): each rank of
        the axis computed the part of its tokens. One all-reduce per axis of all of them
        together (the rank's dp shard under zero=1)."""
        if self.groups is None:
            return
        by_axis: dict[str, list[str]] = {}
        for n, spec in self._local.items():
            for axis in spec.partial_grad:
                by_axis.setdefault(axis, []).append(n)
        for axis, names in by_axis.items():
            if self.groups.size(axis) == 1:
                continue
            if self._zero is not None:
                grads = [g for g, n in self._zero.shard_grads() if n in set(names)]
            else:
                grads = [get_by_path(self, n).grad for n in names]
                grads = [g for g in grads if g is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            with ledger.collective(self.groups.group(axis), "all_reduce", flat):
                dist.all_reduce(flat, group=self.groups.group(axis))
            at = 0
            for g in grads:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()

    def sync_shared_grads(self) -> None:
        """Sum the gradients of weights that several pipeline stages use (a tied input
        embedding and LM head) over the ranks holding them: Megatron's embedding group."""
        if not self._shared or self.groups is None:
            return
        pp_ranks = self.groups.ranks("pp")
        first_last = (0, len(pp_ranks) - 1)
        for name in sorted(self._shared):
            holders = self._shared[name]
            if self.groups.index("pp") not in holders:
                continue
            if holders == first_last:   # the compiler refuses any other sharing
                if self._zero is not None:     # a bucket of its own: every holder has the same shard
                    for g, n in self._zero.shard_grads():
                        if n == name:
                            with ledger.collective(self.groups.group("embedding"), "all_reduce", g):
                                dist.all_reduce(g, group=self.groups.group("embedding"))
                    continue
                p = get_by_path(self, name)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                with ledger.collective(self.groups.group("embedding"), "all_reduce", g):
                    dist.all_reduce(g, group=self.groups.group("embedding"))
                p.grad = g

    # ---------------------------------------------------------------- norms
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients of the whole model, each parameter counted
        once however it is sharded (tp, ep) or replicated (tp, dp, tied over pp): equal to
        torch.nn.utils.get_total_norm over the single-process model's gradients. The dense
        parameters' squares are summed over tp-pp, the expert weights' over tp-ep-pp (each ep
        rank holds other experts, and the same dense replicas), as Megatron's
        get_grad_norm_fp32 sums each over its model-parallel group."""
        device = self.grad_buffer.data.device
        dense, experts = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        coords = {a: self.groups.index(a) if self.groups is not None else 0 for a in NORM_AXES}
        pp_rank = self.groups.index("pp") if self.groups is not None else 0
        for g, name in self._grads_for_norm():
            spec = self._local.get(name)
            if any(c != 0 and (spec is None or spec.shard_on(a) is None) for a, c in coords.items()):
                continue                                   # a replica over a model axis: its rank 0 counts it
            holders = self._shared.get(name)
            if holders is not None and pp_rank != holders[0]:
                continue                                   # a tied weight: its first stage counts it
            total = experts if spec is not None and spec.grad_group == "expert-dp" else dense
            total += g.float().pow(2).sum()
        if self.groups is not None:
            if self._zero is not None:          # each rank holds 1/dp of each buffer's gradients
                for kind, total in ((self._grad_group(), dense), ("expert-dp", experts)):
                    buf = self.grad_buffers.get(kind)
                    if buf is not None and buf.group is not None:
                        with ledger.collective(buf.group, "all_reduce", total):
                            dist.all_reduce(total, group=buf.group)
            for kind, total in (("tp-pp", dense), ("tp-ep-pp", experts)):
                if kind == "tp-ep-pp" and self.groups.size("ep") == 1:
                    continue                               # (every pp rank alike, experts on its stages or not)
                if self.groups.size(kind) > 1:
                    with ledger.collective(self.groups.group(kind), "all_reduce", total):
                        dist.all_reduce(total, group=self.groups.group(kind))
        return (dense + experts).sqrt()

    def _grads_for_norm(self):
        if self._zero is not None:
            yield from self._zero.shard_grads()
            return
        for n, p in self.named_parameters():
            if p.grad is not None:
                yield p.grad, n

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by max_norm / (norm + 1e-6) when that is below 1, as
        torch.nn.utils.clip_grad_norm_ does on the single-process model; returns the norm."""
        norm = self.grad_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g, _ in self._grads_for_norm():
            g.mul_(coef.to(g.dtype))
        return norm

    # ---------------------------------------------------------------- full gradients
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients under the original parameter names (tied weights once)."""
        out = {}
        data = self._zero.full_grad_data() if self._zero is not None else None
        for name, p in self.named_parameters():
            if data is not None:
                g = data[name].view_as(p).to(p.dtype)
            else:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = self._full(name, g.detach()).clone()
        return self._across_stages(out)


__all__ = ["GradientSync", "gather_full", "get_by_path"]
