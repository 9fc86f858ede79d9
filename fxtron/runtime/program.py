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
from fxtron.runtime.buffers import DataParallelOptions, GradBuffer, default_bucket_size
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.zero import ZeroOne
from fxtron.codegen.linear import WgradQueue
from fxtron.runtime.rng import RNGStreams


class Microbatches(list):
    """A global batch given as its microbatches: a list of (args, kwargs) pairs, one per
    microbatch, each with the whole batch dim for data parallel to split. Microbatches may
    differ in sequence length; the loss is the mean of their losses."""


@dataclass(frozen=True)
class PipelineOptions:
    """How a program runs its microbatches: `schedule` over `microbatches` per step (per
    data-parallel rank), `virtual_stages` model chunks per pipeline rank (interleaved), and
    whether stage boundaries travel as 1/tp slices all-gathered on arrival."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    scatter_gather: bool = False


@dataclass(frozen=True)
class LocalParam:
    """How a rank's parameter relates to the full one. `gather(local, groups)` rebuilds the
    full tensor from every holder's local piece (identity when the parameter is whole)."""

    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    gather: Callable[[torch.Tensor, ProcessGroups], torch.Tensor] | None = None
    dim: int | None = None         # the tp-sharded dim (None: whole on every tp rank)
    interleave: int | tuple[int, ...] = 1   # parts of a fused projection (or their proportions), each split over tp
    tp_partial: bool = False       # whole on every tp rank, gradient partial: summed over tp after backward


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
                 fused: list[str] | None = None, dtype: torch.dtype | None = None, stages: list | None = None,
                 pipeline: "PipelineOptions | None" = None, shared: dict[str, tuple[int, ...]] | None = None,
                 data_parallel: DataParallelOptions | None = None, grad_reports: dict[str, int] | None = None,
                 param_order: list[str] | None = None):
        super().__init__()
        for name in info.params:
            if name in params:
                _set_by_path(self, name, nn.Parameter(params[name]), parameter=True)
        for name in info.buffers:
            if name in buffers:
                _set_by_path(self, name, buffers[name], parameter=False, persistent=name in persistent)
        object.__setattr__(self, "graph_module", gm)  # not a submodule: keep the tree the model's
        self._info = info
        self._local = local
        self.rank = rank
        self.groups = groups
        self.rng = rng
        # mixed precision: parameters stay fp32 (the optimizer's main parameters); each forward
        # computes with 16-bit copies (Megatron's Float16Module + mixed-precision optimizer)
        self.dtype = dtype if dtype not in (None, torch.float32) else None
        self.scaler = LossScaler() if self.dtype == torch.float16 else None
        self._fused = set(fused or [])
        # pipeline: this rank's stages (None: the whole graph is one stage), the schedule, and
        # the parameters other pipeline ranks hold too (tied embeddings), by holder ranks
        self._stages = stages
        self.pipeline = pipeline or PipelineOptions()
        self._shared = dict(shared or {})
        self._runner = None
        self._aliases = aliases if stages is None else {a: n for a, n in aliases.items() if n in params}
        # data parallel: every gradient in one bucketed buffer (runtime/buffers.py)
        self.data_parallel = data_parallel or DataParallelOptions()
        names = [n for n, _ in self.named_parameters()]
        order = [n for n in (param_order or names) if n in set(names)]
        order += [n for n in names if n not in set(order)]
        self._chunk_params = [set(st.params) for st in stages] if stages is not None else None
        dp, dp_rank = self._dp()
        opts = self.data_parallel
        self.grad_buffer = GradBuffer(
            [(n, _get_by_path(self, n), (grad_reports or {}).get(n, 1)) for n in order],
            opts.grad_reduce_dtype or torch.float32, opts.bucket_size or default_bucket_size(dp),
            group=self.groups.group("dp") if dp > 1 else None, dp=dp, reduce_scatter=opts.zero == 1,
            dp_rank=dp_rank, alone=frozenset(self._shared))
        # one view per parameter, made once: .grad and .main_grad are the same tensors every step
        self._grad_views = {n: self.grad_buffer.view(n, _get_by_path(self, n)) for n in order}
        self._in_step = False
        self.last_grad_norm: float | None = None   # the global norm before clipping, last step
        for n in order:
            _get_by_path(self, n).register_post_accumulate_grad_hook(self._grad_hook(n))
        self._zero = ZeroOne(self) if opts.zero == 1 else None

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
        if self._stages is not None:
            raise ParallelizeError("a pipeline-parallel program runs forward and backward together, stage by "
                                   "stage over microbatches: call prog.train_step(batch, optimizer)")
        return self._run_graph(self._flat_inputs(inputs, kwargs))

    def _run_graph(self, flat: list) -> torch.Tensor:
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
            copy.fxtron_report = t.fxtron_report
        return copy

    def local_batch(self, inputs: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """This rank's data-parallel slice of a global batch (dim 'batch' of every input), on
        the program's device (a batch from a CPU data loader moves to the rank's GPU here)."""
        dp, index = self._dp()
        if dp == 1:
            return self._on_device(tuple(inputs), dict(kwargs or {}))
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
        return self._on_device(args, kw)

    def _on_device(self, args: tuple, kw: dict) -> tuple[tuple, dict]:
        device = self.groups.device if self.groups is not None else None
        if device is None or device.type == "cpu":
            return args, kw

        def move(x):
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x
        return pytree.tree_map(move, (args, kw))

    def train_step(self, inputs, optimizer: torch.optim.Optimizer, *, kwargs: dict | None = None) -> float:
        """One training step on the global batch `inputs` (the same tensors on every rank):
        forward and backward on this rank's slice, gradient sync, optimizer step. Returns the
        global batch's loss.

        With microbatches > 1 or pipeline parallel, the rank's slice is cut into equal
        microbatches along the batch dim (or `inputs` is a `fxtron.Microbatches` list, whose
        microbatches may differ in sequence length), run by the schedule, and the loss is the
        mean of the microbatches' losses, as gradient accumulation computes it."""
        if self._stages is not None or self.pipeline.microbatches > 1 or isinstance(inputs, Microbatches):
            return self._pipelined_step(inputs, optimizer, kwargs)
        args, kw = self.local_batch(inputs, kwargs)
        optimizer.zero_grad(set_to_none=True)
        with self._grad_accumulation():
            loss = self(*args, **kw)
            scaled = loss * self.scaler.scale if self.scaler is not None else loss
            self._last_backward(None)
            with WgradQueue().active():   # weight-gradient GEMMs overlap tp all-reduces
                scaled.backward()
        self.finalize_grads()
        self._optimizer_step(optimizer)
        return self._global_loss(loss.detach().float())

    # ---------------------------------------------------------------- pipeline / microbatches
    def microbatches(self, inputs, kwargs: dict | None = None) -> list[list[torch.Tensor]]:
        """This rank's microbatches of a global batch: flat tensor inputs of each."""
        m = self.pipeline.microbatches
        if isinstance(inputs, Microbatches):
            if len(inputs) != m:
                raise ParallelizeError(f"{len(inputs)} microbatches given, but the program was compiled for "
                                       f"microbatches={m}")
            return [self._flat_inputs(*self.local_batch(a, kw)) for a, kw in inputs]
        flat = self._flat_inputs(*self.local_batch(inputs, kwargs))
        out = [[] for _ in range(m)]
        for x, dims in zip(flat, self._info.user_dims):
            if "batch" in dims:
                d = dims.index("batch")
                if x.shape[d] % m:
                    raise ParallelizeError(
                        f"this rank's batch of {x.shape[d]} samples (dim {d} of an input of shape {tuple(x.shape)}, "
                        f"after the data-parallel split) does not divide into microbatches={m}; use a global batch "
                        f"that is a multiple of dp x microbatches = {self._dp()[0] * m}")
                pieces = x.chunk(m, dim=d)
            else:
                pieces = [x] * m
            for i in range(m):
                out[i].append(pieces[i])
        return out

    def _call_stage(self, stage, flat: list, received: list) -> tuple:
        if stage.gm is None:     # the whole graph as one stage
            return (self._run_graph(flat),)
        args = [self._compute_copy(_get_by_path(self, n)) for n in stage.params]
        args += [self._compute_copy(_get_by_path(self, n)) for n in stage.buffers]
        args += [flat[i] for i in stage.user_inputs] + list(received)
        with self.rng.active() if self.rng is not None else contextlib.nullcontext():
            return stage.gm(*args)

    def runner(self):
        """The schedule runner of this rank (built once): its chunks, actions and p2p."""
        if self._runner is None:
            from fxtron.runtime import schedules
            from fxtron.passes.stages import Stage
            from fxtron.runtime.executor import StageRunner
            from fxtron.runtime.p2p import P2P
            opts = self.pipeline
            pp = self.groups.size("pp") if self.groups is not None else 1
            pp_rank = self.groups.index("pp") if self.groups is not None else 0
            whole = Stage(index=0, gm=None, params=[], buffers=[], user_inputs=[], has_loss=True)
            stages = self._stages if self._stages is not None else [whole]
            acts = schedules.actions(opts.schedule, pp, opts.microbatches, pp_rank, opts.virtual_stages)
            p2p = P2P(self.groups, scatter_gather=opts.scatter_gather) if pp > 1 else None
            self._runner = StageRunner(stages, self._call_stage, acts, num_stages=pp * opts.virtual_stages,
                                       microbatches=opts.microbatches, p2p=p2p,
                                       zero_bubble=opts.schedule == "zb-h1", before_last_backward=self._last_backward,
                                       quiet=self.grad_buffer.suspended)
        return self._runner

    def _pipelined_step(self, inputs, optimizer, kwargs) -> float:
        mbs = self.microbatches(inputs, kwargs)
        runner = self.runner()
        optimizer.zero_grad(set_to_none=True)
        with self._grad_accumulation():
            loss = runner.run(mbs, loss_scale=self.scaler.scale if self.scaler is not None else 1.0)
        self.finalize_grads()
        self._optimizer_step(optimizer)
        if self.groups is not None and self.groups.size("pp") > 1:
            loss = loss if loss is not None else torch.zeros((), device=self.groups.device)
            loss = loss.clone()
            dist.all_reduce(loss, group=self.groups.group("pp"))   # only the last stage's is non-zero
        return self._global_loss(loss)

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write this rank's shards of the parameters, buffers and optimizer state to the
        directory `path` (torch.distributed.checkpoint; every rank of the job calls it). The
        checkpoint loads on any mesh (`prog.load`) or in one process
        (`fxtron.load_full_state_dict`)."""
        from fxtron.runtime import checkpoint
        checkpoint.save(self, path, optimizer)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read a checkpoint saved by `save` from any mesh into this program (and optimizer)."""
        from fxtron.runtime import checkpoint
        checkpoint.load(self, path, optimizer)

    def timeline(self) -> list:
        """The last pipelined step's events on this rank (runtime.executor.Event: F, B, W and
        waits with start and end in seconds from the step's start)."""
        return list(self._runner.events) if self._runner is not None else []

    def sync_shared_grads(self) -> None:
        """Sum the gradients of weights that several pipeline stages use (a tied input
        embedding and LM head) over the ranks holding them: Megatron's embedding group when
        they are the first and last stage, else the pipeline group with zeros elsewhere."""
        if not self._shared or self.groups is None:
            return
        pp_ranks = self.groups.ranks("pp")
        first_last = (0, len(pp_ranks) - 1)
        for name in sorted(self._shared):
            holders = self._shared[name]
            if self.groups.index("pp") not in holders:
                continue
            if holders == first_last:   # compile_rank refuses any other sharing
                if self._zero is not None:     # a bucket of its own: every holder has the same shard
                    for g, n in self._zero.shard_grads():
                        if n == name:
                            dist.all_reduce(g, group=self.groups.group("embedding"))
                    continue
                p = _get_by_path(self, name)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g, group=self.groups.group("embedding"))
                p.grad = g

    # ---------------------------------------------------------------- gradients
    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            """Autograd finished this parameter's gradient for one backward: move it into the
            buffer (Megatron's DDP hook) and report it."""
            if not self._in_step or p.grad is None:
                return
            p.main_grad.add_(p.grad)
            p.grad = None
            self.grad_buffer.report(name)
        return hook

    def _report(self, name: str):
        return lambda: self.grad_buffer.report(name)

    @contextlib.contextmanager
    def _grad_accumulation(self):
        """During one step every parameter's gradient accumulates into its `main_grad`, a view
        of the bucketed buffer: fused linears write there directly (and report when their
        deferred GEMM has run), autograd's gradients are moved there by a hook."""
        if self._zero is not None:
            self._zero.wait_params()
        self.grad_buffer.reset()
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
            self.grad_buffer.start_reporting(names)

    def finalize_grads(self) -> None:
        """Megatron's finalize_model_grads, in order: finish the data-parallel sync of the
        buckets (all-reduce, or reduce-scatter under zero=1); sum tied weights over the
        pipeline ranks that hold them (the embedding group); then clip the global norm.
        (Replicated norm weights under sequence parallel are summed over tp inside the graph,
        by the backward of the op that enters their region.) Afterwards every parameter's
        .grad is its gradient (the rank's shard under zero=1)."""
        self.grad_buffer.finish()
        if self._zero is not None:
            self._zero.set_grads()
        else:
            for n, p in self.named_parameters():
                g = self._grad_views[n]
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        self.sync_sequence_parallel_grads()
        self.sync_shared_grads()
        if self.data_parallel.clip_grad is not None:
            self.last_grad_norm = float(self.clip_grad_norm_(self.data_parallel.clip_grad))

    def sync_sequence_parallel_grads(self) -> None:
        """Sum over tp the gradients of replicated weights used on sequence shards (norms
        under sequence parallel): each tp rank computed the part of its tokens. One
        all-reduce of all of them together (the rank's dp shard under zero=1)."""
        names = [n for n, spec in self._local.items() if spec.tp_partial]
        if not names or self.groups is None or self.groups.size("tp") == 1:
            return
        if self._zero is not None:
            grads = [g for g, n in self._zero.shard_grads() if n in set(names)]
        else:
            grads = [_get_by_path(self, n).grad for n in names]
            grads = [g for g in grads if g is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.groups.group("tp"))
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients of the whole model, each parameter counted
        once however it is sharded (tp) or replicated (tp, dp, tied over pp): equal to
        torch.nn.utils.get_total_norm over the single-process model's gradients."""
        total = torch.zeros((), dtype=torch.float32, device=self.grad_buffer.data.device)
        tp_rank = self.groups.index("tp") if self.groups is not None else 0
        pp_rank = self.groups.index("pp") if self.groups is not None else 0
        for g, name in self._grads_for_norm():
            spec = self._local.get(name)
            sharded = spec is not None and spec.gather is not None
            if not sharded and tp_rank != 0:
                continue                                   # a tp replica: rank 0 counts it
            holders = self._shared.get(name)
            if holders is not None and pp_rank != holders[0]:
                continue                                   # a tied weight: its first stage counts it
            total += g.float().pow(2).sum()
        if self.groups is not None:
            if self._zero is not None and self.groups.size("dp") > 1:
                dist.all_reduce(total, group=self.groups.group("dp"))   # each rank holds 1/dp
            if self.groups.size("tp-pp") > 1:
                dist.all_reduce(total, group=self.groups.group("tp-pp"))
        return total.sqrt()

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

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._zero is not None:
            params = self._zero.optimizer_for(optimizer)
            grads_ok = self.scaler is None or self.scaler.unscale_and_check(params, self.groups)
            if grads_ok:
                self._zero.step(optimizer)
            return
        if self.scaler is None or self.scaler.unscale_and_check(list(self.parameters()), self.groups):
            optimizer.step()

    # ---------------------------------------------------------------- communication
    def _dp(self) -> tuple[int, int]:
        if self.groups is None:
            return 1, 0
        return self.groups.size("dp"), self.groups.index("dp")

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
        data = self._zero.full_grad_data() if self._zero is not None else None
        for name, p in self.named_parameters():
            if data is not None:
                off, n = self.grad_buffer.offsets[name]
                g = data[off:off + n].view_as(p).to(p.dtype)
            else:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = self._full(name, g.detach()).clone()
        return self._across_stages(out)

    def _across_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Merge the dicts of every pipeline rank (each holds its stages' parameters)."""
        if self.groups is None or self.groups.size("pp") == 1:
            return mine
        every = [None] * self.groups.size("pp")
        dist.all_gather_object(every, {k: v.cpu() for k, v in mine.items()}, group=self.groups.group("pp"))
        out = {}
        for part in every:
            for k, v in part.items():
                out.setdefault(k, v.to(self.groups.device))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape parameters and persistent buffers under the original names, tied aliases
        included, so `model.load_state_dict(prog.full_state_dict())` restores the model."""
        out = {}
        if self._zero is not None:
            self._zero.wait_params()
        for name, p in self.named_parameters():
            out[name] = self._full(name, p.detach()).clone()
        persistent = set(self.state_dict(keep_vars=True))
        for name, b in self.named_buffers():
            if name in persistent:
                out[name] = b.detach().clone()
        out = self._across_stages(out)
        for alias, name in self._info.aliases.items():
            out[alias] = out[name]
        return out
