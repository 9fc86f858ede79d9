"""The user's entry point: `parallelize(model, mesh, example_inputs=...) -> ParallelModel`.

Compile-only: tracing and the per-rank passes run here, with no processes. A ParallelModel
answers questions about any rank (`graph`, `summary`) and builds a rank's runnable
`program(rank)` inside that rank's process.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import warnings

import torch
import torch.fx as fx
from tabulate import tabulate

import sympy

from fxtron.compiler import passmanager, report
from fxtron.compiler.show import format_graph
from fxtron.compiler.trace import check_example_sizes, trace
from fxtron.core import meta
from fxtron.core.meta import BATCH, SEQ, info
from fxtron.errors import ParallelizeError, ParallelizeWarning
from fxtron.mesh import Mesh
from fxtron.passes.tp_plan import TPPlan, make_tp_plan
from fxtron.passes.recompute import check_options as check_recompute, region_labels
from fxtron.passes.stages import StageAssignment, assign_stages
from fxtron.runtime import groups as G
from fxtron.runtime import schedules
from fxtron.runtime.buffers import DataParallelOptions
from fxtron.passes.context_parallel import COMM_TYPES
from fxtron.passes.expert_parallel import aux_statistics, check_experts, moe_layers, unshared
from fxtron.runtime.build import build_program
from fxtron.runtime.program import PipelineOptions, Program


@dataclass(frozen=True)
class Options:
    """Compilation options, validated at the boundary (see `parallelize`)."""

    loss_fn: Callable[[Any], torch.Tensor] | None = None
    batch_dim: int = 0
    seq_dim: int | None = 1
    plan: dict | None = None
    plan_mode: str = "override"
    sequence_parallel: bool = False
    gradient_accumulation_fusion: bool = True
    dtype: torch.dtype | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split_points: tuple[str, ...] | None = None
    scatter_gather: bool = False
    data_parallel: DataParallelOptions = DataParallelOptions()
    trace_layers_once: bool = True
    device: str = "cpu"
    strict: bool = False
    cp_comm_type: str = "p2p"
    moe_aux_loss: str = "local"
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    recompute: str | None = None
    recompute_method: str | None = None
    recompute_layers: int | None = None

    def __post_init__(self):
        if self.batch_dim < 0 or (self.seq_dim is not None and self.seq_dim < 0):
            raise ParallelizeError("batch_dim and seq_dim must be non-negative dims of the inputs")
        if self.seq_dim is not None and self.seq_dim == self.batch_dim:
            raise ParallelizeError(f"batch_dim and seq_dim are both {self.batch_dim}; give two different dims")


def parallelize(model: torch.nn.Module, mesh: Mesh, *, example_inputs: tuple = (),
                example_kwargs: dict | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                batch_dim: int = 0, seq_dim: int | None = 1, plan: dict | None = None,
                plan_mode: str = "override", sequence_parallel: bool = False,
                gradient_accumulation_fusion: bool = True, dtype: torch.dtype | None = None,
                microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
                split_points: list[str] | None = None, scatter_gather: bool = False,
                bucket_size: int | None = None, grad_reduce_dtype: torch.dtype | None = None,
                overlap_grad_reduce: bool = True, clip_grad: float | None = None, zero: int = 0,
                trace_layers_once: bool = True, device: str | torch.device | None = None,
                strict: bool = False, cp_comm_type: str = "p2p", moe_aux_loss: str = "local",
                moe_capacity_factor: float | None = None, moe_pad_to_capacity: bool = False,
                recompute: str | None = None, recompute_method: str | None = None,
                recompute_layers: int | None = None) -> "ParallelModel":
    """Compile `model` for every rank of `mesh`.

    model(*example_inputs, **example_kwargs) must return the loss (a scalar tensor, or an
    output with `.loss`), or `loss_fn(output)` must take it from the output. The example
    batch must hold at least 2 samples of at least 2 tokens. The same call on every rank gives
    the same programs (tracing is deterministic).

    With mesh.tp > 1 the linears are split Megatron's way, found on the graph; `plan` maps
    module path patterns to "colwise" / "rowwise" / "vocab" / "replicate" (or
    fxtron.Colwise(gather_output=True), fxtron.Rowwise(input_is_parallel=False)) and
    refines the automatic plan (plan_mode="override") or replaces it ("replace").
    `sequence_parallel=True` (tp > 1) runs norms, dropout and residual adds on 1/tp of the
    tokens, with reduce-scatter / all-gather in place of each all-reduce (the sequence length
    must then be divisible by tp). `gradient_accumulation_fusion` (default on) accumulates each
    linear's weight gradient straight into an fp32 main_grad and defers it behind the
    tensor-parallel all-reduce of the input gradient. `dtype=torch.bfloat16` (or float16, with
    dynamic loss scaling) computes in 16 bits while the optimizer updates the fp32 parameters
    from fp32 gradients (Megatron's Float16Module and mixed-precision optimizer).

    Pipeline parallel (mesh.pp > 1): the graph is cut between transformer layers into pp
    stages (pp x virtual_stages for the interleaved schedule), balanced by FLOPs and
    parameters or cut before the layers named in `split_points` (["blocks.6"]); `pm.stages()`
    shows the cut. Each step runs `microbatches` microbatches per data-parallel rank with
    `schedule` "gpipe", "1f1b" (default), "interleaved" (virtual_stages >= 2, microbatches a
    multiple of pp) or "zb-h1" (weight gradients deferred into the bubbles; needs
    gradient_accumulation_fusion). `scatter_gather=True` (tp > 1) sends each stage boundary
    as 1/tp slices and all-gathers it on arrival. microbatches > 1 without pipeline parallel
    is gradient accumulation.

    `trace_layers_once` (default): a model whose layers are one program over different weights
    is exported with two of them and the graph repeats the rest (the same graph, ~10x faster to
    trace a deep model); `pm.summary()` says which way it was traced. False exports it whole.

    `device` ("cuda" or "cpu"; default: cuda where torch sees a GPU) is the device type the
    programs will run on: the graphs record the kernels chosen for it (a bf16 linear's weight
    gradient runs the Triton kernel on CUDA). Inspect a GPU job's graphs on a laptop with
    device="cuda"; a program built on another device records its own kernels.

    Context parallel (mesh.cp > 1): every input that carries the sequence is split over the cp
    ranks, load-balanced as Megatron does (the sequence seen as 2 x cp chunks, cp rank r holding
    chunks r and 2cp-1-r, so causal attention costs every rank the same; the sequence length
    must be a multiple of 2 x cp), and attention exchanges keys and values: `cp_comm_type`
    "p2p" (default, Megatron's: key/value blocks travel around the cp ranks while a block is
    computed) or "all_gather" (Llama 3's: keys and values gathered, their gradients
    reduce-scattered). Weights are whole on every cp rank; their gradients are summed over cp.

    Expert parallel (mesh.ep > 1): each mixture-of-experts layer (grouped GEMMs over 3-D expert
    weights, found on the graph) holds E/ep experts per rank; the copies of the rank's tokens
    go to the ranks of their experts and come back by all-to-all, dropless (Megatron's
    dispatcher); the experts' gradients are reduced over expert-dp. The load-balancing loss's
    per-expert token counts are each data-parallel rank's own (`moe_aux_loss="local"`,
    Megatron's default) or summed over the data-parallel ranks first ("global", Megatron's
    global aux loss: the loss then equals the single-process loss of the whole batch).
    Routing is dropless (the single-process model's); `moe_capacity_factor=c` opts into
    Switch/GShard capacity instead: each expert takes at most ceil(c x k T / E) of each rank's k T
    copies (the first in token order), the rest dropped -- a change of the model, since which
    tokens drop depends on how the batch is split; `prog.last_dispatch.dropped` counts them.
    With it, `moe_pad_to_capacity=True` pads every expert's rows with zeros to that capacity
    (Megatron's moe_pad_expert_input_to_capacity): every all-to-all then has the same splits
    and every expert GEMM the same shape whatever the routing (no number changes; more bytes).

    Activation recomputation (Megatron's --recompute-granularity / --recompute-method /
    --recompute-num-layers): `recompute="selective"` keeps no activation of any attention core
    (scores, softmax, attention dropout: the 5as/h term) and recomputes them in backward from q,
    k and v; `recompute="full"` keeps only the inputs of whole layers -- `recompute_method`
    "uniform" (default) in groups of `recompute_layers` (default 1) consecutive layers, "block"
    only the first `recompute_layers` layers of every pipeline stage. Dropout draws the same
    masks again (the random streams are set back), a recomputed layer's collectives run again,
    and the gradients are the run's without recomputation bit for bit.

    Never silent: where fxtron does less than the mesh asks, correctly -- a linear left
    replicated at tp > 1, an op with no sharding rule run replicated on gathered inputs -- it
    warns (fxtron.ParallelizeWarning) and `pm.summary()` lists each with why; `strict=True`
    raises ParallelizeError instead.
    """
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ParallelizeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, not {dtype}")
    if not isinstance(mesh, Mesh):
        raise ParallelizeError(f"mesh must be a fxtron.Mesh, got {type(mesh).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ParallelizeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        device = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError):
        raise ParallelizeError(f"device must be 'cpu' or 'cuda', not {device!r}") from None
    if device not in ("cpu", "cuda"):
        raise ParallelizeError(f"device must be 'cpu' or 'cuda', not {device!r}")
    options = Options(loss_fn=loss_fn, batch_dim=batch_dim, seq_dim=seq_dim, plan=plan, plan_mode=plan_mode,
                      sequence_parallel=sequence_parallel,
                      gradient_accumulation_fusion=gradient_accumulation_fusion, dtype=dtype,
                      microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                      split_points=tuple(split_points) if split_points else None, scatter_gather=scatter_gather,
                      trace_layers_once=trace_layers_once, device=device, strict=strict,
                      cp_comm_type=cp_comm_type, moe_aux_loss=moe_aux_loss,
                      moe_capacity_factor=moe_capacity_factor, moe_pad_to_capacity=moe_pad_to_capacity)
    recompute, recompute_method, recompute_layers = check_recompute(recompute, recompute_method, recompute_layers)
    options = dataclasses.replace(options, recompute=recompute, recompute_method=recompute_method,
                                  recompute_layers=recompute_layers)
    schedules.check(schedule, mesh.pp, microbatches, virtual_stages)
    options = dataclasses.replace(options, data_parallel=DataParallelOptions(
        bucket_size=bucket_size, grad_reduce_dtype=grad_reduce_dtype, overlap_grad_reduce=overlap_grad_reduce,
        clip_grad=clip_grad, zero=zero))
    if schedule == "zb-h1" and not gradient_accumulation_fusion:
        raise ParallelizeError("schedule='zb-h1' defers the linears' weight-gradient GEMMs into the pipeline "
                               "bubbles, which needs gradient_accumulation_fusion=True")
    if split_points and mesh.pp == 1:
        raise ParallelizeError("split_points cut pipeline stages; the mesh has pp=1")
    if scatter_gather and mesh.tp == 1:
        raise ParallelizeError("scatter_gather=True splits stage boundaries over tensor-parallel ranks; the mesh has tp=1")
    if sequence_parallel and mesh.tp == 1:
        raise ParallelizeError("sequence_parallel=True needs tensor parallel (mesh.tp > 1): it shards the "
                               "sequence over the tp ranks; set tp or drop sequence_parallel")
    if sequence_parallel and seq_dim is None:
        raise ParallelizeError("sequence_parallel=True needs the inputs' sequence dim (seq_dim)")
    if moe_capacity_factor is not None and (isinstance(moe_capacity_factor, bool) or
                                            not isinstance(moe_capacity_factor, (int, float)) or
                                            not moe_capacity_factor > 0):
        raise ParallelizeError(f"moe_capacity_factor must be a positive number (Switch uses 1.0-1.25) or None for "
                               f"dropless routing, not {moe_capacity_factor!r}")
    if moe_capacity_factor is not None and mesh.ep == 1:
        raise ParallelizeError(f"moe_capacity_factor={moe_capacity_factor} caps what each expert-parallel dispatch "
                               f"sends an expert, but the mesh has ep=1 (the model runs dropless, as written); use a "
                               f"mesh with ep > 1 or moe_capacity_factor=None")
    if not isinstance(moe_pad_to_capacity, bool):
        raise ParallelizeError(f"moe_pad_to_capacity must be True or False, not {moe_pad_to_capacity!r}")
    if moe_pad_to_capacity and moe_capacity_factor is None:
        raise ParallelizeError("moe_pad_to_capacity=True pads every expert's rows to its capacity, but there is no "
                               "capacity: routing is dropless; give moe_capacity_factor (1.0-1.25, Switch's) too, or "
                               "drop moe_pad_to_capacity")
    if moe_aux_loss not in ("local", "global"):
        raise ParallelizeError(f"moe_aux_loss must be 'local' or 'global', not {moe_aux_loss!r}")
    if cp_comm_type not in COMM_TYPES:
        raise ParallelizeError(f"cp_comm_type must be one of {', '.join(map(repr, COMM_TYPES))}, not {cp_comm_type!r}")
    if mesh.cp > 1 and seq_dim is None:
        raise ParallelizeError("context parallel (mesh.cp > 1) splits the inputs' sequence dim; give seq_dim")
    wide = next((n for n, p in model.named_parameters() if p.dtype == torch.float64), None)
    if wide is not None and mesh.tp > 1:
        raise ParallelizeError(
            f"parameter {wide} is float64: tensor parallel's ops (the vocab-parallel cross entropy, the fused "
            "weight-gradient kernels, the shared-memory transport) compute in 32 bits or less, so a float64 model "
            "would not keep float64 precision at tp > 1; use model.float() (or bfloat16 with dtype=), or tp=1 "
            "(data, pipeline and context parallel keep float64)")
    if mesh.ep > 1 and mesh.cp > 1:
        raise ParallelizeError(
            f"expert parallel composes with tensor, data and pipeline parallel in this build; the mesh asks for "
            f"ep={mesh.ep} with tp={mesh.tp}, cp={mesh.cp} (the experts' tokens split over cp are not built yet). "
            f"Use cp=1 -- Mesh(world_size={mesh.world_size}, ep={mesh.ep}, tp={mesh.tp}, pp={mesh.pp}) -- or ep=1")
    # a 16-bit program is traced in 16 bits (casts such as a norm's .float() ... .type_as(x) only
    # mean something then), on a meta replica so the model's weights are never copied
    if isinstance(example_inputs, (tuple, list, torch.Tensor)) and isinstance(batch_dim, int) and batch_dim >= 0:
        check_example_sizes(example_inputs, example_kwargs, batch_dim, seq_dim)
    subject = _meta_replica(model, dtype) if dtype in (torch.bfloat16, torch.float16) else model
    traced = trace(subject, example_inputs, example_kwargs=example_kwargs, loss_fn=options.loss_fn,
                   batch_dim=options.batch_dim, seq_dim=options.seq_dim, layers_once=options.trace_layers_once)
    if mesh.cp > 1 and not any("seq" in dims for dims in meta.info(traced).user_dims):
        raise ParallelizeError(
            f"context parallel splits the sequence, but no input of the model has a sequence dim (seq_dim={seq_dim}; "
            f"the inputs' shapes are {', '.join(str(tuple(x.shape)) for x in _tensors(example_inputs, example_kwargs))})"
            "; give the dim that holds the sequence")
    ti = meta.info(traced)
    fixed = [i for i, (dims, sig) in enumerate(zip(ti.user_dims, ti.signature))
             if sig is not None and "seq" in dims and not sympy.sympify(sig[1][dims.index("seq")]).free_symbols]
    if (sequence_parallel or mesh.cp > 1) and fixed:
        lengths = sorted({int(ti.signature[i][1][ti.user_dims[i].index("seq")]) for i in fixed})
        raise ParallelizeError(
            f"{'sequence parallel' if sequence_parallel else 'context parallel'} splits the sequence, but the trace "
            f"fixed its length to the example's ({', '.join(map(str, lengths))}): torch.export specializes a length "
            f"the model equates with a constant -- typically a position table or causal-mask buffer as long as the "
            f"example (slicing [:T] of a {lengths[0] if lengths else '?'}-long buffer). Trace with a shorter example "
            f"sequence (the programs still take any length up to the model's limit)")
    if mesh.ep > 1:
        check_experts(traced, mesh.ep)     # experts that do not divide over ep: an error now
    if moe_aux_loss == "global":
        aux_statistics(traced)             # a model with no load-balancing statistic to sum: an error now
    pm = ParallelModel(model, mesh, traced, options)
    pm._check_plan()
    pm.stage_assignment            # a bad stage cut is an error now, not at the first program
    return pm


def _tensors(args, kwargs) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree
    return [x for x in pytree.tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)]


def _by_pattern(items: dict[str, str]) -> dict[str, str]:
    """{path: text} with the layers' indices folded (model.layers.0.x, model.layers.1.x ->
    model.layers.*.x) where they say the same."""
    out: dict[str, str] = {}
    for path, text in items.items():
        pattern = re.sub(r"\.\d+\.", ".*.", path)
        out.setdefault(pattern if out.get(pattern, text) == text else path, text)
    return out


def _fallback_lines(graphs) -> list[str]:
    """One line per node that ran replicated for want of a sharding rule (meta.FALLBACK)."""
    return [f"%{n.name} ({n.target}) in {meta.get(n, meta.MODULE) or '(top level)'}: inputs made whole over "
            f"{meta.get(n, meta.FALLBACK)}, run replicated"
            for g in graphs for n in g.graph.nodes if meta.get(n, meta.FALLBACK) is not None]


def _unringed_attention(graphs) -> list[str]:
    """The modules whose attention gathers keys over cp (attention written out in a form the
    ring's pattern does not take -- einsums, say -- which the generic rules split by query
    rows), as patterns."""
    mods = {re.sub(r"\.\d+(\.|$)", r".*\1", meta.get(n, meta.MODULE) or "(top level)")
            for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target == torch.ops.fxtron.gather_from_sequence.default and n.args[3] == "cp"}
    return sorted(mods)


def _gather_lines(graphs) -> list[str]:
    """One line per all-gather inserted because an op's rule needs a split value whole
    (meta.GATHERED): forward communication Megatron's layers would not issue."""
    return [f"%{n.name} in {meta.get(n, meta.MODULE) or '(top level)'}: {meta.get(n, meta.GATHERED)}"
            for g in graphs for n in g.graph.nodes if meta.get(n, meta.GATHERED) is not None]


def _grouped(items: dict[str, str]) -> str:
    """"path, path: why; path: why" -- the paths folded by `_by_pattern`, grouped by why."""
    by_why: dict[str, list[str]] = {}
    for path, why in _by_pattern(items).items():
        by_why.setdefault(why, []).append(path)
    return "; ".join(f"{', '.join(paths)}: {why}" for why, paths in by_why.items())


def _meta_replica(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model's structure on the meta device with floating parameters and buffers in
    `dtype`: deepcopy with every tensor pre-mapped in the memo, so no data is copied (tied
    weights stay tied: one id, one replica)."""
    import copy
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype),
                                             requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta", dtype=dtype if b.is_floating_point() else b.dtype)
    return copy.deepcopy(model, memo)


class ParallelModel:
    """The compiled model: per-rank graphs and programs for every rank of the mesh."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, traced: fx.GraphModule, options: Options):
        self.model = model
        self.mesh = mesh
        self.traced = traced
        self.options = options
        self._warned_fallbacks = False     # warn of ops run replicated once per model, not per rank
        self._warned_gathers = False       # ... and of all-gathers Megatron would not issue
        self._warned_unringed = False      # ... and of attention the cp ring cannot take
        self._warned_recompute = False     # ... and of selective recomputation that finds no attention

    @functools.cached_property
    def tp_plan(self) -> TPPlan | None:
        """The model's tensor-parallel plan (passes/tp_plan.py), made once for every rank: which
        linears split by columns / rows, every parameter's tp placement. None at tp=1."""
        if self.mesh.tp == 1:
            return None
        return make_tp_plan(self.traced, tp=self.mesh.tp, user_plan=self.options.plan, mode=self.options.plan_mode)

    @functools.cached_property
    def stage_assignment(self) -> StageAssignment | None:
        """Which layers each pipeline stage runs (None at pp=1), made once for every rank."""
        if self.mesh.pp == 1:
            return None
        return assign_stages(self.traced, pp=self.mesh.pp, virtual=self.options.virtual_stages,
                             split_points=list(self.options.split_points) if self.options.split_points else None)

    def _ep_tp_note(self) -> str:
        """What ep x tp costs beyond Megatron: the layers whose tp ranks dispatch the copies whole
        (empty without both, or when every layer dispatches shares, Megatron's order)."""
        if self.mesh.ep == 1 or self.mesh.tp == 1:
            return ""
        whole = {layer.name: why for layer in moe_layers(self.traced)
                 if (why := unshared(layer, self.tp_plan)) is not None}
        if not whole:
            return ""
        return (f"at ep={self.mesh.ep} x tp={self.mesh.tp} the tp ranks of {', '.join(whole)} dispatch the copies whole "
                f"({'; '.join(sorted(set(whole.values())))}), so each of their all-to-alls carries {self.mesh.tp}x the "
                f"bytes of Megatron's, whose tp ranks each dispatch a part and gather the received rows over tp")

    def _check_plan(self) -> None:
        """Warn (strict: raise) when the tp plan leaves linears replicated that Megatron would split,
        and when expert parallel under tp moves more than Megatron's dispatcher."""
        if self._ep_tp_note():
            if self.options.strict:
                raise ParallelizeError(self._ep_tp_note() + "; use tp=1 with ep, or strict=False")
            warnings.warn(self._ep_tp_note(), ParallelizeWarning, stacklevel=3)
        plan = self.tp_plan
        loud = plan.unsplit() if plan is not None else {}
        if not loud:
            return
        msg = (f"at tp={self.mesh.tp}, {len(loud)} linear(s) stay replicated (every tp rank holds and computes "
               f"them whole): {_grouped(loud)}")
        if self.options.strict:
            raise ParallelizeError(msg + ". Give each a style in plan= ('colwise', 'rowwise'), or "
                                   "'replicate' to keep it whole on purpose")
        warnings.warn(msg, ParallelizeWarning, stacklevel=3)

    def fallbacks(self, rank: int = 0) -> list[str]:
        """The ops of rank's graphs that had no sharding rule for their inputs' placements and
        run replicated on inputs made whole (a correct fallback that communicates more than
        Megatron would): one line each, naming the node, its op, module and axis."""
        return _fallback_lines(self.compiled(rank).graphs)

    def gathers(self, rank: int = 0) -> list[str]:
        """The all-gathers in rank's graphs that make a split value whole because an op's
        sharding rule needs it whole (BLOOM's batch and heads folded into one dim, say): not
        the gathers a plan asks for (gather_output) or sequence parallel's into a region. One
        line each: the node, its module, and which value went whole for which op."""
        return _gather_lines(self.compiled(rank).graphs)

    def stages(self) -> StageAssignment:
        """Which layers each pipeline stage runs, with its parameters and FLOPs (`str()` prints
        a table); ParallelizeError without pipeline parallel."""
        if self.stage_assignment is None:
            raise ParallelizeError("the mesh has pp=1: the whole model is one stage")
        return self.stage_assignment

    def pipeline_options(self) -> PipelineOptions:
        o = self.options
        return PipelineOptions(o.schedule, o.microbatches, o.virtual_stages, o.scatter_gather)

    def schedule_chart(self, path: str, timelines: list | None = None, *, memory: list | None = None,
                       t_f=1, t_b=1, t_w=1) -> str:
        """Draw the schedule of every pipeline rank as a timeline picture at `path` (.png or
        .svg): the measured `timelines` (each rank's `prog.timeline()` from a step; ranks in
        mesh order, one per pipeline rank) or, by default, the simulation of the compiled
        schedule with pass times t_f, t_b (input gradient), t_w (weight gradient: its own pass
        under zb-h1, part of B otherwise); unit costs by default. With measured timelines,
        `memory` (each rank's `prog.memory_timeline()` of the same step) is drawn below on the
        same time axis. Returns the path."""
        from fxtron import chart
        o = self.options
        if timelines is None:
            sim = schedules.simulate(o.schedule, self.mesh.pp, o.microbatches, o.virtual_stages,
                                     t_f=t_f, t_b=t_b, t_w=t_w)
            return chart.draw_simulation(sim, path, title=self._schedule_title())
        return chart.draw_timelines(timelines, path, title=self._schedule_title(), memory=memory)

    def _schedule_title(self) -> str:
        o = self.options
        v = f", v={o.virtual_stages}" if o.virtual_stages > 1 else ""
        return f"{o.schedule}: pp={self.mesh.pp}, m={o.microbatches}{v}"

    @functools.lru_cache(maxsize=64)
    def compiled(self, rank: int, dump: str | None = None) -> passmanager.RankGraph:
        """The per-rank compilation result (graph module and parameter shard specs). With
        `dump` (or the environment variable FXTRON_DUMP) a directory, the graph after every
        pass is written there as readable Python (rank<r>/<nn>_<pass>.py)."""
        self._check_rank(rank)
        dump = dump or os.environ.get("FXTRON_DUMP")
        if dump:
            from fxtron.inspection import PassDump
            observer = PassDump(dump, rank)
        else:
            observer = None
        o = self.options
        rg = passmanager.compile_rank(
            self.traced, self.mesh, rank, plan=self.tp_plan, stage_assignment=self.stage_assignment,
            options=passmanager.CompileOptions(sequence_parallel=o.sequence_parallel, cp_comm_type=o.cp_comm_type,
                                            gradient_accumulation_fusion=o.gradient_accumulation_fusion,
                                            device=o.device, strict=o.strict, moe_aux_loss=o.moe_aux_loss,
                                            moe_capacity_factor=o.moe_capacity_factor or 0.0,
                                            moe_pad_to_capacity=o.moe_pad_to_capacity, recompute=o.recompute,
                                            recompute_method=o.recompute_method,
                                            recompute_layers=o.recompute_layers),
            observer=observer)
        fell = _fallback_lines(rg.graphs)
        if fell and not self._warned_fallbacks:
            self._warned_fallbacks = True
            warnings.warn(f"{len(fell)} op(s) have no sharding rule for their inputs' placements and run replicated on "
                          f"gathered inputs (correct, more communication than Megatron): {'; '.join(fell)}. "
                          "Register a rule with fxtron.register_rule, or pass strict=True to make this an error",
                          ParallelizeWarning, stacklevel=2)
        gathered = _gather_lines(rg.graphs)
        if gathered and not self._warned_gathers:
            self._warned_gathers = True
            msg = (f"{len(gathered)} all-gather(s) on rank {rank} make a split value whole for an op whose sharding "
                   f"rule needs it whole (correct, communication Megatron's layers would not issue): "
                   f"{'; '.join(gathered)}")
            if o.strict:
                raise ParallelizeError(msg + ". Replicate the layers named after 'split by' (parallelize(..., "
                                       "plan={'<layer>': 'replicate'})), or register a rule that keeps the value "
                                       "split (fxtron.register_rule)")
            warnings.warn(msg, ParallelizeWarning, stacklevel=2)
        if o.recompute == "selective" and not self._warned_recompute and not all(region_labels(g) for g in rg.graphs):
            self._warned_recompute = True
            msg = (f"recompute='selective' found no attention core to recompute on rank {rank} (a matmul -> softmax "
                   f"-> [dropout] -> matmul whose scores and probabilities have no other use, or an attention op); "
                   f"its activations are kept")
            if o.strict:
                raise ParallelizeError(msg + ": use recompute='full' (a model with a layer list) or None, or write "
                                       "the attention as those ops")
            warnings.warn(msg, ParallelizeWarning, stacklevel=2)
        unringed = _unringed_attention(rg.graphs) if o.cp_comm_type == "p2p" else []
        if unringed and not self._warned_unringed:
            self._warned_unringed = True
            msg = (f"attention written out by hand ({', '.join(unringed)}) exchanges keys and values over cp by "
                   "all-gather (cp_comm_type='all_gather'); the ring of cp_comm_type='p2p' takes "
                   "scaled_dot_product_attention")
            if o.strict:
                raise ParallelizeError(msg + ": call F.scaled_dot_product_attention in the model, or pass "
                                       "cp_comm_type='all_gather'")
            warnings.warn(msg, ParallelizeWarning, stacklevel=2)
        return rg

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.mesh.world_size:
            raise ParallelizeError(f"rank {rank} is outside the mesh (world_size {self.mesh.world_size})")

    # ------------------------------------------------------------ inspection
    def graph(self, rank: int = 0) -> str:
        """The per-rank graph as a table: every node with its local symbolic shape."""
        rg = self.compiled(rank)
        if rg.stages is None:
            return format_graph(rg.gm, title=f"# {self.mesh.describe(rank)}")
        return "\n\n".join(
            format_graph(s.gm, title=f"# {self.mesh.describe(rank)}, stage {s.index} (chunk {i}): "
                         f"receives {', '.join(s.inputs) or '-'}; sends {', '.join(s.outputs) or '-'}")
            for i, s in enumerate(rg.stages))

    def collectives(self, rank: int = 0) -> list[report.CollectiveRecord]:
        """Every collective rank issues per step inside its graphs (forward and backward, over
        whichever mesh axis each communicates), with its group, local shape and bytes as
        formulas in B and S; `report.format_collectives(...)` prints them as a table."""
        return [r for g in self.compiled(rank).graphs for r in report.collectives(g, self.mesh, rank)]

    def summary(self, *, batch: int | None = None, seq: int | None = None) -> str:
        """Per rank: coordinates, local parameters and bytes, tensor-parallel collectives and
        the bytes they move per step (formula in B and S, evaluated when batch and seq are
        given), and the data-parallel gradient sync. Ranks that differ only in their dp
        coordinate compile to the same program and are shown once.

        With microbatches (pipeline parallel or gradient accumulation) B is one microbatch of
        one rank and the tp figures are per microbatch; the table then also gives each rank's
        pipeline stages and the bytes it sends to its neighbours per microbatch (activations
        forward, their gradients backward)."""
        rows, seen, fell, gathered = [], set(), set(), set()
        dp = self.mesh.dp
        for rank in range(self.mesh.world_size):
            c = self.mesh.coords(rank)
            if (c["tp"], c["pp"], c["cp"]) in seen:
                continue
            seen.add((c["tp"], c["pp"], c["cp"]))
            rg = self.compiled(rank)
            fell.update(self.fallbacks(rank))
            gathered.update(self.gathers(rank))
            recs = self.collectives(rank)
            tp_wire = sum((r.wire_bytes for r in recs), sympy.Integer(0))
            if batch is not None and seq is not None:
                tp_wire = _fmt_bytes(int(sum(r.evaluate(batch, seq)[1] for r in recs)))
            expert_bytes = sum(math.prod(p.local_shape) * p.dtype.itemsize for p in rg.local.values()
                               if p.grad_group == "expert-dp")
            d, e = dp * self.mesh.cp, self.mesh.edp   # the dp-cp group reduces the gradients, expert-dp the experts'
            # ring all-reduces of the gradients
            dp_wire = 2 * (d - 1) / d * (rg.param_bytes - expert_bytes) + 2 * (e - 1) / e * expert_bytes
            row = [rank, self.mesh.describe(rank).split(": ", 1)[1], f"{rg.param_count:,}",
                   _fmt_bytes(rg.param_bytes),
                   f"{report.count(recs, 'all_reduce')} AR, {report.count(recs, 'all_gather')} AG, "
                   f"{report.count(recs, 'reduce_scatter')} RS"
                   + (f", {report.count(recs, 'send_recv')} ring" if report.count(recs, 'send_recv') else "")
                   + (f", {report.count(recs, 'all_to_all')} A2A" if report.count(recs, 'all_to_all') else ""),
                   str(tp_wire),
                   _fmt_bytes(dp_wire) if d > 1 or e > 1 else "-"]
            if rg.stages is not None:
                sent = report.p2p_bytes(rg.stages)
                if batch is not None and seq is not None:
                    sent = _fmt_bytes(int(sent.subs({BATCH: batch, SEQ: seq})))
                row += [",".join(str(st.index) for st in rg.stages), str(sent)]
            rows.append(row)
        head = (f"{type(self.model).__name__} on {self.mesh}\n"
                f"parameters {sum(p.numel() for p in self.model.parameters()):,} "
                f"({len(info(self.traced).params)} tensors), graph nodes {len(self.traced.graph.nodes)}\n"
                f"trace: {info(self.traced).layers}")
        plan = self.tp_plan
        if plan is not None:
            # one entry per layer pattern: blocks.0.attn.qkv, blocks.1.attn.qkv -> blocks.*.attn.qkv
            seen: dict[str, str] = {}
            for path, style, _ in plan.table():
                if style != "replicate":
                    seen.setdefault(re.sub(r"\.\d+\.", ".*.", path), style)
            head += "\nplan: " + ", ".join(f"{p}={s}" for p, s in seen.items())
            if plan.notes:
                head += "\nnotes: " + "; ".join(plan.notes)
            if plan.replicated:
                head += "\nreplicated linears: " + _grouped({p: u.why for p, u in plan.replicated.items()})
        if fell:
            head += "\nops run replicated for want of a sharding rule: " + "; ".join(sorted(fell))
        if gathered:
            head += "\nall-gathers Megatron's layers would not issue: " + "; ".join(sorted(gathered))
        if self.mesh.cp > 1:
            head += (f"\ncontext parallel: sequence split over cp={self.mesh.cp} (load-balanced chunks), attention by "
                     f"{self.options.cp_comm_type}; gradients reduced over dp-cp")
            unringed = _unringed_attention(self.compiled(0).graphs) if self.options.cp_comm_type == "p2p" else []
            if unringed:
                head += f"; attention written out by hand gathers its keys instead: {', '.join(unringed)}"
        if self.mesh.ep > 1:
            layers = moe_layers(self.traced)
            counts = sorted({layer.n_experts for layer in layers})
            head += (f"\nexpert parallel: {len(layers)} mixture-of-experts layer(s) of {'/'.join(map(str, counts))} experts "
                     f"over ep={self.mesh.ep} ({'/'.join(str(c // self.mesh.ep) for c in counts)} per rank), tokens "
                     f"dispatched and combined by all-to-all ("
                     + ("dropless" if not self.options.moe_capacity_factor else
                        f"capacity factor {self.options.moe_capacity_factor}: each rank's copies over an expert's "
                        f"capacity dropped, a change of the model"
                        + ("; each expert's rows padded to its capacity, fixed all-to-all splits"
                           if self.options.moe_pad_to_capacity else "")) + "); expert gradients reduced over expert-dp "
                     f"({self.mesh.edp} rank(s)), the rest over {'dp-cp' if self.mesh.cp > 1 else 'dp'} ({dp * self.mesh.cp})")
            if self._ep_tp_note():
                head += f"; {self._ep_tp_note()}"
            elif self.mesh.tp > 1:
                head += (f"; at tp={self.mesh.tp} each tp rank dispatches 1/{self.mesh.tp} of every expert's copies and the "
                         f"rows received are gathered over tp (Megatron's order)")
        if self.options.recompute is not None:
            head += "\n" + self._recompute_note()
        per = "microbatch" if self.options.microbatches > 1 else "step"
        axes = "+".join(a for a in ("tp", "cp", "ep") if getattr(self.mesh, a) > 1) or "tp"
        headers = ["rank", "coords", "params", "param bytes", f"{axes} collectives / {per}", f"{axes} wire bytes / {per}",
                   ("dp-cp" if self.mesh.cp > 1 else "dp") + (" + expert-dp" if self.mesh.ep > 1 else "")
                   + " grad sync sent / step"]
        if self.stage_assignment is not None:
            headers += ["stages", "p2p sent / microbatch"]
            head += f"\nschedule {self._schedule_title()}; bubble over ideal time (formula): " + str(
                schedules.bubble_fraction_formula(self.options.schedule, self.mesh.pp, self.options.microbatches,
                                                  self.options.virtual_stages)) + " (unit F, B, W)"
        return head + "\n" + tabulate(rows, headers=headers)

    def _recompute_note(self) -> str:
        o = self.options
        if o.recompute == "selective":
            how = "selective: every attention core's scores, softmax and dropout recomputed in backward from q, k, v"
        else:
            how = (f"full, {o.recompute_method} {o.recompute_layers}: " +
                   (f"layers in groups of {o.recompute_layers}, each group keeping only its input"
                    if o.recompute_method == "uniform" else
                    f"the first {o.recompute_layers} layer(s) of every stage keep only their inputs"))
        regions: dict[int, list[str]] = {}     # per pp rank (the stages differ; tp, cp, ep, dp ranks do not)
        for pp in range(self.mesh.pp):
            rank = next(r for r in range(self.mesh.world_size) if self.mesh.coords(r)["pp"] == pp)
            regions[pp] = [label for g in self.compiled(rank).graphs for label in region_labels(g)]
        where = "; ".join((f"pp rank {pp}: " if self.stage_assignment is not None else "")
                          + (", ".join(labels) if len(labels) <= 4 else
                             f"{', '.join(labels[:2])}, ... {labels[-1]} ({len(labels)} regions)")
                          for pp, labels in sorted(regions.items())) or "none found"
        return f"recompute {how}. Regions: {where}"

    # ------------------------------------------------------------ running
    def program(self, rank: int, groups: G.ProcessGroups | None = None, *, seed: int = 0) -> Program:
        """An nn.Module holding rank's parameters, ready for an optimizer and `train_step`.

        `seed` seeds the program's random streams (dropout): the replicated stream alike on
        every rank, the sharded one per tp rank (Megatron's seed + 2718 + tp_rank).

        `groups` defaults to the ones fxtron.launch / init_distributed made in this process for
        this mesh; on a 1-rank mesh none are needed.
        """
        self._check_rank(rank)
        groups = groups or G.groups_for(self.mesh)
        if groups is None and self.mesh.world_size > 1:
            raise ParallelizeError(
                f"program({rank}) needs this mesh's process groups: call it inside fxtron.launch, or "
                "after fxtron.init_distributed(mesh) under torchrun, or pass groups=")
        if groups is not None and groups.rank != rank:
            raise ParallelizeError(f"program({rank}) built in the process of rank {groups.rank}")
        return build_program(self.model, self.compiled(rank).spec(), groups, seed=seed, dtype=self.options.dtype,
                             pipeline=self.pipeline_options(), data_parallel=self.options.data_parallel)


_fmt_bytes = report.fmt_bytes
