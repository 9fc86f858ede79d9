"""Passes, sharding rules: views, slices, splits, concatenation."""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from fxtron.core import layout, meta, opsets
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.passes.rules import order
from fxtron.passes.rules.registry import Ctx, expr, is_one, is_zero, ndim, norm, register_rule, shape

from fxtron.errors import ParallelizeError

aten = torch.ops.aten


def _groups(ins: tuple, outs: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims are
    left out: they are never sharded)."""
    ii = [i for i, s in enumerate(ins) if not is_one(s)]
    oo = [j for j, s in enumerate(outs) if not is_one(s)]
    groups, a, b = [], 0, 0
    while a < len(ii) and b < len(oo):
        gi, go = [ii[a]], [oo[b]]
        pi, po = expr(ins[ii[a]]), expr(outs[oo[b]])
        a, b = a + 1, b + 1
        while sympy.simplify(pi - po) != 0:
            if sympy.fraction(sympy.cancel(po / pi))[1] == 1 and a < len(ii):   # pi divides po
                pi *= expr(ins[ii[a]])
                gi.append(ii[a])
                a += 1
            elif b < len(oo):
                po *= expr(outs[oo[b]])
                go.append(oo[b])
                b += 1
            else:
                break
        groups.append((gi, go))
    return groups


def _heads_of_blocks(c: Ctx, p: Shard, size, outs: list, go: list[int]):
    """Unequal fused blocks (a qkv of 4 query, 2 key and 2 value heads, in proportions 2:1:1)
    viewed as (heads, d, ...): a shard of the heads in the same proportions when every block is
    whole heads and each block's heads divide over the ranks (each rank's slice of a block is
    whole heads); else there is no view layout and the value is made whole."""
    full, dims = expr(size), [expr(o) for o in outs]
    inner = sympy.Mul(*dims[1:])
    if p.whole or len(dims) < 2 or not full.is_Integer or not inner.is_Integer:
        return REPLICATE, [REPLICATE]
    try:
        blocks = layout.block_sizes(int(full), p.interleave)
    except ValueError:
        return REPLICATE, [REPLICATE]
    if all(b % int(inner) == 0 and (b // int(inner)) % c.size == 0 for b in blocks):
        return Shard(go[0], p.interleave), [None]
    return REPLICATE, [REPLICATE]


@register_rule(*opsets.RESHAPES, *opsets.FOLDS)
def _view(c: Ctx):
    x, p = c.inputs[0], c.p[0]
    if not isinstance(p, Shard):
        return p, [None]
    ins, outs = shape(x), shape(c.node)
    tail = len(ins) - p.dim
    if len(outs) >= tail and all(sympy.simplify(expr(a) - expr(b)) == 0 for a, b in zip(ins[p.dim:], outs[-tail:])):
        # the sharded dim and every dim after it kept: only the dims before it regrouped (Mamba-2's
        # (B, S padded, heads, d) -> (B, chunks, chunk, heads, d), whose sizes sympy cannot pair)
        return Shard(len(outs) - tail, p.interleave), [None]
    for gi, go in _groups(ins, outs):
        if p.dim not in gi:
            continue
        if len(gi) == 1 and len(go) == 1:
            return Shard(go[0], p.interleave), [None]
        if layout.is_symbolic(p.interleave) and len(gi) == 1:
            return _unfold(c, p, [c.sym(outs[j]) for j in go], go)
        if layout.is_symbolic(p.interleave) and len(go) == 1 and gi[0] == p.dim:
            # (B*S, k) -> B*S*k: each block of the fold grows by the whole dims after it (a
            # mixture of experts' k copies of each token flattened), split as before
            return Shard(go[0], p.interleave), [None]
        if layout.is_symbolic(p.interleave) and gi[0] == p.dim and not c.balanced and not p.order:
            # (B*S*heads, d) -> (B, S, heads*d): the B*S blocks are the leading output dims, each
            # block's heads split contiguously (Qwen3.5's gated norm per head, then its output
            # flattened back to the features for out_proj)
            return _unfold(c, p, [c.sym(outs[j]) for j in go], go)
        if p.interleave == 1 and not c.balanced and not p.order:
            found = _fold_into_rows(c, p, ins, outs, gi, go)
            if found is not None:
                return found, [None]
        if not isinstance(p.interleave, int):              # unequal fused blocks: only the features
            if gi != [p.dim]:                              # (folded with tokens, the blocks would span them)
                return REPLICATE, [REPLICATE]
            return _heads_of_blocks(c, p, ins[p.dim], [outs[j] for j in go], go)
        if len(gi) == 1:                                   # split: (F,) -> (a0, a1, ...)
            found = _split_blocks(c, p.interleave, [expr(outs[j]) for j in go], go)
            if found is not None:
                return found, [None]
            raise ParallelizeError(
                f"node %{c.node.name} in module {meta.get(c.node, meta.MODULE) or '(top level)'} views dim {p.dim} "
                f"of size {ins[p.dim]} (sharded over tp={c.size}"
                + (f", {p.interleave} fused parts" if p.interleave > 1 else "") + f") as {tuple(outs[j] for j in go)}: "
                f"no factor can be split {c.size} ways (a head count not divisible by tp?). "
                f"Choose a tp that divides the number of heads, or replicate this layer in the plan.")
        if len(go) == 1:                                   # merge: (b0, b1, ...) -> (F,)
            t = gi.index(p.dim)
            prefix = sympy.Mul(*[c.sym(ins[j]) for j in gi[:t]])
            if prefix.is_Integer:
                return Shard(go[0], int(prefix) * p.interleave), [None]
            # a symbolic count of blocks (BLOOM's (B, heads/tp) -> B*heads): only with whole
            # blocks of a static size, so that its collectives can unflatten them
            block = sympy.Mul(*[c.sym(ins[j]) for j in gi[t:]])
            if p.interleave == 1 and (block.is_Integer or c.balanced):
                # (a cp shard of the sequence folds with a symbolic block, S: a loss over tokens
                # needs no layout of it, and its collectives refuse it)
                return Shard(go[0], prefix), [None]
            return REPLICATE, [REPLICATE]   # (B, S/tp) -> B*S has no shard layout: gather first
        if p.interleave == 1 and gi[0] == p.dim:
            # the outermost dim of the group split contiguously: each rank holds one contiguous
            # run of the flattened group, which is a contiguous split of the output's outermost
            # dim when it divides (CodeGen's (blocks, 3 x local) qkv viewed as (heads, d))
            first = c.sym(outs[go[0]])
            if first.is_Integer and int(first) % c.size == 0:
                return Shard(go[0]), [None]
        outer = sympy.Mul(*[c.sym(ins[j]) for j in gi[:gi.index(p.dim)]])
        if outer.is_Integer and not c.balanced and not p.order:
            # (k, F) -> (k*h, d) (JetMoE's attention experts' queries, (b, s, top_k, heads*d)
            # viewed per head): the group flattened is outer x interleave blocks, each split
            # contiguously over tp, then split again into the output's dims
            found = _split_blocks(c, int(outer) * p.interleave, [expr(outs[j]) for j in go], go)
            if found is not None:
                return found, [None]
        raise c.fail("a view that regroups the sharded dim with others both ways")
    raise c.fail("could not follow the sharded dim through this view")


def _fold_into_rows(c: Ctx, p: Shard, ins: tuple, outs: tuple, gi: list[int], go: list[int]) -> Shard | None:
    """(B, S, heads*d) -> (B*S*heads, d), the features split: each of the B*S rows of the
    group's first output dim holds `heads` rows of d, this rank's heads/tp of them -- a shard
    of that dim in B*S blocks (OLMo-hybrid's gate viewed per head for its gated norm). None
    unless the dims before the split one are symbolic (the tokens) and whole heads divide."""
    at = gi.index(p.dim)
    outer = sympy.Mul(*[c.sym(ins[j]) for j in gi[:at]])
    inner = sympy.Mul(*[c.sym(ins[j]) for j in gi[at:]])
    rest = sympy.Mul(*[c.sym(outs[j]) for j in go[1:]])
    if outer.is_Integer or not inner.is_Integer or not rest.is_Integer:
        return None
    rows = sympy.simplify(c.sym(outs[go[0]]) / outer)
    if rows.is_Integer and int(rows) % c.size == 0 and int(rows) * int(rest) == int(inner):
        return Shard(go[0], outer)
    return None


def _split_blocks(c: Ctx, k: int, sizes: list, go: list[int]) -> Shard | None:
    """A run of k blocks, each split contiguously over the axis, viewed as (a0, a1, ...): the
    first dim whose blocks left (k over the sizes before it) divide it tp ways, or None."""
    prefix = 1
    for t, a in enumerate(sizes):
        if a.is_Integer and k % prefix == 0 and int(a) % ((k // prefix) * c.size) == 0:
            return Shard(go[t], k // prefix)
        if not a.is_Integer:
            return None
        prefix *= int(a)
    return None


def _unfold(c: Ctx, p: Shard, sizes: list, go: list[int]):
    """A dim split into a symbolic count of blocks, viewed as (a0, a1, ...): the shard lands
    on the first size past the blocks (BLOOM's B*heads -> (B, heads))."""
    prefix = sympy.Integer(1)
    if c.balanced and all(a.is_Integer for a in sizes[1:]):
        # B*S*k -> (B*S, k): the blocks stay in the first dim, whole dims after it (a cp shard
        # of a mixture of experts' k copies of each token, viewed per token again)
        _, den = sympy.fraction(sympy.simplify(sizes[0] / p.interleave))
        if den == 1:
            return Shard(go[0], p.interleave), [None]
    for t, a in enumerate(sizes):
        q = sympy.simplify(p.interleave / prefix)
        if q.is_Integer and a.is_Integer and int(a) % (int(q) * c.size) == 0:
            return Shard(go[t], int(q)), [None]
        if q == 1 and c.balanced:      # B*S -> (B, S) of a cp shard: the sequence again
            return Shard(go[t]), [None]
        prefix *= a
    return REPLICATE, [REPLICATE]


@register_rule(*opsets.RESHAPES_AS)
def _view_as(c: Ctx):
    """x.reshape_as(other) (RoFormer's rotary: the stacked (..., D/2, 2) pairs back to (..., D)):
    x's shard as the view carries it; `other` only lends its shape, so it must be laid out as the
    output (each rank's local shape then the local view's)."""
    x, other = c.node.args[:2]
    if other is x:
        return c.p[0], [None]
    out, want = _view(c)
    if want[0] is not None:
        out = REPLICATE
    expects = {x: want[0], other: None}
    po = c.p[c.index(other)]
    if isinstance(out, Shard):
        expects[other] = None if po == out else out
    elif isinstance(po, Shard):
        expects[other] = REPLICATE
    return out, [expects[a] for a in c.inputs]


@register_rule(aten.transpose.int, aten.t.default, aten.numpy_T.default, aten.permute.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
               aten.broadcast_to.default)
def _permute_like(c: Ctx):
    p = c.p[0]
    if not isinstance(p, Shard):
        return p, [None] * len(c.p)
    node, nd = c.node, ndim(c.inputs[0])
    t = node.target
    if t == aten.transpose.int:
        d0, d1 = norm(node.args[1], nd), norm(node.args[2], nd)
        d = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    elif t == aten.t.default:
        d = 1 - p.dim if nd == 2 else p.dim
    elif t == aten.numpy_T.default:                    # all dims reversed
        d = nd - 1 - p.dim
    elif t == aten.permute.default:
        d = [norm(x, nd) for x in node.args[1]].index(p.dim)
    elif t == aten.unsqueeze.default:
        u = norm(node.args[1], nd + 1)
        d = p.dim + (1 if u <= p.dim else 0)
    elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        sizes = shape(c.inputs[0])
        if t == aten.squeeze.default:
            dims = [i for i, s in enumerate(sizes) if is_one(s)]
        elif t == aten.squeeze.dim:
            dims = [norm(node.args[1], nd)] if is_one(sizes[norm(node.args[1], nd)]) else []
        else:
            dims = [norm(x, nd) for x in node.args[1] if is_one(sizes[norm(x, nd)])]
        d = p.dim - sum(1 for x in dims if x < p.dim)
    elif t in (aten.expand.default, aten.broadcast_to.default):
        d = p.dim + (len(node.args[1]) - nd)
    else:
        raise c.fail()
    return Shard(d, p.interleave), [None] * len(c.p)


@register_rule(aten.slice.Tensor, aten.select.int)
def _slice_select(c: Ctx):
    p, node = c.p[0], c.node
    if not isinstance(p, Shard):
        return p, [None]
    nd = ndim(c.inputs[0])
    dim = norm(node.args[1] if len(node.args) > 1 else 0, nd)
    if node.target == aten.select.int:
        if dim == p.dim:
            return REPLICATE, [REPLICATE]
        return Shard(p.dim - (1 if dim < p.dim else 0), p.interleave), [None]
    if dim == p.dim:
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = shape(c.inputs[0])[dim]
        if p.whole:               # a parameter's blocks, some held whole by every rank (core/layout.py)
            return _part_of_mixed(c, p, size, start, end, step)
        if p.interleave != 1:     # whole blocks of a fused projection ([q|k|v][..., q:q+k]): a shard of them
            part = _blocks_cut(p, size, start, end, step)
            return (Shard(dim, part), [None]) if part is not None else (REPLICATE, [REPLICATE])
        # never int() a symbolic size: that would specialize the shape environment to the example
        to_end = end is None or (isinstance(end, int) and (end >= 2**62 or (isinstance(size, int) and end >= size)))
        whole = start in (None, 0) and step == 1 and to_end
        if not whole and _strided_shard(c, size, start, step, to_end):
            return p, [None]
        return (p, [None]) if whole else (REPLICATE, [REPLICATE])
    return p, [None]


def _strided_shard(c: Ctx, size, start, step, to_end: bool) -> bool:
    """Is x[..., start::step] of an even contiguous shard the shard of the strided slice? Every
    other feature of an interleaved pair (gpt-oss' gate_up[..., ::2] and [..., 1::2]): when each
    rank's part holds a whole number of steps, the global index and the local one agree modulo
    the step, so each rank's local slice is its block of the result -- no communication."""
    if c.balanced or not (isinstance(step, int) and step > 1 and to_end and isinstance(start or 0, int)):
        return False
    n = expr(size)
    return 0 <= (start or 0) < step and n.is_Integer and int(n) % (c.size * step) == 0


@register_rule(aten.pad.default, aten.constant_pad_nd.default)
def _pad(c: Ctx):
    """Padding of the last len(pad)/2 dims: a shard on a dim it does not pad stays; padding
    the sharded dim (labels shifted by one: pad(labels, (0, 1)) then [..., 1:]) needs it whole."""
    p, node = c.p[0], c.node
    if not isinstance(p, Shard):
        return p, [None]
    nd, pads = ndim(c.inputs[0]), list(node.args[1])
    padded = {nd - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]}
    return (REPLICATE, [REPLICATE]) if p.dim in padded else (p, [None])


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
               aten.tensor_split.sections, aten.tensor_split.indices)
def _split(c: Ctx):
    """split, chunk, tensor_split (by a count or at indices), unbind: along another dim than the
    split one each piece keeps the shard; along it, only a fused value's whole blocks ([q|k|v] or
    Mamba's [x|z], which the plan lays out interleaved: each rank's slice of every piece) are
    cut locally -- a contiguous shard's pieces are not shards of the pieces, so it is gathered.
    A partial sum is reduced first, once for all the pieces."""
    p, node = c.p[0], c.node
    n_out = len(node.meta["val"])
    if p.is_partial():          # reduced once before it is cut, not once per piece (Mamba's x_proj: dt, B, C)
        return tuple([REPLICATE] * n_out), [REPLICATE]
    if not isinstance(p, Shard):
        return tuple([p] * n_out), [None]
    nd = ndim(c.inputs[0])
    if node.target == aten.unbind.int:
        dim = norm(node.args[1] if len(node.args) > 1 else 0, nd)
        if dim == p.dim:
            return tuple([REPLICATE] * n_out), [REPLICATE]
        return tuple([Shard(p.dim - (1 if dim < p.dim else 0), p.interleave)] * n_out), [None]
    dim = norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    if dim != p.dim:
        return tuple([p] * n_out), [None]
    sizes = [v.shape[dim] for v in node.meta["val"]]
    if p.interleave == n_out and len({str(s) for s in sizes}) == 1:
        return tuple([Shard(dim)] * n_out), [None]   # a fused [q|k|v]: each part whole heads
    full = expr(shape(c.inputs[0])[dim])
    if not isinstance(p.interleave, int) and full.is_Integer and all(expr(x).is_Integer for x in sizes):
        # unequal fused parts, each piece whole consecutive ones: this rank's slice of each (Mamba-2's
        # [z | x | B | C | dt] cut as [z | xBC | dt], xBC cut again after its conv)
        pieces, start = [], 0
        for x in sizes:
            end = start + int(expr(x))
            pieces.append(_blocks_cut(p, full, start, end, 1))
            start = end
        if all(k is not None for k in pieces):
            return tuple(Shard(dim, k) for k in pieces), [None]
    return tuple([REPLICATE] * n_out), [REPLICATE]


def _part_of_mixed(c: Ctx, p: Shard, size, start, end, step):
    """A slice of consecutive blocks of a parameter some of whose blocks every rank holds whole:
    Replicate where they are all whole (each rank has them), a shard where all are split; the
    slice is then local, no communication."""
    bounds = [0]
    for b in layout.block_sizes(int(expr(size)), p.interleave):
        bounds.append(bounds[-1] + b)
    start, end = start or 0, bounds[-1] if end is None else min(end, bounds[-1])
    if step != 1 or start not in bounds or end not in bounds or end <= start:
        raise c.fail(f"a slice [{start}, {end}) of a parameter laid out as blocks {bounds} must take whole blocks")
    i, j = bounds.index(start), bounds.index(end)
    kept = {t in p.whole for t in range(i, j)}
    if kept == {True}:
        return REPLICATE, [None]
    if kept == {False}:
        return Shard(p.dim, layout.normalize(tuple(bounds[t + 1] - bounds[t] for t in range(i, j)))), [None]
    raise c.fail("a slice of a parameter takes blocks held whole and blocks split together")


def _blocks_cut(p: Shard, size, start, end, step) -> "layout.Interleave | None":
    """The interleave of a slice [start, end) of a dim sharded with fused blocks, where it
    takes whole consecutive blocks (then each rank's slice of it is local); else None."""
    size = expr(size)
    if step != 1 or not size.is_Integer or not isinstance(start or 0, int) or not isinstance(end, (int, type(None))):
        return None
    size = int(size)
    start, end = start or 0, size if end is None else min(end, size)
    bounds = [0]
    for b in layout.block_sizes(size, p.interleave):
        bounds.append(bounds[-1] + b)
    if start not in bounds or end not in bounds or end <= start:
        return None
    i, j = bounds.index(start), bounds.index(end)
    return layout.normalize(tuple(bounds[t + 1] - bounds[t] for t in range(i, j)))


@register_rule(aten.index_select.default)
def _index_select(c: Ctx):
    """x.index_select(dim, index): rows picked along `dim`; a shard on another dim stays, with
    the index whole; a shard on `dim` itself is gathered first (the index is global)."""
    p = c.p[0]
    dim = norm(c.node.args[1], ndim(c.inputs[0]))
    if isinstance(p, Shard) and p.dim != dim:
        return p, [None, REPLICATE]
    if p.is_partial():
        return PARTIAL, [None, REPLICATE]                  # picking rows is linear
    return REPLICATE, [REPLICATE, REPLICATE]


@register_rule(aten.expand_as.default)
def _expand_as(c: Ctx):
    """x.expand_as(other): `other` lends only its shape -- this rank's, so the output is split
    wherever other is, and x too unless it broadcasts there."""
    x, other = c.node.args[:2]
    px, po = c.p[c.index(x)], c.p[c.index(other)]
    shift = ndim(other) - ndim(x)
    if isinstance(po, Shard):
        d = po.dim - shift
        wx = None if d < 0 or is_one(shape(x)[d]) else Shard(d, po.interleave)
        return po, [wx if a is x else None for a in c.inputs]
    if isinstance(px, Shard):
        out = Shard(px.dim + shift, px.interleave)
        return out, [None if a is x else out for a in c.inputs]
    if px.is_partial():
        return REPLICATE, [REPLICATE if a is x else None for a in c.inputs]
    return REPLICATE, [None] * len(c.inputs)


@register_rule(aten.scatter.value, aten.scatter_.value, aten.scatter.src, aten.scatter_.src)
def _scatter(c: Ctx):
    """x.scatter(dim, index, src or value): writes along `dim` row by row. A shard on another
    dim pairs x, index (and src) position by position: all split alike there, the output too
    (DeepSeek's group-limited routing masks each token's expert groups); anything else runs
    replicated."""
    x, index = c.node.args[0], c.node.args[2]
    dim = norm(c.node.args[1], ndim(x))
    shard = next((p for p in c.p if isinstance(p, Shard)), None)
    if shard is None:
        return None if any(p.is_partial() for p in c.p) else (REPLICATE, [None] * len(c.p))
    if shard.dim != dim and len({str(expr(shape(a)[shard.dim])) for a in c.inputs
                                 if ndim(a) > shard.dim}) == 1 and all(ndim(a) == ndim(x) for a in c.inputs):
        return shard, [None if p == shard else shard for p in c.p]
    return None


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


@register_rule(aten.index_add.default)
def _index_add(c: Ctx):
    """x.index_add(dim, index, source): source's rows added into x's at `index` along `dim` (a
    mixture of experts' combine, tokens grouped by expert put back in token order). A shard on
    another dim pairs x and source there; a partial sum of source added into zeros stays a
    partial sum (the add is linear, and the zeros add nothing on any rank); else whole. (The
    in-place index_add_ has no rule: moving its x would write into a copy.)"""
    x, index, source = c.node.args[0], c.node.args[2], c.node.args[3]
    px, ps = c.p[c.index(x)], c.p[c.index(source)]
    dim = norm(c.node.args[1], ndim(x))
    shard = ps if isinstance(ps, Shard) else px if isinstance(px, Shard) else None
    want = {x: REPLICATE, index: REPLICATE, source: REPLICATE}
    if shard is not None and shard.dim != dim and not shard.order and ndim(x) == ndim(source):
        want = {x: shard, index: REPLICATE, source: shard}
        return shard, [None if c.p[i] == want[a] else want[a] for i, a in enumerate(c.inputs)]
    if ps.is_partial() and (px.is_partial() or (px.is_replicate() and getattr(x, "target", None) in _ZEROS)):
        return PARTIAL, [None if a is not index else REPLICATE for a in c.inputs]
    return REPLICATE, [want[a] for a in c.inputs]


@register_rule(aten.repeat.default)
def _repeat(c: Ctx):
    """x.repeat(sizes): x tiled r times along each dim (new leading dims first). A shard on a
    dim tiled once stays; one tiled r times is r blocks, each the rank's part of x -- interleave
    r (JetMoE's keys repeated for each attention expert: `k.repeat(1, top_k, 1, 1)`)."""
    p = c.p[0]
    sizes = list(c.node.args[1])
    extra = len(sizes) - ndim(c.inputs[0])
    if p.is_replicate():
        return REPLICATE, [None]
    if isinstance(p, Shard) and not p.order and isinstance(p.interleave, int):
        r = sizes[p.dim + extra]
        if isinstance(r, int) and (r == 1 or not c.balanced):    # (cp's load-balanced halves: no blocks layout)
            return Shard(p.dim + extra, p.interleave * r), [None]
    return REPLICATE, [REPLICATE]


@register_rule(aten.gather.default)
def _gather(c: Ctx):
    """x.gather(dim, index): out[..i..] = x[.. index[..i..] at dim ..]; the output has the
    index's shape. A shard on another dim d pairs x and index position by position: both split
    on d (where their sizes agree); the index split on `dim` itself picks its rows from the
    whole x; a partial sum picked from stays partial."""
    x, index = c.node.args[0], c.node.args[2]
    px, pi = c.p[c.index(x)], c.p[c.index(index)]
    dim = norm(c.node.args[1], ndim(x))
    want = {x: REPLICATE, index: REPLICATE}
    shard = px if isinstance(px, Shard) else pi if isinstance(pi, Shard) else None
    if shard is not None:
        d = shard.dim
        if d == dim and not isinstance(px, Shard) and shard.interleave == 1:
            want[index] = None
            return Shard(d), [want[a] for a in c.inputs]
        if d != dim and expr(shape(x)[d]) == expr(shape(index)[d]):
            want = {x: shard, index: shard}      # (a cp shard of the folded tokens too: row by row)
            return shard, [None if c.p[i] == want[a] else want[a] for i, a in enumerate(c.inputs)]
    if px.is_partial() and pi.is_replicate():
        return PARTIAL, [None, None]
    if px.is_replicate() and pi.is_replicate():
        return REPLICATE, [None, None]
    return REPLICATE, [want[a] for a in c.inputs]


@register_rule(aten.index.Tensor)
def _index(c: Ctx):
    """x[i0, i1, ...] (advanced indexing; None keeps a dim whole): the indexed dims of x become
    the index tensors' broadcast shape -- in place when the indexed dims are adjacent, in front
    otherwise. A shard of x on a dim not indexed stays, at its new position; a partial sum read
    only here stays partial (picking rows is linear); a shard of the one index tensor on a dim the others
    broadcast along makes the output sharded there (Falcon's rotary tables picked by sequence-
    sharded positions; the one index tensor in any layout, as cp's load-balanced targets picking
    their class weights). Anything else is gathered first."""
    in_order = order.index_rule(c)        # a sort's indices in each rank's own order, or their inverse
    if in_order is not None:
        return in_order
    x, idx = c.node.args[0], list(c.node.args[1])
    px = c.p[c.index(x)]
    pos = [i for i, t in enumerate(idx) if t is not None]
    tensors = [t for t in idx if t is not None]
    bnd = max(ndim(t) for t in tensors)
    front = any(b - a != 1 for a, b in zip(pos, pos[1:]))   # non-adjacent indexed dims go first
    start = 0 if front else pos[0]
    expects = [REPLICATE] * len(c.p)
    expects[c.index(x)] = None
    pi = [c.p[c.index(t)] for t in tensors]
    if all(p.is_replicate() for p in pi):
        if px.is_partial() and len(x.users) == 1:
            return PARTIAL, expects
        if isinstance(px, Shard) and px.dim not in pos:
            before = sum(1 for i in pos if i < px.dim)
            d = px.dim - before + bnd if (front or px.dim > pos[0]) else px.dim
            return Shard(d, px.interleave), expects
        if px.is_replicate():
            return REPLICATE, expects
    elif px.is_replicate():
        sharded = [(t, p) for t, p in zip(tensors, pi) if not p.is_replicate()]
        if len(sharded) == 1 and isinstance(sharded[0][1], Shard) and not sharded[0][1].order and (
                sharded[0][1].interleave == 1 or len(tensors) == 1):
            t, p = sharded[0]
            d = p.dim + bnd - ndim(t)                         # its dim in the broadcast shape
            others = [u for u in tensors if u is not t]
            if all(d - (bnd - ndim(u)) < 0 or is_one(shape(u)[d - (bnd - ndim(u))]) for u in others):
                expects = [None if a is t else REPLICATE for a in c.inputs]
                # (the one index tensor: each output row is its index's, in any layout -- class
                # weights picked by cp's load-balanced targets)
                return Shard(start + d, p.interleave), expects
    return REPLICATE, [REPLICATE] * len(c.p)


@register_rule(aten.view_as_complex.default, aten.view_as_real.default)
def _complex_view(c: Ctx):
    """view_as_complex: (..., 2) real pairs -> (...) complex; view_as_real the inverse (a rotary
    embedding's complex rotation, Llama 4's and DeepSeek-V2's). A shard on a dim before the pair
    stays where it is; the pair itself is never split (gathered); both are linear, so a partial
    sum stays one."""
    p = c.p[0]
    if p.is_partial():
        return PARTIAL, [None]
    if not isinstance(p, Shard):
        return p, [None]
    if c.node.target == aten.view_as_complex.default and p.dim == ndim(c.inputs[0]) - 1:
        return REPLICATE, [REPLICATE]
    return p, [None]


@register_rule(operator.getitem)
def _getitem(c: Ctx):
    """One output of a multi-output op (split): its placement is that op's i-th (also where
    the op's outputs mix tensors and SymInts, a region run as a unit); a SymInt has none."""
    if not c.p:             # a source whose outputs mix tensors and other values (a SymInt)
        src = c.node.args[0]
        placed = c.placement_of(src) if isinstance(src, fx.Node) else None
        if isinstance(placed, tuple) and c.node.args[1] < len(placed):
            return placed[c.node.args[1]], []
        if isinstance(c.node.meta.get("val"), torch.Tensor):
            raise c.fail(f"picks a tensor from %{getattr(src, 'name', src)} ({getattr(src, 'target', '?')}), whose "
                         "outputs mix tensors and other values, with no placement for them")
        return None, []
    return c.p[0][c.node.args[1]], [None]


_CATS = {aten.cat.default}     # (torch.concat / concatenate: renamed to cat as the program is traced)


@register_rule(*_CATS, aten.stack.default)
def _cat(c: Ctx):
    node = c.node
    nd = ndim(node)
    dim = norm(node.args[1] if len(node.args) > 1 else 0, nd)
    ps = c.p
    if all(p.is_replicate() for p in ps):
        return REPLICATE, [None] * len(ps)
    if all(p.is_partial() for p in ps):
        return PARTIAL, [None] * len(ps)
    first = next((p for p in ps if isinstance(p, Shard)), None)
    # legacy cat skips 1-d empty tensors (an empty cache, say): they need no placement
    empty = [a.meta["val"].dim() == 1 and is_zero(a.meta["val"].shape[0]) for a in c.inputs]
    if first is not None and first.dim != dim and node.target in _CATS:
        return first, [None if e else first for e in empty]
    if first is not None and node.target in _CATS and sum(not e for e in empty) == 1:
        return first, [None] * len(ps)     # the one real input (past keys of an empty cache, then these)
    if first is not None and node.target == aten.cat.default and first.dim == dim:
        fused = _cat_blocks(c, dim, empty)
        if fused is not None:
            return fused
    if first is not None and node.target == aten.stack.default:
        # a new dim at `dim`: a shard of the inputs stays, one dim further when at or after it
        # (GPT-J's rotary pairs: stack((-x2, x1), -1) of per-head values)
        return Shard(first.dim + (first.dim >= dim), first.interleave), [first] * len(ps)
    return REPLICATE, [None if e else REPLICATE for e in empty]


def _cat_blocks(c: Ctx, dim: int, empty: list[bool]):
    """cat along the split dim of values each split there (Qwen3-Next's query, key and value
    heads cut from their projection, joined again for the causal conv: cat((q, k, v), -1)):
    each rank's cat is its slice of every input, one after the other -- the fused layout with
    the inputs' blocks as its blocks, no gather. A whole input joins as its own slice (a
    scatter: local). None where a size is symbolic, a block does not divide over the axis, or
    an input is a partial sum, a rank-local order, a load-balanced shard."""
    if c.balanced:
        return None
    blocks, expects = [], []
    for a, p, e in zip(c.inputs, c.p, empty):
        if e:
            expects.append(None)
            continue
        size = expr(shape(a)[dim])
        if not size.is_Integer:
            return None
        if isinstance(p, Shard) and p.dim == dim and not p.whole and not p.order \
                and not layout.is_symbolic(p.interleave):
            parts, want = layout.block_sizes(int(size), p.interleave), None
        elif p.is_replicate():
            parts, want = [int(size)], Shard(dim)
        else:
            return None
        if any(b % c.size for b in parts):
            return None
        blocks += parts
        expects.append(want)
    return Shard(dim, layout.normalize(tuple(blocks)) if len(blocks) > 1 else 1), expects


@register_rule(aten.repeat_interleave.self_int)
def _repeat_interleave(c: Ctx):
    p = c.p[0]
    if not isinstance(p, Shard):
        return p, [None] * len(c.p)
    nd = ndim(c.inputs[0])
    dim = c.node.args[2] if len(c.node.args) > 2 else c.node.kwargs.get("dim")
    if dim is None:
        return REPLICATE, [REPLICATE] + [None] * (len(c.p) - 1)
    if norm(dim, nd) == p.dim and p.interleave != 1:
        return REPLICATE, [REPLICATE] + [None] * (len(c.p) - 1)
    return p, [None] * len(c.p)   # each rank repeats its own kv heads: GQA stays head-aligned


_REPEAT_STEPS = opsets.RESHAPES | {aten.unsqueeze.default, aten.slice.Tensor, aten.expand.default,
                                   aten.repeat_interleave.self_int}


def head_repeat(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """If `node` (B, H, S, D) is keys or values whose heads were repeated from (B, Hkv, S, D)
    -- grouped-query attention's repeat_interleave, or transformers' repeat_kv
    (x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, H, S, D)) -- return the un-repeated value
    and the repeat's nodes in order; else None. Query head j reads kv head j // n."""
    chain, x = [], node
    while x.op == "call_function" and x.target in _REPEAT_STEPS and x.args and isinstance(x.args[0], fx.Node):
        chain.append(x)
        x = x.args[0]
    if not chain or not isinstance(x.meta.get("val"), torch.Tensor) or x.meta["val"].dim() != 4:
        return None
    src, out = shape(x), shape(node)
    if len(out) != 4 or any(expr(a) != expr(b) for i, (a, b) in enumerate(zip(src, out)) if i != 1):
        return None
    h, hkv = expr(out[1]), expr(src[1])
    if not (h.is_Integer and hkv.is_Integer) or int(h) % int(hkv) or int(h) == int(hkv):
        return None
    n = int(h) // int(hkv)
    steps = [c.target for c in reversed(chain)]
    if steps == [aten.repeat_interleave.self_int]:
        rep = chain[0]
        if rep.args[1] != n or norm(rep.args[2] if len(rep.args) > 2 else rep.kwargs.get("dim"), 4) != 1:
            return None
    else:
        core = [t for t in steps if t != aten.slice.Tensor]
        if core[:2] != [aten.unsqueeze.default, aten.expand.default] or len(core) != 3 \
                or norm(next(c for c in reversed(chain) if c.target == aten.unsqueeze.default).args[1], 5) != 2:
            return None
        expand = next(c for c in chain if c.target == aten.expand.default)
        if expr(shape(expand)[2]) != n:
            return None
    return x, list(reversed(chain))
