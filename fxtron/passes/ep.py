"""Passes, expert parallel: each mixture-of-experts layer's experts split over the ep ranks, the
tokens moved to them and back (Megatron's dropless all-to-all dispatcher).

A layer is found on the graph with no model knowledge: grouped GEMMs (passes/tp_plan.py's
`_is_grouped_mm`: aten._grouped_mm, transformers' fallback, fxtron::grouped_mm) whose weight is a
3-D parameter (the experts first, possibly transposed) and which share one offsets node -- the
cumulative token counts per expert of the copies sorted by expert. Its *region* is every node
on a path from one of those GEMMs to another (gate/up -> activation -> down); what enters it
is the sorted copies, what leaves it the last GEMM's rows in the same order.

The rewrite, per layer:

    copies (S, h) sorted by expert, offs (E,)
      -> ep_dispatch(copies, offs, "ep", n) -> rows (R, h), local offs (E/n,), counts (n, E/n)
      -> the region, its GEMMs over this rank's E/n experts with the local offsets
      -> ep_combine(out, offs, counts, S, "ep", n) -> (S, h'), the copies' order again

so everything around the region -- the router, top-k, the sort, the inverse permutation, the
weighting and the per-token sum -- runs on the rank's own tokens, as in Megatron, and the
experts' weights are Shard(0) over ep (rank r holds experts [r E/n, (r+1) E/n), Megatron's
local_expert_indices). On the ep axis every other value is Replicate: the ep ranks are data-
parallel ranks of the dense layers, each with its own tokens, and nothing else communicates
over ep. An expert weight's gradient is then this rank's experts' gradient over the tokens of
every ep rank, summed over expert-dp (core/params.LocalParam.grad_group).
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from fxtron.core import meta
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.errors import ParallelizeError
from fxtron.ops import ep as _ep_ops  # noqa: F401 - registers fxtron::ep_dispatch / ep_combine
from fxtron.ops import registry
from fxtron.passes.propagate import AxisLayout
from fxtron.passes.rules import Ctx, order, register_rule
from fxtron.passes.rules.order import DISPATCHED, OFFSET_CHAIN

aten = torch.ops.aten
AXIS = "ep"
TP = "tp"
_VIEWS = {aten.transpose.int, aten.permute.default, aten.t.default, aten.alias.default}
#: the ops that count the copies per expert
_COUNTS = {aten.histc.default, aten.bincount.default}


@register_rule("fxtron::ep_dispatch", "fxtron::ep_combine")
def _moves_rows(c: Ctx):
    """The dispatch and the combine move whole rows between the ep ranks (linear in them): a
    split of the features (a column-split expert's output) or a partial sum (a row-split one's)
    passes through on any other axis, and so does a tp rank's share of the rows (ep_share,
    ep_scatter); the offsets and counts stay whole. Copies in a rank-local order (context
    parallel: each rank sorted its own tokens' copies, rules/order.py) are dispatched as they
    are, by the rank's own counts: the rows received are in an order of their own, and the
    combine puts them back in the copies' order."""
    p = c.p[0]
    is_dispatch = isinstance(c.node.meta.get("val"), (tuple, list))
    if order.ordered(p):
        if any(not (q.is_partial() or q.is_replicate() or order.ordered(q)) for q in c.p[1:]):
            raise c.fail("the counts of the copies in a rank-local order must be the rank's own (partial sums)")
        if is_dispatch:
            return (Shard(0, order=p.order + DISPATCHED), PARTIAL, PARTIAL), [None] * len(c.p)
        if not p.order.endswith(DISPATCHED):
            raise c.fail(f"combines rows in the order {p.order}, not rows fxtron::ep_dispatch gave this rank")
        return Shard(0, order=p.order[:-len(DISPATCHED)]), [None] * len(c.p)
    keep = (p.is_partial() or p.is_replicate() or (isinstance(p, Shard) and p.dim > 0)
            or (p == Shard(0) and _is_share(c.node.args[0])))
    out = p if keep else REPLICATE
    expects = [None if keep else REPLICATE] + [REPLICATE] * (len(c.p) - 1)
    return ((out, REPLICATE, REPLICATE) if is_dispatch else out), expects


def _is_share(node) -> bool:
    """Is `node` a tp rank's share of a layer's copies -- ep_share's rows, ep_scatter's?"""
    if isinstance(node, fx.Node) and node.target is operator.getitem:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target in (torch.ops.fxtron.ep_share.default,
                                                         torch.ops.fxtron.ep_scatter.default)


def _own_axis(c: Ctx) -> bool:
    return registry.axis_of(c.node) == c.axis


@register_rule("fxtron::ep_share", "fxtron::ep_gather", "fxtron::ep_scatter", "fxtron::ep_unshare")
def _shares(c: Ctx):
    """Over tp (their axis), a tp rank's share of each expert's copies is Shard(0) -- rows split
    over tp, unevenly and by expert: ep_share takes the copies whole, ep_gather makes the
    dispatched shares whole, ep_scatter turns the experts' partial sum into this rank's share,
    ep_unshare puts the share back among the copies, zero elsewhere: a partial sum. Over any
    other axis they are row-wise like the dispatch (every value whole)."""
    name = registry.op_name(c.node.target)
    n_out = len(c.node.meta["val"]) if isinstance(c.node.meta.get("val"), (tuple, list)) else 0
    if not _own_axis(c):
        if any(not p.is_replicate() for p in c.p):
            raise c.fail(f"fxtron::{name} moves a tp rank's share of the experts' rows; over {c.axis} its inputs "
                         "must be whole")
        return ((REPLICATE,) * n_out if n_out else REPLICATE), [REPLICATE] * len(c.p)
    whole = [REPLICATE] * (len(c.p) - 1)
    if name == "ep_share":
        return (Shard(0), REPLICATE), [REPLICATE] + whole
    if name == "ep_gather":
        return (REPLICATE,) * 3, [Shard(0)] + whole
    if name == "ep_scatter":
        if not c.p[0].is_partial():
            raise c.fail(f"the experts' rows reach fxtron::ep_scatter placed {c.axis}:{c.p[0]}, not a partial sum "
                         f"over {c.axis}: the experts' last GEMM must be split by rows")
        return Shard(0), [None] + whole
    return PARTIAL, [Shard(0)] + whole


def expert_weight(w) -> fx.Node | None:
    """The 3-D parameter behind a grouped GEMM's weight argument (through transposes of its
    feature dims), or None."""
    while isinstance(w, fx.Node) and w.op == "call_function" and w.target in _VIEWS:
        if w.target == aten.transpose.int and 0 in (w.args[1] % 3, w.args[2] % 3):
            return None
        if w.target == aten.permute.default and w.args[1][0] % 3 != 0:
            return None
        w = w.args[0]
    return w if meta.is_param(w) and w.meta["val"].dim() == 3 else None


class MoELayer:
    """One layer's experts as found on the graph: its grouped GEMMs (in graph order), the
    offsets they share, the nodes of the region between them, the copies entering it and the
    rows leaving it, and the expert parameters."""

    def __init__(self, gemms: list[fx.Node], offs: fx.Node):
        self.gemms, self.offs = gemms, offs
        self.params = [expert_weight(g.args[1]) for g in gemms]
        down: set[fx.Node] = set()           # reachable from a GEMM
        frontier = list(gemms)
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u not in down:
                    down.add(u)
                    frontier.append(u)
        region, frontier = set(gemms), list(gemms)
        while frontier:                        # ... and reaching a GEMM
            n = frontier.pop()
            for a in n.all_input_nodes:
                if a in down and a not in region:
                    region.add(a)
                    frontier.append(a)
        self.region = region
        self.entry = {g.args[0] for g in gemms if g.args[0] not in region}
        self.exits = [n for n in gemms if any(u not in region for u in n.users)]

    @property
    def name(self) -> str:
        return meta.get(self.gemms[0], meta.MODULE) or self.gemms[0].name

    @property
    def n_experts(self) -> int:
        return int(self.params[0].meta["val"].shape[0])

    def check(self) -> None:
        """The region must be one: the sorted copies in, one set of rows out, rows in order."""
        what = f"the mixture-of-experts layer at {self.name} (grouped GEMMs {', '.join('%' + g.name for g in self.gemms)})"
        if len(self.entry) != 1 or len(self.exits) != 1:
            raise ParallelizeError(
                f"{what}: expert parallel moves the copies entering the experts to their ranks and the rows "
                f"leaving them back, but {len(self.entry)} value(s) enter ({', '.join('%' + e.name for e in self.entry)}) "
                f"and {len(self.exits)} leave; the experts must take one tensor of copies sorted by expert and "
                f"give back one")
        sizes = {int(p.meta["val"].shape[0]) for p in self.params}
        if len(sizes) != 1 or self.offs.meta["val"].shape[0] != next(iter(sizes)):
            raise ParallelizeError(f"{what}: its expert weights have {sorted(sizes)} experts and its offsets "
                                   f"{tuple(self.offs.meta['val'].shape)}; one count of experts expected")
        rows = next(iter(self.entry)).meta["val"].shape[0]
        for n in self.region:
            val = n.meta.get("val")
            vals = val if isinstance(val, (list, tuple)) else [val]
            for v in vals:
                if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != rows):
                    raise ParallelizeError(
                        f"{what}: %{n.name} ({n.target}) inside the experts has shape {tuple(v.shape)}, not one "
                        f"row per copy ({rows}); expert parallel needs the experts to work row by row between "
                        f"their grouped GEMMs")


def moe_layers(gm: fx.GraphModule) -> list[MoELayer]:
    """Every mixture-of-experts layer of the graph, in graph order."""
    from fxtron.passes.tp_plan import _is_grouped_mm
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if (node.op == "call_function" and _is_grouped_mm(node.target) and len(node.args) > 2
                and expert_weight(node.args[1]) is not None and isinstance(node.args[2], fx.Node)):
            by_offs.setdefault(node.args[2], []).append(node)
    return [MoELayer(gemms, offs) for offs, gemms in by_offs.items()]


def _undispatched_experts(gm: fx.GraphModule) -> list[str]:
    """The 3-D expert weights the tp plan finds outside a grouped GEMM (a bmm, per-expert
    linears), by pattern (layer numbers as *)."""
    from fxtron.passes.tp_plan import _is_grouped_mm, find_layers
    return sorted({re.sub(r"\.\d+\.", ".*.", l.weight) for l in find_layers(gm).values()
                   if l.layout.startswith("e_") and not _is_grouped_mm(l.node.target)})


def check_experts(gm: fx.GraphModule, ep: int) -> list[MoELayer]:
    """The graph's MoE layers, each checked to split over `ep` ranks; ParallelizeError names
    what does not (no expert layer at all, experts not divisible by ep, a region that is not
    one)."""
    layers = moe_layers(gm)
    if not layers:
        other = _undispatched_experts(gm)
        if other:
            raise ParallelizeError(
                f"the mesh has ep={ep} but the model's experts ({', '.join(other)}) are not a grouped GEMM over "
                "tokens sorted by expert: a bmm of every expert over every token (Llama 4) or one linear per "
                "expert's group of rows (JetMoE's ParallelExperts), which fxtron does not dispatch over ep; use "
                "ep=1 (at tp > 1 each expert splits over tp, Megatron's expert tensor parallelism)")
        raise ParallelizeError(
            f"the mesh has ep={ep} but the model has no mixture-of-experts layer fxtron recognises (a grouped "
            f"GEMM -- torch._grouped_mm, transformers' grouped_mm or fxtron.models.moe.grouped_mm -- over a "
            f"3-D expert weight): there is nothing to split over ep; use ep=1")
    for layer in layers:
        layer.check()
        if layer.n_experts % ep:
            names = ", ".join(meta.param_name(p) for p in dict.fromkeys(layer.params))
            raise ParallelizeError(
                f"{layer.n_experts} experts of {names} (shape {tuple(layer.params[0].meta['val'].shape)}) do not "
                f"divide over ep={ep} ranks; use an ep that divides {layer.n_experts}")
    return layers


def ep_layout(gm: fx.GraphModule, *, strict: bool = False) -> AxisLayout:
    """The ep axis's AxisLayout: every expert weight Shard(0) (its experts split), the rest
    Replicate."""
    params = {meta.param_name(p): Shard(0) for layer in moe_layers(gm) for p in layer.params}
    return AxisLayout(AXIS, params=params, strict=strict)


def unshared(layer: MoELayer, plan) -> str | None:
    """Why the tp ranks of `layer` cannot each dispatch a share of its copies (Megatron's order
    at ep x tp; None: they can): that needs the experts split over tp as Megatron's expert-tp
    splits them, the GEMMs taking the copies column-split and the last one row-split (its output
    a partial sum over tp), and nothing else in the experts reading the copies."""
    from fxtron.passes.tp_plan import Colwise, Rowwise
    styles = {plan.layers[p].node: plan.style(p) for p in plan.layers}
    copies = next(iter(layer.entry))
    readers = [u for u in copies.users if u in layer.region]
    if any(u not in layer.gemms or not isinstance(styles.get(u.name), Colwise) for u in readers):
        return "the GEMMs reading its copies are not all split by columns over tp"
    if not isinstance(styles.get(layer.exits[0].name), Rowwise):
        return "its last GEMM is not split by rows over tp (its output no partial sum)"
    return None


def _through(node, targets) -> fx.Node:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        node = node.args[0]
    return node


def _copy_experts(layer: MoELayer) -> fx.Node | None:
    """The expert of each sorted copy: what the count the layer's offsets sum is a histogram
    of (through casts), or None where the graph does not show it."""
    count = _through(layer.offs, OFFSET_CHAIN)
    if not (isinstance(count, fx.Node) and count.op == "call_function" and count.target in _COUNTS):
        return None
    return _through(count.args[0], OFFSET_CHAIN)


def _per_row_inputs(layer: MoELayer, copies: fx.Node) -> list[fx.Node]:
    """Values entering the experts' region beside the copies, the offsets and the expert
    weights that hold one row per copy -- a per-expert parameter gathered at each copy's expert
    (GPT-OSS's biases, `bias[expert_of_copy]`). ParallelizeError for any other: once dispatched,
    the region holds the rows this rank received, not its own copies."""
    rows = copies.meta["val"].shape[0]
    weights = {g.args[1] for g in layer.gemms}
    experts = _copy_experts(layer)
    out = []
    for n in sorted(layer.region, key=lambda n: n.name):
        for a in n.all_input_nodes:
            if a in layer.region or a is copies or a is layer.offs or a in weights or a in out:
                continue
            v = a.meta.get("val")
            if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows):
                continue
            ok = (a.target is aten.index.Tensor and len(a.args[1]) == 1 and meta.is_param(a.args[0])
                  and int(a.args[0].meta["val"].shape[0]) == layer.n_experts and experts is not None
                  and _through(a.args[1][0], OFFSET_CHAIN) is experts)
            if not ok:
                raise ParallelizeError(
                    f"the mixture-of-experts layer at {layer.name}: %{n.name} ({n.target}) inside the experts reads "
                    f"%{a.name} ({a.target}), one row per copy of this rank's tokens; expert parallel runs the "
                    f"experts on the rows other ranks send, so only the copies and per-expert parameters gathered "
                    f"at each copy's expert (bias[expert]) may enter them. Apply it outside the experts, or use ep=1")
            out.append(a)
    return out


def _received_expert_ids(g: fx.Graph, layer: MoELayer, rows: fx.Node, local_offs: fx.Node, start: int, mode,
                         like: fx.Node) -> fx.Node:
    """The (global) expert of each received row: rows are sorted by this rank's experts, whose
    local offsets end each one's rows, so row i belongs to local expert searchsorted(offs, i)."""
    why = "the expert of each row this rank received"
    rv, ov = rows.meta["val"], local_offs.meta["val"]
    with mode:
        idx_v = ov.new_empty((rv.shape[0],))
        long_v = idx_v.new_empty(idx_v.shape, dtype=torch.int64)
    n = _call(g, aten.sym_size.int, (rows, 0), rv.shape[0], like, why)
    meta.set(n, meta.OWN_SIZE, True)
    at = _call(g, aten.arange.default, (n,), long_v, like, why)
    at.kwargs = {"dtype": ov.dtype, "device": ov.device}
    at.meta["val"] = idx_v
    which = _call(g, aten.searchsorted.Tensor, (local_offs, at), long_v, like, why)
    which.kwargs = {"right": True}
    return _call(g, aten.add.Tensor, (which, start), long_v, like, why) if start else which


def _rows_like(a: fx.Node, rows_v, mode):
    v = a.meta["val"]
    with mode:
        return v.new_empty((rows_v.shape[0], *v.shape[1:]))


def dispatch_experts(gm: fx.GraphModule, ep: int, capacity: float = 0.0, *, tp: int = 1,
                     plan=None, pad: bool = False, rank: int = 0) -> fx.GraphModule:
    """Rewrite every MoE layer (module docstring): dispatch before its experts, combine after,
    the experts' GEMMs on the rank's local experts; with a capacity factor (> 0) each expert
    takes at most ceil(capacity x copies / E) of each rank's copies, the rest dropped, and with
    `pad` every expert's rows are padded to that capacity (ops/ep.py's _routes). At tp > 1 with
    the experts split over tp (`plan`; `unshared` says when not), each tp rank
    dispatches its share of the copies and the received rows are gathered over tp (Megatron's
    order, ops/ep.py: 1/tp of the bytes in every all-to-all). Edits gm in place and returns it."""
    g = gm.graph
    for layer in check_experts(gm, ep):
        shares = tp if tp > 1 and plan is not None and unshared(layer, plan) is None else 1
        copies = next(iter(layer.entry))
        out = layer.exits[0]
        first = min(layer.region, key=_order(g))
        mode = _fake_mode(copies)
        cv, ov = copies.meta["val"], layer.offs.meta["val"]
        local = layer.n_experts // ep
        with mode:
            received = mode.shape_env.create_unbacked_symint() if mode.shape_env is not None else cv.shape[0]
            rows_v = cv.new_empty((received, *cv.shape[1:]))
        why = "dispatch the copies to the ranks of their experts"
        with g.inserting_before(first):
            rows_n = _call(g, aten.sym_size.int, (copies, 0), cv.shape[0], first, why)
            meta.set(rows_n, meta.OWN_SIZE, True)     # the rank's copies (under cp, its own tokens')
            sent, sent_offs, dispatch_args = copies, layer.offs, (layer.name, float(capacity), pad)
            if shares > 1:
                share = _call(g, torch.ops.fxtron.ep_share.default, (copies, layer.offs, TP, shares, layer.name,
                                                                      float(capacity), pad), (cv, ov), first, why)
                sent, sent_offs = _getitems(g, share, 2, first, why)
                dispatch_args = ("", 0.0, False)                # capped and padded already
            dispatch = _call(g, torch.ops.fxtron.ep_dispatch.default, (sent, sent_offs, AXIS, ep, *dispatch_args),
                             (rows_v, ov.new_empty((local,)), ov.new_empty((ep, local), dtype=torch.int64)), first, why)
            rows, local_offs, counts = _getitems(g, dispatch, 3, first, why)
            if shares > 1:
                sent_n = _call(g, aten.sym_size.int, (sent, 0), cv.shape[0], first, why)
                meta.set(sent_n, meta.OWN_SIZE, True)          # the share's rows, not the copies'
                gather = _call(g, torch.ops.fxtron.ep_gather.default, (rows, local_offs, counts, TP, shares),
                               (rows_v, ov.new_empty((local,)), ov.new_empty((shares, ep, local), dtype=torch.int64)),
                               first, "every tp rank's share of the rows for this rank's experts")
                rows, local_offs, every = _getitems(g, gather, 3, first, why)
        side = dict.fromkeys(_per_row_inputs(layer, copies))
        if side:
            with g.inserting_before(first):
                ids = _received_expert_ids(g, layer, rows, local_offs, rank * local, mode, first)
                side = {a: _call(g, aten.index.Tensor, (a.args[0], [ids]), _rows_like(a, rows_v, mode), a,
                                 "the expert parameter's row of each received row")
                        for a in side}
        for gemm in layer.gemms:
            gemm.args = tuple(rows if a is copies else local_offs if a is layer.offs else a for a in gemm.args)
        for n in layer.region:
            if n not in layer.gemms:
                n.args = tuple(rows if a is copies else side.get(a, a) for a in n.args)
        local_w = {gemm.args[1]: gemm.args[1].meta["val"].narrow(0, 0, local) for gemm in layer.gemms}
        _refake(sorted(layer.region, key=_order(g)), mode, local_w)
        ov_out = out.meta["val"]
        with mode:
            back = ov_out.new_empty((cv.shape[0], *ov_out.shape[1:]))
        users = [u for u in out.users if u not in layer.region]
        why = "the experts' rows back to the ranks of their tokens"
        if shares == 1:
            _reroute(g, out, users, torch.ops.fxtron.ep_combine.default,
                     (out, layer.offs, counts, rows_n, AXIS, ep, float(capacity), pad), back, why)
            continue
        with g.inserting_after(out):
            mine = _call(g, torch.ops.fxtron.ep_scatter.default, (out, every, TP, shares), ov_out, out,
                         "this tp rank's share of the experts' rows, summed over tp")
        with g.inserting_after(mine):
            combined = _call(g, torch.ops.fxtron.ep_combine.default,
                             (mine, sent_offs, counts, sent_n, AXIS, ep, 0.0, False), back, out, why)
        with g.inserting_after(combined):
            whole = _call(g, torch.ops.fxtron.ep_unshare.default, (combined, layer.offs, rows_n, TP, shares,
                                                                    float(capacity), pad), back, out,
                          "the share back among the copies, zero elsewhere: a partial sum over tp")
        for u in users:
            u.replace_input_with(out, whole)
    g.lint()
    gm.recompile()
    return gm


def _call(g: fx.Graph, target, args: tuple, val, like: fx.Node, why: str) -> fx.Node:
    """A call of `target` at the graph's insertion point, with fake value `val`, of `like`'s module."""
    n = g.call_function(target, args)
    n.meta["val"] = val
    _inherit(n, like, why)
    return n


def _getitems(g: fx.Graph, node: fx.Node, n: int, like: fx.Node, why: str) -> list[fx.Node]:
    return [_call(g, operator.getitem, (node, i), node.meta["val"][i], like, why) for i in range(n)]


def _reroute(g: fx.Graph, node: fx.Node, users: list[fx.Node], target, args: tuple, val, why: str) -> fx.Node:
    """A call of `target` right after `node`, with fake value `val`, that `users` read instead
    of `node`."""
    with g.inserting_after(node):
        new = _call(g, target, args, val, node, why)
    for u in users:
        u.replace_input_with(node, new)
    return new


def _order(g: fx.Graph):
    index = {n: i for i, n in enumerate(g.nodes)}
    return lambda n: index[n]


def _fake_mode(node: fx.Node):
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([node.meta["val"]])
    if mode is None:
        raise ParallelizeError(f"%{node.name} has no fake value to derive the dispatched rows' sizes from")
    return mode


def _refake(nodes: list[fx.Node], mode, local: dict) -> None:
    """The region's values again, now over the received rows (their count unbacked) and the
    rank's experts (`local`: the GEMMs' weights, E/ep experts each)."""
    import torch.utils._pytree as pytree

    def val(a):
        return local.get(a, a.meta["val"]) if isinstance(a, fx.Node) else a
    with mode:
        for n in nodes:
            args, kwargs = pytree.tree_map(val, (n.args, n.kwargs))
            n.meta["val"] = n.target(*args, **kwargs)


def _inherit(node: fx.Node, like: fx.Node, why: str) -> None:
    module = meta.get(like, meta.MODULE)
    if module is not None:
        meta.set(node, meta.MODULE, module)
    meta.set(node, meta.PROVENANCE, meta.Provenance("expert_parallel", why))


__all__ = ["AXIS", "MoELayer", "check_experts", "dispatch_experts", "ep_layout", "expert_weight", "moe_layers",
           "unshared"]
