"""Rules: a rank-local order -- a split dim sorted on each rank by its own key, and undone.

A mixture-of-experts layer sorts the copies of its tokens by expert, runs the experts' grouped
GEMMs over the sorted rows by the counts of each expert, and puts the rows back in token order
by the sort's inverse permutation. Under context parallel each rank holds its own tokens (a
split of the folded batch x sequence); Megatron routes each rank's tokens on that rank, and the
sort is then each rank's own: the rows of its tokens, in an order no global layout describes.
The layer is still token-wise, so the whole computes what one process computes.

`Shard(dim, order="%sort")` (core/placement.py) is that value: the rank's elements of `dim`, in
the order of that sort. It follows this contract:

* a sort of a 1-D split value along its split dim orders it (values and indices), but only
  where the graph undoes the order: its indices' inverse permutation (an argsort of them;
  transformers writes `index_put_(empty_like(p), [p], arange(n))`, which
  `rewrite_inverse_permutations` turns into the argsort) is taken. Any other sort of a split
  dim has no rule (it runs replicated);
* the indices hold positions in the rank's shard, so `x[idx]` (and `x[idx // k]`, the token
  of each of k copies) reads the rank's own rows where `x` is laid out as the sort's input (as
  the tokens it was flattened from): ordered;
* ops that cannot see the order across ranks carry it (elementwise among values of the same
  order, views and reductions that keep the ordered dim whole, row-wise GEMMs); a histogram of
  it is each rank's counts, a partial sum, which is also what a grouped GEMM over the rank's
  sorted rows is offset by; a sum over it is a partial sum;
* the inverse permutation's values are positions in the order (`Shard(dim, order="inverse
  %sort")`): `y[inverse]` of a `y` in that order is laid out as the sort's input again;
* anything else that meets an ordered value -- a scan along it, a gather, a move to another
  placement -- is a ParallelizeError naming the op: its result would depend on how the ranks'
  orders interleave, which no collective can restore.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import replace

import torch
import torch.fx as fx

from fxtron.core import meta, opsets
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.errors import ParallelizeError
from fxtron.passes.rules.registry import CASTS, Ctx, expr, ndim, norm, register_rule, shape

aten = torch.ops.aten
_SORTS = {aten.sort.default, aten.sort.stable}
_ARGSORTS = {aten.argsort.default, aten.argsort.stable}
_FLATTENS = opsets.FLATTENS
INVERSE = "inverse "
#: what an inverse permutation's arange and its size are made of
_SIZES = {aten.arange.default, aten.empty_like.default, aten.sym_size.int, operator.mul, operator.add,
          operator.floordiv}
#: the order of the rows an expert-parallel dispatch of copies in a rank-local order gives
DISPATCHED = " dispatched"
#: the casts and running sums between a layer's count of copies per expert and its offsets
OFFSET_CHAIN = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.cumsum.default,
                aten.clone.default, aten.alias.default}


def ordered(p) -> str:
    """The order a placement holds its split dim in ("" for a plain one)."""
    return p.order if isinstance(p, Shard) else ""


def _through(node, targets=CASTS):
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        node = node.args[0]
    return node


def _sort_indices(node) -> fx.Node | None:
    """The sort whose indices `node` is (through casts): a sort's second output, or an argsort
    that is not itself the inverse of one; else None."""
    node = _through(node)
    if (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 1
            and isinstance(node.args[0], fx.Node) and node.args[0].target in _SORTS):
        return node.args[0]
    if isinstance(node, fx.Node) and node.target in _ARGSORTS and _sort_indices(node.args[0]) is None:
        return node
    return None


def _sort_named(graph: fx.Graph, key: str) -> fx.Node | None:
    return next((n for n in graph.nodes if f"%{n.name}" == key), None)


def _inverted(sort: fx.Node) -> bool:
    """Does the graph take the inverse permutation of `sort`'s indices (an argsort of them)?"""
    frontier = ([sort] if sort.target in _ARGSORTS else
                [u for u in sort.users if u.target is operator.getitem and u.args[1] == 1])
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in _ARGSORTS:
                return True
            if u.target in CASTS:
                frontier.append(u)
    return False


# ----------------------------------------------------------------------------- the graph rewrite
def rewrite_inverse_permutations(gm: fx.GraphModule) -> fx.GraphModule:
    """`index_put_(empty_like(p), [p], arange(n))` -- the inverse of the permutation p, as
    transformers' mixture-of-experts layers write it -- becomes `argsort(p)`, the same values
    (p holds every position once), computed from p alone: its arange over the global n has no
    meaning on a rank that sorted only its own rows. Edits gm in place and returns it."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in (aten.index_put_.default, aten.index_put.default):
            continue
        dst, idx, values = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if accumulate or len(idx) != 1 or not isinstance(idx[0], fx.Node):
            continue
        p = idx[0]
        if not (isinstance(dst, fx.Node) and dst.target == aten.empty_like.default and dst.args[0] is p
                and len(dst.users) == 1 and isinstance(values, fx.Node) and values.target == aten.arange.default
                and len(values.users) == 1 and _sort_indices(p) is not None):
            continue
        pv = p.meta["val"]
        if pv.dim() != 1 or len(values.args) != 1 or values.meta["val"].dtype != pv.dtype:
            continue
        with g.inserting_before(node):
            inv = g.call_function(aten.argsort.stable, (p,), {"stable": True})
        inv.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        meta.set(inv, meta.MODULE, meta.get(node, meta.MODULE) or "")
        meta.set(inv, meta.PROVENANCE, meta.Provenance(
            "rewrite_inverse_permutations", "the inverse permutation of the sort's indices, from them alone"))
        node.replace_all_uses_with(inv)
        g.erase_node(node)
        dead = [values, dst]
        while dead:                  # the arange's size, read from the inputs' sizes, goes with it
            n = dead.pop()
            if isinstance(n, fx.Node) and n.op == "call_function" and not n.users and n.target in _SIZES:
                inputs = n.all_input_nodes
                g.erase_node(n)
                dead.extend(inputs)
    g.lint()
    gm.recompile()
    return gm


# ----------------------------------------------------------------------------- rules
def sort_rule(c: Ctx, dim: int):
    """A sort of a 1-D split value along it, whose inverse the graph takes: values and indices
    in the rank's own order. None where that does not hold."""
    p = c.p[0]
    if (isinstance(p, Shard) and not p.order and p.dim == dim == 0 and ndim(c.inputs[0]) == 1
            and _inverted(c.node)):
        mine = Shard(0, order=f"%{c.node.name}")
        return ((mine, mine) if c.node.target in _SORTS else mine), [None]
    return None


@register_rule(*_ARGSORTS)
def _argsort(c: Ctx):
    """argsort of a sort's indices in the rank's order: its inverse permutation, laid out as the
    sort's input, its values positions in that order. Of a whole value it is whole, along
    another dim than the split one each shard sorts its own; anything else runs replicated."""
    p, node = c.p[0], c.node
    dim = norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1), ndim(c.inputs[0]))
    desc = node.args[2] if len(node.args) > 2 else node.kwargs.get("descending", False)
    if p.is_replicate():
        return REPLICATE, [None]
    if isinstance(p, Shard) and p.order and not p.order.startswith(INVERSE):
        sort = _sort_indices(node.args[0])
        if sort is not None and f"%{sort.name}" == p.order and dim == 0 and not desc:
            return Shard(0, order=INVERSE + p.order), [None]
        raise refused(c, "sorts again")
    if isinstance(p, Shard) and not p.order and p.dim != dim:
        return p, [None]
    return None if desc else sort_rule(c, dim)      # the sort itself (an argsort of the copies' experts)


@register_rule(aten.histc.default)
def _histc(c: Ctx):
    """A histogram over fixed bins of a split value: each rank's counts, a partial sum of the
    whole's (also of a rank-local order: counting does not see it). Bins from the data's own
    min and max (min == max) differ per rank: replicated."""
    p, node = c.p[0], c.node
    args = list(node.args) + [None] * (4 - len(node.args))
    lo = node.kwargs.get("min", args[2] if args[2] is not None else 0)
    hi = node.kwargs.get("max", args[3] if args[3] is not None else 0)
    if p.is_replicate():
        return REPLICATE, [None]
    if isinstance(p, Shard) and lo != hi:
        return PARTIAL, [None]
    return None


def index_rule(c: Ctx):
    """x[idx] with idx a sort's indices in the rank's order (or its inverse): the rule of
    module docstring's third and fifth points, None where no ordered value takes part, and
    ParallelizeError where one does some other way."""
    x, idx = c.node.args[0], list(c.node.args[1])
    px = c.p[c.index(x)]
    tensors = [t for t in idx if t is not None]
    pis = [c.p[c.index(t)] for t in tensors]
    if not ordered(px) and not any(ordered(p) for p in pis):
        return None
    if len(idx) == 1 and isinstance(idx[0], fx.Node) and ndim(idx[0]) == 1:
        i, pi = idx[0], pis[0]
        if ordered(pi).startswith(INVERSE) and ordered(px) == pi.order[len(INVERSE):] and px.dim == 0:
            sort = _sort_indices(i.args[0])
            back = c.placement_of(sort.args[0])
            if expr(shape(x)[0]) == expr(shape(i)[0]):
                return replace(back, dim=0), [None, None]
        if ordered(pi) and not pi.order.startswith(INVERSE) and not ordered(px):
            sort, k = _indices_of(i)
            if sort is not None and pi.order == f"%{sort.name}" and _laid_out_as(c, x, sort, k):
                return Shard(0, order=pi.order), [None, None]
    raise refused(c, "indexes with or into")


def _indices_of(i: fx.Node) -> tuple[fx.Node | None, int]:
    """(the sort, k) where `i` is the sort's indices divided by k (floor), k = 1 undivided."""
    node = _through(i)
    k = 1
    if node.target == aten.floor_divide.default or (
            node.target == aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor"):
        if not isinstance(node.args[1], int) or node.args[1] < 1:
            return None, 1
        node, k = node.args[0], node.args[1]
    return _sort_indices(node), k


def _laid_out_as(c: Ctx, x: fx.Node, sort: fx.Node, k: int) -> bool:
    """Is dim 0 of `x` laid out as the sort's input (k = 1), or as the tokens that input is the
    flattened (tokens, k) copies of? A layout is its placement and global size: equal ones
    hold the same rank's elements in the same order."""
    src = sort.args[0]
    if k > 1:                               # the input is (T, k) flattened: find the (T, k)
        src = _through(src, _FLATTENS | CASTS)
        sv = src.meta.get("val")
        if not (isinstance(sv, torch.Tensor) and sv.dim() == 2 and expr(sv.shape[1]) == k):
            return False
    ps, pxx = c.placement_of(src), c.p[c.index(x)]
    return (isinstance(ps, Shard) and ps.dim == 0 and not ps.order and pxx == ps
            and expr(shape(x)[0]) == expr(src.meta["val"].shape[0]))


def grouped_rows(c: Ctx, x: fx.Node, offs) -> tuple | None:
    """A grouped GEMM over rows in a rank-local order, by offsets that count them (a histogram
    of the same order, or the rank's rows an expert-parallel dispatch gave it), the weight
    whole: the rows stay in that order, and the offsets are taken as each rank holds them -- its
    own counts, where the partial sum's whole would be every rank's."""
    px = c.p[c.index(x)]
    if not ordered(px):
        return None
    w = c.node.args[1]
    if not c.p[c.index(w)].is_replicate():
        raise refused(c, "splits the experts of")
    if isinstance(offs, fx.Node):
        if not c.p[c.index(offs)].is_partial():
            raise refused(c, "groups rows by offsets that are not each rank's own counts, of")
        count = _through(offs, OFFSET_CHAIN)
        dispatched = (count.target is operator.getitem and getattr(count.args[0], "target", None)
                      in (torch.ops.fxtron.ep_dispatch.default, torch.ops.fxtron.ep_gather.default))
        # counts of the rank's copies: of their sorted experts, or of the experts the sort sorted
        counted = count.target == aten.histc.default and (
            ordered(c.placement_of(_through(count.args[0]))) == px.order
            or _through(count.args[0]) is _through(getattr(_sort_named(c.node.graph, px.order), "args", [None])[0]))
        if not (dispatched or counted):
            raise refused(c, "groups rows by offsets that do not count them, of")
    return px, [None] * len(c.p)


# ----------------------------------------------------------------------------- carrying an order


def carry(c: Ctx, out, expects):
    """The rule's placements with the inputs' order carried: a Shard out or expected is in that
    order (one order per op: two are a ParallelizeError), where the op keeps the ordered dim's
    size (a view regrouping it is refused). Ops not in safe_targets(), and those whose rule gathers an
    ordered input, raise. Unchanged where no input is ordered."""
    orders = {ordered(p) for p in c.p} - {""}
    if not orders:
        return out, expects
    if len(orders) > 1:
        raise refused(c, "mixes values in different rank-local orders")
    if c.node.target not in safe_targets():
        raise refused(c, "may depend on the order of")
    k = orders.pop()
    sizes = {str(expr(shape(a)[p.dim])) for a, p in zip(c.inputs, c.p) if ordered(p)}

    def fix(p, node_val):
        if not isinstance(p, Shard):
            return p
        if str(expr(node_val.shape[p.dim])) not in sizes:
            raise refused(c, "regroups the ordered dim of")
        return replace(p, interleave=1, order=k)
    val = c.node.meta["val"]
    if isinstance(out, tuple):
        out = tuple(fix(p, v) for p, v in zip(out, val))
    elif out is not None:
        out = fix(out, val)
    new = []
    for a, p, e in zip(c.inputs, c.p, expects):
        if ordered(p) and e is not None and not (isinstance(e, Shard) and e.dim == p.dim):
            raise refused(c, "needs whole or moved")
        new.append(fix(e, a.meta["val"]) if isinstance(e, Shard) else e)
    return out, new


def refused(c: Ctx, what: str) -> ParallelizeError:
    """The error for an op that meets a rank-local order some way it cannot take."""
    module = meta.get(c.node, meta.MODULE) or "(top level)"
    return ParallelizeError(f"node %{c.node.name} ({c.node.target}) in module {module}: {why(c, what)}")


def why(c: Ctx, what: str) -> str:
    orders = sorted({ordered(p) for p in c.p} - {""})
    return (f"it {what} a value in a rank-local order ({', '.join(orders)}: each {c.axis} rank sorted its own "
            f"tokens, as a mixture of experts routes them); only ops that cannot see that order (elementwise, "
            f"row-wise, sums and histograms, the sort's inverse permutation) take it. Compute this from the tokens "
            f"in their own order, or use {c.axis}=1")


@functools.cache
def safe_targets() -> frozenset:
    """The ops whose result cannot depend on how the ranks' orders interleave, given the checks
    of `carry`."""
    from fxtron.passes.rules import pointwise
    return frozenset( set(pointwise._POINTWISE) | set(pointwise._LIKE) | set(CASTS) | {
        operator.getitem, aten.sym_size.int, aten.floor_divide.default, aten.div.Tensor_mode, aten.remainder.Scalar,
        *opsets.RESHAPES, *opsets.FOLDS, *opsets.UNSQUEEZES, *opsets.SLICES, *opsets.SUMS,
        aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default, aten.split.Tensor,
        aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.amax.default,
        aten.linear.default, aten.mm.default, aten.matmul.default, aten._softmax.default, aten.softmax.int,
        aten._log_softmax.default, aten.log_softmax.int, aten.layer_norm.default, aten.rms_norm.default,
        aten.topk.default, aten.cat.default, aten.stack.default})


#: rules that handle an order themselves (carry leaves them as they are)
AWARE = {aten.index.Tensor, aten.histc.default, *_SORTS, *_ARGSORTS}
_AWARE_NAMES = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback", "ep_dispatch", "ep_combine"}


def is_aware(target) -> bool:
    """Does the rule of `target` handle a rank-local order itself?"""
    if isinstance(target, torch._ops.OpOverload):
        return target in AWARE or target.name().split("::")[-1] in _AWARE_NAMES
    return False


__all__ = ["DISPATCHED", "INVERSE", "OFFSET_CHAIN", "carry", "grouped_rows", "index_rule", "is_aware", "ordered",
           "rewrite_inverse_permutations", "safe_targets", "sort_rule"]
