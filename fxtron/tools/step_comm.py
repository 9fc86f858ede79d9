"""What a rank communicates in a training step outside its graphs, as collective records.

The graphs' own collectives (tensor, sequence, context, expert parallel; zero=3's gathers)
come from compiler/report.collectives. Around them the runtime issues, per step:

- pipeline transfers, per microbatch and stage (runtime/pp/executor.py, runtime/pp/p2p.py): a
  stage's boundary outputs to the next stage in forward, the gradients of its floating
  boundary inputs to the previous one in backward, and the matching receives; a message of
  the tensors' shapes first when they vary; under scatter_gather a 1/tp slice of each
  replicated tensor, all-gathered over tp on arrival. Two stages of one rank (ZB-V's pp-1 and
  pp) hand over in memory: nothing;
- the data-parallel gradient reduction (runtime/dp.py, runtime/zero.py): per bucket an
  all-reduce, or under zero=1/2 a reduce-scatter and, after the optimizer step, the
  all-gather of the updated parameters; over dp (dp-cp with cp) for the dense parameters and
  expert-dp for the experts;
- the sums after backward (runtime/grads.py): norm weights' partial gradients over tp
  (sequence parallel), a tied weight over the embedding group, the clipping norm's squares;
- the step's loss, summed over pp (the last stage's) and averaged over dp.

Every record here is per step except the pipeline's, per microbatch (`per`). The numbers are
the ledger's (ops/ledger.py tally): tests compare the two. Not listed: fp16's found-inf
check (one float per step and group) and expert_load's counts (when called).
"""
from __future__ import annotations

import math

import sympy
import torch

from fxtron.compiler.report import CollectiveRecord
from fxtron.config import torch_dtype
from fxtron.core import layout, meta
from fxtron.core.placement import REPLICATE, Replicate
from fxtron.runtime.pp import schedules
from fxtron.runtime.dp import GradBuffer, default_bucket_size


def step_records(pm, rank: int) -> list[CollectiveRecord]:
    """The records of what `rank` communicates outside its graphs in one step (see above)."""
    rg = pm.compiled(rank)
    out: list[CollectiveRecord] = []
    if rg.stages is not None and pm.mesh.pp > 1:
        out += _pipeline(pm, rank, rg)
    out += _gradients(pm, rank, rg)
    out += _loss(pm, rank)
    return out


def _record(op: str, phase: str, group: str, ranks: tuple, shape: tuple, nbytes, wire, module: str = "",
            per: str = "step", kind: str | None = None) -> CollectiveRecord:
    return CollectiveRecord(node="", op=op, phase=phase, kind=kind or op, count=1, group=group, ranks=tuple(ranks),
                            shape=tuple(shape), payload_bytes=sympy.simplify(nbytes), wire_bytes=sympy.simplify(wire),
                            module=module, per=per)


# ----------------------------------------------------------------------------- pipeline
def _pipeline(pm, rank: int, rg) -> list[CollectiveRecord]:
    mesh, p = pm.mesh, pm.config.pipeline
    pp_ranks = mesh.group_of("pp", rank)
    me = mesh.coords(rank)["pp"]
    tp = mesh.tp
    split = p.scatter_gather and tp > 1
    out = []

    def peer(stage: int) -> int | None:
        r = schedules.rank_of(p.schedule, mesh.pp, stage)
        return None if r == me else pp_ranks[r]

    for st in rg.stages:
        moves = [("forward", "send", st.outputs, st.index + 1, False), ("forward", "recv", st.inputs, st.index - 1, False),
                 ("backward", "send", st.inputs, st.index - 1, True), ("backward", "recv", st.outputs, st.index + 1, True)]
        for phase, op, names, other, floating in moves:
            if not names or not 0 <= other < pm.stage_assignment.num_stages or peer(other) is None:
                continue
            nodes = [st.values[n] for n in names if not floating or st.values[n].meta["val"].dtype.is_floating_point]
            if not nodes:
                continue
            what = ("activations" if phase == "forward" else "gradients") + f" of stage {st.index}"
            ranks = pp_ranks
            what += f", {'to' if op == 'send' else 'from'} rank {peer(other)}"
            shapes = [meta.get(n, meta.LOCAL_SHAPE) or () for n in nodes]
            if any(any(sympy.sympify(d).free_symbols for d in s) for s in shapes):   # sizes vary: shapes first
                dims = sum(len(s) for s in shapes)
                out.append(_record(op, phase, "pp control", ranks, (dims,), dims * 8, dims * 8 if op == "send" else 0,
                                   what + ", shapes", per="microbatch"))
            for node, shape in zip(nodes, shapes):
                nbytes = layout.numel(shape, symbolic=True) * node.meta["val"].dtype.itemsize
                whole = isinstance(meta.placement(node, "tp", REPLICATE), Replicate)
                if split and whole and _divisible(layout.numel(shape, symbolic=True), tp):
                    part = nbytes / tp
                    out.append(_record(op, phase, "pp", ranks, shape, part, part if op == "send" else 0, what,
                                       per="microbatch"))
                    if op == "recv":       # the slices made whole again on arrival
                        out.append(_record("all_gather", phase, "tp", mesh.group_of("tp", rank), shape, nbytes,
                                           sympy.Rational(tp - 1, tp) * nbytes, what, per="microbatch"))
                else:
                    out.append(_record(op, phase, "pp", ranks, shape, nbytes, nbytes if op == "send" else 0, what,
                                       per="microbatch"))
    return out


def _divisible(expr, n: int) -> bool:
    """Is the element count `expr` (sympy in B and S) a multiple of n at every size?"""
    coeff, _ = sympy.sympify(expr).as_coeff_Mul()
    return coeff.is_Integer and int(coeff) % n == 0


# ----------------------------------------------------------------------------- gradients
def _gradients(pm, rank: int, rg) -> list[CollectiveRecord]:
    mesh, dpc = pm.mesh, pm.config.data_parallel
    local = rg.local
    order = [n for n in rg.param_order() if n in local]
    order += [n for n in local if n not in set(order)]
    wide = any(local[n].dtype == torch.float64 for n in order)
    reduce_dtype = torch_dtype(dpc.grad_reduce_dtype) or (torch.float64 if wide else torch.float32)
    item = torch.empty((), dtype=reduce_dtype).element_size()
    kinds: dict[str, list[str]] = {}
    for n in order:
        kinds.setdefault(local[n].grad_group, []).append(n)
    out = []
    zero = dpc.zero
    held: dict[str, int] = {n: math.prod(local[n].local_shape) for n in order}   # gradient elements summed after backward
    for kind, names in kinds.items():
        if any(local[n].flat is not None for n in names):
            continue                       # zero=3: reduce-scattered in the graph (report._fsdp_records)
        ranks = mesh.group_of(kind, rank)
        world = len(ranks)
        if world == 1:
            continue
        params = [(n, torch.empty(math.prod(local[n].local_shape), device="meta"), 1) for n in names]
        buf = GradBuffer(params, reduce_dtype, dpc.bucket_size or default_bucket_size(world), dp=world,
                         reduce_scatter=zero in (1, 2), alone=frozenset(rg.shared))
        if zero in (1, 2):        # after the reduce-scatter a rank holds (and sums) its shard's part of each
            me = ranks.index(rank)
            for b in buf.buckets:
                lo, hi = buf.shard(b, me)
                for n in b.params:
                    off, k = buf.offsets[n]
                    held[n] = max(0, min(off + k, hi) - max(off, lo))
        for b in buf.buckets:
            n = b.end - b.start
            label = f"bucket {b.index} ({len(b.params)} parameters)"
            if zero in (1, 2):
                out.append(_record("reduce_scatter", "backward", kind, ranks, (n,), n * item,
                                   sympy.Rational(world - 1, world) * n * item, label))
                # the updated shards of the parameters as held: fp32 masters under a 16-bit compute
                # dtype (the graph's values carry the compute dtype), else the parameters' own dtype
                dtype_bytes = (4 if pm.config.precision.torch_dtype is not None
                               else local[b.params[0]].dtype.itemsize)
                out.append(_record("all_gather", "step", kind, ranks, (n // world,), n * dtype_bytes,
                                   sympy.Rational(world - 1, world) * n * dtype_bytes, label))
            else:
                out.append(_record("all_reduce", "backward", kind, ranks, (n,), n * item,
                                   sympy.Rational(2 * (world - 1), world) * n * item, label))
    # partial gradients of whole weights (norms under sequence parallel), one all-reduce per axis
    by_axis: dict[str, int] = {}
    for n in order:
        for axis in local[n].partial_grad:
            by_axis[axis] = by_axis.get(axis, 0) + held[n]
    for axis, elems in by_axis.items():
        ranks = mesh.group_of(axis, rank)
        if len(ranks) > 1 and elems:
            r = len(ranks)
            out.append(_record("all_reduce", "step", axis, ranks, (elems,), elems * 4,
                               sympy.Rational(2 * (r - 1), r) * elems * 4, "partial gradients of whole weights"))
    # a tied weight over the first and last stage's ranks (Megatron's embedding group)
    first_last = (0, mesh.pp - 1)
    for name, holders in sorted(rg.shared.items()):
        if holders == first_last and mesh.pp > 1 and name in local and held[name]:
            ranks = mesh.group_of("embedding", rank)
            elems = held[name]
            r = len(ranks)
            out.append(_record("all_reduce", "step", "embedding", ranks, (elems,), elems * 4,
                               sympy.Rational(2 * (r - 1), r) * elems * 4, f"tied weight {name}"))
    if dpc.clip_grad is not None:
        out += _norm(pm, rank, kinds, zero)
    return out


def _norm(pm, rank: int, kinds: dict, zero: int) -> list[CollectiveRecord]:
    """The clipping norm's squares: over the sharded groups under zero (each rank holds 1/d),
    then over tp-pp (and tp-ep-pp for experts), one float each."""
    mesh, out = pm.mesh, []
    for kind in [k for k in kinds if k != "expert-dp"] + (["expert-dp"] if "expert-dp" in kinds else []):
        ranks = mesh.group_of(kind, rank)
        if zero and len(ranks) > 1:
            out.append(_record("all_reduce", "step", kind, ranks, (), 4, sympy.Rational(2 * (len(ranks) - 1), len(ranks)) * 4,
                               "gradient norm"))
    for kind in ("tp-pp", "tp-ep-pp"):
        if kind == "tp-ep-pp" and mesh.ep == 1:
            continue
        ranks = mesh.group_of(kind, rank)
        if len(ranks) > 1:
            out.append(_record("all_reduce", "step", kind, ranks, (), 4, sympy.Rational(2 * (len(ranks) - 1), len(ranks)) * 4,
                               "gradient norm"))
    return out


# ----------------------------------------------------------------------------- loss
def _loss(pm, rank: int) -> list[CollectiveRecord]:
    mesh, out = pm.mesh, []
    if mesh.pp > 1:
        ranks = mesh.group_of("pp", rank)
        r = len(ranks)
        out.append(_record("all_reduce", "step", "pp", ranks, (), 8, sympy.Rational(2 * (r - 1), r) * 8, "loss"))
    ranks = mesh.group_of("dp", rank)
    if len(ranks) > 1:
        r = len(ranks)
        out.append(_record("all_reduce", "step", "dp", ranks, (), 8 if mesh.pp > 1 else 4,
                           sympy.Rational(2 * (r - 1), r) * (8 if mesh.pp > 1 else 4), "loss"))
    return out


def step_bytes(records: list[CollectiveRecord], microbatches: int, batch: int, seq: int) -> int:
    """Bytes a rank sends in one step: each record's wire bytes at (batch, seq) -- batch one
    microbatch's -- times the microbatches for what runs per microbatch."""
    return sum(r.evaluate(batch, seq)[1] * (microbatches if r.per == "microbatch" else 1) for r in records)


__all__ = ["step_bytes", "step_records"]
