"""Passes: what a model computes over its batch, computed over the global batch.

A rank runs the model on one piece of the global batch -- its data-parallel slice, cut into
microbatches -- and the runtime averages what the pieces give: the gradients over dp, the
losses over the microbatches. That is the one-process model only where the loss is a mean over
equal pieces. `global_statistics(gm, dp=, pieces=)` finds, on the traced graph, every
statistic of the batch -- a node that reduces away the batch dim (its input's shape holds the
batch symbol B, its output's does not: a sum, a mean, a histogram, a loss reduced over tokens,
or a count of tokens taken from a shape) -- that the loss depends on, and makes it the global
batch's:

* a mean cross entropy (or nll loss) is first written as its sum over tokens divided by the
  count of tokens it counts (targets other than ignore_index), as one process computes it; a
  loss torch reduces by a plain mean or sum of its unreduced values (mse, l1, Huber, BCE, KL
  divergence, the margin losses: `split_elementwise_losses`) as those values and their mean or sum;
* a loss over selected elements (`x[mask]`: a count that depends on the data, which no piece
  can average) is written over every element with the mask in its math
  (`split_masked_selections`), its sums and counts then the batch's statistics as any other;
* where a statistic reaches the loss linearly (added, scaled by a number that is the same on
  every rank), the average over the pieces is already the global value for a mean; a sum is
  multiplied by the pieces (fxtron::batch_scale); a sum divided by a count of the inputs alone
  (the token mean) divides instead by the global batch's count over the pieces
  (fxtron::global_statistic, computed by the runtime from the global batch before the step:
  every rank has the labels; a class-weighted mean's count reads the weights too, a buffer the
  forward does not write). So a token mean is over the global batch's counted tokens across
  dp, cp and microbatches, however the ignored labels spread, and a summed loss stays a sum;
* where the loss uses a statistic nonlinearly (a load-balancing loss's tokens per expert f_e
  times its mean router probability P_e), the statistic is summed over the data-parallel ranks
  (fxtron::batch_all_reduce, whose backward sums too) -- per microbatch, as one process
  accumulating gradients computes it. `moe_aux_loss="local"` (Megatron's default) opts out:
  those statistics stay each rank's own, a change of the model `pm.summary()` names.

* a batch norm in training (aten.batch_norm, training=True) is written out with its mean and
  variance averaged over the data-parallel ranks (fxtron::batch_all_reduce; the ranks' pieces
  are equal) and its running statistics updated from those global values, SyncBatchNorm's math
  (`sync_batch_norms`). Its statistics span the whole global batch, which no rank holds when
  microbatches split it: a training batch norm with microbatches > 1 is a ParallelizeError.

The counts a mixture-of-experts layer's grouped GEMMs are offset by stay the rank's (they
describe the rank's rows). A reduction over the batch the pass cannot reason about (a max over
the batch, a sort of all tokens feeding the loss) is a ParallelizeError unless the user opted
into per-rank statistics.

Math that reads across the batch dim without reducing it away (`batch_coupling`, by shapes: a
(B, B) similarity, a softmax over the batch dim, a loss whose classes are the samples, a roll
along the batch) is made global where fxtron can: a contrastive loss over in-batch negatives (q
@ k.T through scalings, and a transpose, into cross entropies against arange(B): InfoNCE,
CLIP) gathers the negatives over dp, CLIP's way (`gather_negatives`). Anything else is a
ParallelizeError whatever the options: each piece would compute it over its own samples.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import sympy
import torch
import torch.fx as fx

import fxtron.ops.statistics  # noqa: F401 - registers torch.ops.fxtron.batch_*
from fxtron.core import meta, opsets
from fxtron.core.meta import BATCH, SEQ
from fxtron.errors import ParallelizeError
from fxtron.ops import registry

aten = torch.ops.aten
fxops = torch.ops.fxtron

#: reductions whose result is a sum over the reduced elements
_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.histc.default, aten.bincount.default,
         aten.count_nonzero.default, aten.count_nonzero.dim_IntList, aten.scatter_add.default,
         aten.scatter_add_.default, aten.index_add.default, aten.index_add_.default}
_MEANS = {aten.mean.default, aten.mean.dim}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
#: ops that only copy, cast or reshape a value
_SAME = opsets.CASTS | opsets.COPIES | opsets.RESHAPES | opsets.FOLDS | opsets.UNSQUEEZES | {aten.expand.default}
#: elementwise functions of their first input and constants: a denominator's guard (clamp(min=1),
#: + eps, a scale) applied to a statistic
_OF_ONE = {aten.clamp.default, aten.clamp_min.default, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor,
           aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar}
#: linear reductions over dims that are not the batch's (a sum of per-layer losses)
_LINEAR_REDUCTIONS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
_JOINS = {aten.stack.default, aten.cat.default}
#: ops that read only their input's dtype and device, not its values
_FACTORIES = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
              aten.new_empty_strided.default, aten.scalar_tensor.default}
@dataclass(frozen=True)
class Statistic:
    """An input statistic the runtime computes over the global batch before each step: the sum
    over the global batch's microbatches of `gm(*user inputs, *buffers)` (a graph of the inputs
    and of state the step does not change, buffers or frozen parameters: a class-weighted mean's
    count reads the weights) or
    of `expr` (a count from the inputs' batch and sequence sizes), divided by the pieces.
    `buffers`: the names of the buffers (lifted constants, frozen parameters) `gm` reads, with
    their shapes."""

    key: str
    what: str
    gm: fx.GraphModule | None = None
    expr: sympy.Expr | None = None
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: the user inputs `gm` writes in place (the model's own `labels.masked_fill_(...)`): copied
    #: first, so that computing the statistic leaves the batch as the step will read it
    written: tuple[int, ...] = ()

    def value(self, flat: list[torch.Tensor], user_dims, buffers: list[torch.Tensor] = ()) -> torch.Tensor:
        """This statistic of one global microbatch (its flat user inputs; `buffers`, the values
        of self.buffers as the step's graph reads them)."""
        if self.gm is not None:
            device = next((x.device for x in flat if isinstance(x, torch.Tensor)), None)
            flat = [x.clone() if i in self.written else x for i, x in enumerate(flat)]
            with torch.no_grad():     # (the batch where the data loader put it; the buffers the rank's device)
                return self.gm(*flat, *[b.to(device) for b in buffers]).detach().to(torch.float64)
        sizes = {}
        for x, dims in zip(flat, user_dims):
            for d, role in enumerate(dims):
                if role == "batch":
                    sizes.setdefault(BATCH, x.shape[d])
                elif role == "seq":
                    sizes.setdefault(SEQ, x.shape[d])
        return torch.tensor(float(self.expr.subs(sizes)), dtype=torch.float64)


@dataclass
class StatisticsReport:
    """What the pass did, for pm.summary(): each statistic by node and module, and how."""

    scaled: list[str] = field(default_factory=list)       # sums reaching the loss linearly, x pieces
    global_counts: list[str] = field(default_factory=list)  # counts a loss divides by, the global batch's
    summed: list[str] = field(default_factory=list)       # statistics summed over dp (used nonlinearly)
    local: list[str] = field(default_factory=list)        # left per rank (moe_aux_loss="local")
    synced: list[str] = field(default_factory=list)       # batch norms normalized over every dp rank's samples
    gathered: list[str] = field(default_factory=list)     # in-batch negatives gathered over dp
    per_microbatch: list[str] = field(default_factory=list)  # used nonlinearly under microbatches: each one's
    selected: list[str] = field(default_factory=list)     # losses over x[mask], written over every element


def _batchy(val, ti) -> bool:
    if isinstance(val, torch.Tensor):
        return any(BATCH in ti.expr(d).free_symbols for d in val.shape)
    return False


def _sym_expr(val, ti) -> sympy.Expr | None:
    """A SymInt / SymFloat value's expression in B and S, None for anything else."""
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        return sympy.sympify(val.node.expr).xreplace(ti.symbols)
    return None


def _where(node: fx.Node) -> str:
    return f"%{node.name} ({node.target}, in {meta.get(node, meta.MODULE) or 'the top level'})"


def _loss_args(node: fx.Node) -> tuple:
    args = list(node.args) + [None] * (6 - len(node.args))
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    out = [node.kwargs.get(n, a) for n, a in zip(names, args)]
    if out[3] is None:
        out[3] = 1
    if out[4] is None:
        out[4] = -100
    return tuple(out)


def _insert(g: fx.Graph, like: fx.Node, target, args, kwargs=None, val=None) -> fx.Node:
    n = g.call_function(target, tuple(args), kwargs or {})
    for k in ("stack_trace", "nn_module_stack", meta.MODULE, meta.PROVENANCE):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    if val is not None:
        n.meta["val"] = val
    return n


def _fake(node: fx.Node):
    return node.meta.get("val")


#: losses torch reduces by a plain mean or sum of their unreduced values (reduction=none), and
#: where their `reduction` argument is: (mse, l1, smooth l1, Huber, BCE with and without logits,
#: soft margin, KL divergence -- its "batchmean" is the sum over the batch size --, Poisson NLL,
#: the margin losses, cosine embedding, triplet)
_ELEMENTWISE_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
                       aten.huber_loss.default: 2, aten.binary_cross_entropy.default: 3,
                       aten.binary_cross_entropy_with_logits.default: 4, aten.soft_margin_loss.default: 2,
                       aten.kl_div.default: 2, aten.poisson_nll_loss.default: 5,
                       aten.margin_ranking_loss.default: 4, aten.hinge_embedding_loss.default: 3,
                       aten.cosine_embedding_loss.default: 4, aten.multi_margin_loss.default: 5,
                       aten.multilabel_margin_loss.default: 2, aten.triplet_margin_loss.default: 7}


def split_elementwise_losses(gm: fx.GraphModule) -> int:
    """Each loss of _ELEMENTWISE_LOSSES reduced over the batch written as its unreduced values
    (reduction=none) and then their mean or sum: the same number, as torch's own reduction
    computes it, with the reduction one the pass makes global. Returns how many."""
    g, ti = gm.graph, meta.info(gm)
    n = 0
    for node in list(g.nodes):
        at = _ELEMENTWISE_LOSSES.get(node.target) if node.op == "call_function" else None
        if at is None or not _batchy(_fake(node.args[0]), ti):
            continue
        schema = node.target._schema.arguments[at].name
        reduction = node.args[at] if len(node.args) > at else node.kwargs.get(schema, 1)
        if reduction not in (1, 2):
            continue
        args = list(node.args) + [a.default_value for a in node.target._schema.arguments[len(node.args):at + 1]]
        args[at] = 0
        kwargs = {k: v for k, v in node.kwargs.items() if k != schema}
        with g.inserting_before(node):
            each = _insert(g, node, node.target, args, kwargs)
            _refake([each])
            out = _insert(g, node, aten.mean.default if reduction == 1 else aten.sum.default, (each,), val=_fake(node))
        node.replace_all_uses_with(out)
        g.erase_node(node)
        n += 1
    if n:
        g.lint()
        gm.recompile()
    return n


#: losses whose unreduced values sit at their inputs' positions: loss(x[m], y[m]) is loss(x, y)[m]
_POSITIONAL_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                      aten.huber_loss.default, aten.binary_cross_entropy.default,
                      aten.binary_cross_entropy_with_logits.default, aten.soft_margin_loss.default,
                      aten.kl_div.default, aten.poisson_nll_loss.default}


#: the provenance reason of a selection's count (split_masked_selections' mean)
_SELECTION_COUNT = "the elements a mask selects"

#: elementwise math a selection passes through: f(x[m], y[m], c) is f(x, y, c)[m]
_THROUGH = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
            aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
            aten.abs.default, aten.neg.default, aten.exp.default, aten.log.default, aten.log1p.default,
            aten.sqrt.default, aten.rsqrt.default, aten.square.default, aten.sigmoid.default, aten.tanh.default,
            aten.relu.default, aten.softplus.default, aten.log_sigmoid.default, aten.clamp.default,
            aten.clamp_min.default, aten.clamp_max.default, aten.maximum.default, aten.minimum.default,
            aten.to.dtype, aten._to_copy.default}


def _off_mask(dtype: torch.dtype, *, exponent: bool = False):
    """What a selection's values are replaced by off its mask, before any op reads them: a value
    every op of _THROUGH and _POSITIONAL_LOSSES takes -- 0.5 (in every such loss's domain: BCE
    refuses a target outside [0, 1], and padding's -100 is one), 1 for integers, True for
    booleans (a 1 would make True + True 2), and 1 for an exponent, whose base may be negative
    (`c ** k[m]`) -- so nothing there is inf or NaN, in the values or any gradient, which is zero
    there as indexing's is."""
    if dtype == torch.bool:
        return True
    if not dtype.is_floating_point or exponent:
        return 1
    return 0.5


def _push_selections(g: fx.Graph, ti, skip) -> None:
    """Each elementwise op of _THROUGH whose batch inputs are all selections by one mask, x[m],
    of values of one shape (the others numbers, or tensors of the trailing dims alone): computed
    over every element, then selected, its inputs off the mask _off_mask's."""
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _THROUGH:
            continue
        tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(_fake(a), torch.Tensor)]
        sels = {a: _selection(a, ti, skip) for a in tensors}
        picked = [v for v in sels.values() if v is not None]
        if not picked or len({(_mask_key(m, ti), ti.shape(_fake(x))) for x, m in picked}) != 1:
            continue
        x0, m0 = picked[0]
        trailing = _fake(x0).dim() - _fake(m0).dim()
        if any(v is None and (_batchy(_fake(a), ti) or _fake(a).dim() > trailing) for a, v in sels.items()):
            continue

        with g.inserting_before(node):
            args = [_masked_as(g, node, *sels[a], _off_mask(_fake(a).dtype,
                                                           exponent=node.target is aten.pow.Tensor_Tensor and i == 1))
                    if sels.get(a) is not None else a for i, a in enumerate(node.args)]
            whole = _insert(g, node, node.target, args, node.kwargs)
            _refake([whole])
            out = _insert(g, node, aten.index.Tensor, (whole, [m0]), val=_fake(node))
        node.replace_all_uses_with(out)
        g.erase_node(node)
        for a in tensors:
            _drop_size_asserts(g, a)


def _selection(node, ti, skip: set | frozenset = frozenset()) -> tuple[fx.Node, fx.Node] | None:
    """(x, m) where `node` is x[m]: one boolean mask over x's leading dims, holding the batch (a
    mask in `skip` not taken)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not aten.index.Tensor:
        return None
    x, idx = node.args[:2]
    if len(idx) != 1 or not isinstance(idx[0], fx.Node) or not isinstance(x, fx.Node):
        return None
    m = idx[0]
    if m in skip:
        return None
    mv, xv = _fake(m), _fake(x)
    if not isinstance(mv, torch.Tensor) or not isinstance(xv, torch.Tensor) or mv.dtype != torch.bool \
            or mv.dim() == 0 or mv.dim() > xv.dim() or not _batchy(mv, ti):
        return None
    if ti.shape(mv) != ti.shape(xv)[:mv.dim()]:
        return None
    return x, m


def _unbroadcast(node, ti):
    """x where `node` is x's place in broadcast_tensors of tensors of one shape (a loss's
    F.mse_loss broadcasts its inputs first), else node."""
    if isinstance(node, fx.Node) and node.target is operator.getitem \
            and getattr(node.args[0], "target", None) is aten.broadcast_tensors.default:
        inner = node.args[0].args[0]
        if len({ti.shape(_fake(x)) for x in inner}) == 1:
            return inner[node.args[1]]
    return node


def _mask_key(m: fx.Node, ti) -> tuple:
    """Masks that are one: a node, through reshapes, at one shape (`mask.view(-1)` twice)."""
    src = m
    while src.op == "call_function" and src.target in opsets.FLATTENS and isinstance(src.args[0], fx.Node):
        src = src.args[0]
    return src, ti.shape(_fake(m))


def _drop_size_asserts(g: fx.Graph, node: fx.Node) -> None:
    """Erase `node` where nothing reads it but its size's runtime asserts (export's `u0 >= 0` on a
    data-dependent size), with them; through a broadcast's outputs (F.mse_loss broadcasts its
    inputs first), to the selections it broadcast."""
    if node.op == "call_function" and node.target is operator.getitem and not node.users \
            and getattr(node.args[0], "target", None) is aten.broadcast_tensors.default:
        src = node.args[0]
        g.erase_node(node)
        if not src.users:
            inner = src.args[0]
            g.erase_node(src)
            for x in inner:
                _drop_size_asserts(g, x)
        return
    if node.op != "call_function" or node.target is not aten.index.Tensor:
        return
    chain, stack = [], list(node.users)
    while stack:
        u = stack.pop()
        if u.op != "call_function" or not (u.target in (aten.sym_size.int, aten._assert_scalar.default,
                                                          aten.sym_constrain_range_for_size.default)
                                           or getattr(u.target, "__module__", "") == "_operator"):
            return
        chain.append(u)
        stack.extend(u.users)
    for u in reversed(_topo(chain)):
        g.erase_node(u)
    g.erase_node(node)


def _masked_as(g: fx.Graph, like: fx.Node, x: fx.Node, m: fx.Node, fill) -> fx.Node:
    """where(m, x, fill), the mask over x's leading dims broadcast over the rest, in x's dtype."""
    for _ in range(_fake(x).dim() - _fake(m).dim()):
        m = _insert(g, like, aten.unsqueeze.default, (m, -1), val=_fake(m).unsqueeze(-1))
    out = _insert(g, like, aten.where.ScalarOther, (m, x, fill))
    _refake([out])
    if _fake(out).dtype != _fake(x).dtype:      # (a fill that would promote x: True + True is not 2)
        raise AssertionError(f"where({x.name}, {fill!r}) promotes {_fake(x).dtype} to {_fake(out).dtype}")
    return out


def _reduces_all(node: fx.Node) -> bool:
    """Whether a sum / mean reduces its input to one number (every dim, keepdim off)."""
    if node.target in (aten.mean.default, aten.sum.default):
        return True
    ndim = _fake(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return not keep and (not dims or sorted(d % ndim for d in dims) == list(range(ndim)))


def _topo(nodes: list[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(set(nodes), key=order.__getitem__)


def split_masked_selections(gm: fx.GraphModule, *, microbatches: bool = False,
                            frozen_whole: bool = True) -> list[str]:
    """A loss over the batch's selected elements (`x[mask]`, a data-dependent count) written over
    every element, the mask kept in the math, so that the statistics are the batch's: the same
    number as the selection gives, its gradient zero where the mask is off as indexing's is.
    - `x[m].mean()` / `.sum()`: sum(where(m, x, 0)) over the mask's count (times x's trailing
      elements) / that sum;
    - a cross entropy (nll loss) of `logits[m]` against `labels[m]`: over every token, the labels
      off the mask set to ignore_index (a mean then divides by the counted ones; unreduced, the
      tokens' losses picked by the mask, then reduced as above);
    - a loss of _POSITIONAL_LOSSES (after split_elementwise_losses: unreduced) of `x[m]` and
      `y[m]`: the loss of x and y, then selected (and reduced as above);
    - elementwise math between a selection and its reduction (`(p[m] - y[m]).pow(2).mean()`):
      computed over every element, then selected (_push_selections).
    The same mask through reshapes counts as one. A mask the model computes from its weights
    (`x[pred > 0]`) counts its elements by a statistic no piece can take globally before the step:
    with `microbatches` (each piece's count its own) such a selection is left as it is, refused
    by the pass after. Returns where each rewritten loss or reduction was."""
    g, ti = gm.graph, meta.info(gm)
    done = []
    skip = _learned(gm, frozen_whole) if microbatches else frozenset()
    _push_selections(g, ti, skip)
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _POSITIONAL_LOSSES or len(node.args) < 2:
            continue
        at = _ELEMENTWISE_LOSSES[node.target]
        schema = node.target._schema.arguments[at].name
        reduction = node.args[at] if len(node.args) > at else node.kwargs.get(schema, 1)
        a, b = (_selection(_unbroadcast(v, ti), ti, skip) for v in node.args[:2])
        rest = [x for x in list(node.args[2:]) + list(node.kwargs.values()) if isinstance(x, fx.Node)]
        if reduction not in (0, 1, 2) or a is None or b is None or _mask_key(a[1], ti) != _mask_key(b[1], ti) \
                or ti.shape(_fake(a[0])) != ti.shape(_fake(b[0])) or any(_batchy(_fake(x), ti) for x in rest):
            continue
        args = list(node.args) + [x.default_value for x in node.target._schema.arguments[len(node.args):at + 1]]
        args[at] = 0
        with g.inserting_before(node):
            args[:2] = [_masked_as(g, node, v, m, _off_mask(_fake(v).dtype)) for v, m in (a, b)]
            whole = _insert(g, node, node.target, args, {k: v for k, v in node.kwargs.items() if k != schema})
            _refake([whole])
            picked = _insert(g, node, aten.index.Tensor, (whole, [a[1]]),
                             val=_fake(node.args[0]).new_empty(_fake(node.args[0]).shape, dtype=_fake(whole).dtype))
            if reduction:
                picked = _insert(g, node, aten.mean.default if reduction == 1 else aten.sum.default, (picked,),
                                 val=_fake(node))
        sels = node.args[:2]
        done.append(_where(node))
        node.replace_all_uses_with(picked)
        g.erase_node(node)
        for sel in sels:
            _drop_size_asserts(g, sel)
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LOSSES:
            x, t, w, reduction, ignore, smoothing = _loss_args(node)
            a, b = _selection(x, ti, skip), _selection(t, ti, skip)
            if reduction not in (0, 1, 2) or a is None or b is None or _mask_key(a[1], ti) != _mask_key(b[1], ti) \
                    or _fake(t).is_floating_point() or _fake(b[1]).dim() != _fake(b[0]).dim() \
                    or _fake(a[0]).dim() != _fake(a[1]).dim() + 1:
                continue
            k = _fake(b[1]).dim()
            with g.inserting_before(node):
                labels = _insert(g, node, aten.where.ScalarOther, (b[1], b[0], ignore), val=_fake(b[0]).clone())
                logits = _masked_as(g, node, *a, _off_mask(_fake(a[0]).dtype))
                if k > 1:
                    logits = _insert(g, node, aten.flatten.using_ints, (logits, 0, k - 1),
                                     val=_fake(logits).flatten(0, k - 1))
                    labels = _insert(g, node, aten.flatten.using_ints, (labels, 0, k - 1),
                                     val=_fake(labels).flatten(0, k - 1))
                args = [logits, labels, w, reduction, ignore] + ([smoothing if smoothing is not None else 0.0]
                                                                 if node.target is aten.cross_entropy_loss.default else [])
                if reduction:
                    loss = _insert(g, node, node.target, args, val=_fake(node))
                else:         # each token's loss (0 off the mask), then the mask's tokens picked
                    each = _insert(g, node, node.target, args, val=_fake(labels).new_empty(
                        _fake(labels).shape, dtype=_fake(node).dtype))
                    m = b[1] if k == 1 else _insert(g, node, aten.flatten.using_ints, (b[1], 0, k - 1),
                                                    val=_fake(b[1]).flatten(0, k - 1))
                    loss = _insert(g, node, aten.index.Tensor, (each, [m]), val=_fake(node))
        elif node.target in (aten.mean.default, aten.sum.default, aten.sum.dim_IntList, aten.mean.dim):
            a = _selection(node.args[0], ti, skip)
            xv = _fake(a[0]) if a is not None else None
            trailing = xv.shape[_fake(a[1]).dim():] if a is not None else ()
            out = _fake(node)
            if a is None or any(isinstance(d, torch.SymInt) for d in trailing) or not out.dtype.is_floating_point \
                    or not _reduces_all(node):
                continue
            acc = out.dtype if out.dtype in (torch.float32, torch.float64) else torch.float32
            with g.inserting_before(node):
                kept = _masked_as(g, node, a[0], a[1], 0)
                loss = _insert(g, node, aten.sum.dim_IntList, (kept, []), {"dtype": acc}, val=out.new_empty((), dtype=acc))
                if node.target in (aten.mean.default, aten.mean.dim):
                    count = _insert(g, node, aten.sum.dim_IntList, (a[1], []), {"dtype": acc},
                                    val=out.new_empty((), dtype=acc))
                    meta.set(count, meta.PROVENANCE, meta.Provenance("global_statistics", _SELECTION_COUNT))
                    loss = _insert(g, node, aten.div.Tensor, (loss, count), val=out.new_empty((), dtype=acc))
                    per = 1
                    for d in trailing:
                        per *= int(d)
                    if per != 1:     # (x's trailing elements: the count is the mask's times them)
                        loss = _insert(g, node, aten.div.Tensor, (loss, per), val=out.new_empty((), dtype=acc))
                if acc != out.dtype:
                    loss = _insert(g, node, aten.to.dtype, (loss, out.dtype), val=out)
        else:
            continue
        sels = [x for x in node.args[:2] if isinstance(x, fx.Node) and x.target is aten.index.Tensor]
        done.append(_where(node))
        node.replace_all_uses_with(loss)
        g.erase_node(node)
        for sel in sels:
            _drop_size_asserts(g, sel)
    if done:
        g.lint()
        gm.recompile()
    return done


def split_token_means(gm: fx.GraphModule) -> list[fx.Node]:
    """Each mean cross entropy / nll loss over the batch's tokens written as its sum over the
    tokens divided by the count of tokens it counts (targets other than ignore_index): the
    same number, with the count a statistic of the inputs the runtime can take globally.
    With class weights the count is the counted targets' weights (a statistic of the weights
    too, summed over dp where the loss divides by it). Returns the counts."""
    g, ti = gm.graph, meta.info(gm)
    counts = []
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _LOSSES:
            continue
        x, t, w, reduction, ignore, smoothing = _loss_args(node)
        tv = _fake(t)
        if reduction != 1 or not _batchy(_fake(x), ti) or tv is None or tv.is_floating_point():
            continue         # (class probabilities as targets: the mean is over the samples, a plain mean)
        out = _fake(node)
        with g.inserting_before(node):
            dtype = out.dtype if out.dtype in (torch.float32, torch.float64) else torch.float32
            # a 16-bit loss: the tokens' losses summed in fp32, as the mean's own kernel accumulates
            # them (a 16-bit sum overflows past 65504 where the mean does not)
            narrow = dtype != out.dtype
            args = (x, t, w, 0 if narrow else 2, ignore) + ((smoothing if smoothing is not None else 0.0,)
                                                           if node.target is aten.cross_entropy_loss.default else ())
            total = _insert(g, node, node.target, args, val=tv.new_empty(tv.shape, dtype=out.dtype) if narrow else out)
            if narrow:
                total = _insert(g, node, aten.sum.dim_IntList, (total, []), {"dtype": dtype},
                                val=out.new_empty((), dtype=dtype))
            mask = _insert(g, node, aten.ne.Scalar, (t, ignore), val=tv.ne(0))
            counted = mask
            if w is not None:   # with class weights the mean divides by the counted targets' weights
                safe = _insert(g, node, aten.where.ScalarOther, (mask, t, 0), val=tv.clone())
                picked = _insert(g, node, aten.index.Tensor, (w, [safe]), val=tv.new_empty(tv.shape, dtype=out.dtype))
                counted = _insert(g, node, aten.mul.Tensor, (picked, mask), val=tv.new_empty(tv.shape, dtype=out.dtype))
            count = _insert(g, node, aten.sum.dim_IntList, (counted, []), {"dtype": dtype},
                            val=out.new_empty((), dtype=dtype))
            mean = _insert(g, node, aten.div.Tensor, (total, count), val=out.new_empty((), dtype=dtype))
            if dtype != out.dtype:
                mean = _insert(g, node, aten.to.dtype, (mean, out.dtype), val=out)
        node.replace_all_uses_with(mean)
        g.erase_node(node)
        counts.append(count)
    g.lint()
    gm.recompile()
    return counts


def _structural_uses(gm: fx.GraphModule) -> set[tuple[fx.Node, fx.Node]]:
    """(count, user) edges through which a mixture-of-experts layer's count of copies per
    expert becomes its grouped GEMMs' offsets: the rank's own rows, never made global."""
    from fxtron.passes.ep import OFFSET_CHAIN, moe_layers
    edges = set()
    for layer in moe_layers(gm):
        node, prev = layer.offs, None
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target in OFFSET_CHAIN:
            prev, node = node, node.args[0]
        if isinstance(node, fx.Node) and prev is not None:
            edges.add((node, prev))
    return edges


def _ancestors_of(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _upstream(gm: fx.GraphModule) -> set[fx.Node]:
    """What the step's results depend on: the loss, and every in-place write into a buffer or a
    parameter -- state the next steps read (a running average of an activation's batch mean,
    written under no_grad; DINO's center in a frozen parameter) -- with their ancestors. What
    fills the model's state is the global batch's as the loss is: over its own samples each
    data-parallel rank would hold another."""
    sinks = [_loss_node(gm)]
    for n in gm.graph.nodes:
        if meta.writes_first(n) and any(v.op == "placeholder" and meta.get(v, meta.INPUT) is not None
                                        and meta.get(v, meta.INPUT).kind in ("buffer", "parameter")
                                        for v in meta.written(n)):
            sinks.append(n)
    out = set(sinks)
    for n in sinks:
        out |= _ancestors_of(n)
    return out


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = gm.graph.output_node().args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def find_statistics(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The batch statistics the loss (or a buffer's new value, _upstream) depends on: calls whose
    tensor input holds the batch symbol B and whose output does not -- "sum" (a sum, a
    histogram, a count, a loss summed over tokens), "mean" (a mean, a mean loss), "other" (any
    other reduction over the batch) -- and sizes holding B read as numbers in tensor arithmetic,
    "count"."""
    ti = meta.info(gm)
    upstream = _upstream(gm)
    stats: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node not in upstream:
            continue
        val = _fake(node)
        expr = _sym_expr(val, ti)
        if expr is not None:
            if BATCH in expr.free_symbols and any(_takes_value(u, node) for u in node.users):
                stats[node] = "count"
            continue
        if not isinstance(val, torch.Tensor) or _batchy(val, ti):
            continue
        if node.target in _FACTORIES or registry.op_name(node.target) is not None:
            continue     # a factory reads no values; fxtron's own ops (batch_*, global_statistic) are made here
        if not any(_batchy(_fake(a), ti) for a in node.all_input_nodes):
            continue
        if node.target in _SUMS or (node.target in _LOSSES and _loss_args(node)[3] == 2):
            stats[node] = "sum"
        elif node.target in _MEANS or node.target in _LOSSES:
            stats[node] = "mean"
        else:
            stats[node] = "other"
    return stats


def check_statistics(gm: fx.GraphModule) -> str | None:
    """What is wrong after global_statistics: a batch statistic the loss depends on that the pass
    did not mark as made global (or left local at the user's request); None when nothing."""
    for node in find_statistics(gm):
        if meta.get(node, meta.STATISTIC) is None:
            return f"{_where(node)} reduces over the batch, and the loss depends on it, but nothing made it global"
    ti = meta.info(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_training_batch_norm(node, ti):
            return f"{_where(node)} is a batch norm in training left on each rank's own samples"
    for node, why in batch_coupling(gm):
        return f"{_where(node)} reads across the batch dim ({why}) and is each rank's own"
    return None


def global_statistics(gm: fx.GraphModule, *, dp: int, pieces: int, local: bool = False,
                      group: str = "dp", frozen_whole: bool = True) -> fx.GraphModule:
    """Make every statistic of the batch the loss depends on the global batch's (module
    docstring): `dp` data-parallel ranks, `pieces` = dp x microbatches per step; `local`
    (moe_aux_loss="local") leaves the statistics the loss uses nonlinearly per rank. Batch norms
    in training are synced over dp (`sync_batch_norms`), in-batch negatives gathered
    (`gather_negatives`), and other math across the batch is a ParallelizeError
    (`check_batch_coupling`). `frozen_whole`: every rank holds its frozen parameters whole (not
    zero=3's pieces), so a statistic may read them as it reads buffers (class weights). Records
    the input statistics the runtime computes (TraceInfo.statistics) and what it did
    (TraceInfo.statistics_report). Edits gm in place and returns it."""
    if dp == 1 and pieces == 1:
        return gm
    split_elementwise_losses(gm)
    selected = split_masked_selections(gm, microbatches=pieces > dp, frozen_whole=frozen_whole)
    split_token_means(gm)
    gathered = gather_negatives(gm, dp=dp, group=group) if pieces == dp else []
    check_batch_coupling(gm, dp=dp, pieces=pieces)
    g, ti = gm.graph, meta.info(gm)
    out_node = g.output_node()
    loss = _loss_node(gm)
    upstream = _upstream(gm)
    structural = _structural_uses(gm)

    learned = _learned(gm, frozen_whole)
    stats = find_statistics(gm)
    derived: set[fx.Node] = set()           # computed from a statistic
    for node in g.nodes:
        if node in stats or any(a in derived for a in node.all_input_nodes):
            if node.op != "output":
                derived.add(node)

    # the loss's linear terms: walk back from the loss through sums, casts and scalings
    linear: dict[tuple[fx.Node, fx.Node], str] = {}     # (statistic, user) -> "plain" | "mean"
    # (statistic, its use on the way) -> the divisions a token mean divides by it in
    denominators: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
    seen: set[tuple[fx.Node, str]] = set()
    walked: set[fx.Node] = set()            # nodes the loss reaches linearly (numerators' included)
    constant_added: set[fx.Node] = set()    # divisions whose numerator adds a constant
    numerators: dict[fx.Node, set[tuple[fx.Node, fx.Node]]] = {}     # division -> its numerator's (statistic, user)

    def constant(a) -> bool:
        return not isinstance(a, fx.Node) or (a not in derived and not _batchy(_fake(a), ti))

    def walk(node: fx.Node, user: fx.Node | None, tag: str, div: fx.Node | None = None) -> None:
        if (node, tag) in seen or not isinstance(node, fx.Node):
            return
        if node in stats:
            if tag == "mean":
                numerators.setdefault(div, set()).add((node, user))
            linear.setdefault((node, user), tag)
            if linear[(node, user)] != tag:
                linear[(node, user)] = "nonlinear"
            return
        if node not in derived or node.op != "call_function":
            return
        seen.add((node, tag))
        t, args = node.target, [a for a in node.args]
        linear_here = True
        if t in _SAME or t in opsets.NEGS or (t in opsets.ADDS):
            if tag == "mean" and t in opsets.ADDS and any(constant(a) for a in args):
                constant_added.add(div)
            for a in args:
                if isinstance(a, fx.Node):
                    walk(a, node, tag, div)
        elif t in _JOINS:
            for a in args[0]:
                walk(a, node, tag, div)
        elif t in _LINEAR_REDUCTIONS and not _batchy(_fake(args[0]), ti):
            walk(args[0], node, tag, div)
        elif t in opsets.MULS and len(args) == 2 and (constant(args[0]) or constant(args[1])):
            a, b = args
            walk(a if constant(b) else b, node, tag, div)
        elif t in opsets.DIVS and len(args) == 2 and (constant(args[1]) or (
                tag == "plain" and _denominator(args[1]) is not None)):
            a, b = args
            if constant(b):
                walk(a, node, tag, div)
            else:
                denominators.setdefault((_denominator(b), _first_use(b, node)), []).append(node)
                walk(a, node, "mean", node)
        else:
            linear_here = False
        if linear_here:
            walked.add(node)

    def _denominator(b) -> fx.Node | None:
        """The input statistic a division divides by, if it is one: through casts, and through
        functions of it alone (`count.clamp(min=1)`, `count + eps`): over the global batch the
        division is by that function of the global statistic, one process's number."""
        _, b = _divisor_chain(b, stats)
        if not isinstance(b, fx.Node) or b not in stats:
            return None
        if stats[b] == "count" or (stats[b] == "sum" and b not in learned):
            return b
        return None

    def _first_use(b, div: fx.Node) -> fx.Node:
        """The node that consumes the statistic on the way to `div` (div itself when direct)."""
        chain, _ = _divisor_chain(b, stats)
        return chain[-1] if chain else div

    walk(loss, out_node, "plain")
    # A use the walk took for linear is one only if every path from it to the loss is linear (the
    # walk follows the linear ones alone): `s = 0.01 * sum; s + 0.1 * s**2` reaches the sum
    # linearly through s and nonlinearly through s**2, and s scaled by the pieces would be
    # squared. Such a use is nonlinear: summed over dp (one process's number), each microbatch's
    # under microbatches (said).
    onward: dict[fx.Node, bool] = {}

    def linear_onward(node: fx.Node) -> bool:
        """Whether every path from `node` to the loss is one the walk took (linear)."""
        if node not in onward:
            onward[node] = all(u is out_node or u not in upstream or (u in walked and linear_onward(u))
                               for u in node.users)
        return onward[node]

    for edge, tag in list(linear.items()):
        if tag != "nonlinear" and edge[1] is not out_node and not linear_onward(edge[1]):
            linear[edge] = "nonlinear"
    # a token mean by the global count (each piece's quotient averaged over the pieces) only where
    # the quotient reaches the loss linearly, its numerator's statistics are linear uses and add
    # no constant, and every division the count's guard or cast feeds is one of them: the average
    # of f(piece's quotient) is not f(sum / count) for a nonlinear f (`l + 0.1 l^2`), a constant
    # over the count would be counted once a piece, and a numerator summed over dp (nonlinear
    # elsewhere) over a count divided by the pieces would be off by dp. Else the count and the
    # numerator are statistics the loss uses nonlinearly (as above). Dropping one makes its
    # numerator's statistics nonlinear, which may drop another division sharing them: to a fixpoint.
    changed = True
    while changed:
        changed = False
        for key in list(denominators):
            divs = denominators[key]
            if all(d not in constant_added and linear_onward(d)
                   and all(linear[e] != "nonlinear" for e in numerators.get(d, ())) for d in divs) \
                    and _divides_only(key[1], divs, upstream):
                continue
            del denominators[key]
            for d in divs:
                for edge in numerators.get(d, ()):
                    linear[edge] = "nonlinear"
            changed = True

    report = StatisticsReport()
    statistics: dict[str, Statistic] = {}
    for node, kind in stats.items():
        uses = [u for u in node.users if u in upstream or u is out_node]
        lin = {u: linear[(node, u)] for u in uses if (node, u) in linear and linear[(node, u)] != "nonlinear"}
        den = {u for u in uses if (node, u) in denominators}
        rest = [u for u in uses if u not in lin and u not in den and (node, u) not in structural]
        if kind == "count":
            rest = [u for u in rest if _takes_value(u, node)]
        where = _where(node)
        done = []
        if kind == "other" and (lin or den or rest):
            if local:
                report.local.append(where)
                meta.set(node, meta.STATISTIC, "local")
                continue
            raise ParallelizeError(
                f"{where} reduces over the batch (input {_shapes(node, ti)} -> {tuple(ti.shape(_fake(node)))}), and the loss "
                f"(or what the forward writes into the model's buffers or parameters) depends on it: each "
                f"data-parallel rank and microbatch would compute it over its own samples only, "
                f"not over the global batch as one process does, and fxtron cannot make this op global (only sums, "
                f"means, histograms, losses over tokens and losses reduced by a mean or sum). Compute it as a sum or "
                f"mean of per-sample values; a mixture of experts' load-balancing statistics may instead stay each "
                f"rank's own with moe_aux_loss='local' (Megatron's default), a change of the model")
        # linear uses: a sum x pieces; a mean over the batch the sum over its elements divided by
        # the global batch's count of them (microbatches may differ in length); a token mean's
        # numerator as it is
        means = [u for u, tag in lin.items() if tag == "plain" and kind == "mean" and node.target in _MEANS]
        if means:
            key = f"{node.name}_elements"
            statistics[key] = Statistic(key, where, expr=_elements(node, ti))
            s = _mean_as_sum(g, node, key, ti)
            for u in means:
                u.replace_input_with(node, s)
            report.global_counts.append(where)
            done.append("global count")
        scaled = [u for u, tag in lin.items() if tag == "plain" and kind in ("sum", "count")]
        if scaled:
            with g.inserting_before(node.next):
                s = _insert(g, node, fxops.batch_scale.default, (_as_tensor(g, node, ti),), val=_tensor_val(node))
            for u in scaled:
                u.replace_input_with(node, s)
            report.scaled.append(where)
            done.append("scaled")
        if den:
            key = node.name
            statistics[key] = _statistic(gm, node, kind, ti, frozen_whole)
            # the global count divided by the pieces is a fraction: an integer count (`(y != -100).sum()`)
            # enters in the floating dtype its use computes in (the one process's division's), not truncated
            by_dtype: dict[torch.dtype, list[fx.Node]] = {}
            for u in den:
                dtype = _denominator_dtype(node, denominators[(node, u)][0])
                by_dtype.setdefault(dtype, []).append(u)
                for division in denominators[(node, u)]:
                    _retype_guard(division.args[1], stats, dtype)
            with g.inserting_before(node.next):
                x = _as_tensor(g, node, ti)
                for dtype, users in by_dtype.items():
                    val = _tensor_val(node)
                    arg = x
                    if dtype != val.dtype:
                        val = val.to(dtype)
                        arg = _insert(g, node, aten._to_copy.default, (x,), {"dtype": dtype}, val=val)
                    s = _insert(g, node, fxops.global_statistic.default, (arg, key), val=torch.empty_like(val))
                    whole = None
                    for u in users:
                        divisions = denominators[(node, u)]
                        if not any(_guarded(d.args[1], stats) for d in divisions):
                            u.replace_input_with(node, s)     # A / (count / pieces): averages to sum(A) / count
                            continue
                        # a guard on the count (`count.clamp(min=1)`, `+ eps`) is not linear in it: it
                        # guards the whole global count, and each quotient by it is scaled by the
                        # pieces, so that it too averages to sum(A) / guard(count)
                        if whole is None:
                            whole = _insert(g, node, fxops.batch_scale.default, (s,), val=torch.empty_like(val))
                        u.replace_input_with(node, whole)
                        for division in divisions:
                            _scale_after(g, division)
            report.global_counts.append(where)
            done.append("global count")
        if rest and pieces > dp and not local:
            prov = meta.get(node, meta.PROVENANCE)
            if prov is not None and prov.reason == _SELECTION_COUNT:
                raise ParallelizeError(
                    f"the loss uses the mean of a selection x[mask] nonlinearly ({where}: "
                    f"{', '.join(_where(u) for u in rest)}): with microbatches={pieces // dp} each microbatch would "
                    f"divide by its own count of selected elements, and one that selects none by 0 (NaN), where one "
                    f"process divides by the batch's. Use microbatches=1 (dp alone computes it exactly), or use "
                    f"the mean linearly (added or scaled, not squared or multiplied by another)")
            report.per_microbatch.append(where)
        if rest and dp > 1:
            if local:
                report.local.append(where)
                meta.set(node, meta.STATISTIC, ", ".join(done + ["local"]))
                continue
            with g.inserting_before(node.next):
                if kind == "count":
                    s = _insert(g, node, operator.mul, (node, dp), val=_fake(node) * dp)
                    meta.set(s, meta.STATISTIC, "the count over every dp rank")
                else:
                    s = _insert(g, node, fxops.batch_all_reduce.default, (node, group), val=_tensor_val(node))
                    if kind == "mean":
                        s = _insert(g, node, aten.div.Tensor, (s, dp), val=_tensor_val(node))
            for u in rest:
                u.replace_input_with(node, s)
            report.summed.append(where)
            done.append("summed over dp")
        meta.set(node, meta.STATISTIC, ", ".join(done) or "as is")
    report.synced = sync_batch_norms(gm, dp=dp, group=group)
    report.gathered, report.selected = gathered, selected
    g.lint()
    gm.recompile()
    gm.meta[meta.TRACE_INFO] = replace(ti, statistics={**ti.statistics, **statistics},
                                       statistics_report=report)
    return gm


#: batch norm in training: its mean and variance reduce over every dim but the channels (dim 1)
_BATCH_NORM = aten.batch_norm.default
_OTHER_BATCH_NORMS = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                      aten._native_batch_norm_legit_functional.default, aten.cudnn_batch_norm.default}
#: ops that normalize over a dim: over one holding the batch, each sample's value depends on the others'
_NORMALIZING = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                aten._safe_softmax.default}
#: ops that move values along a dim: along the batch's, one sample reads another's
_SHIFTS = {aten.roll.default, aten.flip.default}


def _b_dims(val, ti) -> list[int]:
    """The dims of tensor `val` whose size holds the batch symbol B."""
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d, n in enumerate(val.shape) if BATCH in ti.expr(n).free_symbols]


def _op_dims(node: fx.Node) -> list[int]:
    """The dims a normalizing op or shift works along (non-negative)."""
    nd = _fake(node.args[0]).dim()
    if node.target in _NORMALIZING:
        return [node.args[1] % nd] if nd else []
    dims = node.args[2] if node.target is aten.roll.default and len(node.args) > 2 else (
        node.args[1] if node.target is aten.flip.default else node.kwargs.get("dims", []))
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return [d % nd for d in dims] if dims else list(range(nd))


def batch_coupling(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """The ops the loss (or a buffer's new value) depends on that read across the batch dim
    without reducing it away (the reductions are find_statistics'), by their shapes on the graph: a value pairing samples with
    samples (two dims holding the batch: a similarity q @ k.T of in-batch negatives, pairwise
    distances) made from values that do not; a softmax / log-softmax over a dim holding the
    batch; a loss whose classes are the batch's samples; a roll or flip along the batch. Each
    with why, in words."""
    ti = meta.info(gm)
    upstream = _upstream(gm)
    found = []
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node not in upstream or registry.op_name(node.target) is not None
                or meta.get(node, meta.NEGATIVES) is not None):
            continue
        val = _fake(node)
        out = _b_dims(val, ti)
        ins = [_b_dims(_fake(a), ti) for a in node.all_input_nodes]
        if len(out) >= 2 and all(len(d) < 2 for d in ins):
            found.append((node, f"its output {tuple(ti.shape(val))} pairs every sample with every other sample "
                                f"(dims {out} both hold the batch: a similarity over in-batch negatives)"))
        elif node.target in _NORMALIZING | _SHIFTS and set(_op_dims(node)) & set(ins[0] if ins else []):
            what = "normalizes" if node.target in _NORMALIZING else "moves values"
            found.append((node, f"it {what} along dim {_op_dims(node)} of {tuple(ti.shape(_fake(node.args[0])))}, "
                                f"which holds the batch: each sample's value depends on the other samples"))
        elif node.target in _LOSSES and isinstance(_fake(node.args[0]), torch.Tensor):
            x = _fake(node.args[0])
            classes = 1 if x.dim() > 1 else 0
            if classes in _b_dims(x, ti):
                found.append((node, f"its classes (dim {classes} of {tuple(ti.shape(x))}) are the batch's samples "
                                    f"(in-batch negatives)"))
    return found


_PRODUCTS = {aten.matmul.default, aten.mm.default}
#: what may lie between the similarity and its loss: a temperature, a scale, a cast
_SCALINGS = {aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.to.dtype,
             aten._to_copy.default, aten.clone.default, aten.contiguous.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _swaps(node: fx.Node) -> bool:
    """Whether `node` transposes a 2-d value (.T, t(), transpose(0, 1), permute(1, 0))."""
    t, a = node.target, node.args
    if t in (aten.t.default, aten.numpy_T.default):
        return True
    if t is aten.transpose.int:
        return {a[1] % 2, a[2] % 2} == {0, 1}
    return t is aten.permute.default and [d % 2 for d in a[1]] == [1, 0]


def _arange_of_batch(t, ti) -> bool:
    """Whether targets `t` are arange(B) (through casts): sample i's positive is column i."""
    if not isinstance(t, fx.Node):
        return False
    while t.op == "call_function" and t.target in opsets.CASTS and isinstance(t.args[0], fx.Node):
        t = t.args[0]
    if t.op != "call_function" or t.target not in _ARANGES:
        return False
    start = 0 if t.target is aten.arange.default else t.args[0]
    step = t.args[2] if t.target is aten.arange.start_step else 1
    tv = _fake(t)
    return start == 0 and step == 1 and tv is not None and tv.dim() == 1 and ti.expr(tv.shape[0]) == BATCH


@dataclass
class _Path:
    """One way from a similarity to a loss: the scalings before a transpose (or all of them),
    the transpose (None: the loss's rows are the similarity's), the scalings after it, the loss."""

    before: list
    swap: fx.Node | None
    after: list
    loss: fx.Node


def _negatives(node: fx.Node, ti) -> list[_Path] | None:
    """For a similarity `node` = q @ k.T over in-batch negatives -- q (B, D) the rank's samples on
    the rows, k.T (D, B) the negatives on the columns -- every use of which reaches a cross
    entropy (or nll loss) against arange(B) (sample i's positive is column i) through scalings (a
    temperature, a scale, casts) and at most one transpose (CLIP's symmetric loss): the paths.
    None for anything else."""
    if node.target not in _PRODUCTS or len(node.args) != 2:
        return None
    q, k = (_fake(a) for a in node.args)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 2 and k.dim() == 2):
        return None
    if _b_dims(q, ti) != [0] or _b_dims(k, ti) != [1] or ti.expr(q.shape[0]) != BATCH or ti.expr(k.shape[1]) != BATCH:
        return None
    paths: list[_Path] = []

    def walk(cur: fx.Node, before: list, swap, after: list) -> bool:
        if not cur.users:
            return False
        for u in cur.users:
            if u.target in _SCALINGS:
                rest = [a for i, a in enumerate(u.args) if a is not cur]
                if (u.args[0] is not cur and not (u.target is aten.mul.Tensor and u.args[1] is cur)) or any(
                        isinstance(a, fx.Node) and _b_dims(_fake(a), ti) for a in rest):
                    return False
                if not walk(u, before + [u] if swap is None else before, swap, after + [u] if swap else after):
                    return False
            elif swap is None and _swaps(u):
                if not walk(u, before, u, []):
                    return False
            elif u.target in _LOSSES and u.args[0] is cur:
                x, t, w, *_ = _loss_args(u)
                if w is not None or not _arange_of_batch(t, ti):
                    return False
                paths.append(_Path(before, swap, after, u))
            else:
                return False
        return True
    return paths if walk(node, [], None, []) and paths else None


def _refake(nodes) -> None:
    """Each node's value computed again from its inputs' (their shapes changed)."""
    for n in nodes:
        n.meta["val"] = n.target(*[_fake(a) if isinstance(a, fx.Node) else a for a in n.args], **n.kwargs)


def gather_negatives(gm: fx.GraphModule, *, dp: int, group: str = "dp") -> list[str]:
    """Each loss over in-batch negatives (`_negatives`: q @ k.T through scalings into a cross
    entropy against arange(B), an InfoNCE loss, and CLIP's symmetric one through a transpose)
    made the global batch's as CLIP's gathered negatives do. The rank's rows meet every rank's
    columns: k.T is all-gathered over the data-parallel ranks (fxtron::batch_gather; its backward
    reduce-scatters the gradient, so every rank's loss reaches the rank's samples); the transposed
    similarity's rows are the rank's k against every rank's q, computed so (k @ gathered q.T, the
    scalings before the transpose repeated on it). Each loss's targets move to the rank's rows
    among the columns (fxtron::batch_offset). A loss over the rank's rows is then a statistic the
    rest of global_statistics averages over dp as any other. Only when the step's pieces are the
    dp ranks (no microbatches: one process holds every negative at once). Returns where each was."""
    if dp == 1:
        return []
    g, ti = gm.graph, meta.info(gm)
    done = []
    how = f"the negatives gathered over dp={dp}, the targets the rank's rows among them"
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        paths = _negatives(node, ti)
        if paths is None:
            continue
        q, k = node.args

        def gathered(x: fx.Node, like: fx.Node) -> fx.Node:
            xv = _fake(x)
            return _insert(g, like, fxops.batch_gather.default, (x, 1, dp, group),
                           val=xv.new_empty((xv.shape[0], xv.shape[1] * dp)))
        if any(p.swap is None for p in paths):
            with g.inserting_before(node):
                every = gathered(k, node)
            node.replace_input_with(k, every)
            _refake([node] + list(dict.fromkeys(n for p in paths if p.swap is None for n in p.before)))
            meta.set(node, meta.NEGATIVES, how)
        for swap in dict.fromkeys(p.swap for p in paths if p.swap is not None):
            before = next(p.before for p in paths if p.swap is swap)
            with g.inserting_before(swap):
                def call(target, *args, like=swap):
                    out = _insert(g, like, target, args, val=target(
                        *[_fake(a) if isinstance(a, fx.Node) else a for a in args]))
                    return out
                rows = call(aten.t.default, k)
                qt = call(aten.t.default, q)
                every = gathered(qt, swap)
                prod = call(node.target, rows, every, like=node)
                meta.set(prod, meta.NEGATIVES, how)
                prev_old, prev_new = node, prod
                for s in before:      # the scalings before the transpose, on the rank's rows of k
                    args = tuple(prev_new if a is prev_old else a for a in s.args)
                    prev_old, prev_new = s, call(s.target, *args, like=s)
            swap.replace_all_uses_with(prev_new)
            g.erase_node(swap)
        _refake(list(dict.fromkeys(n for p in paths for n in p.after)))
        for p in paths:
            t = p.loss.args[1]
            with g.inserting_before(p.loss):
                moved = _insert(g, p.loss, fxops.batch_offset.default, (t, group), val=torch.empty_like(_fake(t)))
            p.loss.replace_input_with(t, moved)
            meta.set(p.loss, meta.NEGATIVES, how)
        for n in reversed([node] + list(dict.fromkeys(n for p in paths for n in p.before))):
            if not n.users and n.op == "call_function":      # only the transposed use: the product unused
                g.erase_node(n)
        done.append(_where(node))
    if done:
        g.lint()
        gm.recompile()
    return done


def check_batch_coupling(gm: fx.GraphModule, *, dp: int, pieces: int) -> None:
    """ParallelizeError for math across the batch dim fxtron cannot compute over the global batch
    (batch_coupling's ops), and for batch norm in training when a step cuts the batch into
    microbatches: in one process the model sees the whole global batch at once, and no rank ever
    holds it."""
    micro = pieces // dp
    found = batch_coupling(gm)
    if found:
        node, why = found[0]
        more = f" (and {len(found) - 1} more: {', '.join(_where(n) for n, _ in found[1:4])})" if len(found) > 1 else ""
        raise ParallelizeError(
            f"{_where(node)} reads across the batch dim: {why}{more}. The loss depends on it, and each of the "
            f"{pieces} pieces a step cuts the global batch into (dp={dp} x microbatches={micro}) would compute it over "
            f"its own samples only, not over the global batch as one process does; fxtron cannot make this op global "
            f"(it makes reductions over the batch and batch norm global, and gathers the negatives of a "
            f"contrastive loss, q @ k.T scaled -- and transposed -- into cross entropies against arange(B), at "
            f"microbatches=1). Train "
            f"this model with dp=1 and microbatches=1, or compute the coupling outside the batch dim")
    norms = [n for n in gm.graph.nodes if n.op == "call_function" and _is_training_batch_norm(n, meta.info(gm))]
    if norms and micro > 1:
        raise ParallelizeError(
            f"{_where(norms[0])} is a batch norm in training: one process normalizes with the mean and variance "
            f"of the whole global batch, but a step runs microbatches={micro} one after another and no rank ever "
            f"holds the global batch at once, so each would be normalized with its own statistics. Use "
            f"microbatches=1 (fxtron computes the statistics over every dp rank's samples, as SyncBatchNorm does)"
            + (f"; {len(norms) - 1} more batch norm(s) likewise" if len(norms) > 1 else ""))


def _is_training_batch_norm(node: fx.Node, ti) -> bool:
    """Whether `node` is a batch norm in training mode over dims holding the batch."""
    if node.target is _BATCH_NORM:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
    elif node.target in _OTHER_BATCH_NORMS:
        training = node.target is not aten.native_batch_norm.default or (
            node.args[5] if len(node.args) > 5 else node.kwargs.get("training"))
    else:
        return False
    x = _fake(node.args[0])
    return bool(training) and any(d != 1 for d in _b_dims(x, ti))


def sync_batch_norms(gm: fx.GraphModule, *, dp: int, group: str = "dp") -> list[str]:
    """Each batch norm in training (aten.batch_norm, training=True) over the batch written out with
    its statistics over every data-parallel rank's samples, SyncBatchNorm's math: the mean over
    the rank's samples averaged over dp (fxtron::batch_all_reduce, whose backward sums the
    gradient), the biased variance of the centered values likewise, then normalize, scale and
    shift; the running mean and variance (unbiased with the global count, the module's momentum)
    updated from those global values, the same on every rank. The ranks' pieces are equal (the
    runtime splits the batch evenly), so the average of their means is the global mean. The
    channel dim keeps its placement on every other axis (the reductions are plain aten sums).
    Returns where each was, for the report."""
    g, ti = gm.graph, meta.info(gm)
    done = []
    for node in list(g.nodes):
        if node.op != "call_function" or not _is_training_batch_norm(node, ti):
            continue
        if node.target is not _BATCH_NORM:
            raise ParallelizeError(f"{_where(node)} is a batch norm in training that fxtron cannot compute over the "
                                   f"global batch (only aten.batch_norm); train it with dp=1 and microbatches=1")
        args = list(node.args) + [None] * (9 - len(node.args))
        x, w, b, rm, rv, _, momentum, eps = args[:8]
        momentum = node.kwargs.get("momentum", momentum)
        eps = node.kwargs.get("eps", eps)
        xv = _fake(x)
        if 1 in _b_dims(xv, ti) or not isinstance(xv.shape[1], int):
            raise ParallelizeError(f"{_where(node)} normalizes channels (dim 1 of {tuple(ti.shape(xv))}) that hold "
                                   f"the batch; fxtron cannot compute its statistics over the global batch")
        if rm is not None and not isinstance(momentum, (int, float)):
            raise ParallelizeError(f"{_where(node)}: a batch norm with momentum {momentum!r} (a cumulative average) "
                                   f"is not computed over the global batch by fxtron; give the module a momentum")
        nd, c = xv.dim(), int(xv.shape[1])
        dims = [0] + list(range(2, nd))
        bshape = [1, c] + [1] * (nd - 2)
        up = xv.dtype not in (torch.float32, torch.float64)
        with g.inserting_before(node):
            def call(target, *a, **kw):
                if target is aten.scalar_tensor.default:
                    val = xv.new_empty((), dtype=kw["dtype"])
                else:
                    val = target(*[_fake(v) if isinstance(v, fx.Node) else v for v in a], **kw)
                out = _insert(g, node, target, a, kw, val=val)
                meta.set(out, meta.PROVENANCE, meta.Provenance(
                    "global_statistics", "batch norm over every dp rank's samples (SyncBatchNorm)"))
                return out

            def over_dp(local):          # the average over the dp ranks of a per-rank mean
                meta.set(local, meta.STATISTIC, "batch norm's, averaged over dp")
                return call(aten.div.Tensor, call(fxops.batch_all_reduce.default, local, group), dp)

            xf = call(aten.to.dtype, x, torch.float32) if up else x
            mean = over_dp(call(aten.mean.dim, xf, dims, True))
            centered = call(aten.sub.Tensor, xf, mean)
            var = over_dp(call(aten.mean.dim, call(aten.mul.Tensor, centered, centered), dims, True))
            y = call(aten.mul.Tensor, centered, call(aten.rsqrt.default, call(aten.add.Tensor, var, eps)))
            if up:
                y = call(aten.to.dtype, y, xv.dtype)
            if w is not None:
                y = call(aten.mul.Tensor, y, call(aten.view.default, w, bshape))
            if b is not None:
                y = call(aten.add.Tensor, y, call(aten.view.default, b, bshape))
            if rm is not None:
                # the global count of samples each channel's statistics are over: the rank's x dp
                count = dp
                for d in dims:
                    size = xv.shape[d]
                    if isinstance(size, torch.SymInt):
                        size = call(aten.sym_size.int, x, d)
                        if BATCH in ti.expr(_fake(size)).free_symbols:
                            meta.set(size, meta.STATISTIC, "batch norm's count, times dp")
                    count = call(operator.mul, count, size) if isinstance(size, fx.Node) or isinstance(
                        count, fx.Node) else count * size
                    if isinstance(count, fx.Node):     # (the running statistics' writes take it: global)
                        meta.set(count, meta.STATISTIC, "batch norm's count, times dp")
                n = (call(aten.scalar_tensor.default, count, dtype=torch.promote_types(_fake(rv).dtype, torch.float32))
                     if isinstance(count, fx.Node) else count)    # (a float64 model's correction in float64)
                for buf, stat, unbiased in ((rm, mean, False), (rv, var, True)):
                    value = call(aten.view.default, call(aten.detach.default, stat), [c])
                    if unbiased:         # torch's running variance is the unbiased one
                        factor = (call(aten.div.Tensor, n, call(aten.sub.Tensor, n, 1)) if isinstance(n, fx.Node)
                                  else n / (n - 1))
                        value = call(aten.mul.Tensor, value, factor)
                    value = call(aten.to.dtype, value, _fake(buf).dtype)
                    new = call(aten.add.Tensor, call(aten.mul.Tensor, buf, 1.0 - momentum),
                               call(aten.mul.Tensor, value, momentum))
                    call(aten.copy_.default, buf, new)
        node.replace_all_uses_with(y)
        g.erase_node(node)
        done.append(_where(node))
    return done


def _elements(node: fx.Node, ti) -> sympy.Expr:
    """How many elements mean `node` averages, in B and S."""
    from fxtron.passes.rules.registry import reduced_dims
    shape = ti.shape(_fake(node.args[0]))
    return sympy.Mul(*[shape[d] for d in reduced_dims(node)])


def _mean_as_sum(g: fx.Graph, node: fx.Node, key: str, ti) -> fx.Node:
    """mean(x, dims) as sum(x, dims) / the global batch's count of averaged elements over the
    pieces (the rank's own count outside a step)."""
    from fxtron.passes.rules.registry import reduced_dims
    x = node.args[0]
    dims = reduced_dims(node)
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    out = _fake(node)
    # in fp32 for a 16-bit mean (its kernel accumulates so): a 16-bit sum, or a count past 65504,
    # would overflow where the mean does not (a count of inf made the mean 0, silently)
    acc = out.dtype if out.dtype in (torch.float32, torch.float64) or not out.dtype.is_floating_point \
        else torch.float32
    with g.inserting_before(node.next):
        total = _insert(g, node, aten.sum.dim_IntList, (x, dims, keep), {"dtype": acc},
                        val=out.new_empty(out.shape, dtype=acc))
        xv = _fake(x)
        count, count_val = 1, 1               # the rank's own count: static sizes, then each symbolic one
        for d in dims:
            size = xv.shape[d]
            if isinstance(size, torch.SymInt):
                size_node = _insert(g, node, aten.sym_size.int, (x, d), val=size)
                count_val = count_val * size
                count = (size_node if count == 1 else
                         _insert(g, node, operator.mul, (count, size_node), val=count_val))
            else:
                count_val = count_val * int(size)
                count = (int(size) if not isinstance(count, fx.Node) else
                         _insert(g, node, operator.mul, (count, int(size)), val=count_val))
                if not isinstance(count, fx.Node):
                    count = count_val
        if isinstance(count, fx.Node):
            meta.set(count, meta.STATISTIC, "the rank's own count, outside a step")
        local = _insert(g, node, aten.scalar_tensor.default, (count,), {"dtype": acc},
                        val=out.new_empty((), dtype=acc))
        glob = _insert(g, node, fxops.global_statistic.default, (local, key), val=out.new_empty((), dtype=acc))
        meta.set(total, meta.STATISTIC, "as is")
        mean = _insert(g, node, aten.div.Tensor, (total, glob), val=out.new_empty(out.shape, dtype=acc))
        if acc != out.dtype:
            mean = _insert(g, node, aten.to.dtype, (mean, out.dtype), val=out)
        return mean


def _takes_value(user: fx.Node, sym: fx.Node) -> bool:
    """Whether `user` reads the size `sym` as a number in tensor arithmetic (not as a shape)."""
    return (user.op == "call_function" and isinstance(_fake(user), torch.Tensor)
            and user.target in (opsets.ADDS | opsets.MULS | opsets.DIVS | {aten.full.default, aten.scalar_tensor.default,
                                                         aten.rsub.Scalar, aten.sub.Scalar}))


def _as_tensor(g: fx.Graph, node: fx.Node, ti) -> fx.Node:
    """node, or for a size a 0-dim float tensor of it."""
    if isinstance(_fake(node), torch.Tensor):
        return node
    return _insert(g, node, aten.scalar_tensor.default, (node,), {"dtype": torch.float32},
                   val=torch.empty((), dtype=torch.float32, device="meta"))


def _divides_only(first: fx.Node, divisions: list[fx.Node], upstream: set[fx.Node]) -> bool:
    """Whether the count's cast or guard `first` (the node that takes the statistic on the way to
    `divisions`; a division itself when direct) feeds, on the way to the loss, those divisions
    alone: `nf = n.float(); ce / nf + 0.1 * (z / nf)**2` also divides z by nf, through a use the
    walk did not take, which would divide by the count over the pieces as well."""
    if first in divisions:
        return True
    chain, todo = {first}, [first]
    while todo:
        for u in todo.pop().users:
            if u not in upstream or u in chain:
                continue
            if u in divisions and u.args[1] in chain:
                continue
            if _of_one_value(u) and u.args[0] in chain:
                chain.add(u)
                todo.append(u)
                continue
            return False
    return True


def _of_one_value(node) -> bool:
    """Whether `node` is a cast or view of its first argument or a function of it alone (a
    guard: `clamp(min=1)`, `+ eps`, a scale)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in _SAME or (node.target in _OF_ONE and node.all_input_nodes == [node.args[0]]))


def _divisor_chain(b, stats) -> tuple[list[fx.Node], object]:
    """A divisor `b` walked back through casts, views and guards (`_of_one_value`) to the value
    they start from, stopping at a statistic of `stats`: those nodes, the divisor first, and
    that value."""
    chain = []
    while b not in stats and _of_one_value(b):
        chain.append(b)
        b = b.args[0]
    return chain, b


def _guarded(b: fx.Node, stats) -> bool:
    """Whether the divisor `b` is more than a cast or view of its statistic: a guard on it."""
    return any(n.target in _OF_ONE for n in _divisor_chain(b, stats)[0])


def _scale_after(g: fx.Graph, division: fx.Node) -> None:
    """`division`'s users read its value times the step's pieces (batch_scale), once."""
    users = [u for u in division.users if u.target is not fxops.batch_scale.default]
    if len(users) < len(division.users):
        return
    with g.inserting_after(division):
        scaled = _insert(g, division, fxops.batch_scale.default, (division,), val=torch.empty_like(_fake(division)))
    for u in users:
        u.replace_input_with(division, scaled)


def _retype_guard(b: fx.Node, stats, dtype: torch.dtype) -> None:
    """The nodes between a statistic and the division by it (a clamp, an addition) compute in
    `dtype` once the statistic enters in it: their recorded values say so."""
    for n in _divisor_chain(b, stats)[0]:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype != dtype and not val.dtype.is_floating_point:
            n.meta["val"] = val.to(dtype)


def _denominator_dtype(node: fx.Node, use: fx.Node) -> torch.dtype:
    """The dtype statistic `node` enters its denominator `use` in: its own, but for an integer
    count read by a use that computes in floating point, that use's dtype."""
    own = _tensor_val(node).dtype
    out = _fake(use)
    if own.is_floating_point or own == torch.bool or not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        return own
    return out.dtype


def _tensor_val(node: fx.Node):
    v = _fake(node)
    return torch.empty_like(v) if isinstance(v, torch.Tensor) else torch.empty((), dtype=torch.float32, device="meta")


def _shapes(node: fx.Node, ti) -> str:
    return ", ".join(str(tuple(ti.shape(_fake(a)))) for a in node.all_input_nodes if isinstance(_fake(a), torch.Tensor))


def _written_inputs(nodes, kind: str) -> list[fx.Node]:
    """The placeholders of `kind` ("buffer", "user") that the in-place ops among `nodes` write
    (export keeps them in the graph: `self.cw.mul_(1.1)`, `labels.masked_fill_(...)`)."""
    out = []
    for n in nodes:
        if meta.writes_first(n):
            out += [v for v in meta.written(n) if v.op == "placeholder" and meta.get(v, meta.INPUT) is not None
                    and meta.get(v, meta.INPUT).kind == kind and v not in out]
    return out


def _learned(gm: fx.GraphModule, frozen_whole: bool = True) -> set[fx.Node]:
    """What depends on the model's changing state: parameters that train, or buffers and frozen
    parameters the forward writes. A statistic of the inputs and of the state the forward only
    reads (class weights, in a buffer or a frozen parameter: which parameters train is fixed when
    the program is built, runtime/optim.py check_frozen) the runtime can compute over the global
    batch before the step; a learned one it cannot. Without `frozen_whole` (zero=3 holds every
    parameter in pieces) a frozen parameter counts as learned: no rank could read it whole."""
    written = set(meta.info(gm).buffer_mutations.values())
    written |= {meta.get(v, meta.INPUT).target for kind in ("buffer", "parameter")
                for v in _written_inputs(gm.graph.nodes, kind)}
    learned: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = meta.get(node, meta.INPUT)
            if spec is None or (spec.kind != "user" and not _fixed_state(node, written, frozen_whole)):
                learned.add(node)
        elif any(a in learned for a in node.all_input_nodes):
            learned.add(node)
    return learned


def _fixed_state(node: fx.Node, written: set[str] = frozenset(), frozen_whole: bool = True) -> bool:
    """Whether placeholder `node` is state no step changes and every rank can read whole: a
    buffer, or a parameter that takes no gradient (`frozen_whole`), that no forward in
    `written` (its names) writes."""
    spec = meta.get(node, meta.INPUT)
    if spec is None or spec.target in written:
        return False
    val = node.meta.get("val")
    return spec.kind == "buffer" or (frozen_whole and spec.kind == "parameter" and isinstance(val, torch.Tensor)
                                     and not val.requires_grad)


def _statistic(gm: fx.GraphModule, node: fx.Node, kind: str, ti, frozen_whole: bool = True) -> Statistic:
    """The runtime's recipe for input statistic `node`: a graph of the user inputs (and of the
    buffers it reads after them), or the expression of a count from sizes."""
    if kind == "count":
        return Statistic(node.name, _where(node), expr=_sym_expr(_fake(node), ti))
    keep = _ancestors_of(node) | {node}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if meta.get(n, meta.INPUT) is not None and meta.get(n, meta.INPUT).kind == "user":
            env[n] = g.placeholder(n.name)
    buffers = []
    for n in placeholders:
        spec = meta.get(n, meta.INPUT)
        if n in keep and n not in env:
            if not _fixed_state(n, frozen_whole=frozen_whole):
                raise AssertionError(f"input statistic {node.name} depends on {n.name}")
            env[n] = g.placeholder(n.name)
            buffers.append((spec.target, tuple(int(d) for d in _fake(n).shape)))
    kept = [n for n in gm.graph.nodes if n in keep and n not in env]
    for n in kept:
        env[n] = g.node_copy(n, lambda a: env[a])
    if _written_inputs(kept, "buffer"):
        raise AssertionError(f"input statistic {node.name} writes buffers {_written_inputs(kept, 'buffer')}")
    written = {meta.get(v, meta.INPUT).index for v in _written_inputs(kept, "user")}
    g.output(env[node])
    return Statistic(node.name, _where(node), gm=fx.GraphModule(gm, g), buffers=tuple(buffers),
                     written=tuple(sorted(written)))


__all__ = ["Statistic", "StatisticsReport", "batch_coupling", "check_batch_coupling", "gather_negatives", "global_statistics",
           "split_token_means", "sync_batch_norms"]
