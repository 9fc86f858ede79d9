"""Passes, sharding rules: linears and matmuls, embeddings, norms, softmax, attention, cross
entropy -- and the lowerings that turn an embedding and a cross entropy split by vocabulary
into Megatron's vocab-parallel ops."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxtron.ops  # noqa: F401 - torch.ops.fxtron.vocab_parallel_*
from fxtron.core import meta
from fxtron.core.layout import block_sizes, is_symbolic
from fxtron.core.placement import PARTIAL, REPLICATE, Shard
from fxtron.errors import ParallelizeError
from fxtron.passes.rules import order
from fxtron.passes.rules.registry import Ctx, expr, is_one, ndim, norm, register_lowering, register_rule, shape

aten = torch.ops.aten


def _linear_like(c: Ctx, x: fx.Node, w: fx.Node, layout: str, bias: fx.Node | None):
    """y = x @ W^T (+ b) for layout out_in (nn.Linear), y = x @ W (+ b) for in_out."""
    px, pw = c.p[c.index(x)], c.p[c.index(w)]
    nd_out = ndim(c.node)
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
        expects[c.index(x)] = Shard(ndim(x) - 1)
        return PARTIAL, expects
    # replicated weight
    if isinstance(px, Shard) and px.dim < ndim(x) - 1:
        if bias is not None:
            expects[c.index(bias)] = REPLICATE
        return Shard(px.dim + nd_out - ndim(x), px.interleave), expects
    expects = [REPLICATE if i == c.index(x) or (bias is not None and i == c.index(bias)) else e
               for i, e in enumerate(expects)]
    return REPLICATE, expects


@register_rule(aten.linear.default)
def _linear(c: Ctx):
    a = c.node.args
    return _linear_like(c, a[0], a[1], "out_in", a[2] if len(a) > 2 and a[2] is not None else None)


@register_rule(aten._grouped_mm.default, "transformers::grouped_mm_fallback", "fxtron::grouped_mm")
def grouped_mm(c: Ctx):
    """A mixture of experts' grouped GEMM, x (tokens sorted by expert, in) @ w (experts, in,
    out) by offsets: the experts split over tp as Megatron does when they are not expert-
    parallel -- colwise (each expert's output features: gate/up) or rowwise (its input features:
    down, a partial sum). Tokens are rows grouped by the offsets: never sharded."""
    x, w = c.node.args[:2]
    in_order = order.grouped_rows(c, x, c.node.args[2] if len(c.node.args) > 2 else None)
    if in_order is not None:              # each rank's own rows, sorted by expert (cp: rules/order.py)
        return in_order
    pw = c.p[c.index(w)]
    expects = [REPLICATE] * len(c.p)
    expects[c.index(w)] = None
    if isinstance(pw, Shard) and pw.dim == 2:
        return Shard(1, pw.interleave), expects
    if isinstance(pw, Shard) and pw.dim == 1:
        expects[c.index(x)] = Shard(1)
        return PARTIAL, expects
    if isinstance(pw, Shard) and pw.dim == 0:
        # the experts split (expert parallel): the rows are the ones dispatched to this rank's
        # experts, counted by its local offsets (passes/ep.py) -- nothing to move
        offs = c.node.args[2] if len(c.node.args) > 2 else None
        src = offs.args[0] if isinstance(offs, fx.Node) and offs.target is operator.getitem else None
        if getattr(src, "target", None) not in (torch.ops.fxtron.ep_dispatch.default, torch.ops.fxtron.ep_gather.default):
            raise c.fail(f"expert weights split on their experts dim over {c.axis}, but the rows are not the ones "
                         "dispatched to this rank's experts (fxtron::ep_dispatch)")
        return REPLICATE, expects
    if not pw.is_replicate():
        raise c.fail(f"expert weights placed {pw}: only their feature dims split over tp (the experts dim is "
                     "expert parallel's, which tp does not do)")
    return REPLICATE, expects


@register_rule(aten.addmm.default)
def _addmm(c: Ctx):
    b, x, w = c.node.args[:3]
    return _linear_like(c, x, w, "in_out", b)


@register_rule(aten.mm.default, aten.matmul.default, aten.bmm.default)
def _matmul(c: Ctx):
    x, y = c.node.args[:2]
    px, py = c.p[c.index(x)], c.p[c.index(y)]
    nx, ny, no = ndim(x), ndim(y), ndim(c.node)
    if ny == 2 and (meta.is_param(y) or meta.transposed_param(y)):   # activation @ weight (or weight.T)
        return _linear_like(c, x, y, "in_out", None)
    if nx == 2 and meta.is_param(x) and isinstance(px, Shard) and px.dim == 1 and ny >= 2:
        return PARTIAL, [None, Shard(ny - 2)]          # weight @ x split by rows: x's features split, a partial sum
    if px.is_replicate() and py.is_replicate():
        return REPLICATE, [None, None]
    # batched matmul of activations: same batch dim sharded on both (attention scores)
    if isinstance(px, Shard) and px.dim < nx - 2:
        d_out = px.dim + no - nx
        dy = d_out - (no - ny)
        ey = Shard(dy, px.interleave) if dy >= 0 and not is_one(shape(y)[dy]) else REPLICATE
        return Shard(d_out, px.interleave), [None, ey]
    if isinstance(px, Shard) and px.dim == nx - 1 and isinstance(py, Shard) and py.dim == ny - 2:
        return PARTIAL, [None, None]
    if isinstance(px, Shard) and px.dim == nx - 2 and py.is_replicate():
        return Shard(no - 2, px.interleave), [None, None]
    if isinstance(px, Shard) and px.dim == nx - 2 and c.balanced:
        # context parallel's attention written out: the rank's query rows against every key
        # (q @ k^T with the keys gathered, then scores @ v with the values gathered)
        return Shard(no - 2, px.interleave), [None, REPLICATE]
    if isinstance(py, Shard) and py.dim == ny - 1 and px.is_replicate():
        return Shard(no - 1, py.interleave), [None, None]
    return REPLICATE, [REPLICATE, REPLICATE]


@register_rule(aten.embedding.default)
def _embedding(c: Ctx):
    w, ids = c.node.args[:2]
    pw, pi = c.p[c.index(w)], c.p[c.index(ids)]
    if isinstance(pw, Shard) and pw.dim == 0:            # vocab-parallel: partial sums
        return PARTIAL, [None, REPLICATE]
    if isinstance(pw, Shard) and pw.dim == 1:
        return Shard(ndim(c.node) - 1), [None, REPLICATE]
    if isinstance(pi, Shard):
        return Shard(pi.dim), [None, None]
    return REPLICATE, [None, REPLICATE]


@register_rule(aten.layer_norm.default, aten.rms_norm.default)
def _layer_norm(c: Ctx):
    x = c.node.args[0]
    px = c.p[0]
    n_norm = len(c.node.args[1])
    nd = ndim(x)
    expects = [None] + [REPLICATE] * (len(c.p) - 1)      # weight and bias whole
    if isinstance(px, Shard) and px.dim < nd - n_norm:
        return px, expects
    seq = c.seq_shard(x) if px.is_partial() else None
    if seq is not None and seq.dim < nd - n_norm:     # sequence parallel: normalize token shards
        return seq, [seq] + expects[1:]
    return REPLICATE, [REPLICATE] + expects[1:]


_CONV_GROUPS = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.conv3d.default: 6, aten.convolution.default: 8}


def _conv_args(node: fx.Node):
    """(input, weight, bias, groups, transposed) of a convolution, whichever overload."""
    a, at = list(node.args), _CONV_GROUPS[node.target]
    bias = a[2] if len(a) > 2 else node.kwargs.get("bias")
    groups = a[at] if len(a) > at else node.kwargs.get("groups", 1)
    transposed = node.target == aten.convolution.default and bool(a[6] if len(a) > 6 else node.kwargs.get("transposed"))
    return a[0], a[1], bias, groups, transposed


@register_rule(*_CONV_GROUPS)
def _conv(c: Ctx):
    """A grouped convolution (Mamba's causal depthwise conv1d, groups = channels) with its
    input split on the channel dim into whole groups (groups divisible by the axis): each rank
    convolves its own groups -- weight and bias split alike on their output channels, the
    output split on its channels -- with groups / size (the lowering below). A shard on the
    batch dim keeps the weights whole. Anything else (a partial sum, a spatial dim split, a
    dense convolution over split channels) gathers first."""
    x, w, bias, groups, transposed = _conv_args(c.node)
    px = c.p[c.index(x)]
    pw = c.p[c.index(w)]
    batched = ndim(x) == ndim(w)              # (N, C, L...) against (C_out, C_in/g, K...)
    ch = 1 if batched else 0
    whole = [REPLICATE] * len(c.p)
    if transposed or not all(p.is_replicate() or isinstance(p, Shard) for p in c.p):
        return REPLICATE, whole
    if isinstance(px, Shard) and px.dim == ch and isinstance(groups, int) and groups % c.size == 0 \
            and not px.whole and (pw.is_replicate() or pw == Shard(0, px.interleave)):
        if not _whole_groups(shape(x)[ch], groups, px.interleave, c.size):
            return REPLICATE, whole
        want = Shard(0, px.interleave)
        expects = [None if a is x else want for a in c.inputs]
        return Shard(ch, px.interleave), expects
    if batched and isinstance(px, Shard) and px.dim == 0 and pw.is_replicate() \
            and (bias is None or c.p[c.index(bias)].is_replicate()):
        return px, [None] * len(c.p)
    if all(p.is_replicate() for p in c.p):
        return REPLICATE, [None] * len(c.p)
    return REPLICATE, whole


def _whole_groups(channels, groups: int, interleave, size: int) -> bool:
    """Does a channel dim split over `size` ranks in fused blocks (k equal ones, or the
    proportions of Qwen3-Next's [q | k | v] before its depthwise conv) give every rank whole
    groups, none cut across two blocks or two ranks?"""
    channels = expr(channels)
    if is_symbolic(interleave) or not channels.is_Integer or int(channels) % groups:
        return False
    per = int(channels) // groups                      # channels in one group
    try:
        blocks = block_sizes(int(channels), interleave)
    except ValueError:
        return False
    return all(b % (per * size) == 0 for b in blocks)


@register_lowering(*_CONV_GROUPS)
def _conv_on_groups(node: fx.Node, lower):
    """The convolution of this rank's groups: the same call with groups / size."""
    x, _, _, groups, _ = _conv_args(node)
    p = meta.placement(node, lower.axis)          # the rule's choice: split on the channels, or not
    batched = ndim(x) == ndim(node.args[1])
    if not (isinstance(p, Shard) and p.dim == (1 if batched else 0)):
        return None
    at = _CONV_GROUPS[node.target]
    args = [lower.remap(a) if isinstance(a, fx.Node) else a for a in node.args]
    kwargs = dict(node.kwargs)
    if len(args) > at:
        args[at] = groups // lower.size
    else:
        kwargs["groups"] = groups // lower.size
    return lower.call(node.target, tuple(args), node, meta.placement(node, lower.axis),
                      f"the convolution of this rank's {groups // lower.size} of {groups} groups (channels split over "
                      f"{lower.axis})", kwargs=kwargs)


@register_rule(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def _softmax(c: Ctx):
    px = c.p[0]
    dim = norm(c.node.args[1], ndim(c.inputs[0]))
    if isinstance(px, Shard) and px.dim != dim:
        return px, [None]
    return REPLICATE, [REPLICATE]


@register_rule(aten.scaled_dot_product_attention.default)
def _sdpa(c: Ctx):
    q, k, v = c.node.args[:3]
    pq = c.p[0]
    if isinstance(pq, Shard) and pq.dim == 2 and pq.interleave == 1:
        return _sdpa_over_sequence(c)
    if isinstance(pq, Shard) and pq.dim in (0, 1):
        expects = []
        for a in c.inputs:
            d = pq.dim - (4 - ndim(a))
            expects.append(Shard(d, pq.interleave) if d >= 0 and not is_one(shape(a)[d]) else REPLICATE)
        return Shard(pq.dim, pq.interleave), expects
    return REPLICATE, [REPLICATE] * len(c.p)


def _sdpa_over_sequence(c: Ctx):
    """Queries split on their sequence dim (context parallel): with cp_comm_type "all_gather"
    every rank attends its queries to the whole sequence's keys and values (gathered, their
    gradients reduce-scattered) under the mask's rows of its queries; with "p2p" the keys stay
    split and travel around the ring; with "a2a" queries, keys and values go through an
    all-to-all to a head split, under the whole mask ("a2a+p2p": inside groups of cp ranks, the
    ring across them; the lowerings, passes/cp.py)."""
    comm = c.options.get("cp_comm_type")
    ring = comm in ("p2p", "a2a", "a2a+p2p")   # the keys stay split: around the ring, or into an all-to-all
    expects = [None]
    for a in c.inputs[1:]:
        if a is c.node.args[1] or a is c.node.args[2]:
            expects.append(Shard(2) if ring else REPLICATE)
        elif comm in ("a2a", "a2a+p2p"):        # the mask: whole (every query of the rank's heads)
            expects.append(REPLICATE)
        else:                                   # the mask: the queries' rows, every key
            d = ndim(a) - 2
            expects.append(Shard(d) if not is_one(shape(a)[d]) else REPLICATE)
    return Shard(2), expects


def _ce_reduction(node: fx.Node) -> int:
    args = list(node.args) + [None] * (6 - len(node.args))
    r = node.kwargs.get("reduction", args[3])
    return 1 if r is None else r


#: nll losses: a cross entropy's arguments but label smoothing, of log-probabilities
_NLL = (aten.nll_loss.default, aten.nll_loss_nd.default)


@register_rule(aten.cross_entropy_loss.default, *_NLL)
def _cross_entropy(c: Ctx):
    logits = c.node.args[0]
    pl = c.p[0]
    if c.node.target in _NLL and isinstance(pl, Shard) and pl.dim == 1:
        return REPLICATE, [REPLICATE] * len(c.p)     # (log-probabilities split by class: gathered)
    if isinstance(pl, Shard) and pl.dim == 1 and ndim(logits) == 2 and pl.interleave == 1:
        return REPLICATE, [None, REPLICATE] + [REPLICATE] * (len(c.p) - 2)   # vocab-parallel
    if isinstance(pl, Shard) and pl.dim != 1 and ndim(logits) >= 2:
        # tokens split (context parallel): each rank its tokens' losses; a mean divides the
        # summed losses by the summed count of counted tokens (_cross_entropy_over_tokens)
        rows = Shard(pl.dim if pl.dim == 0 else pl.dim - 1, pl.interleave)
        # class indices lack the class dim; class probabilities are laid out as the logits
        target = Shard(pl.dim, pl.interleave) if _probabilities(c.node) else rows
        out = {0: rows, 1: REPLICATE, 2: PARTIAL}[_ce_reduction(c.node)]    # (none: a loss a token)
        return out, [None, target] + [REPLICATE] * (len(c.p) - 2)
    return REPLICATE, [REPLICATE] * len(c.p)


# ----------------------------------------------------------------------------- lowerings
@register_lowering(aten.embedding.default)
def _vocab_parallel_embedding(node: fx.Node, lower) -> fx.Node | None:
    """An embedding whose table is split by rows becomes Megatron's vocab-parallel lookup:
    this rank's rows, zeros elsewhere, a partial sum the next op reduces."""
    w, ids = node.args[:2]
    pw = lower.placement(w)
    if not (isinstance(pw, Shard) and pw.dim == 0):
        return None
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    per = int(w.meta["val"].shape[0]) // lower.size
    start = lower.coord * per
    return lower.call(torch.ops.fxtron.vocab_parallel_embedding.default,
                      (lower.remap(w), lower.remap(ids), start, -1 if padding_idx is None else padding_idx,
                       int(w.meta["val"].shape[0])),
                      node, PARTIAL, f"vocab-parallel embedding, rows [{start}, {start + per})")


@register_lowering(aten.cross_entropy_loss.default)
def _vocab_parallel_cross_entropy(node: fx.Node, lower) -> fx.Node | None:
    """A cross entropy of logits split by vocabulary becomes Megatron's vocab-parallel one:
    three all-reduces of one float per token, the logits never gathered."""
    logits, target = node.args[:2]
    pl = lower.placement(logits)
    if not (isinstance(pl, Shard) and pl.dim == 1):
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    weight = node.kwargs.get("weight", args[2])
    reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
    if weight is not None:
        raise ParallelizeError(f"node %{node.name}: class weights in a vocab-parallel cross entropy are not "
                               "supported; replicate the LM head in the plan")
    if reduction == 1 and _tokens_split_on(node, lower) is not None:
        return None          # the mean over tokens split on another axis lowers there, with this inside
    return _vocab_parallel_ce(node, lower, reduction, REPLICATE)


def _vocab_parallel_ce(node: fx.Node, lower, reduction: int, placement) -> fx.Node:
    """The vocab-parallel op over `lower`'s axis, with this `reduction`, placed `placement` there."""
    logits, target = node.args[:2]
    args = list(node.args) + [None] * (6 - len(node.args))
    ignore_index = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    smoothing = node.kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
    per = int(logits.meta["val"].shape[1]) // lower.size
    return lower.call(torch.ops.fxtron.vocab_parallel_cross_entropy.default,
                      (lower.remap(logits), lower.remap(target), lower.coord * per, ignore_index, reduction,
                       float(smoothing), lower.axis),
                      node, placement, "vocab-parallel cross entropy: the full logits are never gathered")


def _tokens_split_on(node: fx.Node, lower) -> str | None:
    """The axis (other than lower's) on which the logits' tokens are split, if any."""
    for axis in lower.axes():
        p = lower.on(axis).placement(node.args[0])
        if axis != lower.axis and isinstance(p, Shard) and p.dim != 1:
            return axis
    return None


@register_lowering(aten.cross_entropy_loss.default, *_NLL)
def _cross_entropy_over_tokens(node: fx.Node, lower) -> fx.Node | None:
    """A mean cross entropy (or nll loss) over tokens split across the axis: the sum of this
    rank's losses and the count of its counted tokens (not ignore_index; with class weights,
    their targets' weights, as torch's mean divides by them), each all-reduced, then divided --
    the single-process mean however the ignored tokens spread over the ranks."""
    logits, target = node.args[:2]
    pl = lower.placement(logits)
    if not (isinstance(pl, Shard) and pl.dim != 1 and _ce_reduction(node) == 1):
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    weight = node.kwargs.get("weight", args[2])
    ignore_index = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    nll = node.target in _NLL
    smoothing = None if nll else node.kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
    x, t = lower.remap(logits), lower.remap(target)
    vocab = next((a for a in lower.axes() if isinstance(lower.on(a).placement(logits), Shard)
                  and lower.on(a).placement(logits).dim == 1), None)
    if nll and vocab is not None:
        raise ParallelizeError(f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'}): an nll loss of "
                               f"log-probabilities split by class across {vocab} and by token across {lower.axis} is "
                               f"not supported; replicate the head in the plan, or compute the loss as a cross "
                               f"entropy of the logits (the vocab-parallel one)")

    def loss_args(reduction: int) -> tuple:
        return (x, t, w, reduction, ignore_index) + (() if nll else (smoothing,))
    if weight is not None and (vocab is not None or any(not lower.on(a).placement(weight).is_replicate()
                                                        for a in lower.axes())):
        raise ParallelizeError(f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'}): class weights in a "
                               f"cross entropy over a vocabulary split across tp are not supported; replicate the "
                               f"LM head in the plan")
    w = lower.remap(weight) if weight is not None else None
    rows = Shard(pl.dim if pl.dim == 0 else pl.dim - 1, pl.interleave)
    probabilities = _probabilities(node)
    tpl = Shard(pl.dim, pl.interleave) if probabilities else rows
    if probabilities and vocab is not None:
        raise ParallelizeError(f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'}): a cross entropy "
                               f"with class probabilities as targets over a vocabulary split across tp and tokens "
                               f"split across {lower.axis} is not supported; replicate the head in the plan")
    val = node.meta.get("val")
    narrow = val is not None and val.dtype in (torch.float16, torch.bfloat16)
    if vocab is not None:         # the vocabulary split too (tp): its sum over this rank's tokens (fp32)
        total = _vocab_parallel_ce(node, lower.on(vocab), 2, REPLICATE)
        total.meta[meta.PLACEMENT] = meta.get(total, meta.PLACEMENT).with_axis(lower.axis, PARTIAL)
    elif narrow:                  # a 16-bit loss: its tokens' losses summed in fp32 (a 16-bit sum overflows
        each = lower.call(node.target, loss_args(0), target, rows,
                          "each of this rank's tokens' loss")       # past 65504 where the mean does not)
        tv = target.meta.get("val")
        if tv is not None:            # (a loss a token, in the loss's dtype: a float, not the ids' integers)
            each.meta["val"] = tv.new_empty([n for i, n in enumerate(tv.shape) if not (probabilities and i == 1)],
                                            dtype=val.dtype)
        total = lower.call(aten.sum.dim_IntList, (each, []), node, PARTIAL,
                           f"the summed loss of this rank's tokens ({lower.axis} splits them), in fp32",
                           kwargs={"dtype": torch.float32})
    else:
        total = lower.call(node.target, loss_args(2), node, PARTIAL,
                           f"the summed loss of this rank's tokens ({lower.axis} splits them)")
    if probabilities:             # the mean is over the tokens (every one counts), not the target's elements
        lv = logits.meta.get("val")
        one = lower.call(aten.select.int, (x, 1, 0), logits, rows, "one logit a token, counting the tokens")
        if lv is not None:
            one.meta["val"] = lv.new_empty([n for i, n in enumerate(lv.shape) if i != 1])
        counted = lower.call(aten.ones_like.default, (one,), one, rows, "the tokens counted in the mean")
    else:
        counted = lower.call(aten.ne.Scalar, (t, ignore_index), target, tpl, "the tokens counted in the mean")
        if w is not None:         # the mean divides by the counted targets' weights
            mask, tv = counted, target.meta.get("val")
            safe = lower.call(aten.where.ScalarOther, (mask, t, 0), target, tpl, "the counted tokens' classes")
            picked = lower.call(aten.index.Tensor, (w, [safe]), target, tpl, "each counted token's class weight")
            counted = lower.call(aten.mul.Tensor, (picked, mask), target, tpl, "the counted tokens' weights")
            if tv is not None:
                for n in (picked, counted):
                    n.meta["val"] = tv.new_empty(tv.shape, dtype=weight.meta["val"].dtype)
    # (float64 class weights summed in float64: their sum is not an integer fp32 holds exactly)
    wide = weight is not None and not probabilities and weight.meta["val"].dtype == torch.float64
    count = lower.call(aten.sum.dim_IntList, (counted, []), node, PARTIAL, "this rank's counted tokens",
                       kwargs={"dtype": torch.float64 if wide else torch.float32})
    total = lower.call(torch.ops.fxtron.all_reduce.default, (total, lower.axis), node, REPLICATE,
                       f"the loss summed over {lower.axis}")
    count = lower.call(torch.ops.fxtron.all_reduce.default, (count, lower.axis), node, REPLICATE,
                       f"the tokens counted over {lower.axis}")
    mean = lower.call(aten.div.Tensor, (total, count), node, REPLICATE, "mean over every rank's counted tokens")
    if narrow and vocab is None:
        mean = lower.call(aten.to.dtype, (mean, val.dtype), node, REPLICATE, "the loss in the model's dtype")
    return mean


def _probabilities(node: fx.Node) -> bool:
    """Whether a cross entropy's targets are class probabilities (floats, shaped as the logits)."""
    tv = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    return tv is not None and tv.is_floating_point()


@register_rule(aten.baddbmm.default)
def _baddbmm(c: Ctx):
    """beta * input + alpha * (batch1 @ batch2) (BLOOM's alibi scores): sharded over the batch
    dim of batch1 (heads folded into it), batch2 and the broadcast input follow."""
    inp, b1, b2 = c.node.args[:3]
    p1 = c.p[c.index(b1)]
    if all(p.is_replicate() for p in c.p):
        return REPLICATE, [None] * len(c.p)
    if isinstance(p1, Shard) and p1.dim == 0:
        out = Shard(0, p1.interleave)
        want = {b1: None, b2: out if not is_one(shape(b2)[0]) else REPLICATE}
        d = 3 - ndim(inp)
        want[inp] = REPLICATE if d > 0 or is_one(shape(inp)[0]) else out
        return out, [want[a] for a in c.inputs]
    return REPLICATE, [REPLICATE] * len(c.p)


def einsum_subscripts(eq: str, ndims: list[int]) -> tuple[list[str], str]:
    """The subscripts of each input and of the output, an ellipsis spelled out as letters the
    equation does not use (implicit output: the letters used once, in order, after the
    ellipsis's)."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    ins = lhs.split(",")
    free = (ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if ch not in eq)
    ell_n = max((nd - (len(s) - 3) for s, nd in zip(ins, ndims) if "..." in s), default=0)
    ell = "".join(next(free) for _ in range(ell_n))
    spelled = [s.replace("...", ell[len(ell) - (nd - (len(s) - 3)):]) if "..." in s else s for s, nd in zip(ins, ndims)]
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(spelled)
        out = ell + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1 and ch not in ell))
    return spelled, out


@register_rule(aten.einsum.default)
def _einsum(c: Ctx):
    """einsum(equation, tensors) from its subscripts: a letter sharded in one operand is sharded
    in every operand that has it (the others whole); kept in the output it is the output's
    shard, summed over it the output is a partial sum (an einsum contracting the split head dim
    of q and k is Megatron's row-parallel product). A partial sum times whole operands stays
    partial: einsum is linear in each operand."""
    eq, ops = c.node.args[0], list(c.node.args[1])
    subs, out = einsum_subscripts(eq, [ndim(t) for t in ops])
    ps = [c.p[c.index(t)] for t in ops]
    shards = [(s[p.dim], p.interleave) for s, p in zip(subs, ps) if isinstance(p, Shard)]
    if shards and len(set(shards)) == 1 and not any(p.is_partial() for p in ps):
        letter, k = shards[0]
        expects = [Shard(s.index(letter), k) if letter in s and not is_one(shape(t)[s.index(letter)]) else REPLICATE
                   for s, t in zip(subs, ops)]
        by_input = {t: e for t, e in zip(ops, expects)}
        return (Shard(out.index(letter), k) if letter in out else PARTIAL), [by_input.get(a) for a in c.inputs]
    partial = [i for i, p in enumerate(ps) if p.is_partial()]
    if len(partial) == 1 and all(p.is_replicate() for i, p in enumerate(ps) if i != partial[0]):
        return PARTIAL, [None] * len(c.inputs)
    if c.balanced and isinstance(ps[0], Shard) and subs[0][ps[0].dim] in out:
        # context parallel's attention as einsums: the first operand's rows (the rank's queries)
        # against the others whole (every key, every value)
        letter = subs[0][ps[0].dim]
        by_input = {t: (None if i == 0 else REPLICATE) for i, t in enumerate(ops)}
        return Shard(out.index(letter), ps[0].interleave), [by_input.get(a) for a in c.inputs]
    return REPLICATE, [REPLICATE] * len(c.inputs)
