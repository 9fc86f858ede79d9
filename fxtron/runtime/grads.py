"""Runtime: a program's gradients -- accumulated into one bucketed fp32 buffer during backward
(runtime/dp.py), then Megatron's finalize_model_grads: the data-parallel sync of the
buckets, the sums over the axes where a whole weight's gradient is partial (norm weights under
sequence parallel), the sums over the pipeline ranks that share a tied weight, the global norm
and clipping; full-shape gradients on request.

`Gradients` is the object a Program holds for this: made from the program's parameters, their
descriptions (core.params.LocalParam), the groups and the data-parallel section of the
configuration; it owns the gradient buffers, their views, the hooks and, under zero=1, the
distributed optimizer (runtime/zero.py).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist

from torch import nn

from fxtron.config import DataParallelConfig, torch_dtype
from fxtron.core import layout
from fxtron.core.layout import unshard
from fxtron.core.params import LocalParam
from fxtron.core.records import FRESH_GRADS, GRAD_REPORTS, GradReport
from fxtron.errors import ParallelizeError
from fxtron.ops import ledger
from fxtron.runtime.dp import GradBuffer, default_bucket_size
from fxtron.runtime.zero import ZeroOne

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
        out = unshard(pieces, s.dim, s.interleave, s.whole)
    return out


def _whole_elements(spec: LocalParam, coords: dict, sizes: dict, start: int, n: int, device) -> torch.Tensor | None:
    """Which of the `n` elements from `start` of a parameter's flat local tensor lie in a block
    every rank of an axis holds whole (core/layout.py), on a rank other than the axis's first:
    that copy is not counted again in the norm. None when there are none."""
    mask = None
    for s in spec.shards:
        if not s.whole or coords.get(s.axis, 0) == 0:
            continue
        shape = list(spec.local_shape)
        rows = torch.zeros(shape[s.dim], dtype=torch.bool, device=device)
        at = 0
        for i, size in enumerate(layout.blocks_of_piece(shape[s.dim], sizes[s.axis], s.interleave, s.whole)):
            rows[at:at + size] = i in s.whole
            at += size
        view = [1] * len(shape)
        view[s.dim] = shape[s.dim]
        m = rows.view(view).expand(shape).reshape(-1)[start:start + n]
        mask = m if mask is None else mask | m
    return mask


def across_stages(groups, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Merge the dicts of every pipeline rank (each holds its stages' parameters)."""
    if groups is None or groups.size("pp") == 1:
        return mine
    every = [None] * groups.size("pp")
    with ledger.collective(groups.group("pp"), "all_gather_object"):
        dist.all_gather_object(every, {k: v.cpu() for k, v in mine.items()}, group=groups.group("pp"))
    out = {}
    for part in every:
        for k, v in part.items():
            out.setdefault(k, v.to(groups.device))
    return out


class Gradients:
    """A program's gradients (see the module docstring).

    params: the program's parameters by name; local: their descriptions (a parameter without
    one is whole and averaged over dp); groups: the rank's process groups (None: no
    communication); config: the data-parallel section. shared: the parameters several pipeline
    ranks hold (tied weights), by holder pp ranks; grad_reports: how many times each
    parameter's gradient reports complete per step; param_order: the order of first use in
    forward; chunk_params: each model chunk's parameter names (pipeline stages)."""

    def __init__(self, params: dict[str, nn.Parameter], local: dict[str, LocalParam], groups,
                 config: DataParallelConfig, *, shared: dict[str, tuple[int, ...]] | None = None,
                 grad_reports: dict[str, int] | None = None, param_order: list[str] | None = None,
                 chunk_params: list[set[str]] | None = None, autograd=(), direct: bool = True):
        self.params = params
        self.local = local
        self.groups = groups
        self.config = config
        self.shared = dict(shared or {})
        self.chunk_params = chunk_params
        self._last_started: set[int] = set()      # chunks whose last backward began, this step
        dp = 1 if groups is None else groups.size("dp")
        order = [n for n in (param_order or params) if n in params]
        order += [n for n in params if n not in set(order)]
        # fp32 main_grad (Megatron's), or float64 for a float64 model: never narrower than its weights
        wide = any(p.dtype == torch.float64 for p in params.values())
        reduce_dtype = torch_dtype(config.grad_reduce_dtype) or (torch.float64 if wide else torch.float32)
        # one buffer per group that reduces gradients: the dense parameters' (dp, or dp-cp), and the
        # expert weights' over expert-dp; each averaged over the dense dp (Megatron scales the
        # expert gradients by 1/dp too: an expert sums the tokens of every ep rank it served)
        kinds: dict[str, list[str]] = {}
        for n in order:
            kinds.setdefault(local[n].grad_group if n in local else "dp", []).append(n)
        self.buffers: dict[str, GradBuffer] = {}
        #: the group kinds whose ranks each hold another piece of the gradients after the step
        #: (zero=1's shards of every buffer; zero=3's flat pieces, reduced by runtime/fsdp.py)
        self.sharded_kinds: set[str] = set()
        self._norm_kind: dict[str, str] = {}
        for kind, names in kinds.items():
            world, index = (1, 0) if groups is None else (groups.size(kind), groups.index(kind))
            if config.zero in (1, 2) and world > 1:
                self.sharded_kinds.add(kind)
            flat = next((local[n].flat for n in names if n in local and local[n].flat is not None), None)
            if flat is not None:
                self.sharded_kinds.add(kind)
                self._norm_kind[kind] = flat.group or kind     # (HSDP: the pieces differ within a shard group)
                world, index, average = 1, 0, 1     # the pieces' gradients come reduced (runtime/fsdp.py)
            else:
                average = dp
            self.buffers[kind] = GradBuffer(
                [(n, params[n], (grad_reports or {}).get(n, 1)) for n in names], reduce_dtype,
                config.bucket_size or default_bucket_size(world),
                group=groups.group(kind) if world > 1 else None, dp=world, reduce_scatter=config.zero in (1, 2),
                dp_rank=index, alone=frozenset(self.shared), average=average)
        self._buffer_of = {n: self.buffers[kind] for kind, names in kinds.items() for n in names}
        dense = [k for k in self.buffers if k != "expert-dp"]
        if len(dense) > 1:
            raise ParallelizeError(f"this rank's parameters average their gradients over different groups "
                                   f"({', '.join(sorted(dense))}); one gradient buffer serves the dense parameters")
        #: the group kind of the dense parameters' buffer (dp, or dp-cp)
        self.dense_group = dense[0] if dense else "dp"
        #: the dense parameters' buffer (the distributed optimizer shards it)
        self.buffer = self.buffers[dense[0]] if dense else next(iter(self.buffers.values()), None)
        if self.buffer is None:
            self.buffer = self.buffers["dp"] = GradBuffer([], torch.float32, 1)
        # a gradient every rank of the group computes whole (not a partial sum over cp) enters the
        # sum divided by those ranks' count
        self.share = self._share = {n: 1.0 / math.prod(groups.size(a) for a in local[n].grad_whole_on)
                       for n in order if groups is not None and n in local and local[n].grad_whole_on}
        # one view per parameter, made once: .grad and .main_grad are the same tensors every step
        self._views = {n: self._buffer_of[n].view(n, params[n]) for n in order}
        self._in_step = False
        self.last_norm: float | None = None   # the global norm before clipping, last step
        #: the distributed optimizer (zero=1): this rank's shards of every buffer
        #: the parameters no gradient of the loss reaches (LocalParam.takes_grad): .grad None after
        #: finalize, as in the model, so the optimizer skips them
        self.gradless = frozenset(n for n in params if n in local and not local[n].takes_grad)
        #: direct accumulation: each step zeroes the buffers and sets the .grad of every trained
        #: parameter that autograd computes a gradient of (`autograd`: any use but a fused
        #: linear's weight) to its main_grad, so that AccumulateGrad adds the gradient there in
        #: place (one add, in C++), as a fused linear's GEMM adds its own; the hook only reports
        #: it. Where a gradient enters scaled (`share`), in another dtype than its parameter's (a
        #: 16-bit buffer, a 16-bit model), into zero=3's pieces, or under a captured step
        #: (runtime/graphs.py), the hook moves it instead. (Under the distributed optimizer .grad
        #: is None again after the step, as the hook left it: the shards hold the gradients.)
        self.direct = (direct and config.zero != 3 and not self.share
                       and all(self._views[n].dtype == params[n].dtype for n in order))
        autograd = set(autograd)
        self._direct = [(params[n], self._views[n]) for n in order
                        if self.direct and n in autograd and params[n].requires_grad and n not in self.gradless]
        # the hooks report a gradient complete (a bucket's collective may start while backward
        # goes on: overlap_grad_reduce over more than one rank); direct accumulation needs them for nothing else
        reports = config.overlap_grad_reduce and any(b.dp > 1 for b in self.buffers.values())
        if not self.direct or reports:
            for n in order:
                params[n].register_post_accumulate_grad_hook(self._hook(n))
        self.zero = ZeroOne(self.buffers, params, release=config.zero == 2,
                            gradless=self.gradless) if config.zero in (1, 2) else None
        #: zero=3's units (runtime/fsdp.py FsdpUnits), set by the program
        self.fsdp = None
        #: overlap_param_gather: the parameters whose buckets the graph waits for itself (param_wait)
        self.waited_in_graph: set[str] = set()
        self.reduce_dtype = reduce_dtype
        self._reports: dict[str, GradReport] | None = None

    # ---------------------------------------------------------------- accumulation
    def _hook(self, name: str):
        # the parameter holds its hook: a hook holding these Gradients strongly made a cycle
        # through the tensor that gc does not collect, and the program's buffers, units and
        # process groups lived on until interpreter exit (gloo's threads with them)
        owner = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            """Autograd finished this parameter's gradient for one backward: move it into the
            buffer (Megatron's DDP hook; under direct accumulation it is there already) and
            report it."""
            self = owner()
            if self is None or not self._in_step or p.grad is None:
                return
            if self.direct:           # added into main_grad already (its .grad), or a gradient
                g = p.main_grad       # of a parameter not preset (a fused linear's weight alone): added now
                if p.grad.data_ptr() != g.data_ptr():
                    g.add_(p.grad)
                    p.grad = None
                self._buffer_of[name].report(name)
                return
            g, share = p.main_grad, self._share.get(name, 1.0)
            if FRESH_GRADS.take(g):     # the step's first contribution: written, not added (runtime/dp.py)
                g.copy_(p.grad)
                if share != 1.0:
                    g.mul_(share)
            else:
                g.add_(p.grad, alpha=share)
            p.grad = None
            self._buffer_of[name].report(name)
        return hook

    def _report(self, name: str):
        # the buffer held weakly: the record stays on the parameter between steps (accumulation),
        # and must not keep the program's buffers and process groups alive after it
        buf = weakref.ref(self._buffer_of[name])
        return lambda: buf().report(name)

    @contextlib.contextmanager
    def quiet(self):
        """Gradient reports inside do not count, in every buffer (GradBuffer.suspended)."""
        with contextlib.ExitStack() as stack:
            for buf in self.buffers.values():
                stack.enter_context(buf.suspended())
            yield

    @contextlib.contextmanager
    def accumulation(self):
        """During one step every parameter's gradient accumulates into its `main_grad`, a view
        of the bucketed buffer: fused linears write there directly (and report when their
        deferred GEMM has run), autograd adds its gradients there itself (direct accumulation:
        the buffer zeroed, .grad set to main_grad) or a hook moves them there."""
        if self.zero is not None:      # (overlap_param_gather: the graph waits for what it has not yet)
            if self.waited_in_graph:
                self.zero.wait_for([n for n in self.params if n not in self.waited_in_graph])
            else:
                self.zero.wait_params()
        for buf in self.buffers.values():
            buf.reset(None if self.direct else self._views)
        for p, view in self._direct:
            p.grad = view
        self._last_started = set()
        if self._reports is None:
            # one record a parameter, made once and kept: a fused linear (ops/linear.py) reports
            # only while its weight has a main_grad, i.e. inside a step
            self._reports = {n: GradReport(self._report(n)) for n in self.params}
            for n, p in self.params.items():
                GRAD_REPORTS.set(p, self._reports[n])
        for n, p in self.params.items():
            p.main_grad = self._views[n]
        if self.fsdp is not None:
            self.fsdp.begin({n: self._views[n] for n in self.params if n in self.local and self.local[n].flat is not None})
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            for p in self.params.values():
                del p.main_grad

    def last_backward(self, chunk: int | None) -> None:
        """The next backward is the step's last for `chunk` (None: all parameters): bucket
        collectives may start as their gradients complete. A parameter two chunks of this rank
        use (ZB-V's first and last stage share a tied embedding) counts only once the last of
        them has begun its last backward: until then the other chunk's earlier microbatches
        still add to it (its bucket then starts when the step's backward ends)."""
        if not self.config.overlap_grad_reduce:
            return
        names = None
        if chunk is not None and self.chunk_params is not None:
            self._last_started.add(chunk)
            names = {n for n in self.chunk_params[chunk]
                     if all(c in self._last_started for c, ps in enumerate(self.chunk_params) if n in ps)}
        for buf in self.buffers.values():
            buf.start_reporting(names)

    # ---------------------------------------------------------------- finalize
    def finalize(self, *, read_norm: bool = True, loss_scale: float | None = None) -> torch.Tensor | None:
        """Megatron's finalize_model_grads, in order: finish the data-parallel sync of the
        buckets (all-reduce, or reduce-scatter under zero=1); sum over their axes the gradients
        that are partial there although the weight is whole (norm weights under sequence
        parallel: Megatron's _allreduce_layernorm_grads); sum tied weights over the pipeline
        ranks that hold them (the embedding group); then clip the global norm. Afterwards every
        parameter's .grad is its gradient (the rank's shard under zero=1, its piece under zero=3).
        Returns the norm before clipping (a device tensor; None without clip_grad), read on the
        host into `last_norm` unless `read_norm` is False (a captured step, runtime/graphs.py,
        reads it after the replay). `loss_scale`: the gradients are fp16's scaled ones (the
        optimizer step unscales them): the norm and the clipping are the model's (clip_)."""
        if self.fsdp is not None:
            self.fsdp.finish()
        for buf in self.buffers.values():
            buf.finish()
        if self.zero is not None:
            self.zero.set_grads()
            for p, _ in self._direct:
                p.grad = None
        else:
            for n, p in self.params.items():
                g = self._views[n]
                p.grad = None if n in self.gradless else g if g.dtype == p.dtype else g.to(p.dtype)
        self.sync_partial()
        self.sync_shared()
        if self.config.clip_grad is None:
            return None
        norm = self.clip_(self.config.clip_grad, loss_scale)
        if read_norm:
            self.last_norm = float(norm)
        return norm

    def synced_by_the_step(self) -> list[str]:
        """What of the gradients' sync the step runs after the backward (`finalize`), a phrase
        each; empty where a rank's backward alone leaves its gradients whole (one rank, tp
        without sequence parallel)."""
        out = [f"the {kind} gradient reduction over {buf.dp} ranks" for kind, buf in self.buffers.items()
               if buf.dp > 1]
        if self.groups is not None:
            axes = sorted({a for spec in self.local.values() for a in spec.partial_grad if self.groups.size(a) > 1})
            out += [f"the sum over {a} of the gradients its ranks compute in part (norm weights under sequence "
                    f"parallel)" for a in axes]
            if self.shared and self.groups.size("pp") > 1:
                out.append("the sum of the tied weights' gradients over the pipeline stages")
        return out

    def sync_partial(self) -> None:
        """Sum over each axis the gradients of the weights whole there but used on shards of
        the data (LocalParam.partial_grad: norms under sequence parallel, over tp): each rank of
        the axis computed the part of its tokens. One all-reduce per axis of all of them
        together (the rank's dp shard under zero=1)."""
        if self.groups is None:
            return
        by_axis: dict[str, list[str]] = {}
        for n, spec in self.local.items():
            for axis in spec.partial_grad:
                by_axis.setdefault(axis, []).append(n)
        for axis, names in by_axis.items():
            if self.groups.size(axis) == 1:
                continue
            if self.zero is not None:
                grads = [g for g, n in self.zero.shard_grads() if n in set(names)]
            else:
                grads = [self.params[n].grad for n in names]
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

    def sync_shared(self) -> None:
        """Sum the gradients of weights that several pipeline stages use (a tied input
        embedding and LM head) over the ranks holding them: Megatron's embedding group."""
        if not self.shared or self.groups is None:
            return
        pp_ranks = self.groups.ranks("pp")
        first_last = (0, len(pp_ranks) - 1)
        for name in sorted(self.shared):
            holders = self.shared[name]
            if self.groups.index("pp") not in holders or name in self.gradless:
                continue         # (a frozen or gradless tied weight: .grad None on every holder, as in the model)
            if holders == first_last:   # the compiler refuses any other sharing
                if self.zero is not None:     # a bucket of its own: every holder has the same shard
                    for g, n in self.zero.shard_grads():
                        if n == name:
                            with ledger.collective(self.groups.group("embedding"), "all_reduce", g):
                                dist.all_reduce(g, group=self.groups.group("embedding"))
                    continue
                p = self.params[name]
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                with ledger.collective(self.groups.group("embedding"), "all_reduce", g):
                    dist.all_reduce(g, group=self.groups.group("embedding"))
                p.grad = g

    # ---------------------------------------------------------------- norms
    def norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients of the whole model, each parameter counted
        once however it is sharded (tp, ep) or replicated (tp, dp, tied over pp): equal to
        torch.nn.utils.get_total_norm over the single-process model's gradients. The dense
        parameters' squares are summed over tp-pp, the expert weights' over tp-ep-pp (each ep
        rank holds other experts, and the same dense replicas), as Megatron's
        get_grad_norm_fp32 sums each over its model-parallel group."""
        device = self.buffer.data.device
        # fp32, as Megatron's get_grad_norm_fp32 -- float64 for a float64 model, as torch's norm of its gradients
        acc = torch.float64 if any(p.dtype == torch.float64 for p in self.params.values()) else torch.float32
        dense, experts = (torch.zeros((), dtype=acc, device=device) for _ in range(2))
        coords = {a: self.groups.index(a) if self.groups is not None else 0 for a in NORM_AXES}
        sizes = {a: self.groups.size(a) if self.groups is not None else 1 for a in NORM_AXES}
        pp_rank = self.groups.index("pp") if self.groups is not None else 0
        starts = self.zero.shard_starts() if self.zero is not None else iter(lambda: 0, None)
        for (g, name), start in zip(self._for_norm(), starts):
            spec = self.local.get(name)
            if spec is not None and spec.flat is not None:    # zero=3: the piece, its padding left out
                f = spec.flat
                start = min(f.index * f.chunk, layout.numel(spec.local_shape))
                g = g[:min(f.chunk, layout.numel(spec.local_shape) - start)]
            if any(c != 0 and (spec is None or spec.shard_on(a) is None) for a, c in coords.items()):
                continue                                   # a replica over a model axis: its rank 0 counts it
            holders = self.shared.get(name)
            if holders is not None and pp_rank != holders[0]:
                continue                                   # a tied weight: its first stage counts it
            total = experts if spec is not None and spec.grad_group == "expert-dp" else dense
            squares = g.to(acc).pow(2)
            whole = _whole_elements(spec, coords, sizes, start, g.numel(), g.device) if spec is not None else None
            if whole is None:
                total += squares.sum()
            elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                total += squares.reshape(-1).masked_fill(whole, 0).sum()   # (a mask's selection reads its count on the host)
            else:
                total += squares.reshape(-1)[~whole].sum()
        if self.groups is not None:
            for kind, total in ((self.dense_group, dense), ("expert-dp", experts)):
                if kind in self.sharded_kinds:     # each rank holds 1/d of the gradients
                    group = self.groups.group(self._norm_kind.get(kind, kind))
                    with ledger.collective(group, "all_reduce", total):
                        dist.all_reduce(total, group=group)
            for kind, total in (("tp-pp", dense), ("tp-ep-pp", experts)):
                if kind == "tp-ep-pp" and self.groups.size("ep") == 1:
                    continue                               # (every pp rank alike, experts on its stages or not)
                if self.groups.size(kind) > 1:
                    with ledger.collective(self.groups.group(kind), "all_reduce", total):
                        dist.all_reduce(total, group=self.groups.group(kind))
        return (dense + experts).sqrt()

    def _for_norm(self):
        if self.zero is not None:
            yield from self.zero.shard_grads()
            return
        for n, p in self.params.items():
            if p.grad is not None:
                yield p.grad, n

    def clip_(self, max_norm: float, loss_scale: float | None = None) -> torch.Tensor:
        """Scale every gradient by max_norm / (norm + 1e-6) when that is below 1, as
        torch.nn.utils.clip_grad_norm_ does on the single-process model; returns the norm.
        Gradients still multiplied by fp16's `loss_scale` S: the norm is the model's (the scaled
        gradients' over S) and so is the coefficient, which commutes with the unscaling after
        it (Megatron unscales, then clips: the same numbers)."""
        norm = self.norm()
        if loss_scale is not None:
            norm = norm / loss_scale
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g, _ in self._for_norm():
            g.mul_(coef.to(g.dtype))
        return norm

    # ---------------------------------------------------------------- full tensors
    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter `name` from every rank's `local` piece (itself when whole)."""
        spec = self.local.get(name)
        if spec is None or not spec.sharded:
            return local
        return gather_full(local, spec, self.groups)

    def piece_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor shaped like parameter `name` (its shard on the axes
        it is split over; `full` itself when whole): `full`'s inverse."""
        spec = self.local.get(name)
        if spec is None or not spec.shards or self.groups is None:
            return full
        axes = [s.axis for s in spec.shards]
        return spec.local_of(full, {a: self.groups.size(a) for a in axes}, {a: self.groups.index(a) for a in axes})

    def local_of(self, name: str, held: torch.Tensor) -> torch.Tensor:
        """The rank's local tensor of parameter `name` from what the rank holds of it (under
        zero=3, its flat piece: gathered over its group; every rank of the group calls it)."""
        spec = self.local.get(name)
        if spec is None or spec.flat is None:
            return held
        from fxtron.runtime.fsdp import whole_local
        return whole_local(held, spec, self.groups)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients under the original parameter names (tied weights once)."""
        out = {}
        data = self.zero.full_grad_data() if self.zero is not None else None
        for name, p in self.params.items():
            if name in self.gradless:        # (the model's .grad is None)
                continue
            if data is not None:
                g = data[name].view_as(p).to(p.dtype)
            else:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = self.local_of(name, g.detach())
            out[name] = self.full(name, g).clone()
        return across_stages(self.groups, out)

    def bytes(self, also=()) -> int:
        """The rank's gradient bytes: its gradient buffers and any .grad outside them -- of the
        parameters, and of `also` (the distributed optimizer's shards: under zero=2 copies of
        the rank's shards of the gradients, the buffer released)."""
        held = sum(b.data.untyped_storage().nbytes() for b in self.buffers.values())
        views = {b.data.untyped_storage().data_ptr() for b in self.buffers.values()}
        loose = sum(p.grad.numel() * p.grad.element_size() for p in [*self.params.values(), *also]
                    if p.grad is not None and p.grad.untyped_storage().data_ptr() not in views)
        return held + loose


def check_differentiable(loss: torch.Tensor) -> None:
    """ParallelizeError where the step's loss carries no gradient to any parameter (computed
    under torch.no_grad, through argmax or a comparison, or of frozen parameters alone):
    autograd's own error says only that 'element 0 of tensors does not require grad'."""
    if not loss.requires_grad:
        raise ParallelizeError("the loss carries no gradient to any parameter: the model computes it under "
                               "torch.no_grad, through an op without a gradient (argmax, a comparison, a cast to "
                               "integers), or from frozen parameters alone; train_step needs a loss that gradients "
                               "flow back from (eval_step evaluates one that has none)")


__all__ = ["Gradients", "across_stages", "check_differentiable", "gather_full", "get_by_path"]
