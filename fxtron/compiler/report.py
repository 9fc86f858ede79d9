"""Compiler: what a per-rank graph communicates — every collective with its group, shape and
bytes per training step as sympy formulas in the batch and sequence symbols B and S.

Bytes on the wire per rank follow the ring algorithms (nccl-tests' bus-bandwidth factors,
../shared/PAPERS.md section 7): all-reduce 2(n-1)/n x S, all-gather and reduce-scatter
(n-1)/n x S where S is the full (gathered / unreduced) tensor.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from tabulate import tabulate

from fxtron.core import meta
from fxtron.core.meta import BATCH, SEQ
from fxtron.mesh import Mesh
from fxtron.ops import registry
from fxtron.ops.ep import routing_args


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective a rank issues per step: `node` in the per-rank graph, forward or
    backward, its kind and count, its group (kind and global ranks), the local shape of the
    tensor it carries, and the bytes of that tensor and on the wire (sympy in B, S). `group`
    is the mesh axis the op communicates over (its group kind: "tp", "cp", ...)."""

    node: str
    op: str
    phase: str
    kind: str
    count: int
    group: str
    ranks: tuple[int, ...]
    shape: tuple
    payload_bytes: sympy.Expr
    wire_bytes: sympy.Expr
    module: str

    def evaluate(self, batch: int, seq: int) -> tuple[int, int]:
        """(payload bytes, wire bytes) at a concrete batch and sequence length."""
        sub = {BATCH: batch, SEQ: seq}
        return int(self.payload_bytes.subs(sub)), int(sympy.ceiling(self.wire_bytes.subs(sub)))


def _numel(shape) -> sympy.Expr:
    n = sympy.Integer(1)
    for s in shape:
        n *= s
    return n


def _regathered(node: fx.Node) -> bool:
    """Is `node` a sequence-parallel all-gather whose shard the fused linears it feeds save and
    gather again in backward (Megatron's sequence-parallel linear)?"""
    return (node.target == torch.ops.fxtron.gather_from_sequence.default
            and any(u.target == torch.ops.fxtron.linear.default and u.args[0] is node for u in node.users))


def _with_recomputed(gm: fx.GraphModule, records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    """The records, each forward collective of a recomputed region (passes/recompute.py) followed
    by its second run in backward (a recomputed layer's all-reduces, gathers, all-to-alls, ring)."""
    recomputed = {n.name for n in gm.graph.nodes if meta.get(n, meta.RECOMPUTE) is not None}
    out = []
    for r in records:
        out.append(r)
        if r.node in recomputed and r.phase == "forward":
            out.append(dataclasses.replace(r, phase="backward"))
    return out


def collectives(gm: fx.GraphModule, mesh: Mesh, rank: int) -> list[CollectiveRecord]:
    """Every collective of the per-rank graph `gm`, forward and backward, in graph order: what
    each registered op (ops.registry) says it communicates, over the group of `rank` on the
    axis the op names."""
    out = []
    grad = meta.carries_grad(gm)
    uniform = uniform_routing(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        spec = registry.spec_of(node.target)
        if spec is None:
            continue
        axis = registry.axis_of(node)
        ranks = tuple(mesh.group_of(axis, rank)) if axis else (rank,)
        n = len(ranks)
        for phase in ("forward", "backward"):
            comm = getattr(spec, phase)
            if comm is None or (phase == "backward" and node not in grad):
                continue                     # no gradient comes back through a value that needs none
            src = node.args[0] if comm.payload in ("input", "grad_input", "rows") else node
            shape = meta.get(src, meta.LOCAL_SHAPE) or ()
            if comm.payload == "ring":          # keys and values around the ring (ops/registry.py)
                k, v = node.args[1], node.args[2]
                steps = n - 1 if phase == "forward" else 2 * n - 1
                nbytes = sum(_numel(meta.get(a, meta.LOCAL_SHAPE)) * a.meta["val"].dtype.itemsize for a in (k, v))
                out.append(CollectiveRecord(
                    node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=steps, group=axis or "",
                    ranks=ranks, shape=tuple(meta.get(k, meta.LOCAL_SHAPE)), payload_bytes=sympy.simplify(steps * nbytes),
                    wire_bytes=sympy.simplify(steps * nbytes), module=meta.get(node, meta.MODULE) or ""))
                continue
            if comm.payload == "copies":        # expert parallel: the copies (and the per-expert counts)
                copies = node if isinstance(node.meta["val"], torch.Tensor) else node.args[0]   # combine's out, dispatch's in
                shape = meta.get(copies, meta.LOCAL_SHAPE) or ()
                nbytes = _numel(shape) * copies.meta["val"].dtype.itemsize * _padded(node)
                nbytes += (comm.count - 1) * int(node.args[1].meta["val"].shape[0]) * 8
                factor = sympy.Rational(n - 1, n)
                out.append(CollectiveRecord(
                    node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=comm.count, group=axis or "",
                    ranks=ranks, shape=tuple(shape), payload_bytes=sympy.simplify(nbytes),
                    wire_bytes=sympy.simplify(factor * nbytes), module=meta.get(node, meta.MODULE) or ""))
                continue
            if comm.payload == "shares":         # expert parallel at ep x tp: every share of the received rows
                rows = next(u for u in node.users if u.target is operator.getitem and u.args[1] == 0)
                shape = meta.get(rows, meta.LOCAL_SHAPE) or ()
                nbytes = _numel(shape) * rows.meta["val"].dtype.itemsize
                nbytes += (comm.count - 1) * _numel(node.meta["val"][2].shape) * 8
                out.append(CollectiveRecord(
                    node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=comm.count, group=axis or "",
                    ranks=ranks, shape=tuple(shape), payload_bytes=sympy.simplify(nbytes),
                    wire_bytes=sympy.simplify(sympy.Rational(n - 1, n) * nbytes), module=meta.get(node, meta.MODULE) or ""))
                continue
            if comm.payload == "rows":
                shape, itemsize = tuple(shape[:-1]), 4      # one float32 per logits row
            elif comm.payload in ("output", "grad_output") and comm.kind == "all_gather":
                shape = meta.get(node, meta.LOCAL_SHAPE)
                itemsize = node.meta["val"].dtype.itemsize
            else:
                itemsize = src.meta["val"].dtype.itemsize
            elems = _numel(shape)
            nbytes = elems * itemsize
            factor = sympy.Rational(2 * (n - 1), n) if comm.kind == "all_reduce" else sympy.Rational(n - 1, n)
            out.append(CollectiveRecord(
                node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=comm.count, group=axis or "",
                ranks=ranks, shape=tuple(shape), payload_bytes=sympy.simplify(comm.count * nbytes),
                wire_bytes=sympy.simplify(comm.count * factor * nbytes), module=meta.get(node, meta.MODULE) or ""))
            if phase == "forward" and _regathered(node):
                # the fused linears it feeds saved the shard: one all-gather again in backward (ops/linear.py)
                out.append(dataclasses.replace(out[-1], phase="backward"))
    out = _with_recomputed(gm, out)
    if uniform:
        out = [dataclasses.replace(r, payload_bytes=sympy.simplify(assume_uniform(r.payload_bytes, uniform)),
                                   wire_bytes=sympy.simplify(assume_uniform(r.wire_bytes, uniform)))
               for r in out]
    return out


def _padded(node: fx.Node):
    """The factor by which an expert-parallel all-to-all's rows exceed the copies under uniform
    routing: the capacity factor where each expert's rows are padded to capacity, else 1."""
    ops = torch.ops.fxtron
    if node.target == ops.ep_dispatch.default:
        src = node.args[0].args[0] if node.args[0].target is operator.getitem else None
        source = src if getattr(src, "target", None) == ops.ep_share.default else node    # ep x tp: the share
        capacity, pad = routing_args(source.args, 5)
    else:
        unshare = next((u for u in node.users if u.target == ops.ep_unshare.default), None)
        capacity, pad = routing_args(unshare.args, 5) if unshare is not None else routing_args(node.args, 6)
    return sympy.nsimplify(capacity) if pad else 1


def uniform_routing(gm: fx.GraphModule) -> dict:
    """The rows an expert-parallel dispatch receives are data-dependent (unbacked sizes u0,
    u1, ...); the formulas assume uniform routing, where a rank receives as many copies as it
    sends: {u's name: the dispatched copies' local rows}. `assume_uniform` substitutes it."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.fxtron.ep_dispatch.default:
            rows = node.meta["val"][0].shape[0]
            sent = meta.get(node.args[0], meta.LOCAL_SHAPE)
            src = node.args[0].args[0] if node.args[0].target is operator.getitem else None
            shares = src.args[3] if getattr(src, "target", None) == torch.ops.fxtron.ep_share.default else 1
            if isinstance(rows, torch.SymInt) and sent:
                out[str(rows.node.expr)] = sent[0] * shares * _padded(node)   # every tp rank's share, padded
    return out


def assume_uniform(expr, uniform: dict):
    """`expr` with every received-rows symbol replaced as `uniform` (uniform_routing) says."""
    expr = sympy.sympify(expr)
    return expr.subs({s: uniform[s.name] for s in expr.free_symbols if s.name in uniform}) if uniform else expr


def format_collectives(records: list[CollectiveRecord], *, batch: int | None = None, seq: int | None = None) -> str:
    rows = []
    for r in records:
        row = [r.node, f"{r.kind} x{r.count}" if r.count > 1 else r.kind, r.phase,
               f"{r.group} {list(r.ranks)}", "(" + ", ".join(str(s) for s in r.shape) + ")",
               str(r.payload_bytes), str(r.wire_bytes), r.module]
        if batch is not None and seq is not None:
            row.append(f"{r.evaluate(batch, seq)[1]:,}")
        rows.append(row)
    headers = ["node", "collective", "phase", "group", "local shape", "bytes", "wire bytes / rank", "module"]
    if batch is not None and seq is not None:
        headers.append(f"wire at B={batch}, S={seq}")
    total = sympy.simplify(sum((r.wire_bytes for r in records), sympy.Integer(0)))
    return tabulate(rows, headers=headers) + f"\n{len(records)} collectives per step; wire bytes per rank per step: {total}"


def count(records: list[CollectiveRecord], kind: str, phase: str | None = None) -> int:
    """How many collectives of `kind` (counting multi-collective ops like the cross entropy's 3)."""
    return sum(r.count for r in records if r.kind == kind and (phase is None or r.phase == phase))


def p2p_bytes(stages) -> sympy.Expr:
    """Bytes a rank sends to its pipeline neighbours per microbatch: each stage's boundary
    outputs forward and the gradients of its floating boundary inputs backward (local
    shapes, sympy in B and S)."""
    total = sympy.Integer(0)
    for st in stages:
        for names, floating_only in ((st.outputs, False), (st.inputs, True)):
            for name in names:
                node = st.values[name]
                val = node.meta["val"]
                if floating_only and not val.dtype.is_floating_point:
                    continue
                total += _numel(meta.get(node, meta.LOCAL_SHAPE) or ()) * val.dtype.itemsize
    return sympy.simplify(total)


def fmt_bytes(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)
