"""Runtime: a rank's program -- an nn.Module holding that rank's parameters and running its graph.

The module tree mirrors the original model's (`prog.named_parameters()` yields
`blocks.0.attn.qkv.weight`, ...), so optimizers, clipping and state dicts see familiar names.
Forward calls the per-rank GraphModule with (parameters, buffers, flattened inputs) in the
order the trace fixed. `train_step` does one whole step: the rank's slice of the batch
(runtime/batch.py), forward and backward (or the pipeline schedule, runtime/executor.py), the
gradient sync (runtime/grads.py), mixed precision (runtime/precision.py) and the optimizer.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fxtron.core.meta import TraceInfo
from fxtron.core.params import LocalParam
from fxtron.core.stage import Stage
from fxtron.errors import ParallelizeError
from fxtron.ops import ledger
from fxtron.ops.ep import DispatchLog
from fxtron.ops.linear import WgradQueue
from fxtron.ops.rng import RNGStreams
from fxtron.runtime.batch import BatchSlicer, Microbatches
from fxtron.runtime.buffers import DataParallelOptions, GradBuffer, default_bucket_size
from fxtron.runtime.grads import GradientSync, gather_full, get_by_path
from fxtron.runtime.executor import Event
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.memory import MemoryTracker, tracking
from fxtron.runtime.precision import LossScaler, compute_copy
from fxtron.runtime.zero import ZeroOne


@dataclass(frozen=True)
class PipelineOptions:
    """How a program runs its microbatches: `schedule` over `microbatches` per step (per
    data-parallel rank), `virtual_stages` model chunks per pipeline rank (interleaved), and
    whether stage boundaries travel as 1/tp slices all-gathered on arrival."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    scatter_gather: bool = False


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


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class Program(GradientSync, nn.Module):
    """One rank's share of the model, ready for an optimizer.

    params: name -> this rank's tensor (a shard or the whole parameter); buffers likewise;
    local: name -> how the rank's parameter relates to the full one (core.params.LocalParam).
    groups: the rank's process groups (None for a program that is only inspected or run
    without communication, e.g. on a 1-rank mesh). runtime/build.py makes Programs.
    """

    def __init__(self, gm: fx.GraphModule | None, info: TraceInfo, params: dict[str, torch.Tensor],
                 buffers: dict[str, torch.Tensor], persistent: set[str], local: dict[str, LocalParam],
                 rank: int, groups: ProcessGroups | None, aliases: dict[str, str], rng: RNGStreams | None = None,
                 fused: list[str] | None = None, dtype: torch.dtype | None = None, stages: list | None = None,
                 pipeline: "PipelineOptions | None" = None, shared: dict[str, tuple[int, ...]] | None = None,
                 data_parallel: DataParallelOptions | None = None, grad_reports: dict[str, int] | None = None,
                 param_order: list[str] | None = None, seq_split: int = 1,
                 max_seq: tuple[int | None, str] = (None, "")):
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
        self.track_memory = False         # sample the memory after every pass of a step (memory_timeline)
        self._memory = None
        self._events: list = []           # the last step's passes without a schedule (F, B)
        self._aliases = aliases if stages is None else {a: n for a, n in aliases.items() if n in params}
        dp, dp_rank = self._dp()
        cp, cp_rank = (1, 0) if groups is None else (groups.size("cp"), groups.index("cp"))
        self._batch = BatchSlicer(info, dp=dp, dp_index=dp_rank, microbatches=self.pipeline.microbatches,
                                  device=groups.device if groups is not None else None, cp=cp, cp_index=cp_rank,
                                  seq_split=seq_split, max_seq=max_seq)
        # data parallel: every gradient in one bucketed buffer (runtime/buffers.py), reduced over
        # the group the parameters name (dp today; dp-cp and expert-dp with cp and ep)
        self.data_parallel = data_parallel or DataParallelOptions()
        names = [n for n, _ in self.named_parameters()]
        order = [n for n in (param_order or names) if n in set(names)]
        order += [n for n in names if n not in set(order)]
        self._chunk_params = [set(st.params) for st in stages] if stages is not None else None
        opts = self.data_parallel
        # fp32 main_grad (Megatron's), or float64 for a float64 model: never narrower than its weights
        wide = any(p.dtype == torch.float64 for _, p in self.named_parameters())
        # one buffer per group that reduces gradients: the dense parameters' (dp, or dp-cp), and the
        # expert weights' over expert-dp; each averaged over the dense dp (Megatron scales the
        # expert gradients by 1/dp too: an expert sums the tokens of every ep rank it served)
        kinds: dict[str, list[str]] = {}
        for n in order:
            kinds.setdefault(self._local[n].grad_group if n in self._local else "dp", []).append(n)
        self.grad_buffers: dict[str, GradBuffer] = {}
        for kind, names in kinds.items():
            world, index = (1, 0) if groups is None else (groups.size(kind), groups.index(kind))
            self.grad_buffers[kind] = GradBuffer(
                [(n, get_by_path(self, n), (grad_reports or {}).get(n, 1)) for n in names],
                opts.grad_reduce_dtype or (torch.float64 if wide else torch.float32),
                opts.bucket_size or default_bucket_size(world),
                group=self.groups.group(kind) if world > 1 else None, dp=world, reduce_scatter=opts.zero == 1,
                dp_rank=index, alone=frozenset(self._shared), average=dp)
        self._buffer_of = {n: self.grad_buffers[kind] for kind, names in kinds.items() for n in names}
        dense = [k for k in self.grad_buffers if k != "expert-dp"]
        if len(dense) > 1:
            raise ParallelizeError(f"this rank's parameters average their gradients over different groups "
                                   f"({', '.join(sorted(dense))}); one gradient buffer serves the dense parameters")
        #: the dense parameters' buffer (the distributed optimizer shards it)
        self.grad_buffer = self.grad_buffers[dense[0]] if dense else next(iter(self.grad_buffers.values()), None)
        if self.grad_buffer is None:
            self.grad_buffer = self.grad_buffers["dp"] = GradBuffer([], torch.float32, 1)
        # a gradient every rank of the group computes whole (not a partial sum over cp) enters the
        # sum divided by those ranks' count
        self._grad_share = {n: 1.0 / _prod(groups.size(a) for a in self._local[n].grad_whole_on)
                            for n in order if groups is not None and n in self._local and self._local[n].grad_whole_on}
        # one view per parameter, made once: .grad and .main_grad are the same tensors every step
        self._grad_views = {n: self._buffer_of[n].view(n, get_by_path(self, n)) for n in order}
        self._in_step = False
        self.last_grad_norm: float | None = None   # the global norm before clipping, last step
        self.last_dispatch: DispatchLog | None = None   # what expert parallel's all-to-alls did, last step
        for n in order:
            get_by_path(self, n).register_post_accumulate_grad_hook(self._grad_hook(n))
        self._zero = ZeroOne(self) if opts.zero == 1 else None

    def _grad_group(self) -> str:
        """The group kind of the dense parameters' gradient buffer (dp, or dp-cp)."""
        return next((k for k in self.grad_buffers if k != "expert-dp"), "dp")

    # ---------------------------------------------------------------- running
    def _flat_inputs(self, inputs: tuple, kwargs: dict | None) -> list:
        return self._batch.flat(inputs, kwargs)

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        """The loss of this rank's program on these (already local) inputs."""
        if self._stages is not None:
            raise ParallelizeError("a pipeline-parallel program runs forward and backward together, stage by "
                                   "stage over microbatches: call prog.train_step(batch, optimizer)")
        return self._run_graph(self._flat_inputs(inputs, kwargs))

    def _run_graph(self, flat: list) -> torch.Tensor:
        args = [self._compute_copy(get_by_path(self, n)) for n in self._info.params]
        args += [self._compute_copy(get_by_path(self, n)) for n in self._info.buffers]
        with self.rng.active() if self.rng is not None else contextlib.nullcontext():
            outs = self.graph_module(*args, *flat)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = None
        for i, out in enumerate(outs):
            if i in self._info.buffer_mutations:
                with torch.no_grad():
                    get_by_path(self, self._info.buffer_mutations[i]).copy_(out)
            else:
                loss = out
        return loss

    def _compute_copy(self, t: torch.Tensor) -> torch.Tensor:
        return compute_copy(t, self.dtype)

    def local_batch(self, inputs: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """This rank's data-parallel slice of a global batch (dim 'batch' of every input), on
        the program's device (a batch from a CPU data loader moves to the rank's GPU here)."""
        return self._batch.local(inputs, kwargs)

    def train_step(self, inputs, optimizer: torch.optim.Optimizer, *, kwargs: dict | None = None) -> float:
        """One training step on the global batch `inputs` (the same tensors on every rank):
        forward and backward on this rank's slice, gradient sync, optimizer step. Returns the
        global batch's loss.

        With microbatches > 1 or pipeline parallel, the rank's slice is cut into equal
        microbatches along the batch dim (or `inputs` is a `fxtron.Microbatches` list, whose
        microbatches may differ in sequence length), run by the schedule, and the loss is the
        mean of the microbatches' losses, as gradient accumulation computes it."""
        self._check_optimizer(optimizer)
        if self._stages is not None or self.pipeline.microbatches > 1 or isinstance(inputs, Microbatches):
            return self._pipelined_step(inputs, optimizer, kwargs)
        args, kw = self.local_batch(inputs, kwargs)
        optimizer.zero_grad(set_to_none=True)
        memory = self._memory_tracker()
        t0 = time.perf_counter()
        with self._grad_accumulation(), self._dispatch_log():
            with tracking(memory):
                loss = self(*args, **kw)
            t1 = time.perf_counter()
            if memory is not None:
                memory.sample("F", 0, 0)
            scaled = loss * self.scaler.scale if self.scaler is not None else loss
            self._last_backward(None)
            with WgradQueue().active():   # weight-gradient GEMMs overlap the input gradients' communication
                scaled.backward()
            del scaled
            t2 = time.perf_counter()
            if memory is not None:
                memory.sample("B", 0, 0)
        self._events = [Event("F", 0, 0, 0, 0.0, t1 - t0), Event("B", 0, 0, 0, t1 - t0, t2 - t0)]
        self.finalize_grads()
        self._optimizer_step(optimizer)
        out = self._global_loss(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
        ledger.step_end(self.groups)
        return out

    # ---------------------------------------------------------------- pipeline / microbatches
    def microbatches(self, inputs, kwargs: dict | None = None) -> list[list[torch.Tensor]]:
        """This rank's microbatches of a global batch: flat tensor inputs of each."""
        return self._batch.microbatches(inputs, kwargs)

    def _call_stage(self, stage, flat: list, received: list) -> tuple:
        if stage.gm is None:     # the whole graph as one stage
            return (self._run_graph(flat),)
        args = [self._compute_copy(get_by_path(self, n)) for n in stage.params]
        args += [self._compute_copy(get_by_path(self, n)) for n in stage.buffers]
        args += [flat[i] for i in stage.user_inputs] + list(received)
        with self.rng.active() if self.rng is not None else contextlib.nullcontext():
            return stage.gm(*args)

    def runner(self):
        """The schedule runner of this rank (built once): its chunks, actions and p2p."""
        if self._runner is None:
            from fxtron.runtime import schedules
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
                                       quiet=self._quiet_grads)
        return self._runner

    def _pipelined_step(self, inputs, optimizer, kwargs) -> float:
        mbs = self.microbatches(inputs, kwargs)
        runner = self.runner()
        optimizer.zero_grad(set_to_none=True)
        runner.memory = self._memory_tracker()
        with self._grad_accumulation(), self._dispatch_log():
            loss = runner.run(mbs, loss_scale=self.scaler.scale if self.scaler is not None else 1.0)
        self.finalize_grads()
        self._optimizer_step(optimizer)
        if self.groups is not None and self.groups.size("pp") > 1:
            # float64 on every pp rank: the last stage's loss keeps a float64 model's precision
            loss = (loss.double().clone() if loss is not None
                    else torch.zeros((), dtype=torch.float64, device=self.groups.device))
            with ledger.collective(self.groups.group("pp"), "all_reduce", loss):   # only the last stage's is non-zero
                dist.all_reduce(loss, group=self.groups.group("pp"))
        out = self._global_loss(loss)
        ledger.step_end(self.groups)
        return out

    # ---------------------------------------------------------------- mixtures of experts
    def _dispatch_log(self):
        self.last_dispatch = DispatchLog()
        return self.last_dispatch.active()

    def expert_load(self) -> dict[str, torch.Tensor]:
        """The copies each expert received in the last step, per mixture-of-experts layer of
        this rank's stages: {layer: (E,) int64} over the whole global batch (every data-
        parallel rank's tokens: one all-reduce over dp; every rank of the group calls it).
        Empty without expert parallel. `last_dispatch.bytes_sent`: the bytes this rank sent
        to other ranks in the step's all-to-alls."""
        log = getattr(self, "last_dispatch", None)
        if log is None or not log.copies:
            return {}
        names = sorted(log.copies)
        stacked = torch.stack([log.copies[n].to(torch.int64) for n in names])
        if self.groups is not None and self.groups.size("dp") > 1:
            stacked = stacked.to(self.groups.device)
            with ledger.collective(self.groups.group("dp"), "all_reduce", stacked):
                dist.all_reduce(stacked, group=self.groups.group("dp"))
        return {n: stacked[i].cpu() for i, n in enumerate(names)}

    def timeline(self) -> list:
        """The last step's events on this rank (runtime.executor.Event: F, B, W and, with a
        schedule, the waits for messages and the sends, with start and end in seconds from the
        step's start)."""
        return list(self._runner.events) if self._runner is not None else list(self._events)

    def memory_timeline(self) -> list:
        """The last step's memory on this rank, after every pass (runtime.memory.MemorySample:
        the bytes saved for backward then alive, the gradient bytes, CUDA's allocated bytes),
        recorded when `prog.track_memory = True` was set before the step."""
        if self._memory is None or not self.track_memory:
            raise RuntimeError("no memory timeline recorded: set prog.track_memory = True before the step")
        return list(self._memory.samples)

    def _memory_tracker(self):
        """This step's MemoryTracker, started (None unless track_memory)."""
        if not self.track_memory:
            return None
        if self._memory is None:
            self._memory = MemoryTracker([*self.parameters(), *self.buffers()], self._grad_bytes)
        self._memory.start()
        return self._memory

    def _grad_bytes(self) -> int:
        """The rank's gradient bytes: its gradient buffers and any .grad outside them."""
        held = sum(b.data.numel() * b.data.element_size() for b in self.grad_buffers.values())
        views = {b.data.untyped_storage().data_ptr() for b in self.grad_buffers.values()}
        loose = sum(p.grad.numel() * p.grad.element_size() for p in self.parameters()
                    if p.grad is not None and p.grad.untyped_storage().data_ptr() not in views)
        return held + loose

    # ---------------------------------------------------------------- optimizer
    def _check_optimizer(self, optimizer) -> None:
        """ParallelizeError for an optimizer that would not train this program: not an
        optimizer, or holding tensors that are not its parameters (the original model's,
        whose gradients the step never fills)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ParallelizeError(f"train_step needs a torch.optim.Optimizer over prog.parameters(), got "
                                   f"{type(optimizer).__name__}")
        mine = {id(p) for p in self.parameters()}
        foreign = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ParallelizeError(
                f"the optimizer holds {len(foreign)} tensor(s) that are not this program's parameters (the first "
                f"of shape {foreign[0]}): build it over prog.parameters() -- the rank's shards -- not over the "
                "original model's")

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._zero is not None:
            params = self._zero.optimizer_for(optimizer)
            grads_ok = self.scaler is None or self.scaler.unscale_and_check(params, self.groups, sharded_over_dp=True,
                                                                               dp_kind=self._grad_group())
            if grads_ok:
                self._zero.step(optimizer)
            return
        if self.scaler is None or self.scaler.unscale_and_check(list(self.parameters()), self.groups):
            optimizer.step()

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None, storage_writer=None) -> None:
        """Write this rank's shards of the parameters, buffers and optimizer state to the
        directory `path` (torch.distributed.checkpoint; every rank of the job calls it),
        atomically: a failed or interrupted save leaves the checkpoint that was at `path`
        loadable and unchanged. The checkpoint loads on any mesh (`prog.load`) or in one
        process (`fxtron.load_full_state_dict`). `storage_writer(directory)`, optional, gives
        DCP's StorageWriter (default: files)."""
        from fxtron.runtime import checkpoint
        checkpoint.save(self, path, optimizer, storage_writer)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read a checkpoint saved by `save` from any mesh into this program (and optimizer)."""
        from fxtron.runtime import checkpoint
        checkpoint.load(self, path, optimizer)

    # ---------------------------------------------------------------- communication
    def _dp(self) -> tuple[int, int]:
        if self.groups is None:
            return 1, 0
        return self.groups.size("dp"), self.groups.index("dp")

    def _global_loss(self, loss: torch.Tensor) -> float:
        dp, _ = self._dp()
        if dp > 1:
            loss = loss.clone()
            with ledger.collective(self.groups.group("dp"), "all_reduce", loss):
                dist.all_reduce(loss, group=self.groups.group("dp"))
            loss /= dp
        return float(loss)

    # ---------------------------------------------------------------- full tensors
    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        spec = self._local.get(name)
        if spec is None or not spec.sharded:
            return local
        return gather_full(local, spec, self.groups)

    def _across_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Merge the dicts of every pipeline rank (each holds its stages' parameters)."""
        if self.groups is None or self.groups.size("pp") == 1:
            return mine
        every = [None] * self.groups.size("pp")
        with ledger.collective(self.groups.group("pp"), "all_gather_object"):
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


__all__ = ["Microbatches", "PipelineOptions", "Program"]
