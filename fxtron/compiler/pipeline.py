"""Compiler: the per-rank pass pipeline, top to bottom in one place.

`compile_rank(traced, mesh, rank)` copies the traced graph and runs the passes for that rank;
the result (`RankGraph`) knows which slice of each full parameter the rank holds and builds
the rank's runnable Program.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxtron.compiler.trace import TRACE_INFO, info
from fxtron.errors import ParallelizeError
from fxtron.mesh import Mesh
from fxtron.passes.shapes import annotate_local_shapes
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.program import LocalParam, Program


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = copy.deepcopy(gm.graph)
    out = fx.GraphModule(gm, graph)
    out.meta[TRACE_INFO] = gm.meta[TRACE_INFO]
    return out


@dataclass
class RankGraph:
    """One rank's compiled graph and how its parameters relate to the full ones."""

    gm: fx.GraphModule
    mesh: Mesh
    rank: int
    local: dict[str, LocalParam] = field(default_factory=dict)
    slicers: dict[str, object] = field(default_factory=dict)  # name -> fn(full tensor) -> local

    @property
    def param_count(self) -> int:
        return sum(_numel(p.local_shape) for p in self.local.values())

    @property
    def param_bytes(self) -> int:
        return sum(_numel(p.local_shape) * p.dtype.itemsize for p in self.local.values())

    def build_program(self, model: torch.nn.Module, rank: int, groups: ProcessGroups | None) -> Program:
        ti = info(self.gm)
        named = dict(model.named_parameters())
        params = {}
        for name in ti.params:
            full = named[name]
            if full.device.type == "meta":
                raise ParallelizeError(
                    f"parameter {name} {tuple(full.shape)} is on the meta device; a program needs real "
                    "weights: build the model on a real device (or use the meta model only for "
                    "pm.graph / pm.summary)")
            sl = self.slicers.get(name)
            local = sl(full.detach()) if sl is not None else full.detach()
            params[name] = local.clone()
        model_buffers = dict(model.named_buffers())
        persistent = set(model.state_dict().keys())
        buffers = {}
        for name in ti.buffers:
            b = model_buffers.get(name)
            if b is None:
                b = ti.constants[name]
            buffers[name] = b.detach().clone()
        device = groups.device if groups is not None else None
        if device is not None and device.type != "cpu":
            params = {k: v.to(device) for k, v in params.items()}
            buffers = {k: v.to(device) for k, v in buffers.items()}
        return Program(self.gm, ti, params, buffers, persistent, self.local, rank, groups, ti.aliases)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def compile_rank(traced: fx.GraphModule, mesh: Mesh, rank: int) -> RankGraph:
    """Run the per-rank passes on a copy of `traced`.

    Data parallel only so far: every rank's graph is the traced graph; the passes that follow
    trace (plan, propagate, insert_collectives, localize, pipeline, codegen) land with tensor,
    pipeline and the other parallelisms.
    """
    gm = _copy(traced)
    ti = info(gm)
    local = {}
    for node in gm.graph.nodes:
        spec = node.meta.get("fxtron_input")
        if spec is not None and spec.kind == "parameter":
            val = node.meta["val"]
            shape = tuple(int(s) for s in val.shape)
            local[spec.target] = LocalParam(spec.target, shape, shape, val.dtype)
    assert set(local) == set(ti.params)
    gm = annotate_local_shapes(gm)   # last: shapes as this rank holds them
    gm.graph.lint()
    return RankGraph(gm=gm, mesh=mesh, rank=rank, local=local)
