"""Passes, tensor parallel step 2: propagate placements through every op.

Parameters take the plan's placements, buffers and user inputs are Replicate. Each op's rule
sees its inputs' placements and decides its output placement and the placement each input must
have (`node.meta["fxtron_expects"]`); `insert_collectives` then emits the redistribution where
an input's placement differs from what its consumer expects. Shapes are the global ones from
export (`val`); rules never run tensors.

An op whose inputs are all Replicate is computed redundantly on every tp rank and stays
Replicate: that is always correct. Ops that receive a Shard or Partial input need a rule here;
one without a rule raises ParallelizeError naming the node, its module and shapes.
"""
from __future__ import annotations

import operator
from typing import Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.compiler import meta
from fxtron.errors import ParallelizeError
from fxtron.passes.placement import PARTIAL, REPLICATE, Placement, Replicate, Shard
from fxtron.passes.plan import Colwise, Rowwise, TPPlan
from fxtron.runtime import shard as shard_math

aten = torch.ops.aten
P = Placement


# ----------------------------------------------------------------------------- helpers
def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued fx.Node leaves of node.args/kwargs, in pytree order (the order of
    `fxtron_expects`)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and _is_tensor(a)]


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and bool(val)
                                             and all(isinstance(v, torch.Tensor) for v in val))


def _shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _ndim(node: fx.Node) -> int:
    return node.meta["val"].dim()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _expr(s) -> sympy.Expr:
    return sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def _is_zero(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 0


def _is_one(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 1


class _Ctx:
    """What a rule may ask: the node, its tensor inputs' placements, the plan and tp."""

    def __init__(self, node: fx.Node, placements: dict, plan: TPPlan, tp: int, sequence_parallel: bool = False):
        self.node, self.plan, self.tp, self.sp = node, plan, tp, sequence_parallel
        self.inputs = tensor_inputs(node)
        self.p = [placements[a] for a in self.inputs]

    def seq_shard(self, node: fx.Node | None = None) -> Shard | None:
        """With sequence parallel: Shard on the sequence dim of `node` (default: this node),
        the dim whose size is exactly the sequence symbol; None without sequence parallel or
        when the value has no such dim."""
        if not self.sp:
            return None
        from fxtron.compiler.trace import SEQ
        node = node or self.node
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and self.plan.symbols.get(sympy.sympify(size.node.expr)) == SEQ:
                return Shard(d)
        return None

    def index(self, arg) -> int:
        return next(i for i, a in enumerate(self.inputs) if a is arg)

    def fail(self, why: str) -> ParallelizeError:
        return no_rule(self.node, self.p, why)


def no_rule(node: fx.Node, placements, why: str = "") -> ParallelizeError:
    ins = tensor_inputs(node)
    desc = ", ".join(f"%{a.name} {tuple(str(_expr(s)) for s in a.meta['val'].shape)} placed {p}"
                     for a, p in zip(ins, placements) if isinstance(a.meta.get("val"), torch.Tensor))
    module = meta.get(node, meta.MODULE) or "(top level)"
    return ParallelizeError(
        f"node %{node.name} ({node.target}) in module {module}: {why or 'no sharding rule for this op with these input placements'}. "
        f"Inputs: {desc}. Either make the layers that produce these inputs replicated "
        f"(parallelize(..., plan={{'{module}': 'replicate'}})), or add a rule for this op in "
        "fxtron/passes/propagate.py.")


Rule = Callable[[_Ctx], tuple]   # -> (out placement, expects: list[P | None])


# ----------------------------------------------------------------------------- pointwise
_LINEAR_UNARY = {aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                 aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                 aten.type_as.default, aten.mul.Scalar, aten.div.Scalar, aten.to.device}
_PARTIAL_THROUGH = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.to.device}
_POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.rsub.Scalar, aten.rsub.Tensor, aten.gelu.default, aten.silu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.sin.default,
    aten.cos.default, aten.abs.default, aten.erf.default, aten.reciprocal.default, aten.softplus.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.maximum.default, aten.minimum.default,
    aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.eq.Scalar, aten.ne.Scalar,
    aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.eq.Tensor, aten.ne.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.dropout.default, aten.gelu_.default,
    aten.tril.default, aten.triu.default, aten.mul_.Tensor, aten.add_.Tensor,
} | _LINEAR_UNARY
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
         aten.rand_like.default, aten.randn_like.default}


def _pointwise(c: _Ctx):
    node = c.node
    out_nd = _ndim(node)
    if node.target in (aten.tril.default, aten.triu.default):
        # the last two dims take part in the mask: they must be whole
        for i, p in enumerate(c.p):
            if p.is_shard() and p.dim >= out_nd - 2:
                return REPLICATE, [REPLICATE]
    shard = None
    for a, p in zip(c.inputs, c.p):
        if isinstance(p, Shard):
            shard = (p.dim + out_nd - _ndim(a), p.interleave)
            break
    if shard is not None:
        d, k = shard
        expects = []
        for a, p in zip(c.inputs, c.p):
            ad = d - (out_nd - _ndim(a))
            if ad < 0 or _is_one(_shape(a)[ad]):
                expects.append(REPLICATE)        # broadcast along the sharded dim
            else:
                expects.append(Shard(ad, k))
        return Shard(d, k), expects
    if any(p.is_partial() for p in c.p):
        # Partial sums pass through casts and copies only; anything else reduces them first,
        # right where Megatron's row-parallel linear does (one all-reduce, shared by all users;
        # with sequence parallel a reduce-scatter onto sequence shards)
        if node.target in _PARTIAL_THROUGH:
            return PARTIAL, [None] * len(c.p)
        seq = c.seq_shard()
        if seq is not None:
            expects = []
            for a in c.inputs:
                d = seq.dim - (out_nd - _ndim(a))
                expects.append(Shard(d) if d >= 0 and not _is_one(_shape(a)[d]) else REPLICATE)
            return seq, expects
        return REPLICATE, [REPLICATE] * len(c.p)
    return REPLICATE, [None] * len(c.p)


def _like(c: _Ctx):
    p = c.p[0]
    return (p if isinstance(p, Shard) else REPLICATE), [None]


# ----------------------------------------------------------------------------- views
def _groups(ins: tuple, outs: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims are
    left out: they are never sharded)."""
    ii = [i for i, s in enumerate(ins) if not _is_one(s)]
    oo = [j for j, s in enumerate(outs) if not _is_one(s)]
    groups, a, b = [], 0, 0
    while a < len(ii) and b < len(oo):
        gi, go = [ii[a]], [oo[b]]
        pi, po = _expr(ins[ii[a]]), _expr(outs[oo[b]])
        a, b = a + 1, b + 1
        while sympy.simplify(pi - po) != 0:
            if sympy.fraction(sympy.cancel(po / pi))[1] == 1 and a < len(ii):   # pi divides po
                pi *= _expr(ins[ii[a]])
                gi.append(ii[a])
                a += 1
            elif b < len(oo):
                po *= _expr(outs[oo[b]])
                go.append(oo[b])
                b += 1
            else:
                break
        groups.append((gi, go))
    return groups


def _view(c: _Ctx):
    x, p = c.inputs[0], c.p[0]
    if not isinstance(p, Shard):
        return p, [None]
    ins, outs = _shape(x), _shape(c.node)
    for gi, go in _groups(ins, outs):
        if p.dim not in gi:
            continue
        if len(gi) == 1 and len(go) == 1:
            return Shard(go[0], p.interleave), [None]
        if not isinstance(p.interleave, int):              # unequal fused blocks: no view layout
            return REPLICATE, [REPLICATE]
        if len(gi) == 1:                                   # split: (F,) -> (a0, a1, ...)
            sizes = [_expr(outs[j]) for j in go]
            prefix = 1
            for t, a in enumerate(sizes):
                k = p.interleave
                if a.is_Integer and k % prefix == 0 and int(a) % ((k // prefix) * c.tp) == 0:
                    return Shard(go[t], k // prefix), [None]
                if not a.is_Integer:
                    break
                prefix *= int(a)
            raise ParallelizeError(
                f"node %{c.node.name} in module {meta.get(c.node, meta.MODULE) or '(top level)'} views dim {p.dim} "
                f"of size {ins[p.dim]} (sharded over tp={c.tp}"
                + (f", {p.interleave} fused parts" if p.interleave > 1 else "") + f") as {tuple(outs[j] for j in go)}: "
                f"no factor can be split {c.tp} ways (a head count not divisible by tp?). "
                f"Choose a tp that divides the number of heads, or replicate this layer in the plan.")
        if len(go) == 1:                                   # merge: (b0, b1, ...) -> (F,)
            t = gi.index(p.dim)
            prefix = 1
            for j in gi[:t]:
                if not _expr(ins[j]).is_Integer:
                    return REPLICATE, [REPLICATE]   # (B, S/tp) -> B*S has no shard layout: gather first
                prefix *= int(ins[j])
            return Shard(go[0], prefix * p.interleave), [None]
        raise c.fail("a view that regroups the sharded dim with others both ways")
    raise c.fail("could not follow the sharded dim through this view")


def _permute_like(c: _Ctx):
    p = c.p[0]
    if not isinstance(p, Shard):
        return p, [None] * len(c.p)
    node, nd = c.node, _ndim(c.inputs[0])
    t = node.target
    if t == aten.transpose.int:
        d0, d1 = _norm(node.args[1], nd), _norm(node.args[2], nd)
        d = d1 if p.dim == d0 else d0 if p.dim == d1 else p.dim
    elif t == aten.t.default:
        d = 1 - p.dim if nd == 2 else p.dim
    elif t == aten.permute.default:
        d = [_norm(x, nd) for x in node.args[1]].index(p.dim)
    elif t == aten.unsqueeze.default:
        u = _norm(node.args[1], nd + 1)
        d = p.dim + (1 if u <= p.dim else 0)
    elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        shape = _shape(c.inputs[0])
        if t == aten.squeeze.default:
            dims = [i for i, s in enumerate(shape) if _is_one(s)]
        elif t == aten.squeeze.dim:
            dims = [_norm(node.args[1], nd)] if _is_one(shape[_norm(node.args[1], nd)]) else []
        else:
            dims = [_norm(x, nd) for x in node.args[1] if _is_one(shape[_norm(x, nd)])]
        d = p.dim - sum(1 for x in dims if x < p.dim)
    elif t == aten.expand.default:
        d = p.dim + (len(node.args[1]) - nd)
    else:
        raise c.fail()
    return Shard(d, p.interleave), [None] * len(c.p)


def _slice_select(c: _Ctx):
    p, node = c.p[0], c.node
    if not isinstance(p, Shard):
        return p, [None]
    nd = _ndim(c.inputs[0])
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
    if node.target == aten.select.int:
        if dim == p.dim:
            return REPLICATE, [REPLICATE]
        return Shard(p.dim - (1 if dim < p.dim else 0), p.interleave), [None]
    if dim == p.dim:
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = _shape(c.inputs[0])[dim]
        if p.interleave != 1:     # whole blocks of a fused projection ([q|k|v][..., q:q+k]): a shard of them
            part = _blocks_cut(p, size, start, end, step)
            return (Shard(dim, part), [None]) if part is not None else (REPLICATE, [REPLICATE])
        # never int() a symbolic size: that would specialize the shape environment to the example
        whole = start in (None, 0) and step == 1 and (
            end is None or (isinstance(end, int) and (end >= 2**62 or (isinstance(size, int) and end >= size))))
        return (p, [None]) if whole else (REPLICATE, [REPLICATE])
    return p, [None]


def _split(c: _Ctx):
    p, node = c.p[0], c.node
    n_out = len(node.meta["val"])
    if not isinstance(p, Shard):
        return tuple([p] * n_out), [None]
    nd = _ndim(c.inputs[0])
    if node.target == aten.unbind.int:
        dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
        if dim == p.dim:
            return tuple([REPLICATE] * n_out), [REPLICATE]
        return tuple([Shard(p.dim - (1 if dim < p.dim else 0), p.interleave)] * n_out), [None]
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    if dim != p.dim:
        return tuple([p] * n_out), [None]
    sizes = [v.shape[dim] for v in node.meta["val"]]
    if p.interleave == n_out and len({str(s) for s in sizes}) == 1:
        return tuple([Shard(dim)] * n_out), [None]   # a fused [q|k|v]: each part whole heads
    full = _expr(_shape(c.inputs[0])[dim])
    if not isinstance(p.interleave, int) and full.is_Integer and all(_expr(x).is_Integer for x in sizes) \
            and [int(_expr(x)) for x in sizes] == shard_math.block_sizes(int(full), p.interleave):
        return tuple([Shard(dim)] * n_out), [None]   # unequal fused parts, each this rank's slice
    return tuple([REPLICATE] * n_out), [REPLICATE]


def _blocks_cut(p: Shard, size, start, end, step) -> "shard_math.Interleave | None":
    """The interleave of a slice [start, end) of a dim sharded with fused blocks, where it
    takes whole consecutive blocks (then each rank's slice of it is local); else None."""
    size = _expr(size)
    if step != 1 or not size.is_Integer or not isinstance(start or 0, int) or not isinstance(end, (int, type(None))):
        return None
    size = int(size)
    start, end = start or 0, size if end is None else min(end, size)
    bounds = [0]
    for b in shard_math.block_sizes(size, p.interleave):
        bounds.append(bounds[-1] + b)
    if start not in bounds or end not in bounds or end <= start:
        return None
    i, j = bounds.index(start), bounds.index(end)
    return shard_math.normalize(tuple(bounds[t + 1] - bounds[t] for t in range(i, j)))


def _getitem(c: _Ctx):
    """One output of a multi-output op (split): its placement is that op's i-th."""
    return c.p[0][c.node.args[1]], [None]


def _cat(c: _Ctx):
    node = c.node
    nd = _ndim(node)
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
    ps = c.p
    if all(p.is_replicate() for p in ps):
        return REPLICATE, [None] * len(ps)
    if all(p.is_partial() for p in ps):
        return PARTIAL, [None] * len(ps)
    first = next((p for p in ps if isinstance(p, Shard)), None)
    # legacy cat skips 1-d empty tensors (an empty cache, say): they need no placement
    empty = [a.meta["val"].dim() == 1 and _is_zero(a.meta["val"].shape[0]) for a in c.inputs]
    if first is not None and first.dim != dim and node.target == aten.cat.default:
        return first, [None if e else first for e in empty]
    return REPLICATE, [None if e else REPLICATE for e in empty]


def _repeat_interleave(c: _Ctx):
    p = c.p[0]
    if not isinstance(p, Shard):
        return p, [None] * len(c.p)
    nd = _ndim(c.inputs[0])
    dim = c.node.args[2] if len(c.node.args) > 2 else c.node.kwargs.get("dim")
    if dim is None:
        return REPLICATE, [REPLICATE] + [None] * (len(c.p) - 1)
    if _norm(dim, nd) == p.dim and p.interleave != 1:
        return REPLICATE, [REPLICATE] + [None] * (len(c.p) - 1)
    return p, [None] * len(c.p)   # each rank repeats its own kv heads: GQA stays head-aligned


def _check(c: _Ctx):
    """Export's metadata asserts: no value; `localize` drops them (they carry global sizes)."""
    return None, [None] * len(c.p)


def _factory(c: _Ctx):
    return REPLICATE, [None] * len(c.p)


def _sym_size(c: _Ctx):
    p = c.p[0]
    if isinstance(p, Shard) and _norm(c.node.args[1], _ndim(c.inputs[0])) == p.dim:
        raise c.fail(f"reads the size of dim {p.dim}, which is sharded")
    return None, [None]


# ----------------------------------------------------------------------------- layers
def _linear_like(c: _Ctx, x: fx.Node, w: fx.Node, layout: str, bias: fx.Node | None):
    """y = x @ W^T (+ b) for layout out_in (nn.Linear), y = x @ W (+ b) for in_out."""
    px, pw = c.p[c.index(x)], c.p[c.index(w)]
    nd_out = _ndim(c.node)
    expects = [None] * len(c.p)
    out_dim_w = 0 if layout == "out_in" else 1          # weight dim of output features
    in_dim_w = 1 - out_dim_w
    if isinstance(pw, Shard) and pw.dim == out_dim_w:   # colwise
        expects[c.index(x)] = REPLICATE
        if bias is not None:
            expects[c.index(bias)] = Shard(0, pw.interleave)
        return Shard(nd_out - 1, pw.interleave), expects
    if isinstance(pw, Shard) and pw.dim == in_dim_w:    # rowwise (bias split off by split_row_bias)
        if bias is not None:
            raise c.fail("rowwise linear with its bias still attached (split_row_bias must run first)")
        expects[c.index(x)] = Shard(_ndim(x) - 1)
        return PARTIAL, expects
    # replicated weight
    if isinstance(px, Shard) and px.dim < _ndim(x) - 1:
        if bias is not None:
            expects[c.index(bias)] = REPLICATE
        return Shard(px.dim + nd_out - _ndim(x), px.interleave), expects
    expects = [REPLICATE if i == c.index(x) or (bias is not None and i == c.index(bias)) else e
               for i, e in enumerate(expects)]
    return REPLICATE, expects


def _linear(c: _Ctx):
    a = c.node.args
    return _linear_like(c, a[0], a[1], "out_in", a[2] if len(a) > 2 and a[2] is not None else None)


def _addmm(c: _Ctx):
    b, x, w = c.node.args[:3]
    return _linear_like(c, x, w, "in_out", b)


def _matmul(c: _Ctx):
    x, y = c.node.args[:2]
    px, py = c.p[c.index(x)], c.p[c.index(y)]
    nx, ny, no = _ndim(x), _ndim(y), _ndim(c.node)
    if y.op == "placeholder" and ny == 2:               # activation @ weight
        return _linear_like(c, x, y, "in_out", None)
    if px.is_replicate() and py.is_replicate():
        return REPLICATE, [None, None]
    # batched matmul of activations: same batch dim sharded on both (attention scores)
    if isinstance(px, Shard) and px.dim < nx - 2:
        d_out = px.dim + no - nx
        dy = d_out - (no - ny)
        ey = Shard(dy, px.interleave) if dy >= 0 and not _is_one(_shape(y)[dy]) else REPLICATE
        return Shard(d_out, px.interleave), [None, ey]
    if isinstance(px, Shard) and px.dim == nx - 1 and isinstance(py, Shard) and py.dim == ny - 2:
        return PARTIAL, [None, None]
    if isinstance(px, Shard) and px.dim == nx - 2 and py.is_replicate():
        return Shard(no - 2, px.interleave), [None, None]
    if isinstance(py, Shard) and py.dim == ny - 1 and px.is_replicate():
        return Shard(no - 1, py.interleave), [None, None]
    return REPLICATE, [REPLICATE, REPLICATE]


def _embedding(c: _Ctx):
    w, ids = c.node.args[:2]
    pw, pi = c.p[c.index(w)], c.p[c.index(ids)]
    if isinstance(pw, Shard) and pw.dim == 0:            # vocab-parallel: partial sums
        return PARTIAL, [None, REPLICATE]
    if isinstance(pw, Shard) and pw.dim == 1:
        return Shard(_ndim(c.node) - 1), [None, REPLICATE]
    if isinstance(pi, Shard):
        return Shard(pi.dim), [None, None]
    return REPLICATE, [None, REPLICATE]


def _layer_norm(c: _Ctx):
    x = c.node.args[0]
    px = c.p[0]
    n_norm = len(c.node.args[1])
    nd = _ndim(x)
    expects = [None] + [REPLICATE] * (len(c.p) - 1)      # weight and bias whole
    if isinstance(px, Shard) and px.dim < nd - n_norm:
        return px, expects
    seq = c.seq_shard(x) if px.is_partial() else None
    if seq is not None and seq.dim < nd - n_norm:     # sequence parallel: normalize token shards
        return seq, [seq] + expects[1:]
    return REPLICATE, [REPLICATE] + expects[1:]


def _softmax(c: _Ctx):
    px = c.p[0]
    dim = _norm(c.node.args[1], _ndim(c.inputs[0]))
    if isinstance(px, Shard) and px.dim != dim:
        return px, [None]
    return REPLICATE, [REPLICATE]


def _sdpa(c: _Ctx):
    q, k, v = c.node.args[:3]
    pq = c.p[0]
    if isinstance(pq, Shard) and pq.dim in (0, 1):
        expects = []
        for a in c.inputs:
            d = pq.dim - (4 - _ndim(a))
            expects.append(Shard(d, pq.interleave) if d >= 0 and not _is_one(_shape(a)[d]) else REPLICATE)
        return Shard(pq.dim, pq.interleave), expects
    return REPLICATE, [REPLICATE] * len(c.p)


def _cross_entropy(c: _Ctx):
    logits = c.node.args[0]
    pl = c.p[0]
    if isinstance(pl, Shard) and pl.dim == 1 and _ndim(logits) == 2 and pl.interleave == 1:
        return REPLICATE, [None, REPLICATE] + [REPLICATE] * (len(c.p) - 2)   # vocab-parallel
    return REPLICATE, [REPLICATE] * len(c.p)


def _reduce(c: _Ctx):
    node, p = c.node, c.p[0]
    nd = _ndim(c.inputs[0])
    t = node.target
    dims = node.args[1] if len(node.args) > 1 else None
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if t in (aten.sum.default, aten.mean.default) or dims is None or dims == []:
        dims = list(range(nd))
    dims = [_norm(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if p.is_partial():
        return REPLICATE, [REPLICATE]
    if not isinstance(p, Shard):
        return REPLICATE, [None]
    if p.dim in dims:
        if t in (aten.sum.dim_IntList, aten.sum.default):
            return PARTIAL, [None]
        return REPLICATE, [REPLICATE]
    d = p.dim if keep else p.dim - sum(1 for x in dims if x < p.dim)
    return Shard(d, p.interleave), [None]


RULES: dict = {}
for _t in _POINTWISE:
    RULES[_t] = _pointwise
for _t in _LIKE:
    RULES[_t] = _like
for _t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
    RULES[_t] = _view
for _t in (aten.transpose.int, aten.t.default, aten.permute.default, aten.unsqueeze.default,
           aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default):
    RULES[_t] = _permute_like
RULES.update({
    aten.slice.Tensor: _slice_select, aten.select.int: _slice_select,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split, aten.unbind.int: _split,
    aten.chunk.default: _split,
    aten.cat.default: _cat, aten.stack.default: _cat,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.sym_size.int: _sym_size,
    aten._assert_tensor_metadata.default: _check,
    aten.linear.default: _linear, aten.addmm.default: _addmm, aten.mm.default: _matmul,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul,
    aten.embedding.default: _embedding,
    aten.layer_norm.default: _layer_norm, aten.rms_norm.default: _layer_norm,
    aten._softmax.default: _softmax, aten.softmax.int: _softmax, aten._log_softmax.default: _softmax,
    aten.log_softmax.int: _softmax,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.sum.dim_IntList: _reduce, aten.sum.default: _reduce, aten.mean.dim: _reduce,
    aten.mean.default: _reduce, aten.amax.default: _reduce,
})


# ----------------------------------------------------------------------------- the pass
def split_row_bias(gm: fx.GraphModule, plan: TPPlan) -> fx.GraphModule:
    """Rowwise linears add their bias after the all-reduce (Megatron 2.4): rewrite
    linear(x, W, b) -> add(linear(x, W), b) and addmm(b, x, W) -> add(mm(x, W), b).
    Edits gm in place and returns it."""
    g = gm.graph
    for path, style in plan.styles.items():
        layer = plan.layers[path]
        node = layer.node
        if not isinstance(style, Rowwise) or layer.bias is None or layer.kind != "linear":
            continue
        if node.target == aten.linear.default:
            x, w, b = node.args[:3]
            new_args, target = (x, w), aten.linear.default
        elif node.target == aten.addmm.default:
            b, x, w = node.args[:3]
            new_args, target = (x, w), aten.mm.default
        else:
            continue
        with g.inserting_before(node):
            mm = g.call_function(target, new_args)
            mm.meta.update({k: v for k, v in node.meta.items()})
            meta.set(mm, meta.PROVENANCE, meta.Provenance("split_row_bias", f"rowwise {path}: bias after the all-reduce"))
            add = g.call_function(aten.add.Tensor, (mm, b))
            add.meta.update({k: v for k, v in node.meta.items()})
            meta.set(add, meta.PROVENANCE, meta.Provenance("split_row_bias", f"bias of {path}"))
        node.replace_all_uses_with(add)
        g.erase_node(node)
        plan.layers[path] = type(layer)(mm, layer.kind, layer.path, layer.weight, None, layer.layout,
                                        layer.in_features, layer.out_features)
    gm.recompile()
    return gm


def propagate(gm: fx.GraphModule, plan: TPPlan, *, tp: int, sequence_parallel: bool = False) -> fx.GraphModule:
    """Give every node a tp placement (node.meta fxtron_placement) and every call the
    placements it expects of its tensor inputs (fxtron_expects). Edits gm in place.

    With `sequence_parallel`, partial sums that feed token-wise ops (residual adds, norms,
    dropout) are reduce-scattered onto sequence shards instead of all-reduced, and those ops
    run on 1/tp of the tokens (Korthikanti et al. 2022); a colwise linear then gathers them."""
    placements: dict[fx.Node, object] = {}
    gathered = {plan.layers[p].node for p, s in plan.styles.items() if isinstance(s, Colwise) and s.gather_output}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = meta.get(node, meta.INPUT)
            pl = plan.params.get(spec.target, REPLICATE) if spec.kind == "parameter" else REPLICATE
            placements[node] = pl
            meta.set(node, meta.PLACEMENT, pl)
            continue
        if node.op == "output":
            c = _Ctx(node, placements, plan, tp, sequence_parallel)
            meta.set(node, meta.EXPECTS, tuple(REPLICATE for _ in c.p))
            continue
        if node.op != "call_function":
            if node.op == "get_attr":
                placements[node] = REPLICATE
            continue
        c = _Ctx(node, placements, plan, tp, sequence_parallel)
        if node.target is operator.getitem:
            out, expects = _getitem(c)
        else:
            rule = RULES.get(node.target)
            if rule is None:
                if all(isinstance(p, Replicate) for p in c.p):
                    out, expects = (tuple(REPLICATE for _ in node.meta["val"])
                                    if isinstance(node.meta.get("val"), (list, tuple)) else REPLICATE), [None] * len(c.p)
                else:
                    raise no_rule(node, c.p)
            else:
                out, expects = rule(c)
        if node in gathered and isinstance(out, Shard):
            meta.set(node, meta.REDISTRIBUTE_OUT, REPLICATE)
            placements[node] = REPLICATE       # what every consumer sees
        else:
            placements[node] = out
        if out is not None:
            meta.set(node, meta.PLACEMENT, out)
        meta.set(node, meta.EXPECTS, tuple(expects))
    return gm
