"""Runtime: build one rank's Program from its compilation (core.rank.RankSpec) -- its parameter
shards sliced from the model's tensors (made module by module for a model on the meta device),
its buffers, its graphs bound to this process's groups and device, its random streams."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch
import torch.fx as fx

from fxtron.config import Config
from fxtron.core.rank import RankSpec
from fxtron.errors import ParallelizeError, ParallelizeWarning
from fxtron.mesh import hsdp_kinds
from fxtron.ops.rng import RNGStreams
from fxtron.runtime.bind import bind
from fxtron.runtime.graphs import check_program
from fxtron.runtime.groups import ProcessGroups
from fxtron.runtime.materialize import MetaMaterializer
from fxtron.runtime.checkpoint.hf import origin_of
from fxtron.runtime.program import EvalGraphs, Program


def local_params(model: torch.nn.Module, spec: RankSpec, seed: int = 0,
                 materialized: MetaMaterializer | None = None) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter it holds, new tensors on the CPU (under zero=3 its
    flat data-parallel piece of that)."""
    named = dict(model.named_parameters())
    out = {}
    materialized = materialized if materialized is not None else MetaMaterializer(model, seed)
    sizes, coords = spec.mesh.sizes, spec.mesh.coords
    for name, lp in spec.local.items():
        full = named[name]
        if full.device.type == "meta":     # made shard by shard, never whole (runtime/materialize.py)
            local = materialized.local(name, lp.shards, sizes, coords)
        else:
            local = lp.local_of(full.detach(), sizes, coords)
        out[name] = lp.held_of(local)      # (under zero=3, the rank's flat piece)
    if materialized.defaulted:
        warnings.warn(f"rank {spec.rank}: {len(materialized.defaulted)} parameter(s) of the meta model have no init of "
                      f"their own (no reset_parameters, no init_weights): fxtron's default given: "
                      + ", ".join(materialized.defaulted[:4]), ParallelizeWarning, stacklevel=3)
    if materialized.whole:
        warnings.warn(f"rank {spec.rank}: {len(materialized.whole)} parameter(s) of the meta model were made whole before "
                      f"being cut, their init being more than elementwise writes: "
                      + "; ".join(f"{n} ({why})" for n, why in list(materialized.whole.items())[:4]),
                      ParallelizeWarning, stacklevel=3)
    return out


def used_buffers(model: torch.nn.Module, spec: RankSpec,
                 materialized: MetaMaterializer | None = None) -> dict[str, torch.Tensor]:
    """Copies of the buffers (and lifted constants) the rank's graphs read; a meta model's
    buffers as its initialization computes them (runtime/materialize.py)."""
    model_buffers = dict(model.named_buffers())
    names = spec.info.buffers if spec.stages is None else sorted({b for s in spec.stages for b in s.buffers}
                                                                  | set(spec.unread_buffers))
    out = {}
    for name in names:
        b = model_buffers.get(name)
        if b is None:
            b = spec.info.constants[name]
        if b.device.type == "meta" and b.numel() == 0:
            b = torch.empty(b.shape, dtype=b.dtype)   # an empty constant has no values to know
        if b.device.type == "meta":
            if name not in model_buffers:
                raise ParallelizeError(
                    f"constant {name} {tuple(b.shape)} of the traced model is on the meta device and fxtron cannot "
                    "know its values; make it a buffer of its module, computed by the module's init")
            materialized = materialized if materialized is not None else MetaMaterializer(model, 0)
            b = materialized.buffer(name)
        out[name] = b.detach().clone()
    return out


def hsdp_group_kinds(config: Config, mesh) -> list[str]:
    """The derived group kinds hybrid sharding (zero=3 with dp_shard) needs on `mesh`."""
    k = config.data_parallel.dp_shard
    if config.data_parallel.zero != 3 or k is None:
        return []
    kind = "dp-cp" if mesh.cp > 1 else "dp"
    return list(hsdp_kinds(kind, k)) if mesh.dp * mesh.cp != k else []


def cp_group_kinds(config: Config, mesh) -> list[str]:
    """The derived group kinds cp_comm_type='a2a+p2p' needs on `mesh`: its all-to-all groups of
    cp_a2a_size consecutive cp ranks and the rings across them."""
    k = config.context.a2a_size
    return list(hsdp_kinds("cp", k)) if config.context.comm_type == "a2a+p2p" and mesh.cp > 1 else []


def build_program(model: torch.nn.Module, spec: RankSpec, groups: ProcessGroups | None, config: Config | None = None,
                  *, seed: int = 0, eval_spec: Callable[[], RankSpec] | None = None, compiler=None,
                  emit: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Program:
    """The runnable Program of rank `spec.rank` under `config` (default: the defaults): an
    nn.Module holding its parameters. `eval_spec()`, when given, compiles the rank's eval-mode
    graph (the same parameters): the program binds it on its first evaluation. `compiler`, when
    given (compile=True: codegen/regions.py's Compiler), turns each bound graph into the one
    that runs; its `stats` become `program.compiled`. `emit`, when given (codegen/calls.py's
    direct_calls), generates each bound graph's forward last. Under cuda_graphs=True what a captured
    step cannot replay is refused here (runtime/graphs.py check_program)."""
    config = config if config is not None else Config()
    # a frozen parameter (requires_grad=False) takes no gradient, as in the model: .grad None
    # after every step, so no optimizer moves it (runtime/grads.py's gradless)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if frozen & set(spec.local):
        spec = dataclasses.replace(spec, local={n: dataclasses.replace(lp, takes_grad=False) if n in frozen else lp
                                                for n, lp in spec.local.items()})
    device = groups.device if groups is not None else torch.device("cpu")
    if config.codegen.cuda_graphs:       # what a captured step cannot replay, before any tensor is made
        check_program(spec.host_bound, groups, device)
    materialized = MetaMaterializer(model, seed)
    params = local_params(model, spec, seed, materialized)
    held_in: dict[str, torch.dtype] = {}
    if config.precision.torch_dtype is not None:
        held_in = {k: v.dtype for k, v in params.items() if v.is_floating_point() and v.element_size() < 4}
        # a 16-bit compute dtype updates fp32 masters from fp32 gradients (Megatron's mixed-precision
        # optimizer), whatever the model holds: a model loaded in bf16 gets fp32 copies of its
        # weights, which the step updates (in bf16 themselves most small updates rounded away)
        params = {k: v.float() if v.is_floating_point() and v.element_size() < 4 else v for k, v in params.items()}
    buffers = used_buffers(model, spec, materialized)
    if device.type != "cpu":
        params = {k: v.to(device) for k, v in params.items()}
        buffers = {k: v.to(device) for k, v in buffers.items()}
    if groups is not None:       # HSDP's and a2a+p2p's groups, made by every rank alike (the same kinds on each)
        groups.add(hsdp_group_kinds(config, groups.mesh) + cp_group_kinds(config, groups.mesh))
    rng = RNGStreams(seed, coords=dict(spec.mesh.coords), device=device, sizes=dict(spec.mesh.sizes))
    def ready(g, training: bool = True):
        """g bound to this process (an eval-mode graph without recomputed regions: no backward),
        compiled region by region under compile=True, its forward generated by `emit`."""
        g = bind(g, groups, device, recompute=training)
        g = compiler(g, training) if compiler is not None else g
        return emit(g) if emit is not None else g

    gm = ready(spec.gm) if spec.gm is not None else None
    stages = None
    if spec.stages is not None:
        stages = [dataclasses.replace(s, gm=ready(s.gm)) for s in spec.stages]
    evaluation = None
    if eval_spec is not None:
        def evaluation() -> EvalGraphs:
            es = eval_spec()
            return EvalGraphs(
                info=es.info, gm=ready(es.gm, False) if es.gm is not None else None,
                stages=[dataclasses.replace(s, gm=ready(s.gm, False)) for s in es.stages]
                if es.stages is not None else None,
                buffers={k: v.to(device) for k, v in used_buffers(model, es).items()})
    program = Program(spec, params, buffers, set(model.state_dict().keys()), groups, config, rng=rng, gm=gm,
                      stages=stages, evaluation=evaluation)
    for name, p in program.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    program.frozen = frozenset(n for n, _ in program.named_parameters() if n in frozen)
    # the 16-bit dtype of each weight the model held in 16 bits (now an fp32 master): save_pretrained
    # writes it back in it, as transformers saves the model it loaded
    program.held_in = held_in
    program.compiled = compiler.stats if compiler is not None else None   # (codegen/regions.py)
    program.origin = origin_of(model)      # transformers' config and key layout, for load/save_pretrained
    return program


__all__ = ["build_program", "local_params", "used_buffers"]
