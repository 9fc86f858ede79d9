"""Compiler: what a per-rank graph communicates — every collective with its group, shape and
bytes per training step as sympy formulas in the batch and sequence symbols B and S.

Also ParallelModel's reports on a whole model (`summary`, and the lines of what its compilation does
less well than Megatron: ops run replicated, all-gathers, attention the cp ring cannot take).

Bytes on the wire per rank follow the ring algorithms (nccl-tests' bus-bandwidth factors): all-reduce 2(n-1)/n x S, all-gather and reduce-scatter
(n-1)/n x S where S is the full (gathered / unreduced) tensor.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from tabulate import tabulate

from fxtron.config import torch_dtype
from fxtron.ops.fsdp import read_in_backward
from fxtron.core import layout, meta
from fxtron.core.meta import BATCH, SEQ
from fxtron.mesh import Mesh
from fxtron.ops import registry
from fxtron.ops.ep import routing_args
from fxtron.passes.tp_plan import ROUTER, Rowwise, router_weights, unused_weights


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective a rank issues per step: `node` in the per-rank graph, forward or
    backward, its kind and count, its group (kind and global ranks), the local shape of the
    tensor it carries, and the bytes of that tensor and on the wire (sympy in B, S). `group`
    is the mesh axis the op communicates over (its group kind: "tp", "cp", ...). `per`: how
    often it runs, once per "microbatch" (a graph's collectives, a pipeline transfer; B is then
    a microbatch's batch) or once per "step" (the data-parallel reduction, fxtron/tools/step_comm.py)."""

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
    per: str = "microbatch"

    def evaluate(self, batch: int, seq: int) -> tuple[int, int]:
        """(payload bytes, wire bytes) at a concrete batch and sequence length."""
        sub = {BATCH: batch, SEQ: seq}
        return int(self.payload_bytes.subs(sub)), int(sympy.ceiling(self.wire_bytes.subs(sub)))


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
                nbytes = sum(layout.numel(meta.get(a, meta.LOCAL_SHAPE), symbolic=True) * a.meta["val"].dtype.itemsize for a in (k, v))
                out.append(CollectiveRecord(
                    node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=steps, group=axis or "",
                    ranks=ranks, shape=tuple(meta.get(k, meta.LOCAL_SHAPE)), payload_bytes=sympy.simplify(steps * nbytes),
                    wire_bytes=sympy.simplify(steps * nbytes), module=meta.get(node, meta.MODULE) or ""))
                continue
            if comm.payload == "edges":         # a split scan: the last element of each chunk, gathered
                x = node.args[0]
                xs = meta.get(x, meta.LOCAL_SHAPE) or ()
                chunks = 2 if node.args[3 if spec.name == "shard_prev" else 2] else 1
                nbytes = layout.numel(xs, symbolic=True) / xs[int(node.args[1]) % len(xs)] * chunks * n * node.meta["val"].dtype.itemsize
                out.append(CollectiveRecord(
                    node=node.name, op=spec.name, phase=phase, kind=comm.kind, count=comm.count, group=axis or "",
                    ranks=ranks, shape=tuple(xs), payload_bytes=sympy.simplify(nbytes),
                    wire_bytes=sympy.simplify(sympy.Rational(n - 1, n) * nbytes), module=meta.get(node, meta.MODULE) or ""))
                continue
            if comm.payload == "hierarchical":  # a2a+p2p: all-to-alls in the group, the ring across groups
                out += _hierarchical_records(node, spec.name, phase, mesh, rank)
                continue
            if comm.payload == "params":        # zero=3: a layer's pieces gathered whole (ops/fsdp.py)
                out += _fsdp_records(node, spec.name, phase, axis or "", ranks, mesh, rank)
                continue
            if comm.payload == "copies":        # expert parallel: the copies (and the per-expert counts)
                copies = node if isinstance(node.meta["val"], torch.Tensor) else node.args[0]   # combine's out, dispatch's in
                shape = meta.get(copies, meta.LOCAL_SHAPE) or ()
                nbytes = layout.numel(shape, symbolic=True) * copies.meta["val"].dtype.itemsize * _padded(node)
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
                nbytes = layout.numel(shape, symbolic=True) * rows.meta["val"].dtype.itemsize
                nbytes += (comm.count - 1) * layout.numel(node.meta["val"][2].shape, symbolic=True) * 8
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
            elems = layout.numel(shape, symbolic=True)
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


def _hierarchical_records(node: fx.Node, op: str, phase: str, mesh, rank: int) -> list[CollectiveRecord]:
    """cp_comm_type='a2a+p2p' (ops/cp/hierarchical.py hierarchical_attention): in forward the
    all-to-alls of q, k, v and of the output inside the group of a2a_size ranks ((a-1)/a of each
    on the wire), and the keys and values of the head split around the ring of the groups (g-1
    steps of the rank's k and v, which hold as many elements as before the all-to-all); in
    backward the all-to-alls of the output's gradient and of dq, dk, dv, and 2g-1 ring steps."""
    q, k, v = node.args[:3]
    inner, outer = node.args[9], node.args[10]
    a = int(node.args[6])
    module = meta.get(node, meta.MODULE) or ""

    def nbytes(t):
        return layout.numel(meta.get(t, meta.LOCAL_SHAPE), symbolic=True) * t.meta["val"].dtype.itemsize

    qb, kvb = nbytes(q), nbytes(k) + nbytes(v)
    rin, rout = tuple(mesh.group_of(inner, rank)), tuple(mesh.group_of(outer, rank))
    g = len(rout)
    steps = g - 1 if phase == "forward" else 2 * g - 1
    a2a = 2 * qb + kvb                                   # q, k, v one way; the output (or dq) the other
    return [CollectiveRecord(node=node.name, op=op, phase=phase, kind="all_to_all", count=4, group=inner, ranks=rin,
                             shape=tuple(meta.get(q, meta.LOCAL_SHAPE)), payload_bytes=sympy.simplify(a2a),
                             wire_bytes=sympy.simplify(sympy.Rational(a - 1, a) * a2a), module=module),
            CollectiveRecord(node=node.name, op=op, phase=phase, kind="send_recv", count=steps, group=outer,
                             ranks=rout, shape=tuple(meta.get(k, meta.LOCAL_SHAPE)),
                             payload_bytes=sympy.simplify(steps * kvb), wire_bytes=sympy.simplify(steps * kvb),
                             module=module)]


def _fsdp_records(node: fx.Node, op: str, phase: str, group: str, ranks: tuple, mesh, rank: int
                  ) -> list[CollectiveRecord]:
    """A unit's gather (zero=3): in forward one all-gather of its parameters (padded pieces of
    every rank, in their dtype); in backward the same all-gather again (unless only embedding
    lookups read them, whose backward needs no table) and the reduce-scatter of their fp32
    gradients: 3 (n-1)/n of the bytes, where an all-reduce moves 2 (n-1)/n."""
    n = len(ranks)
    pieces = node.args[2]
    elems = sum(int(p.meta["val"].shape[0]) for p in pieces) * n
    itemsize = pieces[0].meta["val"].dtype.itemsize
    factor = sympy.Rational(n - 1, n)
    module = meta.get(node, meta.MODULE) or ""
    shape = (elems,)

    def record(kind, nbytes):
        return CollectiveRecord(node=node.name, op=op, phase=phase, kind=kind, count=1, group=group, ranks=ranks,
                                shape=shape, payload_bytes=sympy.Integer(nbytes), wire_bytes=factor * nbytes,
                                module=module)
    if phase == "forward":
        return [record("all_gather", elems * itemsize)]
    again = read_in_backward(node)      # (a table only lookups read: not gathered again)
    out = ([record("all_gather", elems * itemsize)] if again else []) + [record("reduce_scatter", elems * 4)]
    base, _, part = group.partition("/shard:")
    if part:                 # HSDP: the reduced pieces all-reduced over their replicas
        rep = f"{base}/replicate:{part}"
        rranks = tuple(mesh.group_of(rep, rank))
        r = len(rranks)
        nbytes = elems // n * 4
        out.append(CollectiveRecord(node=node.name, op=op, phase=phase, kind="all_reduce", count=1, group=rep,
                                    ranks=rranks, shape=(elems // n,), payload_bytes=sympy.Integer(nbytes),
                                    wire_bytes=sympy.Rational(2 * (r - 1), r) * nbytes, module=module))
    return out


def unsharded_zero(config, mesh) -> str:
    """What a ZeRO level asked for on a mesh with no data-parallel ranks to shard over does
    (nothing), in words; "" when it shards."""
    zero = config.data_parallel.zero
    if zero == 0 or mesh.dp * mesh.cp > 1 or mesh.edp > 1:
        return ""
    return (f"zero={zero} shards over the data-parallel ranks that hold the same weights, and this mesh has one "
            f"(dp={mesh.dp} x cp={mesh.cp}): nothing is sharded, every rank holds its whole parameters, gradients "
            f"and optimizer state")


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
                total += layout.numel(meta.get(node, meta.LOCAL_SHAPE) or (), symbolic=True) * val.dtype.itemsize
    return sympy.simplify(total)


def fmt_bytes(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return str(n)


# ----------------------------------------------------------------------------- what a model's compilation did less well
# (ParallelModel's reports: each a line per node or layer, folded over the layers where they say the same)
def by_pattern(items: dict[str, str]) -> dict[str, str]:
    """{path: text} with the layers' indices folded (model.layers.0.x, model.layers.1.x ->
    model.layers.*.x) where they say the same."""
    out: dict[str, str] = {}
    for path, text in items.items():
        pattern = re.sub(r"\.\d+\.", ".*.", path)
        out.setdefault(pattern if out.get(pattern, text) == text else path, text)
    return out


def grouped(items: dict[str, str]) -> str:
    """"path, path: why; path: why" -- the paths folded by `by_pattern`, grouped by why."""
    by_why: dict[str, list[str]] = {}
    for path, why in by_pattern(items).items():
        by_why.setdefault(why, []).append(path)
    return "; ".join(f"{', '.join(paths)}: {why}" for why, paths in by_why.items())


def fallback_lines(graphs) -> list[str]:
    """One line per node that ran replicated for want of a sharding rule (meta.FALLBACK)."""
    return [f"%{n.name} ({n.target}) in {meta.get(n, meta.MODULE) or '(top level)'}: inputs made whole over "
            f"{meta.get(n, meta.FALLBACK)}, run replicated"
            for g in graphs for n in g.graph.nodes if meta.get(n, meta.FALLBACK) is not None]


def gather_lines(graphs) -> list[str]:
    """One line per all-gather inserted because an op's rule needs a split value whole
    (meta.GATHERED): forward communication Megatron's layers would not issue."""
    return [f"%{n.name} in {meta.get(n, meta.MODULE) or '(top level)'}: {meta.get(n, meta.GATHERED)}"
            for g in graphs for n in g.graph.nodes if meta.get(n, meta.GATHERED) is not None]


def local_orders(graphs) -> list[str]:
    """The modules whose sorts put a split dim in a rank-local order (passes/rules/order.py)."""
    out = []
    for gm in graphs:
        for node in gm.graph.nodes:
            p = meta.placement(node, "cp") if node.op == "call_function" else None
            first = p[0] if isinstance(p, tuple) else p
            if getattr(first, "order", "") == f"%{node.name}":
                out.append(meta.get(node, meta.MODULE) or node.name)
    return list(dict.fromkeys(out))


def unringed_attention(graphs) -> list[str]:
    """The modules whose attention gathers keys over cp (attention written out in a form the
    ring's pattern does not take -- einsums, say -- which the generic rules split by query
    rows), as patterns."""
    mods = {re.sub(r"\.\d+(\.|$)", r".*\1", meta.get(n, meta.MODULE) or "(top level)")
            for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target == torch.ops.fxtron.gather_from_sequence.default and n.args[3] == "cp"}
    return sorted(mods)


# the cp ops whose attention runs block by block (ops/cp/blocks.py): (mask, causal, dropout) arg positions
_BLOCK_OPS = {"ring_attention": (3, 5, 8), "masked_attention": (3, None, 7), "hierarchical_attention": (3, 5, 11)}


def cp_block_note(config, graphs) -> str:
    """One line: the kernels the cp attention blocks take (codegen/attention.py `block_kernel`),
    decided from static facts only: the programs' device, the compute dtype, each op's mask
    kind, head dims and dropout. Empty when no graph has a ring-style cp attention."""
    from fxtron.codegen.attention import MATMUL, block_kernel, mask_kind
    device = config.inputs.resolved_device()
    takes: dict[str, set[str]] = {}
    additive = False
    for g in graphs:
        for n in g.graph.nodes:
            name = getattr(n.target, "__name__", "").split(".")[0] if n.op == "call_function" else ""
            if getattr(n.target, "namespace", None) != "fxtron" or name not in _BLOCK_OPS:
                continue
            m_at, c_at, p_at = _BLOCK_OPS[name]
            if not all(isinstance(a, fx.Node) for a in n.args[:3]):
                continue
            q, v, mask = n.args[0].meta.get("val"), n.args[2].meta.get("val"), n.args[m_at]
            if q is None or v is None:
                continue
            mask_val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
            kind = "none" if mask is None else mask_kind(mask_val) if mask_val is not None else "additive"
            additive = additive or kind == "additive"
            causal = bool(n.args[c_at]) if c_at is not None and len(n.args) > c_at else False
            dropout = float(n.args[p_at] if len(n.args) > p_at else n.kwargs.get("dropout_p", 0.0) or 0.0)
            dtype = config.precision.torch_dtype or q.dtype
            where = re.sub(r"\.\d+(\.|$)", r".*\1", meta.get(n, meta.MODULE) or n.name)
            why = ", ".join(x for x in ("dropout" if dropout else "", f"{kind} mask" if kind != "none" else "",
                                        "causal" if causal else "",
                                        "values' head dim differs" if q.shape[-1] != v.shape[-1] else "") if x)
            # a causal op's diagonal blocks are causal, its other blocks unmasked
            for c in ((True, False) if causal else (False,)):
                k = block_kernel(device, dtype, kind, int(q.shape[-1]), int(v.shape[-1]), dropout=bool(dropout),
                                 causal=c)
                takes.setdefault(k, set()).add(f"{where} ({name}{': ' + why if why else ''})"
                                               if k == MATMUL else where)
    if not takes:
        return ""
    parts = [f"{_KERNEL_WORDS[k]} for {', '.join(sorted(w))}" for k, w in sorted(takes.items())]
    if additive and device == "cuda":
        parts.append("matmuls in backward where a row sees no key under an additive mask (found at run time)")
    dtypes = sorted({str(config.precision.torch_dtype or n.args[0].meta["val"].dtype).removeprefix("torch.")
                     for g in graphs for n in g.graph.nodes
                     if n.op == "call_function" and getattr(n.target, "namespace", None) == "fxtron"
                     and getattr(n.target, "__name__", "").split(".")[0] in _BLOCK_OPS
                     and isinstance(n.args[0], fx.Node) and "val" in n.args[0].meta})
    return f"cp attention blocks on {device} ({'/'.join(dtypes)}): " + "; ".join(parts)


_KERNEL_WORDS = {"flash": "fused: flash attention", "efficient": "fused: memory-efficient attention",
                 "cpu_flash": "fused: torch's CPU flash kernel",
                 "matmul": "matmuls (each block's scores materialized in fp32)"}


VECTORS = "vectors (norm weights, biases): replicated, as in Megatron"
POSITIONS = "an embedding not looked up with the token ids (positions): replicated, as in Megatron"
TABLE = ("a position table (read by position, added to the token embeddings): replicated, as Megatron's "
         "position embeddings")
ROW_BIAS = ("a row-parallel layer's bias (the experts' (experts, out), gpt-oss'), added once after the sum: "
            "replicated, as in Megatron")
NO_RULE = "no rule splits it: held whole on every rank"
UNUSED = "not read by the traced forward (no input of the example reaches it): held whole, unsplit"


@dataclass(frozen=True)
class Held:
    """Parameters that model parallelism leaves whole on every rank, for one reason: `loud`
    where Megatron would split them (fxtron could not), quiet where Megatron keeps them whole."""

    why: str
    names: tuple[str, ...]
    numel: int
    loud: bool


def held_whole(local: dict, tp_plan, routers: set[str] = frozenset(),
               unused: set[str] = frozenset()) -> tuple[int, list[Held]]:
    """Every parameter of a rank accounted for at tp > 1: (the model's parameter count, the
    groups of those held whole with their reason). A parameter is split when a model-parallel
    axis (tp, ep) shards it; the others are a replicated linear (the plan's reason), a vector,
    a position table (an embedding's, or tp_plan.position_tables'), a router (`routers`:
    tp_plan.router_weights), one the traced forward never reads (`unused`:
    tp_plan.unused_weights), or whole for want of a rule -- so the split count and the groups
    add up to every parameter, and none is held whole without a line saying why."""
    layers = {layer.weight: layer for layer in tp_plan.layers.values()} if tp_plan is not None else {}
    row_biases = {layer.bias for layer in tp_plan.layers.values()
                  if layer.bias and isinstance(tp_plan.style(layer.path), Rowwise)} if tp_plan is not None else set()
    groups: dict[tuple[str, bool], list[tuple[str, int]]] = {}
    total = 0
    for name, lp in local.items():
        n = math.prod(lp.full_shape)
        total += n
        if any(s.axis in ("tp", "ep") for s in lp.shards):
            continue
        layer = layers.get(name)
        path = layer.path if layer is not None else name.rsplit(".", 1)[0]
        unsplit = tp_plan.replicated.get(path) if tp_plan is not None else None
        if unsplit is not None:
            key = (unsplit.why, unsplit.loud)
        elif tp_plan is not None and name in tp_plan.kept:
            key = ("replicated by the plan", False)
        elif sum(d > 1 for d in lp.full_shape) <= 1:      # (a (1, 1, D) class token is a vector too)
            key = (VECTORS, False)
        elif name in routers:
            key = (ROUTER, False)
        elif name in unused:
            key = (UNUSED, False)
        elif layer is not None and layer.kind == "embedding":
            key = (POSITIONS, False)
        elif name in row_biases:
            key = (ROW_BIAS, False)
        elif tp_plan is not None and name in tp_plan.positions:
            key = (TABLE, False)
        else:
            key = (NO_RULE, True)
        groups.setdefault(key, []).append((name, n))
    held = [Held(why, tuple(n for n, _ in items), sum(k for _, k in items), loud)
            for (why, loud), items in groups.items()]
    return total, sorted(held, key=lambda h: (not h.loud, -h.numel))


def held_note(local: dict, tp_plan, tp: int, routers: set[str] = frozenset(), unused: set[str] = frozenset()) -> str:
    """The summary's accounting line: the share of the parameters split, then each group held
    whole with its reason and share."""
    total, held = held_whole(local, tp_plan, routers, unused)
    if not total:
        return ""
    whole = sum(h.numel for h in held)
    parts = [f"{100 * h.numel / total:.1f}% " + (f"{', '.join(by_pattern({n: '' for n in h.names}))} ({h.why})"
                                               if h.loud or len(h.names) <= 2 else f"in {len(h.names)} tensors, {h.why}")
             for h in held]
    return (f"parameters at tp={tp}: {100 * (total - whole) / total:.1f}% split; held whole on every rank: "
            + ("; ".join(parts) if parts else "none"))


def ep_tp_note(mesh: Mesh, traced: fx.GraphModule, tp_plan) -> str:
    """What ep x tp costs beyond Megatron: the layers whose tp ranks dispatch the copies whole
    (empty without both, or when every layer dispatches shares, Megatron's order)."""
    if mesh.ep == 1 or mesh.tp == 1:
        return ""
    from fxtron.passes.ep import moe_layers, unshared
    whole = {layer.name: why for layer in moe_layers(traced) if (why := unshared(layer, tp_plan)) is not None}
    if not whole:
        return ""
    return (f"at ep={mesh.ep} x tp={mesh.tp} the tp ranks of {', '.join(whole)} dispatch the copies whole "
            f"({'; '.join(sorted(set(whole.values())))}), so each of their all-to-alls carries {mesh.tp}x the "
            f"bytes of Megatron's, whose tp ranks each dispatch a part and gather the received rows over tp")


def recompute_note(config, mesh: Mesh, pipelined: bool, compiled) -> str:
    """One line: how activations are recomputed and the regions found, per pp rank
    (`compiled(rank)` gives a rank's RankGraph)."""
    from fxtron.passes.recompute import region_labels
    granularity, method, layers = config.recompute.resolved()
    if granularity == "selective":
        how = "selective: every attention core's scores, softmax and dropout recomputed in backward from q, k, v"
    else:
        how = (f"full, {method} {layers}: " +
               (f"layers in groups of {layers}, each group keeping only its input" if method == "uniform" else
                f"the first {layers} layer(s) of every stage keep only their inputs"))
    regions: dict[int, list[str]] = {}     # per pp rank (the stages differ; tp, cp, ep, dp ranks do not)
    for pp in range(mesh.pp):
        rank = next(q for q in range(mesh.world_size) if mesh.coords(q)["pp"] == pp)
        regions[pp] = [label for g in compiled(rank).graphs for label in region_labels(g)]
    where = "; ".join((f"pp rank {pp}: " if pipelined else "")
                      + (", ".join(labels) if len(labels) <= 4 else
                         f"{', '.join(labels[:2])}, ... {labels[-1]} ({len(labels)} regions)")
                      for pp, labels in sorted(regions.items())) or "none found"
    return f"recompute {how}. Regions: {where}"


def _few(items: list[str], n: int = 3) -> str:
    return "; ".join(items[:n]) + (f"; and {len(items) - n} more" if len(items) > n else "")


def per_microbatch_note(mesh: Mesh, microbatches: int, summed: list[str]) -> str:
    """The warning that the statistics the loss uses nonlinearly (or a buffer's new value) are
    each microbatch's."""
    return (f"with microbatches={microbatches}, {len(summed)} statistic(s) of the batch the loss uses nonlinearly "
            f"(or a buffer written in the forward takes) "
            f"are computed per microbatch" + (f" (summed over dp={mesh.dp})" if mesh.dp > 1 else "")
            + ", not over the global batch as one process "
            f"computes them, so the terms built from them are the mean of the microbatches' terms: {_few(summed)} "
            f"(a load-balancing loss's tokens per expert, as Megatron and gradient accumulation compute it; a running "
            f"average of a batch mean kept in a buffer, updated once a microbatch; a mean "
            f"weighted by weights the forward computes or writes divides by each microbatch's); the loss's token means still divide "
            f"by the global batch's count")


def statistics_note(mesh: Mesh, config, report) -> str:
    """What passes/statistics.py made of the model's batch-wide statistics (its report), in
    words: which are the global batch's and how, and which stay each rank's (a change of the
    model, moe_aux_loss='local')."""
    if report is None:
        return ""
    pieces = mesh.dp * config.pipeline.microbatches
    parts = []
    if report.selected:
        parts.append(f"losses over selected elements (x[mask]) written over every element, the mask in their math "
                     f"({_few(report.selected)})")
    if report.global_counts:
        parts.append(f"token means divide by the global batch's count ({_few(report.global_counts)})")
    if report.scaled:
        parts.append(f"sums over tokens summed over the global batch ({_few(report.scaled)})")
    if report.summed:
        parts.append(f"statistics the loss uses nonlinearly, or a buffer takes, summed over dp={mesh.dp}, per microbatch "
                     f"({_few(report.summed)})")
    if report.per_microbatch:
        parts.append(f"statistics the loss uses nonlinearly, or a buffer takes, each microbatch's, not the global "
                     f"batch's -- a change of "
                     f"the model ({_few(report.per_microbatch)})")
    if report.gathered:
        parts.append(f"in-batch negatives gathered over dp={mesh.dp} with their gradient and the targets moved to the "
                     f"rank's rows among them (CLIP's gathered negatives; {_few(report.gathered)})")
    if report.synced:
        parts.append(f"batch norms' mean and variance over every dp rank's samples and their running statistics "
                     f"from those, the same on every rank (SyncBatchNorm; {_few(report.synced)})")
    text = (f"batch statistics over the global batch ({mesh.dp} dp x {config.pipeline.microbatches} microbatches = "
            f"{pieces} pieces): " + ("; ".join(parts) if parts else "none the loss depends on"))
    if report.local:
        text += (f"\nbatch statistics left per data-parallel rank (moe_aux_loss='local', Megatron's default) -- a change "
                 f"of the model: the loss averages each rank's own value of {_few(report.local)}, not the global "
                 f"batch's; moe_aux_loss='global' computes them as one process does")
    return text


def cuda_graphs_note(config, graphs) -> str:
    """One line: how cuda_graphs=True runs rank 0's step (runtime/graphs.py), or what in its
    graphs the program build will refuse (codegen/regions.py host_bound)."""
    from fxtron.codegen.regions import host_bound
    bound = host_bound(graphs)
    if bound:
        return "cuda_graphs=True: refused at program build: " + "; ".join(bound)
    w = config.codegen.cuda_graph_warmup
    return (f"cuda_graphs=True: the whole step (forward, backward, gradient sync, optimizer) runs eagerly for {w} "
            f"warm-up step(s) on a side stream, is captured in one CUDA graph on step {w + 1} and replayed from then "
            "on; each batch is copied into static buffers (one shape), the loss and the gradient norm are read after "
            "the replay, Adam / AdamW are made capturable (the lr a device tensor); NCCL groups only")


def summary(*, model, mesh: Mesh, traced: fx.GraphModule, config, tp_plan, stage_assignment, compiled,
            schedule: str = "", bubble: str = "", batch: int | None = None, seq: int | None = None,
            init: str = "", step_records=None) -> str:
    """ParallelModel.summary's text (see there): the model-wide notes, then a row per rank
    that differs in more than its dp coordinate. `compiled(rank)` gives a rank's RankGraph;
    `schedule` and `bubble` the pipeline schedule's title and bubble formula; `init` how a meta
    model is initialized (runtime.materialize.init_note); `step_records(rank)` what the rank
    sends outside its graphs (fxtron/tools/step_comm.py): the dp and p2p columns are their sums, and
    the last column everything the rank sends in a step, the sum of pm.collectives(rank)."""
    from fxtron.passes.ep import moe_layers
    rows, seen, fell, gathered = [], set(), set(), set()
    every_local: dict = {}
    dp = mesh.dp
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        if (c["tp"], c["pp"], c["cp"]) in seen:
            continue
        seen.add((c["tp"], c["pp"], c["cp"]))
        rg = compiled(rank)
        every_local.update(rg.local)    # (each pipeline stage's parameters: the accounting covers the model)
        fell.update(fallback_lines(rg.graphs))
        gathered.update(gather_lines(rg.graphs))
        recs = [r for g in rg.graphs for r in collectives(g, mesh, rank)]
        fsdp = [r for r in recs if r.op == "fsdp_gather"]       # zero=3's gathers and reduce-scatters
        recs = [r for r in recs if r.op != "fsdp_gather"]
        tp_wire = sum((r.wire_bytes for r in recs), sympy.Integer(0))
        if batch is not None and seq is not None:
            tp_wire = fmt_bytes(int(sum(r.evaluate(batch, seq)[1] for r in recs)))
        expert_bytes = sum(math.prod(p.local_shape) * p.dtype.itemsize for p in rg.local.values()
                           if p.grad_group == "expert-dp")
        d, e = dp * mesh.cp, mesh.edp   # the dp-cp group reduces the gradients, expert-dp the experts'
        # ring all-reduces of the gradients
        dp_wire = 2 * (d - 1) / d * (rg.param_bytes - expert_bytes) + 2 * (e - 1) / e * expert_bytes
        # the parameters as the rank holds them: under a 16-bit compute dtype fp32 masters (the
        # graph's values carry the compute dtype; the 16-bit copies live during the step)
        master = config.precision.torch_dtype is not None
        held = [(math.prod(p.held_shape), math.prod(p.held_shape)
                 * (4 if master and p.dtype.is_floating_point and p.dtype.itemsize < 4 else p.dtype.itemsize))
                for p in rg.local.values()]
        if fsdp:      # zero=3: the pieces held, and per layer gather, gather again, reduce-scatter
            dp_wire = float(sum(r.wire_bytes for r in fsdp))
        around = step_records(rank) if step_records is not None else None
        m = config.pipeline.microbatches

        def total(records, times=1):
            if batch is not None and seq is not None:
                return fmt_bytes(times * sum(r.evaluate(batch, seq)[1] for r in records))
            return str(sympy.simplify(times * sum((r.wire_bytes for r in records), sympy.Integer(0))))
        if around is not None:
            dp_recs = [r for r in around if r.group.split("/")[0] in ("dp", "dp-cp", "expert-dp")]
            if dp_recs and not fsdp:
                dp_wire = float(sum(r.wire_bytes for r in dp_recs if not r.wire_bytes.free_symbols))
        row = [rank, mesh.describe(rank).split(": ", 1)[1], f"{sum(n for n, _ in held):,}",
               fmt_bytes(sum(b for _, b in held)),
               f"{count(recs, 'all_reduce')} AR, {count(recs, 'all_gather')} AG, {count(recs, 'reduce_scatter')} RS"
               + (f", {count(recs, 'send_recv')} ring" if count(recs, 'send_recv') else "")
               + (f", {count(recs, 'all_to_all')} A2A" if count(recs, 'all_to_all') else ""),
               str(tp_wire), fmt_bytes(dp_wire) if d > 1 or e > 1 else "-"]
        if rg.stages is not None:
            if around is not None:
                sent = total([r for r in around if r.group in ("pp", "pp control")])
            else:
                sent = p2p_bytes(rg.stages)
                if batch is not None and seq is not None:
                    sent = fmt_bytes(int(sent.subs({BATCH: batch, SEQ: seq})))
            row += [",".join(str(st.index) for st in rg.stages), str(sent)]
        if around is not None:
            every = recs + fsdp + around
            if batch is not None and seq is not None:
                row.append(fmt_bytes(sum(r.evaluate(batch, seq)[1] * (m if r.per == "microbatch" else 1) for r in every)))
            else:
                row.append(str(sympy.simplify(sum((r.wire_bytes * (m if r.per == "microbatch" else 1) for r in every),
                                                  sympy.Integer(0)))))
        rows.append(row)
    head = (f"{type(model).__name__} on {mesh}\n"
            f"parameters {sum(p.numel() for p in model.parameters()):,} "
            f"({len(meta.info(traced).params)} tensors), graph nodes {len(traced.graph.nodes)}\n"
            f"trace: {meta.info(traced).layers}")
    if tp_plan is not None:
        # one entry per layer pattern: blocks.0.attn.qkv, blocks.1.attn.qkv -> blocks.*.attn.qkv
        styles: dict[str, str] = {}
        for path, style, _ in tp_plan.table():
            if style != "replicate":
                styles.setdefault(re.sub(r"\.\d+\.", ".*.", path), style)
        head += "\nplan: " + ", ".join(f"{p}={s}" for p, s in styles.items())
        if tp_plan.notes:
            head += "\nnotes: " + "; ".join(tp_plan.notes)
        if tp_plan.replicated:
            head += "\nreplicated linears: " + grouped({p: u.why for p, u in tp_plan.replicated.items()})
        head += "\n" + held_note(every_local, tp_plan, mesh.tp, router_weights(traced), unused_weights(traced))
    if fell:
        head += "\nops run replicated for want of a sharding rule: " + "; ".join(sorted(fell))
    unsharded = unsharded_zero(config, mesh)
    if unsharded:
        head += "\ndata parallel: " + unsharded
    if gathered:
        head += ("\nall-gathers Megatron's layers would not issue (forward; where the gathered value then meets a "
                 "split op, its gradient is gathered in backward too, counted in the table's AG): "
                 + "; ".join(sorted(gathered)))
    comm_type = config.context.comm_type
    if mesh.cp > 1:
        head += (f"\ncontext parallel: sequence split over cp={mesh.cp} (load-balanced chunks), attention by "
                 f"{comm_type}; gradients reduced over dp-cp")
        if comm_type == "a2a+p2p":
            head += f" (a2a inside groups of {config.context.a2a_size} cp ranks, the ring across them)"
        if config.context.documents is not None:
            head += (f"; packed documents balanced document by document (Megatron's THD): each row's tokens reordered "
                     f"by the chunk of their document in {config.context.documents}= before the split, proved not to "
                     f"change the model's numbers")
        unringed = unringed_attention(compiled(0).graphs) if comm_type != "all_gather" else []
        if unringed:
            head += f"; attention written out by hand gathers its keys instead: {', '.join(unringed)}"
        routed = local_orders(compiled(0).graphs)
        if routed:
            head += (f"; {len(routed)} sort(s) of the tokens' copies run on each rank's own tokens (a mixture of "
                     f"experts routing them, in a rank-local order): {', '.join(routed)}")
        blocks = cp_block_note(config, compiled(0).graphs)
        if blocks:
            head += "\n" + blocks
    if mesh.ep > 1:
        x = config.experts
        layers = moe_layers(traced)
        counts = sorted({layer.n_experts for layer in layers})
        head += (f"\nexpert parallel: {len(layers)} mixture-of-experts layer(s) of {'/'.join(map(str, counts))} experts "
                 f"over ep={mesh.ep} ({'/'.join(str(c // mesh.ep) for c in counts)} per rank), tokens "
                 f"dispatched and combined by all-to-all ("
                 + ("dropless" if not x.capacity_factor else
                    f"capacity factor {x.capacity_factor}: each rank's copies over an expert's "
                    f"capacity dropped, a change of the model"
                    + ("; each expert's rows padded to its capacity, fixed all-to-all splits"
                       if x.pad_to_capacity else "")) + "); expert gradients reduced over expert-dp "
                 f"({mesh.edp} rank(s)), the rest over {'dp-cp' if mesh.cp > 1 else 'dp'} ({dp * mesh.cp})")
        note = ep_tp_note(mesh, traced, tp_plan)
        if note:
            head += f"; {note}"
        elif mesh.tp > 1:
            head += (f"; at tp={mesh.tp} each tp rank dispatches 1/{mesh.tp} of every expert's copies and the "
                     f"rows received are gathered over tp (Megatron's order)")
    if config.recompute.granularity is not None:
        head += "\n" + recompute_note(config, mesh, stage_assignment is not None, compiled)
    stats = meta.info(compiled(0).gm).statistics_report
    note = statistics_note(mesh, config, stats)
    if note:
        head += "\n" + note
    if config.codegen.compile:
        from fxtron.codegen.regions import holds_comm, plan
        from fxtron.compiler.passmanager import linears_in_regions
        comm = linears_in_regions(config, mesh.view(0))
        held = mesh.tp > 1 and all(holds_comm(g, comm) for g in compiled(0).graphs)
        head += (f"\ncompile=True: on rank 0, {plan(compiled(0).graphs, comm).line()}, on the first step; the fxtron ops "
                 "(collectives, fused linears, attention blocks, random draws) run as they are between them"
                 + ((" (tensor parallel's " + ("gathers and reduce-scatters over the sequence"
                                                if config.tensor.sequence_parallel else "all-reduces")
                     + " inside them, calls in the compiled graphs)") if held else ""))
        if config.precision.gradient_accumulation_fusion and comm:
            # what rank 0's graphs hold, not what the configuration would give (the model's own
            # 16-bit weights stay fused)
            ops = [n.target for g in compiled(0).graphs for n in g.graph.nodes]
            master, fused = ops.count(torch.ops.fxtron.master_linear.default), ops.count(torch.ops.fxtron.linear.default)
            how = (f"{master} fxtron::master_linear cast the fp32 weight inside the region and return its weight "
                   "gradient accumulated in fp32, the fused linear's number" if master else
                   "fp32: autograd's weight gradient, added into main_grad, is the same number"
                   if config.precision.torch_dtype is None else None)
            if how is not None:
                head += ("; the linears are left to the compiled regions, not fused: one region runs where one per "
                         f"linear would (compiler/passmanager.py linears_in_regions; {how}"
                         + (f"; {fused} stay fused, their weights 16-bit in the model" if fused else "") + ")")
    else:
        from fxtron.compiler.passmanager import linears_to_autograd
        if linears_to_autograd(config, mesh.view(0)):
            fused = [n for g in compiled(0).graphs for n in g.graph.nodes if n.target == torch.ops.fxtron.linear.default]
            head += ("\nlinears with fp32 weights: nothing defers their weight gradients (no tp, cp, zero=3 or zero-bubble "
                     "schedule), so they are left to autograd, not fused: its weight gradient, added into main_grad "
                     "in place, is the fused linear's number, without a Python autograd Function per linear "
                     "(compiler/passmanager.py linears_to_autograd)"
                     + (f"; {len(fused)} stay fused, their weights 16-bit in the model" if fused else ""))
    narrow = {}
    for prm in model.parameters():
        if prm.dtype in (torch.bfloat16, torch.float16):
            narrow[prm.dtype] = narrow.get(prm.dtype, 0) + prm.numel()
    if narrow and config.precision.torch_dtype is None:
        held = ", ".join(f"{n:,} in {str(d).removeprefix('torch.')}" for d, n in narrow.items())
        total = sum(prm.numel() for prm in model.parameters())
        head += (f"\nprecision: the model holds {held} of its {total:,} parameters, and no dtype= was given: they train "
                 f"in their own dtype, as the model in one process does, without fp32 master weights or gradients "
                 f"(an update below a weight's precision rounds away); dtype='bf16' gives Megatron's mixed precision "
                 f"(16-bit compute, fp32 masters and gradients)")
    if config.codegen.cuda_graphs:
        head += "\n" + cuda_graphs_note(config, compiled(0).graphs)
    reduced = torch_dtype(config.data_parallel.grad_reduce_dtype)
    if reduced in (torch.bfloat16, torch.float16):
        head += (f"\ngradients: accumulated and reduced in {config.data_parallel.grad_reduce_dtype} (grad_reduce_dtype, "
                 "Megatron's --grad-reduce-in-bf16): a change of the model's math, each microbatch's gradient and each "
                 "data-parallel sum rounded to 16 bits; the one-process number is fp32 main_grad's (grad_reduce_dtype="
                 "None)")
    if init:
        head += "\n" + init
    if mesh.world_size > 1:
        head += ("\noptimizer: SGD, Adam, AdamW and the other elementwise torch optimizers step each rank's pieces; "
                 "Adafactor, Muon and any other class step whole matrices, each gathered to an owner rank "
                 "(prog.optimizer_mode(opt)); a class fxtron does not know is stepped per parameter and warned of "
                 "unless fxtron.optimizer_reads(opt, 'element' | 'parameter' | 'all') says what its update reads")
    per = "microbatch" if config.pipeline.microbatches > 1 else "step"
    # the graphs' collectives: over tp, cp, ep, and over dp where the model's batch math is (passes/statistics.py)
    over = [a for a in ("tp", "cp", "ep") if getattr(mesh, a) > 1]
    if stats is not None and (stats.summed or stats.synced or stats.gathered):
        over.append("dp")
    axes = "+".join(over) or "tp"
    headers = ["rank", "coords", "params", "param bytes", f"{axes} collectives / {per}", f"{axes} wire bytes / {per}",
               ("dp-cp" if mesh.cp > 1 else "dp") + (" + expert-dp" if mesh.ep > 1 else "") + " grad sync sent / step"]
    if stage_assignment is not None:
        headers += ["stages", "p2p sent / microbatch"]
        head += f"\nschedule {schedule}; bubble over ideal time: {bubble} (its order simulated at unit F, B, W)"
    if step_records is not None:
        headers.append("sent / step (all)")
    return head + "\n" + tabulate(rows, headers=headers)
