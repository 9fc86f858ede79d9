"""Runtime: a rank's program -- an nn.Module holding that rank's parameters and running its graph.

The module tree mirrors the original model's (`prog.named_parameters()` yields
`blocks.0.attn.qkv.weight`, ...), so optimizers, clipping and state dicts see familiar names.
Forward calls the per-rank GraphModule with (parameters, buffers, flattened inputs) in the
order the trace fixed. `train_step` does one whole step: the rank's slice of the batch
(runtime/batch.py), forward and backward (or the pipeline schedule, runtime/pp/runner.py), the
gradient sync (runtime/grads.py), mixed precision (runtime/precision.py) and the optimizer;
under cuda_graphs=True it is captured once in a CUDA graph and replayed (runtime/graphs.py).
`eval_step` runs the model's eval-mode graph (traced with the model in eval mode; compiled on
first use with the same parameters), forward only; `prog.eval()` makes `prog(...)` run it too.

What is not the step lives beside it, as functions of the program: the pipeline runner
(runtime/pp/runner.py), the timelines (runtime/pp/timeline.py), the experts' load
(runtime/ep.py), the optimizer step with its skipping and loss scaling (runtime/optim.py),
checkpoints and pretrained weights (runtime/checkpoint/dcp.py, runtime/checkpoint/hf.py).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fxtron.config import Config
from fxtron.core.meta import TraceInfo
from fxtron.core.meta import param_name as meta_param_name
from fxtron.core.params import LocalParam
from fxtron.core.records import FSDP_PIECES, ZERO_WAITED, FsdpPiece, ZeroWaited
from fxtron.core.rank import RankSpec
from fxtron.errors import ParallelizeError
from fxtron.ops import ledger
from fxtron.ops.ep import DispatchLog
from fxtron.ops.linear import WgradQueue
from fxtron.ops.rng import RNGStreams
from fxtron.runtime import ep, graphs, optim
from fxtron.runtime.batch import BatchSlicer, Microbatches, check_same_batch
from fxtron.runtime.checkpoint import dcp, hf
from fxtron.runtime.grads import Gradients, check_differentiable, get_by_path
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.memory import tracking
from fxtron.runtime.pp import runner as pp_runner
from fxtron.runtime.pp import timeline
from fxtron.runtime.pp.executor import Event
from fxtron.runtime.precision import LossScaler, compute_copy

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


@dataclass
class EvalGraphs:
    """A rank's eval-mode graph (the model traced in eval mode: dropout off, BatchNorm on its
    running statistics) bound to the program's groups: its trace info, the graph or pipeline
    stages, and the values of the buffers it reads (the program's own are used where it has
    them)."""

    info: TraceInfo
    gm: fx.GraphModule | None
    stages: list | None
    buffers: dict[str, torch.Tensor]


def _own_backward(syncs: list[str], grad):
    raise ParallelizeError(
        "backward of prog(...)'s loss would leave this rank with the gradients of its own rows only: "
        "prog.train_step(batch, optimizer) runs, after its backward, " + " and ".join(syncs) + ". Train with "
        "train_step (a custom loss: parallelize(..., loss_fn=)), or compute the loss under torch.no_grad()")


class Program(nn.Module):
    """One rank's share of the model, ready for an optimizer.

    Built (runtime/build.py) from the compiler's description of the rank, `spec`
    (core.rank.RankSpec: its parameters' shards, stages, tied weights ...), and the
    configuration (fxtron.config.Config: precision, pipeline, data parallel): `params` and
    `buffers` are the rank's tensors by name (`persistent`: the buffers a state dict keeps),
    `gm` / `stages` its graph or pipeline stages bound to `groups` (the rank's process groups;
    None for a program run without communication, e.g. on a 1-rank mesh), `rng` its random
    streams.

    For checkpoints and tools: `local` (name -> core.params.LocalParam, how the rank's
    parameter relates to the full one), `info` (the trace's signature), `grads` (the gradient
    buffers and their sync, runtime/grads.py) and `zero` (the distributed optimizer or None).
    """

    def __init__(self, spec: RankSpec, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 persistent: set[str], groups: ProcessGroups | None, config: Config, *, rng: RNGStreams | None = None,
                 gm: fx.GraphModule | None = None, stages: list | None = None,
                 evaluation: Callable[[], EvalGraphs] | None = None):
        super().__init__()
        info = spec.info
        for name in info.params:
            if name in params:
                _set_by_path(self, name, nn.Parameter(params[name]), parameter=True)
        for name in info.buffers:
            if name in buffers:
                _set_by_path(self, name, buffers[name], parameter=False, persistent=name in persistent)
        object.__setattr__(self, "graph_module", gm)  # not a submodule: keep the tree the model's
        self.spec = spec
        self.config = config
        self.info: TraceInfo = info
        self.local: dict[str, LocalParam] = dict(spec.local)
        self.rank = spec.rank
        self.groups = groups
        self.rng = rng
        self.rng_restored: bool | None = None    # the last load: its random streams continued (checkpoint/dcp.py)
        # mixed precision: parameters stay fp32 (the optimizer's main parameters); each forward
        # computes with 16-bit copies (Megatron's Float16Module + mixed-precision optimizer)
        self.dtype = config.precision.torch_dtype
        self.scaler = LossScaler.for_loss(info.loss_dtype, config.precision) if self.dtype == torch.float16 else None
        # pipeline: this rank's stages (None: the whole graph is one stage) and the schedule
        self._stages = stages
        self.pipeline = config.pipeline
        self._runner = None
        # evaluation: the eval-mode graph, compiled and bound on first use (`evaluation()`)
        self._evaluation = evaluation
        self._eval: EvalGraphs | None = None
        self._eval_runners: dict = {}     # microbatches -> the forward-only runner (pp/runner.py)
        self._last_runner = None          # the runner of the last step (training or evaluation)
        self.frozen: frozenset = frozenset()   # the parameters the model froze (requires_grad=False), runtime/build.py
        self.held_in: dict = {}           # name -> the 16-bit dtype the model held an fp32 master's weight in (build.py)
        self.compiled = None              # compile=True: what Inductor compiled (codegen/regions.py CompileStats)
        self.captured = None              # cuda_graphs=True: the captured step, made at the first (runtime/graphs.py)
        self.track_memory = False         # sample the memory after every pass of a step (memory_timeline)
        # a step whose global gradient norm is not finite leaves the weights as they were (the trainer's)
        self.skip_nonfinite = False
        self.last_step_skipped = False
        self._batch_agreed = groups is None or groups.mesh.world_size == 1   # (check_same_batch, the first step)
        self._memory = None
        self._events: list = []           # the last step's passes without a schedule (F, B)
        self._aliases = info.aliases if stages is None else {a: n for a, n in info.aliases.items() if n in params}
        dp, dp_rank = self._dp()
        cp, cp_rank = (1, 0) if groups is None else (groups.size("cp"), groups.index("cp"))
        self._batch = BatchSlicer(info, dp=dp, dp_index=dp_rank, microbatches=self.pipeline.microbatches,
                                  device=groups.device if groups is not None else None, cp=cp, cp_index=cp_rank,
                                  seq_split=spec.seq_split, max_seq=(spec.max_seq, spec.max_seq_why),
                                  strict=config.debug.strict, buffer=self._statistic_buffer)
        # data parallel: every gradient in bucketed buffers (runtime/dp.py), reduced over the
        # group the parameters name (dp; dp-cp and expert-dp with cp and ep), the distributed
        # optimizer under zero=1
        self.data_parallel = config.data_parallel
        # the parameters by name, once: every step reads them (the graph's arguments, the
        # optimizer's checks), and walking the module tree for them cost a small model's step
        # more host time than its optimizer (a GPU waiting on its host pays it)
        self._params: dict[str, nn.Parameter] = dict(self.named_parameters())
        self.grads = Gradients(dict(self._params), self.local, groups, config.data_parallel,
                               shared=spec.shared, grad_reports=spec.grad_reports, param_order=list(spec.param_order),
                               chunk_params=[set(st.params) for st in stages] if stages is not None else None,
                               autograd=spec.autograd, direct=not config.codegen.cuda_graphs)
        self.last_dispatch: DispatchLog | None = None   # what expert parallel's all-to-alls did, last step
        self.last_eval_dispatch: DispatchLog | None = None   # the same of the last evaluation
        self._tp_comm = groups is not None and groups.size("tp") > 1
        # overlap_param_gather (zero=1/2): the graph's param_wait nodes wait for each layer's buckets
        # and make its compute copies; those parameters are passed to the graph as they are
        self._raw: set[str] = set()
        if self.zero is not None:
            self.zero.dtype = self.dtype
            wait = torch.ops.fxtron.param_wait.default
            self._raw = {meta_param_name(a) for g in spec.graphs for n in g.graph.nodes if n.target == wait
                         for a in n.args[2]}
            named = dict(self.named_parameters())
            for n in self._raw:
                ZERO_WAITED.set(named[n], ZeroWaited(self.zero, n))   # what param_wait reads (ops/fsdp.py)
            self.grads.waited_in_graph = set(self._raw)
            self.zero.overlap = bool(self._raw)
        # compile=True under 16-bit compute: the linears its regions hold take the fp32 master weight
        # and cast it themselves (ops/linear.py master_linear): those weights are passed as they are
        master = torch.ops.fxtron.master_linear.default
        self._raw |= {meta_param_name(n.args[1]) for g in spec.graphs for n in g.graph.nodes if n.target == master}
        # sharded data parallel (zero=3): each layer's pieces gathered at the graph's fsdp_gather nodes
        self.fsdp = None
        if any(lp.flat is not None for lp in self.local.values()):
            from fxtron.runtime.fsdp import FsdpUnits
            self.fsdp = FsdpUnits(list(spec.graphs), dict(self.named_parameters()), self.local, groups,
                                  dtype=self.dtype, grad_dtype=self.grads.reduce_dtype,
                                  average=dp, share=self.grads.share,
                                  gather_per_step=config.data_parallel.gather_per_step)
            self.grads.fsdp = self.fsdp
            for name, p in self.named_parameters():
                if name in self.local and self.local[name].flat is not None:
                    FSDP_PIECES.set(p, FsdpPiece(self.fsdp))   # what the graph's gathers call (ops/fsdp.py)

    # ---------------------------------------------------------------- the original model's shapes
    def original_shape(self, name: str) -> torch.Size:
        """The shape parameter `name` (a name of `prog.named_parameters()`, or a tied alias) has
        in the original model -- not the rank's tensor's, which is a shard under tp, ep and
        pp and a flat 1-d piece under zero=3. Grouping rules written over the model (no
        weight decay on 1-d parameters) read `len(prog.original_shape(n))` at every zero level."""
        name = self._aliases.get(name, name)
        if name not in self.local:
            raise ParallelizeError(f"{name!r} is not a parameter of this rank's program")
        return torch.Size(self.local[name].full_shape)

    def original_shapes(self) -> dict[str, torch.Size]:
        """`original_shape` of every parameter of `prog.named_parameters()`, by name."""
        return {n: self.original_shape(n) for n, _ in self.named_parameters()}

    # ---------------------------------------------------------------- gradients (runtime/grads.py)
    @property
    def zero(self):
        """The distributed optimizer (runtime/zero.py ZeroOne) under zero=1, else None."""
        return self.grads.zero

    @property
    def grad_buffers(self):
        """The gradient buffers by the group that reduces them (dp or dp-cp, expert-dp)."""
        return self.grads.buffers

    @property
    def grad_buffer(self):
        """The dense parameters' gradient buffer (the distributed optimizer shards it)."""
        return self.grads.buffer

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping, last step (with clip_grad)."""
        return self.grads.last_norm

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the whole model's gradients (Gradients.norm)."""
        return self.grads.norm()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to `max_norm` (Gradients.clip_); returns the norm."""
        return self.grads.clip_(max_norm)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full-shape gradients under the original parameter names (tied weights once)."""
        return self.grads.full_grads()

    # ---------------------------------------------------------------- running
    def _flat_inputs(self, inputs: tuple, kwargs: dict | None) -> list:
        return self._batch.flat(inputs, kwargs)

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        """The loss of this rank's program on these (already local) inputs: the training
        graph's, or after `prog.eval()` the eval-mode graph's (dropout off, BatchNorm on its
        running statistics), as the model's own forward follows model.train() / model.eval().
        Its backward is refused where the step syncs the gradients after the backward (dp, cp,
        expert dp, sequence parallel's norm weights): a rank would keep only its own rows'
        gradients; `train_step` runs forward, backward, the sync and the optimizer together."""
        if self._stages is not None:
            raise ParallelizeError("a pipeline-parallel program runs forward and backward together, stage by "
                                   "stage over microbatches: call prog.train_step(batch, optimizer), or "
                                   "prog.eval_step(batch) for the loss alone")
        self._settle_params()
        if not self.training and self._evaluation is not None:
            loss = self._run_graph(self._flat_inputs(inputs, kwargs), self.eval_graphs())
        else:
            loss = self._run_graph(self._flat_inputs(inputs, kwargs))
        if loss.requires_grad and (syncs := self.grads.synced_by_the_step()):
            loss.register_hook(functools.partial(_own_backward, syncs))
        return loss

    def eval_graphs(self) -> EvalGraphs:
        """The rank's eval-mode graph (or stages), compiled and bound on first use; the
        buffers only it reads join the program's."""
        if self._eval is None:
            if self._evaluation is None:
                raise ParallelizeError("this program was built without its eval-mode graph (build_program(..., "
                                       "eval_spec=)): ParallelModel.program builds it")
            ev = self._evaluation()
            if list(ev.info.params) != list(self.info.params):
                raise ParallelizeError("the eval-mode graph's parameters are not the training graph's")
            own = dict(self.named_buffers())
            for name, value in ev.buffers.items():
                if name not in own:
                    _set_by_path(self, name, value, parameter=False, persistent=False)
            self._eval = ev
        return self._eval

    def _run_graph(self, flat: list, evaluation: EvalGraphs | None = None) -> torch.Tensor:
        info = evaluation.info if evaluation is not None else self.info
        gm = evaluation.gm if evaluation is not None else self.graph_module
        args = [self._param_arg(n) for n in info.params]
        args += [self._compute_copy(get_by_path(self, n)) for n in info.buffers]
        with self.rng.active() if self.rng is not None else contextlib.nullcontext(), self._gathering():
            outs = gm(*args, *flat)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = None
        for i, out in enumerate(outs):
            if i in info.buffer_mutations:
                with torch.no_grad():
                    get_by_path(self, info.buffer_mutations[i]).copy_(out)
            else:
                loss = out
        return loss

    def _param_arg(self, name: str) -> torch.Tensor:
        """What the graph receives for parameter `name`: its compute copy, or the parameter
        itself where a param_wait node makes the copy once its bucket has arrived."""
        p = self._params.get(name)
        if p is None:             # (a tied alias)
            p = get_by_path(self, name)
        return p if name in self._raw else self._compute_copy(p)

    def _statistic_buffer(self, name: str) -> torch.Tensor | None:
        """Buffer `name` as the graphs read it (its compute copy), None where this rank holds no
        such buffer: what an input statistic reads besides the batch (runtime/batch.py)."""
        try:
            t = get_by_path(self, name)
        except AttributeError:
            return None
        return self._compute_copy(t) if isinstance(t, torch.Tensor) else None

    def _compute_copy(self, t: torch.Tensor) -> torch.Tensor:
        return compute_copy(t, self.dtype)

    def param_items(self) -> list[tuple[str, nn.Parameter]]:
        """`prog.named_parameters()` as the program was built, without walking its module tree
        (the step's checks read it every step)."""
        return list(self._params.items())

    def local_batch(self, inputs: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """This rank's data-parallel slice of a global batch (dim 'batch' of every input), on
        the program's device (a batch from a CPU data loader moves to the rank's GPU here)."""
        return self._batch.local(inputs, kwargs)

    def train_step(self, inputs, optimizer: torch.optim.Optimizer | list, *, kwargs: dict | None = None) -> float:
        """One training step on the global batch `inputs` (the same tensors on every rank):
        forward and backward on this rank's slice, gradient sync, optimizer step. Returns the
        global batch's loss.

        `optimizer`: a torch optimizer over `prog.parameters()`, or a list of them (Muon on the
        2-d weights, AdamW on the rest). An elementwise one (SGD, Adam, AdamW, ...) steps the
        rank's pieces; any other (Adafactor, Muon, a class fxtron does not know) steps whole
        matrices gathered to owner ranks (runtime/optim.py; `optimizer_mode`).

        With microbatches > 1 or pipeline parallel, the rank's slice is cut into equal
        microbatches along the batch dim (or `inputs` is a `fxtron.Microbatches` list, whose
        microbatches may differ in sequence length), run by the schedule, and the loss is the
        mean of the microbatches' losses, as gradient accumulation computes it -- a token mean
        over the whole batch's counted tokens (passes/statistics.py). A training step runs the
        training graph whether the program is in train or eval mode (`eval_step` evaluates).

        Under cuda_graphs=True the step after the warm-up is captured in a CUDA graph and
        replayed from then on (runtime/graphs.py: one input shape, Adam / AdamW)."""
        optim.check_optimizer(self, optimizer)
        self._agree_on_batch(inputs, kwargs)
        if self.config.codegen.cuda_graphs:     # the whole step captured once, then replayed (runtime/graphs.py)
            return graphs.captured_step(self, inputs, optimizer, kwargs)
        if self._stages is not None or self.pipeline.microbatches > 1 or isinstance(inputs, Microbatches):
            return pp_runner.pipelined_step(self, inputs, optimizer, kwargs)
        args, kw = self.local_batch(inputs, kwargs)
        batch = self._batch.context(inputs, kwargs)
        optim.zero_grad(optimizer)
        memory = timeline.memory_tracker(self)
        t0 = time.perf_counter()
        with self.grads.accumulation(), ep.dispatch_log(self), batch.active():
            with tracking(memory):     # the training graph, whatever prog.train() / prog.eval() says
                loss = self._run_graph(self._flat_inputs(args, kw))
            t1 = time.perf_counter()
            if memory is not None:
                memory.sample("F", 0, 0)
            total = self._start_global_loss(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
            scaled = loss * self.scaler.scale if self.scaler is not None else loss
            self.grads.last_backward(None)
            # weight-gradient GEMMs overlap the input gradients' tp communication; without any, each
            # runs as its linear's backward does (while its inputs are hot in cache)
            check_differentiable(scaled)
            with WgradQueue().active() if self._tp_comm else contextlib.nullcontext():
                scaled.backward()
            del scaled
            t2 = time.perf_counter()
            if memory is not None:
                memory.sample("B", 0, 0)
        self._events = [Event("F", 0, 0, 0, 0.0, t1 - t0), Event("B", 0, 0, 0, t1 - t0, t2 - t0)]
        self._last_runner = None
        self.grads.finalize(loss_scale=self.scaler.scale if self.scaler is not None else None)
        optim.optimizer_step(self, optimizer)
        out = total()
        ledger.step_end(self.groups)
        return out

    def optimizer_mode(self, optimizer) -> list[str]:
        """How each optimizer steps on this program, a line each: elementwise on the rank's
        pieces, or whole matrices gathered to owner ranks (runtime/optim.py)."""
        return [optim.mode(o) for o in optim.optimizers(optimizer)]

    def build_optimizer(self, cls: type, params, **kwargs) -> torch.optim.Optimizer:
        """`cls(params, **kwargs)` over this program's parameters, the constructor's checks made
        on their shapes in the model: torch.optim.Muon (2-d parameters only) over the flat
        pieces of a zero=3 program (runtime/optim.py build_optimizer)."""
        return optim.build_optimizer(self, cls, params, **kwargs)

    # ---------------------------------------------------------------- pipeline / microbatches
    def microbatches(self, inputs, kwargs: dict | None = None) -> list[list[torch.Tensor]]:
        """This rank's microbatches of a global batch: flat tensor inputs of each."""
        return self._batch.microbatches(inputs, kwargs)

    def _call_stage(self, stage, flat: list, received: list, evaluation: EvalGraphs | None = None) -> tuple:
        if stage.gm is None:     # the whole graph as one stage
            return (self._run_graph(flat, evaluation),)
        args = [self._param_arg(n) for n in stage.params]
        args += [self._compute_copy(get_by_path(self, n)) for n in stage.buffers]
        args += [flat[i] for i in stage.user_inputs] + list(received)
        with self.rng.active() if self.rng is not None else contextlib.nullcontext(), self._gathering():
            return stage.gm(*args)

    def _gathering(self):
        """zero=3: the graph's gathers find this program's units (runtime/fsdp.py)."""
        return self.fsdp.running() if self.fsdp is not None else contextlib.nullcontext()

    def runner(self):
        """The schedule runner of this rank (built once): its chunks, actions and p2p (runtime/pp/runner.py)."""
        return pp_runner.runner(self)

    def eval_step(self, inputs, *, kwargs: dict | None = None) -> float:
        """The global batch's loss as the model computes it in eval mode (model.eval(): dropout
        off, BatchNorm on its running statistics), forward only: the eval-mode graph, under
        no_grad; with a pipeline schedule or microbatches, a forward-only schedule (every
        microbatch's F in the schedule's order, no backward, no gradient buffer touched).
        Weights, buffers, the optimizer and the last step's gradient norm stay as they were."""
        self._agree_on_batch(inputs, kwargs)
        evaluation = self.eval_graphs()
        self._settle_params()
        if self._stages is not None or self.pipeline.microbatches > 1 or isinstance(inputs, Microbatches):
            return pp_runner.evaluate(self, inputs, kwargs, evaluation)
        args, kw = self.local_batch(inputs, kwargs)
        batch = self._batch.context(inputs, kwargs, evaluation.info.statistics)
        t0 = time.perf_counter()
        with torch.no_grad(), ep.dispatch_log(self, evaluation=True), batch.active():
            loss = self._run_graph(self._flat_inputs(args, kw), evaluation)
        self._events = [Event("F", 0, 0, 0, 0.0, time.perf_counter() - t0)]
        self._last_runner = None
        out = self._global_loss(loss.detach().to(torch.promote_types(loss.dtype, torch.float32)))
        ledger.step_end(self.groups)
        return out

    def _agree_on_batch(self, inputs, kwargs) -> None:
        """At the first step (training or evaluation), that every rank was given the same global
        batch (runtime/batch.py check_same_batch)."""
        if not self._batch_agreed:
            check_same_batch(self.groups, (inputs, kwargs))
            self._batch_agreed = True

    def _settle_params(self) -> None:
        """Outside a training step (the program's own forward, eval_step): the distributed
        optimizer's all-gathers of the last step's parameters land first, so nothing reads a
        half-updated weight (a training step waits for them itself, per layer under
        overlap_param_gather)."""
        if self.zero is not None:
            self.zero.wait_params()

    def settle(self) -> None:
        """Finish every collective this program still has in flight outside a step: the
        distributed optimizer's all-gathers of the updated parameters (zero=1/2 start them after
        each step, for a next step that may never come) and zero=3's gathers; every rank of
        the job calls it at the run's end, before its process groups are destroyed (a gloo work
        still running then is torn down with the interpreter: an abort after the job's work is
        done). The program stays usable."""
        self._settle_params()
        if self.fsdp is not None:
            self.fsdp.settle()

    # ---------------------------------------------------------------- expert load, timelines
    def expert_load(self) -> dict[str, torch.Tensor]:
        """The copies each expert received in the last step, per mixture-of-experts layer,
        over the whole global batch (runtime/ep.py expert_load; every rank of dp, or dp-cp, calls it)."""
        return ep.expert_load(self)

    def timeline(self) -> list:
        """The last step's events on this rank (runtime/pp/timeline.py timeline)."""
        return timeline.timeline(self)

    def memory_timeline(self) -> list:
        """The last step's memory on this rank, after every pass, recorded when
        `prog.track_memory = True` was set before the step (runtime/pp/timeline.py)."""
        return timeline.memory_timeline(self)

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None, storage_writer=None,
             extra: dict | None = None) -> None:
        """Write this rank's shards of the parameters, buffers and optimizer state to the
        directory `path` (torch.distributed.checkpoint; every rank of the job calls it),
        atomically: a failed or interrupted save leaves the checkpoint that was at `path`
        loadable and unchanged. The checkpoint loads on any mesh (`prog.load`) or in one
        process (`fxtron.load_full_state_dict`). `storage_writer(directory)`, optional, gives
        DCP's StorageWriter (default: files). `extra`: a picklable object (the same on every
        rank) saved with them, read back by fxtron.runtime.checkpoint.dcp.read_extra."""
        dcp.save(self, path, optimizer, storage_writer, extra)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read a checkpoint saved by `save` from any mesh into this program (and optimizer)."""
        dcp.load(self, path, optimizer)

    def load_pretrained(self, path: str, prefix: str = "") -> None:
        """Pretrained weights from safetensors (a directory save_pretrained wrote, or one file)
        into this rank's shards, each rank reading only its own slices (runtime/checkpoint/hf.py);
        every rank calls it. `prefix`: what the checkpoint's keys carry in front of the model's
        names. Missing, unexpected and mis-shaped tensors are one ParallelizeError."""
        hf.load_pretrained(self, path, prefix)

    def save_pretrained(self, path: str, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
        """Write the model as transformers' save_pretrained does -- safetensors files of at most
        `max_shard_size` with an index, transformers' own key layout, config.json and
        generation_config.json for a transformers model -- tensor by tensor, each gathered once
        (runtime/checkpoint/hf.py); every rank calls it. `dtype` (torch.bfloat16): the floating
        tensors written in it; by default each in the dtype the model held it in (a model loaded
        in bf16 and trained on fp32 masters under dtype="bf16" is written in bf16, as transformers
        saves it). `AutoModelForCausalLM.from_pretrained(path)` loads it."""
        hf.save_pretrained(self, path, max_shard_size, dtype)

    # ---------------------------------------------------------------- communication
    def _dp(self) -> tuple[int, int]:
        if self.groups is None:
            return 1, 0
        return self.groups.size("dp"), self.groups.index("dp")

    def _start_global_loss(self, loss: torch.Tensor, *, on_device: bool = False):
        """Start summing the ranks' losses over dp (it runs during backward); the function
        returned waits and gives the global batch's loss (`on_device`: as a device tensor,
        nothing read on the host -- a captured step's, runtime/graphs.py)."""
        dp, _ = self._dp()
        if dp == 1:
            return (lambda: loss) if on_device else (lambda: float(loss))
        loss = loss.clone()
        e = ledger.issue(self.groups.group("dp"), "all_reduce", loss)
        work = ledger.started(e, dist.all_reduce(loss, group=self.groups.group("dp"), async_op=True))

        def finish():
            work.wait()
            return loss / dp if on_device else float(loss) / dp
        return finish

    def _global_loss(self, loss: torch.Tensor) -> float:
        dp, _ = self._dp()
        if dp > 1:
            loss = loss.clone()
            with ledger.collective(self.groups.group("dp"), "all_reduce", loss):
                dist.all_reduce(loss, group=self.groups.group("dp"))
            loss /= dp
        return float(loss)

    def state_dict(self, *args, **kwargs):
        """nn.Module's, once the distributed optimizer's all-gathers of the updated parameters
        (started after the step, asynchronous) have landed: never a stale shard."""
        if self.zero is not None:
            self.zero.wait_params()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """nn.Module's, once the distributed optimizer's all-gathers still in flight
        (overlap_param_gather) have landed: a gather landing after the load would overwrite it."""
        self._settle_params()
        return super().load_state_dict(state_dict, *args, **kwargs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape parameters and persistent buffers under the original names, tied aliases
        included, so `model.load_state_dict(prog.full_state_dict())` restores the model
        (runtime/checkpoint/dcp.py full_state_dict; every rank calls it)."""
        return dcp.full_state_dict(self)

__all__ = ["Microbatches", "Program"]
