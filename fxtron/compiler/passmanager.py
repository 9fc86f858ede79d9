"""Compiler: the per-rank pass pipeline, top to bottom in one list.

`compile_rank(traced, mesh, rank, ...)` copies the traced graph and runs `PASSES` for that rank:
each entry has its name, a one-line reason, when it applies, and the passes it must follow
(checked when the list is built). The model-wide decisions -- the tp plan and the stage
assignment -- are made once per model (api.ParallelModel) and passed in; the passes apply
them. The result, `RankGraph`, says which slice of each full parameter the rank holds; its
`spec()` is what the runtime builds the rank's Program from.

With config.debug.verify (on by default; FXTRON_VERIFY=0 or --no-verify turns it off) the
verifier (passes/verify.py) checks the graph after every pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from fxtron.passes.fsdp import STANDS_FOR_PARAMS, is_free, param_of, shard_data_parallel, wait_for_params
from fxtron.codegen.fuse import fuse_linears, fused_weights
from fxtron.codegen.regions import host_bound
from fxtron.config import Config
from fxtron.config.fields import torch_dtype
from fxtron.core import layout, meta
from fxtron.core.axes import MeshView
from fxtron.core.params import AxisShard, LocalParam
from fxtron.core.placement import Shard
from fxtron.core.rank import RankSpec
from fxtron.core.stage import Stage
from fxtron.errors import CompileError, ParallelizeError
from fxtron.mesh import Mesh, hsdp_kinds
from fxtron.passes import verify as verifier
from fxtron.passes.cp import cp_layout, fuse_written_out_attention
from fxtron.passes.devices import check_kernels, on_device
from fxtron.passes.ep import dispatch_experts, ep_layout
from fxtron.passes.limits import SeqLimit, seq_limit
from fxtron.passes.localize import drop_dead_values, drop_metadata_asserts, localize
from fxtron.passes.tp_plan import TPPlan
from fxtron.passes.propagate import propagate
from fxtron.passes.recompute import mark_recompute
from fxtron.passes.redistribute import insert_redistributions
from fxtron.passes.rules.order import rewrite_inverse_permutations
from fxtron.passes.rng import assign_rng_regions
from fxtron.passes.shapes import annotate_local_shapes
from fxtron.passes.statistics import global_statistics
from fxtron.passes.pp import StageAssignment, param_stages, split_stages
from fxtron.passes.tp import split_fused_parts, split_row_bias, tp_layout


@dataclass
class RankGraph:
    """One rank's compiled graph (or pipeline stages) and how its parameters relate to the
    full ones, with the model-wide plans it was compiled with."""

    gm: fx.GraphModule
    mesh: Mesh
    rank: int
    local: dict[str, LocalParam] = field(default_factory=dict)
    plan: TPPlan | None = None
    stage_assignment: StageAssignment | None = None
    stages: list[Stage] | None = None        # this rank's pipeline stages, chunk 0 first
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> pp ranks holding it
    seq_split: int = 1                  # sequence parallel: each rank's tokens cut into tp parts
    max_seq: SeqLimit | None = None     # the longest sequence the model takes (passes/limits.py)

    @property
    def graphs(self) -> list[fx.GraphModule]:
        """The graphs this rank runs: its stages', or the whole per-rank graph."""
        return [s.gm for s in self.stages] if self.stages is not None else [self.gm]

    @property
    def param_count(self) -> int:
        return sum(layout.numel(p.local_shape) for p in self.local.values())

    @property
    def param_bytes(self) -> int:
        return sum(layout.numel(p.local_shape) * p.dtype.itemsize for p in self.local.values())

    def param_order(self) -> list[str]:
        """This rank's parameters in order of first use in forward (chunk by chunk)."""
        order: dict[str, None] = {}
        for g in self.graphs:
            for node in g.graph.nodes:
                if node.target in STANDS_FOR_PARAMS:
                    continue
                for a in node.all_input_nodes:
                    name = param_of(a)
                    if name is not None:
                        order.setdefault(name)
        return list(order)

    def grad_reports(self) -> tuple[dict[str, int], set[str]]:
        """How many times per step each parameter's gradient reports complete during the last
        microbatch's backward: once per fused linear using it (its weight-gradient job), plus
        once if autograd computes any other part (the post-accumulate-grad hook), per chunk; and
        the parameters autograd computes a part of."""
        out: dict[str, int] = {}
        autograd: set[str] = set()
        linear = torch.ops.fxtron.linear.default
        for g in self.graphs:
            for node in g.graph.nodes:
                name = param_of(node)
                if name is None or (meta.is_param(node) and any(u.target in STANDS_FOR_PARAMS for u in node.users)):
                    continue
                users = [u for u in node.users if not is_free(u)]
                fused = sum(1 for u in users if u.target == linear and u.args[1] is node)
                other = any(not (u.target == linear and u.args[1] is node) for u in users)
                out[name] = out.get(name, 0) + fused + int(other)
                if other:
                    autograd.add(name)
        return out, autograd

    def spec(self) -> RankSpec:
        """What the runtime builds this rank's Program from."""
        reports, autograd = self.grad_reports()
        return RankSpec(rank=self.rank, mesh=self.mesh.view(self.rank), info=meta.info(self.gm),
                        gm=self.gm if self.stages is None else None,
                        stages=tuple(self.stages) if self.stages is not None else None,
                        local=dict(self.local), shared=dict(self.shared), param_order=tuple(self.param_order()),
                        grad_reports=reports, autograd=tuple(sorted(autograd)),
                        fused=tuple(sorted({w for g in self.graphs for w in fused_weights(g)})),
                        seq_split=self.seq_split, max_seq=self.max_seq.tokens if self.max_seq else None,
                        max_seq_why=self.max_seq.why if self.max_seq else "",
                        host_bound=tuple(host_bound(self.graphs)), unread_params=_held_unread(self, "parameter"),
                        unread_buffers=_held_unread(self, "buffer"))


def _held_unread(s, kind: str) -> tuple[str, ...]:
    """Under pipeline parallel, on the first stage's ranks, the parameters or buffers the model's
    forward never reads: they are in no stage's graph, and the first stage holds them (with no
    gradient, as in one process) so that checkpoints and full_state_dict keep them."""
    if s.stages is None or not any(st.index == 0 for st in s.stages):
        return ()
    return meta.unread(s.gm, kind)


# ----------------------------------------------------------------------------- the pass list
@dataclass
class RankState:
    """One rank's compilation while the pass list runs: the graph, then the stages and the
    parameter descriptions the last passes add."""

    gm: fx.GraphModule
    mesh: MeshView
    config: Config
    plan: TPPlan | None
    stage_assignment: StageAssignment | None
    stages: list[Stage] | None = None
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)
    local: dict[str, LocalParam] = field(default_factory=dict)
    redistributed: bool = False
    job: Mesh | None = None             # the whole mesh (group sizes beyond one axis)


def _always(s: RankState) -> bool:
    return True


def _tp(s: RankState) -> bool:
    return s.mesh.parallel("tp")


def _cp(s: RankState) -> bool:
    return s.mesh.parallel("cp")


def _ep(s: RankState) -> bool:
    return s.mesh.parallel("ep")


def _pieces(s: RankState) -> int:
    """The pieces a step cuts the global batch into: data-parallel ranks x microbatches."""
    return s.mesh.size("dp") * s.config.pipeline.microbatches


def _distributed(s: RankState) -> bool:
    return bool(meta.graph_axes(s.gm))


@dataclass(frozen=True)
class Pass:
    """One entry of the pipeline: `run(state)` applies the pass, `when(state)` says whether it
    applies (`when_doc` in words), `after` names the passes it must follow in the list."""

    name: str
    reason: str
    run: Callable[[RankState], None]
    when: Callable[[RankState], bool] = _always
    when_doc: str = "always"
    after: tuple[str, ...] = ()
    model_wide: bool = False    # the same result on every rank: run once per model (`prepare`), copied per rank


def pass_list(*passes: Pass) -> tuple[Pass, ...]:
    """The passes in order, with every order constraint checked: each name in `after` is an
    earlier entry of the list."""
    seen: list[str] = []
    for i, p in enumerate(passes):
        if p.model_wide and not all(q.model_wide for q in passes[:i]):
            raise ValueError(f"model-wide pass {p.name!r} follows a per-rank one: model-wide passes lead the list")
        if p.name in seen:
            raise ValueError(f"pass {p.name!r} appears twice in the pipeline")
        for before in p.after:
            if before not in seen:
                where = "later in the list" if any(q.name == before for q in passes) else "not in the list"
                raise ValueError(f"pass {p.name!r} must run after {before!r}, which is {where}")
        seen.append(p.name)
    return tuple(passes)


def _set(field_name: str, fn):
    def run(s: RankState) -> None:
        setattr(s, field_name, fn(s))
    return run


def _redistribute(s: RankState) -> None:
    s.gm = insert_redistributions(s.gm, mesh=s.mesh)
    s.redistributed = True


def _split_stages(s: RankState) -> None:
    a = s.stage_assignment
    s.stages = split_stages(s.gm, a, a.stages_of(s.mesh.coord("pp")))
    for name, used in param_stages(s.gm, a).items():
        ranks = tuple(sorted({a.rank_of(st) for st in used}))
        if len(ranks) > 1:
            if ranks != (0, a.pp - 1):
                raise ParallelizeError(
                    f"parameter {name} is used on pipeline ranks {list(ranks)}; fxtron ties weights only "
                    f"between the first and the last stage (an embedding and its LM head, Megatron's embedding "
                    f"group): untie it, or choose split_points that keep its uses on those stages")
            s.shared[name] = ranks


def _mark_recompute(s: RankState) -> None:
    granularity, method, layers = s.config.recompute.resolved()
    prefix = s.stage_assignment.layer_list if s.stage_assignment is not None else None
    for g in ([s.gm] if s.stages is None else [st.gm for st in s.stages]):
        mark_recompute(g, granularity, method, layers, prefix=prefix)


def shard_params(gm: fx.GraphModule, mesh: MeshView, mine: set[str]) -> dict[str, LocalParam]:
    """The description of every parameter in `mine`: per axis its shard (from its placement),
    the axes its gradient is partial over (meta.GRAD_REDUCE), and the data-parallel group
    that reduces it (dp-cp under context parallel, which sums the cp ranks' partial
    gradients; expert-dp for an expert weight split over ep)."""
    local: dict[str, LocalParam] = {}
    reached = meta.reaches_loss(gm)
    for node in gm.graph.nodes:
        name = meta.param_name(node)
        if name is None or name not in mine:
            continue
        val = node.meta["val"]
        full = tuple(int(s) for s in val.shape)
        shape, shards = list(full), []
        for axis in meta.graph_axes(gm):
            pl = meta.placement(node, axis)
            if isinstance(pl, Shard):
                if not pl.whole:
                    layout.check_divisible(full[pl.dim], mesh.size(axis), pl.interleave,
                                           f"parameter {name} {full} dim {pl.dim}")
                shape[pl.dim] = layout.local_size(shape[pl.dim], mesh.size(axis), pl.interleave, pl.whole)
                shards.append(AxisShard(axis, pl.dim, pl.interleave, pl.whole))
        partial = tuple(meta.get(node, meta.GRAD_REDUCE) or ())
        group, whole = "dp", ()
        if any(s.axis == "ep" for s in shards):
            # an expert's gradient sums the tokens every ep rank sent it; the replicas of the
            # rank's experts are its expert-dp group (Megatron's expert data parallel). The cp
            # ranks fold into ep x expert-dp, so that sum already takes every cp rank's tokens
            group = "expert-dp"
            partial = tuple(a for a in partial if a != "cp")
        elif mesh.parallel("cp"):        # the cp sum joins the dp average in one collective
            group = "dp-cp"
            whole = () if "cp" in partial else ("cp",)
            partial = tuple(a for a in partial if a != "cp")
        local[name] = LocalParam(name, full, tuple(shape), val.dtype, shards=tuple(shards),
                                 partial_grad=partial, grad_group=group, grad_whole_on=whole,
                                 takes_grad=node in reached)
    return local


def _shard_params(s: RankState) -> None:
    mine = (set(meta.info(s.gm).params) if s.stages is None
            else {p for st in s.stages for p in st.params} | set(_held_unread(s, "parameter")))
    s.local = shard_params(s.gm, s.mesh, mine)
    assert set(s.local) == mine


def _zero3(s: RankState) -> bool:
    c = s.config.data_parallel
    return c.zero == 3 or (c.zero in (1, 2) and c.overlap_param_gather)


def _shard_data_parallel(s: RankState) -> None:
    def group_of(kind: str) -> tuple[int, int]:
        ranks = s.job.group_of(kind, s.mesh.rank)
        return len(ranks), ranks.index(s.mesh.rank)
    graphs = [s.gm] if s.stages is None else [st.gm for st in s.stages]
    k = s.config.data_parallel.dp_shard

    def split(kind: str):
        """HSDP: the dense weights' group cut into shard groups of k (experts shard over all of expert-dp)."""
        if k is None or kind == "expert-dp" or group_of(kind)[0] == k:
            return None
        return hsdp_kinds(kind, k)
    if s.config.data_parallel.zero == 3:
        s.local = shard_data_parallel(graphs, s.local, group_of, split)
    else:
        wait_for_params(graphs, s.local, group_of)


def linears_in_regions(config: Config, mesh) -> bool:
    """Whether compile=True keeps a rank's linears inside its compiled regions instead of fusing
    their weight gradients into main_grad with fxtron::linear, which a region cannot hold (its
    backward writes main_grad and may be deferred); `mesh`, the rank's MeshView. An opaque
    linear splits the step into a compiled region per linear, each called through Dynamo's
    guard and AOTAutograd's wrappers (~0.1 ms of host time per region and pass); without them a
    world-1 step is one region. In the regions an fp32 linear is an aten op (autograd's weight
    gradient is the same fp32 GEMM, added into main_grad by autograd: runtime/grads.py), and under 16-bit
    compute a linear is fxtron::master_linear: it takes the fp32 master weight, casts it inside
    the region and returns the weight gradient accumulated in fp32 (the fused linear's number;
    autograd's gradient of a 16-bit compute copy would be rounded to 16 bits first; a tied
    embedding reads a cast of the same weight). A linear whose weight the model itself holds in
    16 bits stays fused (codegen/fuse.py). Taken where the fusion defers nothing a compiled step
    needs:
    - an fp32 gradient buffer (a 16-bit one takes the fused path's 16-bit GEMM);
    - no data-parallel reduction overlapping backward (dp x cp > 1 with overlap_grad_reduce): a
      fused linear reports its gradient done as its GEMM runs, and its bucket starts; a
      compiled backward returns a region's weight gradients together, at its end;
    - no zero=3 (its linears gather their weights again in backward), and under 16-bit compute
      no zero at all (overlap_param_gather makes the compute copies inside the graph);
    - no zero-bubble schedule (its W passes are the deferred GEMMs);
    - no tp on a GPU, where the fused linear's GEMM runs while NCCL all-reduces the input
      gradient on its own stream, and where sequence parallelism's fused linear keeps the
      sequence shard and gathers it again in backward (a region keeps the gathered input for
      its linears' backward: the activation memory sequence parallelism saves there). On the
      CPU the collective and the GEMM share the rank's cores: there (benchmarks/bench_tp.py's
      model at tp=2) the step is ~5% faster in the regions, and sequence parallel's gathers and
      reduce-scatters are the regions' own calls too.
    A compiled backward holds a region's weight gradients until it returns (as torch.compile's
    does a model's): up to one fp32 copy of the weights beside main_grad at the end of backward."""
    dp = config.data_parallel
    if not (config.codegen.compile and dp.zero != 3 and not config.pipeline.split_backward
            and torch_dtype(dp.grad_reduce_dtype) in (None, torch.float32)):
        return False
    if config.precision.torch_dtype is not None and dp.zero != 0:
        return False
    if dp.overlap_grad_reduce and mesh.size("dp") * mesh.size("cp") > 1:
        return False
    return mesh.size("tp") == 1 or config.inputs.resolved_device() == "cpu"


def linears_to_autograd(config: Config, mesh) -> bool:
    """Whether an uncompiled program leaves its fp32 linears to autograd (aten ops, their weight
    gradients added into main_grad in place by AccumulateGrad: runtime/grads.py's direct
    accumulation) instead of fusing them into fxtron::linear; `mesh`, the rank's MeshView. The
    fused linear is a Python autograd Function: ~9 us more host time per linear and step than
    aten's C++ linear (ops/linear.py), which a GPU waiting on its host pays. It is kept where it
    computes another number or does what autograd cannot:
    - 16-bit compute (its GEMM accumulates the weight gradient in fp32; autograd's would be rounded
      to 16 bits first), a 16-bit gradient buffer, or a model whose weights are 16-bit (asked per
      linear by codegen/fuse.py);
    - tensor parallelism (its weight-gradient GEMM waits in a queue for the input gradient's
      all-reduce and runs while the bytes move; under sequence parallelism it keeps the shard of
      its input and gathers it again in backward) and context parallelism (a weight whose
      gradient is whole on every cp rank enters the sum scaled);
    - zero=3 (gathers its weight again in backward), the zero-bubble schedules (the W pass is the
      deferred GEMM), cuda_graphs (the captured step's gradients);
    - compile=True, where linears_in_regions decides.
    Data parallelism, zero 1-2, the other pipeline schedules, recompute and ep are autograd's
    business alike: a gradient's post-accumulate hook reports it to its bucket as the fused
    linear's GEMM does. The number is the same: both write the fp32 product of dy^T and x into
    the zeroed main_grad (and add the next microbatches' into it)."""
    dp = config.data_parallel
    return (config.precision.gradient_accumulation_fusion and not config.codegen.compile
            and not config.codegen.cuda_graphs and config.precision.torch_dtype is None
            and torch_dtype(dp.grad_reduce_dtype) in (None, torch.float32) and dp.zero != 3
            and not config.pipeline.split_backward and mesh.size("tp") == 1 and mesh.size("cp") == 1)


def _device_type(s: RankState) -> str:
    return s.config.inputs.resolved_device()


def _trace(s: RankState) -> None:
    s.gm = drop_dead_values(drop_metadata_asserts(s.gm))
    check_kernels(s.gm, _device_type(s))


def _on_device(s: RankState) -> None:
    for g in [s.gm] + ([st.gm for st in s.stages] if s.stages is not None else []):
        on_device(g, _device_type(s))


PASSES = pass_list(
    Pass("trace", "the traced graph (torch.export), export's metadata asserts dropped (they pin the traced "
         "dtype, device and global sizes), values the loss does not depend on dropped; an op with no kernel for its dtype on the program's device (CUDA's "
         "bf16-only grouped GEMM) an error now", _trace, model_wide=True),
    Pass("global_statistics", "what the model computes over its batch is the global batch's: a token mean over "
         "every piece's counted tokens, a summed loss summed, a load-balancing loss's statistics summed over dp, "
         "BatchNorm's statistics over dp, in-batch negatives gathered over dp; math across the batch dim it cannot "
         "make global an error",
         _set("gm", lambda s: global_statistics(s.gm, dp=s.mesh.size("dp"), pieces=_pieces(s),
                                                local=s.config.experts.aux_loss == "local",
                                                frozen_whole=s.config.data_parallel.zero != 3)),
         lambda s: _pieces(s) > 1, "dp x microbatches > 1", after=("trace",), model_wide=True),
    Pass("plan", "which linears split by columns / rows: the model's tp plan, made once for every rank "
         "(data; the graph is unchanged)", lambda s: None, _tp, "tp > 1"),
    Pass("split_row_bias", "rowwise biases move after the all-reduce (Megatron adds them there)",
         _set("gm", lambda s: split_row_bias(s.gm, s.plan)), _tp, "tp > 1", after=("plan",)),
    Pass("split_fused_parts", "a fused projection with parts too few heads to split (multi-query attention's "
         "key and value) becomes a column-split linear of the rest and a whole one of those",
         _set("gm", lambda s: split_fused_parts(s.gm, s.plan)),
         lambda s: s.mesh.parallel("tp") and any(getattr(p, "whole", ()) for p in s.plan.params.values()),
         "tp > 1 and such a projection", after=("split_row_bias",)),
    Pass("inverse_permutations", "a permutation's inverse written index_put_(empty_like(p), [p], arange(n)) "
         "becomes argsort(p), which each rank computes from its own sort (a mixture of experts' copies under cp)",
         _set("gm", lambda s: rewrite_inverse_permutations(s.gm)), _cp, "cp > 1", after=("trace",)),
    Pass("dispatch_experts", "each mixture-of-experts layer's copies go to the ranks of their experts and come back "
         "(Megatron's all-to-all dispatcher); the experts' GEMMs run on the rank's own experts",
         _set("gm", lambda s: dispatch_experts(s.gm, s.mesh.size("ep"), s.config.experts.capacity_factor or 0.0,
                                              tp=s.mesh.size("tp"), plan=s.plan,
                                              pad=s.config.experts.pad_to_capacity, rank=s.mesh.coord("ep"))), _ep, "ep > 1", after=("split_row_bias",)),
    Pass("propagate_ep", "an ep placement on every value: the experts' weights split on their experts dim",
         _set("gm", lambda s: propagate(s.gm, ep_layout(s.gm, strict=s.config.debug.strict), mesh=s.mesh)),
         _ep, "ep > 1", after=("dispatch_experts",)),
    Pass("fuse_written_out_attention", "attention written out as matmuls becomes one attention op, which the cp "
         "ring takes", _set("gm", lambda s: fuse_written_out_attention(s.gm)),
         lambda s: s.mesh.parallel("cp") and s.config.context.comm_type in ("p2p", "a2a", "a2a+p2p"),
         "cp > 1 with cp_comm_type='p2p', 'a2a' or 'a2a+p2p'",
         after=("split_row_bias",)),
    Pass("propagate_tp", "a tp placement on every value, from the plan's parameter placements",
         _set("gm", lambda s: propagate(s.gm, tp_layout(s.plan, sequence_parallel=s.config.tensor.sequence_parallel,
                                                  strict=s.config.debug.strict),
                                        mesh=s.mesh)),
         _tp, "tp > 1", after=("split_row_bias",)),
    Pass("propagate_cp", "a cp placement on every value: the inputs' sequence split load-balanced over cp",
         _set("gm", lambda s: propagate(s.gm, cp_layout(meta.info(s.gm), comm_type=s.config.context.comm_type,
                                                      a2a_size=s.config.context.a2a_size,
                                                      strict=s.config.debug.strict), mesh=s.mesh)),
         _cp, "cp > 1", after=("propagate_tp",)),
    Pass("insert_redistributions", "the collectives each placement mismatch needs (f/g pairs, gathers, "
         "scatters) and the lowerings (vocab-parallel, context-parallel attention and loss)", _redistribute,
         _distributed, "the graph is distributed over an axis", after=("propagate_tp", "propagate_cp", "propagate_ep")),
    Pass("localize", "sizes written into the graph become this rank's", _set("gm", lambda s: localize(s.gm, mesh=s.mesh)),
         _distributed, "the graph is distributed over an axis", after=("insert_redistributions",)),
    Pass("assign_rng_regions", "random ops draw from the program's streams (replicated or per rank), which "
         "checkpoints save", _set("gm", lambda s: assign_rng_regions(s.gm)), after=("insert_redistributions",)),
    Pass("fuse_linears", "weight gradients straight into fp32 main_grad, deferrable behind the input "
         "gradient's communication (fp32 linears nothing defers stay autograd's: linears_to_autograd; under "
         "compile=True the linears stay in the compiled regions where nothing defers their GEMMs: "
         "linears_in_regions)",
         _set("gm", lambda s: fuse_linears(s.gm, device=torch.device(s.config.inputs.resolved_device()),
                                           in_regions=linears_in_regions(s.config, s.mesh),
                                           master=s.config.precision.torch_dtype,
                                           fp32_to_autograd=linears_to_autograd(s.config, s.mesh))),
         lambda s: s.config.precision.gradient_accumulation_fusion, "gradient_accumulation_fusion",
         after=("insert_redistributions",)),
    Pass("annotate_local_shapes", "local symbolic shapes for inspection and the stage boundaries",
         _set("gm", lambda s: annotate_local_shapes(s.gm, mesh=s.mesh)), after=("localize", "fuse_linears")),
    Pass("split_stages", "this rank's pipeline stages, each its own graph with the activations crossing it "
         "as inputs and outputs", _split_stages, lambda s: s.stage_assignment is not None, "pp > 1",
         after=("annotate_local_shapes",)),
    Pass("mark_recompute", "activations of the attention cores (selective) or of whole layers (full) recomputed in "
         "backward instead of kept, per stage graph", _mark_recompute, lambda s: s.config.recompute.granularity is not None,
         "recompute is 'selective' or 'full'", after=("split_stages",)),
    Pass("on_device", "every device the graphs name made the program's device type: the trace ran on the model's "
         "own tensors (a meta model's as its CPU build) and the passes copy devices from those values; binding "
         "then picks the rank's device", _on_device, after=("split_stages", "mark_recompute")),
    Pass("shard_params", "each parameter's local shape, shards per axis and gradient group", _shard_params,
         after=("split_stages",)),
    Pass("shard_data_parallel", "each parameter held as the rank's 1/d flat piece; each layer's pieces gathered just "
         "before its first use and freed after its last (FSDP); under zero=1/2 with overlap_param_gather, each "
         "layer waits for its own buckets' gathered update", _shard_data_parallel, _zero3,
         "zero=3, or zero=1/2 with overlap_param_gather",
         after=("shard_params", "mark_recompute")),
)


def _run(p: Pass, state: RankState, mesh: Mesh, rank: int | None) -> None:
    """Apply one pass; whatever it raises names the pass and the rank (None: a model-wide pass,
    every rank's). A user's mistake stays a ParallelizeError (its message already says what to
    change; the pass is added as a note, shown with the traceback); anything else is a
    CompileError naming the pass, from the original exception."""
    where = f"the pass {p.name!r} compiling {'every rank' if rank is None else f'rank {rank}'} of {mesh}"
    try:
        p.run(state)
    except (ParallelizeError, verifier.VerifyError) as e:
        e.add_note(f"fxtron: raised by {where}")
        raise
    except Exception as e:   # noqa: BLE001 - any other failure is the pass's, named as such
        raise CompileError(f"{where} failed: {type(e).__name__}: {e}") from e


def prepare(traced: fx.GraphModule, mesh: Mesh, *, config: Config | None = None) -> fx.GraphModule:
    """The model-wide passes (the list's head, `Pass.model_wide`) run once on a copy of
    `traced`: their result is every rank's, so `compile_rank(..., prepared=...)` starts from it
    instead of running them again per rank. Their errors (a batch statistic fxtron cannot make
    global) are raised here, before any rank compiles."""
    config = config if config is not None else Config()
    state = RankState(meta.copy_graph(traced), mesh.view(0), config, None, None, job=mesh)
    for p in PASSES:
        if not p.model_wide:
            break
        if p.when(state):
            _run(p, state, mesh, None)
            if config.debug.verify:
                verifier.verify(state.gm, after=p.name)
    return state.gm


def compile_rank(traced: fx.GraphModule, mesh: Mesh, rank: int, *, plan: TPPlan | None = None,
                 stage_assignment: StageAssignment | None = None, config: Config | None = None,
                 observer=None, prepared: fx.GraphModule | None = None) -> RankGraph:
    """Run `PASSES` on a copy of `traced` for `rank` of `mesh`, with the model's tp `plan`
    (required when mesh.tp > 1) and `stage_assignment` (when mesh.pp > 1), under `config`
(fxtron.config.Config: the sections a rank's passes read; default the defaults). With
config.debug.verify the verifier checks the graph after every pass.

    `observer(pass_name, gm, seconds, doc)`, when given, sees the graph after every pass that
    applied (`fxtron inspect --dump`); after split_stages, each stage's graph. `prepared`
    (`prepare(traced, mesh, config=config)`) is the graph after the model-wide passes, which
    then do not run again.
    """
    view = mesh.view(rank)
    if view.parallel("tp") and plan is None:
        raise ValueError("compile_rank: mesh.tp > 1 needs the model's tp plan")
    config = config if config is not None else Config()
    state = RankState(meta.copy_graph(traced if prepared is None else prepared), view, config, plan,
                      stage_assignment, job=mesh)
    check = config.debug.verify
    for p in PASSES:
        if (p.model_wide and prepared is not None) or not p.when(state):
            continue
        t0 = time.perf_counter()
        _run(p, state, mesh, rank)
        seconds = time.perf_counter() - t0
        graphs = [state.gm] if state.stages is None else [st.gm for st in state.stages]
        if check:
            for g in graphs:
                verifier.verify(g, after=p.name, redistributed=state.redistributed)
        if observer is not None:
            if p.name == "split_stages":
                for st in state.stages:
                    observer(f"split_stages_stage{st.index}", st.gm, seconds,
                             f"stage {st.index}: receives {', '.join(st.inputs) or '-'}; sends {', '.join(st.outputs) or '-'}")
            elif p.name in ("shard_data_parallel", "on_device") and state.stages is not None:
                for st in state.stages:
                    observer(f"{p.name}_stage{st.index}", st.gm, seconds, p.reason)
            elif p.name != "shard_params":
                observer(p.name, state.gm, seconds, p.reason)
    state.gm.graph.lint()
    for i, g in enumerate([state.gm] if state.stages is None else [st.gm for st in state.stages]):
        verifier.check_devices(g, _device_type(state), where=f"rank {rank}" + (
            f" stage {state.stages[i].index}" if state.stages is not None else ""))
    return RankGraph(gm=state.gm, mesh=mesh, rank=rank, local=state.local, plan=plan,
                     stage_assignment=stage_assignment, stages=state.stages, shared=state.shared,
                     seq_split=view.size("tp") if config.tensor.sequence_parallel else 1, max_seq=seq_limit(traced))


__all__ = ["PASSES", "Pass", "RankGraph", "RankState", "compile_rank", "pass_list", "prepare",
           "shard_params"]
