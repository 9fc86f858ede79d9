"""Compiler: the per-rank pass pipeline, top to bottom in one place.

`compile_rank(traced, mesh, rank)` copies the traced graph and runs the passes for that rank;
the result (`RankGraph`) knows which slice of each full parameter the rank holds and builds
the rank's runnable Program.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxtron.compiler.trace import info
from fxtron.errors import ParallelizeError
from fxtron.mesh import Mesh
from fxtron.passes.collectives import TP_GROUP, assign_rng_regions, drop_metadata_asserts, insert_collectives, localize
from fxtron.passes.placement import Shard
from fxtron.passes.plan import TPPlan, plan
from fxtron.passes.propagate import propagate, split_row_bias
from fxtron.passes.stages import Stage, StagePlan, param_stages, split_stages
from fxtron.passes.shapes import annotate_local_shapes
from fxtron.runtime import shard as shard_math
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.program import LocalParam, Program
from fxtron.runtime.rng import RNGStreams
from fxtron.codegen.linear import fuse_linears, fused_weights


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of gm's graph (node.meta copied shallowly: the fake
    tensors in `val` are shared, never mutated)."""
    graph = fx.Graph()
    out_val = graph.graph_copy(gm.graph, {})
    graph.output(out_val)
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


@dataclass
class RankGraph:
    """One rank's compiled graph and how its parameters relate to the full ones."""

    gm: fx.GraphModule
    mesh: Mesh
    rank: int
    local: dict[str, LocalParam] = field(default_factory=dict)
    slicers: dict[str, object] = field(default_factory=dict)  # name -> fn(full tensor) -> local
    plan: TPPlan | None = None
    stage_plan: StagePlan | None = None
    stages: list[Stage] | None = None        # this rank's pipeline stages, chunk 0 first
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> pp ranks holding it

    @property
    def graphs(self) -> list[fx.GraphModule]:
        """The graphs this rank runs: its stages', or the whole per-rank graph."""
        return [s.gm for s in self.stages] if self.stages is not None else [self.gm]

    @property
    def param_count(self) -> int:
        return sum(_numel(p.local_shape) for p in self.local.values())

    @property
    def param_bytes(self) -> int:
        return sum(_numel(p.local_shape) * p.dtype.itemsize for p in self.local.values())

    def build_program(self, model: torch.nn.Module, rank: int, groups: ProcessGroups | None,
                      seed: int = 0, dtype: torch.dtype | None = None, pipeline=None,
                      data_parallel=None) -> Program:
        ti = info(self.gm)
        named = dict(model.named_parameters())
        params = {}
        materialized = _MetaMaterializer(model, seed)
        for name in self.local:
            full = named[name]
            if full.device.type == "meta":
                full = materialized.full(name)   # one module at a time, never the whole model
            sl = self.slicers.get(name)
            local = sl(full.detach()) if sl is not None else full.detach()
            params[name] = local.clone()
            materialized.release(name)
        model_buffers = dict(model.named_buffers())
        persistent = set(model.state_dict().keys())
        buffers = {}
        used_buffers = ti.buffers if self.stages is None else sorted({b for s in self.stages for b in s.buffers})
        for name in used_buffers:
            b = model_buffers.get(name)
            if b is None:
                b = ti.constants[name]
            if b.device.type == "meta" and b.numel() == 0:
                b = torch.empty(b.shape, dtype=b.dtype)   # an empty constant has no values to know
            if b.device.type == "meta":
                raise ParallelizeError(
                    f"buffer {name} {tuple(b.shape)} is on the meta device and fxtron cannot know its "
                    "values; create buffers on the CPU when building the model on meta (they are small), "
                    "or load them into the model before pm.program()")
            buffers[name] = b.detach().clone()
        device = groups.device if groups is not None else None
        if device is not None and device.type != "cpu":
            params = {k: v.to(device) for k, v in params.items()}
            buffers = {k: v.to(device) for k, v in buffers.items()}
        device = device or torch.device("cpu")
        rng = RNGStreams(seed, self.mesh.coords(rank)["tp"], device)
        stages = None
        if self.stages is not None:
            stages = [dataclasses.replace(s, gm=_bind_groups(s.gm, groups, device)) for s in self.stages]
        fused = sorted({w for g in self.graphs for w in fused_weights(g)})
        return Program(_bind_groups(self.gm, groups, device) if self.stages is None else None, ti, params, buffers,
                       persistent, self.local, rank, groups, ti.aliases, rng, fused=fused, dtype=dtype,
                       stages=stages, pipeline=pipeline, shared=self.shared, data_parallel=data_parallel,
                       grad_reports=self.grad_reports(), param_order=self.param_order())

    def param_order(self) -> list[str]:
        """This rank's parameters in order of first use in forward (chunk by chunk)."""
        order: dict[str, None] = {}
        for g in self.graphs:
            for node in g.graph.nodes:
                for a in node.all_input_nodes:
                    spec = a.meta.get("fxtron_input")
                    if spec is not None and spec.kind == "parameter":
                        order.setdefault(spec.target)
        return list(order)

    def grad_reports(self) -> dict[str, int]:
        """How many times per step each parameter's gradient reports complete during the last
        microbatch's backward: once per fused linear using it (its weight-gradient job), plus
        once if autograd computes any other part (the post-accumulate-grad hook), per chunk."""
        out: dict[str, int] = {}
        for g in self.graphs:
            for node in g.graph.nodes:
                spec = node.meta.get("fxtron_input")
                if node.op != "placeholder" or spec is None or spec.kind != "parameter":
                    continue
                fused = sum(1 for u in node.users if u.target == torch.ops.fxtron.linear.default and u.args[1] is node)
                other = any(not (u.target == torch.ops.fxtron.linear.default and u.args[1] is node) for u in node.users)
                out[spec.target] = out.get(spec.target, 0) + fused + int(other)
        return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _MetaMaterializer:
    """Real values for parameters of a model built on the meta device, made module by module:
    the module that owns a parameter is copied to the CPU and initialized with its own
    `reset_parameters()` under a seed derived from (seed, module path), so every rank makes the
    same full tensor and keeps only its shard; the copy is dropped before the next module. A
    module without `reset_parameters` gets GPT-2's init: normal(0, 0.02) for matrices, ones
    for 1-d weights (norm scales), zeros for biases."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model, self.seed = model, seed
        self._owner: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    def full(self, name: str) -> torch.Tensor:
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner != self._owner:
            self._values = self._materialize(owner)
            self._owner = owner
        return self._values[leaf]

    def release(self, name: str) -> None:
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner == self._owner:
            self._values.pop(leaf, None)

    def _materialize(self, owner: str) -> dict[str, torch.Tensor]:
        import zlib
        module = self.model.get_submodule(owner)
        local = {n: p for n, p in module.named_parameters(recurse=False)}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + zlib.crc32(owner.encode())) % 2**63)
            if hasattr(module, "reset_parameters"):
                shell = copy.copy(module)           # shallow: children stay shared and untouched
                shell._parameters = {n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                                     for n, p in local.items()}
                shell.reset_parameters()
                return {n: p.detach() for n, p in shell._parameters.items()}
            out = {}
            for n, p in local.items():
                t = torch.empty(p.shape, dtype=p.dtype)
                if p.dim() >= 2:
                    t.normal_(0.0, 0.02)
                elif n.endswith("bias"):
                    t.zero_()
                else:
                    t.fill_(1.0)
                out[n] = t
            return out


def _bind_groups(gm: fx.GraphModule, groups: ProcessGroups | None, device: torch.device) -> fx.GraphModule:
    """A copy of gm for this process: collectives name its real tp group instead of "tp",
    tensors the graph creates (arange, zeros, .to(device)) land on its device, whatever device
    the model was traced on (meta, say), and the ops called once per layer run in their
    run-time forms (the same autograd formulas without the custom-op dispatch overhead)."""
    import torch.utils._pytree as pytree
    from fxtron.codegen.linear import EAGER as LINEAR_EAGER
    from fxtron.runtime.collectives import EAGER as COLLECTIVE_EAGER
    eager = {**LINEAR_EAGER, **COLLECTIVE_EAGER}
    out = _copy(gm)
    name = ""
    if groups is not None and groups.size("tp") > 1:
        name = groups.group("tp").group_name
    for node in out.graph.nodes:
        if node.op != "call_function":
            continue
        if str(node.target).startswith("fxtron."):
            node.args = tuple(name if a == TP_GROUP else a for a in node.args)
            node.target = eager.get(node.target, node.target)
        node.args, node.kwargs = pytree.tree_map(
            lambda a: device if isinstance(a, torch.device) else a, (node.args, node.kwargs))
    out.recompile()
    return out


def _tp_gather(placement: Shard, tp: int):
    def gather(local: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
        import torch.distributed as dist
        pieces = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(pieces, local.contiguous(), group=groups.group("tp"))
        return shard_math.unshard(pieces, placement.dim, placement.interleave)
    return gather


def compile_rank(traced: fx.GraphModule, mesh: Mesh, rank: int, *, user_plan: dict | None = None,
                 plan_mode: str = "override", sequence_parallel: bool = False,
                 gradient_accumulation_fusion: bool = True, stage_plan: StagePlan | None = None,
                 observer=None) -> RankGraph:
    """Run the per-rank passes on a copy of `traced`, in this order:

    plan                which linears split by columns / rows, embeddings by vocabulary
    split_row_bias      rowwise biases move after the all-reduce (Megatron adds them there)
    propagate           a tp placement on every value; what each op expects of its inputs
    insert_collectives  the redistributions (f/g pairs, gathers, scatters), vocab-parallel ops
    localize            sizes written into the graph become this rank's
    assign_rng_regions  random ops draw from the replicated or the per-rank stream
    fuse_linears        (codegen) weight gradients accumulate into fp32 main_grad, deferrable
                        behind the tp all-reduce of the input gradient
    annotate shapes     local symbolic shapes for inspection
    split_stages        (pp > 1) this rank's pipeline stages, cut where `stage_plan` says,
                        each its own graph with the activations crossing it as inputs/outputs

    `observer(pass_name, gm, seconds, doc)`, when given, sees the graph after every pass
    (`fxtron inspect --dump`).
    """
    def run(name: str, doc: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if observer is not None:
            observer(name, out if isinstance(out, fx.GraphModule) else args[0], time.perf_counter() - t0, doc)
        return out

    gm = run("trace", "the traced graph (torch.export), metadata asserts dropped",
             lambda g: drop_metadata_asserts(_copy(g)), traced)
    tp, tp_rank = mesh.tp, mesh.coords(rank)["tp"]
    tp_plan = None
    if tp > 1:
        tp_plan = run("plan", "which linears split by columns / rows (data; the graph is unchanged)",
                      plan, gm, tp=tp, user_plan=user_plan, mode=plan_mode)
        gm = run("split_row_bias", "rowwise biases move after the all-reduce", split_row_bias, gm, tp_plan)
        gm = run("propagate", "a tp placement on every value", propagate, gm, tp_plan, tp=tp,
                 sequence_parallel=sequence_parallel)
        gm = run("insert_collectives", "the redistributions each placement mismatch needs",
                 insert_collectives, gm, tp=tp, tp_rank=tp_rank)
        gm = run("localize", "sizes become this rank's", localize, gm, tp=tp)
        gm = run("assign_rng_regions", "random ops draw from the replicated or per-rank stream",
                 assign_rng_regions, gm)
    if gradient_accumulation_fusion:
        gm = run("fuse_linears", "weight gradients straight into fp32 main_grad", fuse_linears, gm)
    gm = run("annotate_local_shapes", "local symbolic shapes", annotate_local_shapes, gm, tp=tp)
    gm.graph.lint()
    ti = info(gm)
    stages, shared, mine = None, {}, set(ti.params)
    if stage_plan is not None:
        pp_rank = mesh.coords(rank)["pp"]
        t0 = time.perf_counter()
        stages = split_stages(gm, stage_plan, stage_plan.stages_of(pp_rank))
        if observer is not None:
            for st in stages:
                observer(f"split_stages_stage{st.index}", st.gm, time.perf_counter() - t0,
                         f"stage {st.index}: receives {', '.join(st.inputs) or '-'}; sends {', '.join(st.outputs) or '-'}")
        for name, used in param_stages(gm, stage_plan).items():
            ranks = tuple(sorted({stage_plan.rank_of(s) for s in used}))
            if len(ranks) > 1:
                if ranks != (0, mesh.pp - 1):
                    raise ParallelizeError(
                        f"parameter {name} is used on pipeline ranks {list(ranks)}; fxtron ties weights only "
                        f"between the first and the last stage (an embedding and its LM head, Megatron's embedding "
                        f"group): untie it, or choose split_points that keep its uses on those stages")
                shared[name] = ranks
        mine = {p for s in stages for p in s.params}
    local, slicers = {}, {}
    for node in gm.graph.nodes:
        spec = node.meta.get("fxtron_input")
        if spec is None or spec.kind != "parameter" or spec.target not in mine:
            continue
        val = node.meta["val"]
        full = tuple(int(s) for s in val.shape)
        pl = node.meta.get("fxtron_placement")
        if isinstance(pl, Shard):
            shard_math.check_divisible(full[pl.dim], tp, pl.interleave, f"parameter {spec.target} {full} dim {pl.dim}")
            shape = list(full)
            shape[pl.dim] //= tp
            local[spec.target] = LocalParam(spec.target, full, tuple(shape), val.dtype, _tp_gather(pl, tp),
                                            dim=pl.dim, interleave=pl.interleave)
            slicers[spec.target] = (lambda p: lambda t: shard_math.shard(t, p.dim, tp, tp_rank, p.interleave))(pl)
        else:
            local[spec.target] = LocalParam(spec.target, full, full, val.dtype,
                                            tp_partial=node.meta.get("fxtron_grad_reduce") == "tp")
    assert set(local) == mine
    return RankGraph(gm=gm, mesh=mesh, rank=rank, local=local, slicers=slicers, plan=tp_plan,
                     stage_plan=stage_plan, stages=stages, shared=shared)
