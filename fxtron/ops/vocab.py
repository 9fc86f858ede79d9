"""Ops: Megatron's vocab-parallel embedding and cross entropy (megatron/core/tensor_parallel: layers.py
VocabParallelEmbedding, cross_entropy.py), for a
table and an LM head split by vocabulary over one mesh axis: the embedding's partial sums and
the cross entropy's three all-reduces of one float per token, never the logits.

    vocab_parallel_embedding(Tensor weight, Tensor ids, int vocab_start, int padding_idx, int vocab_size)
                                                                   masked lookup     index_add into weight
    vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_start, int ignore_index,
                                 int reduction, float label_smoothing, str group)
                                                                   3 all-reduces     local (saved softmax)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.errors import ParallelizeError
from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register


# reduction codes of vocab_parallel_cross_entropy (torch's own enum order)
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# vocab-parallel embedding (Megatron's VocabParallelEmbedding), without its reduction


def check_ids(ids: Tensor, vocab: int, what: str, ignore_index: int | None = None) -> None:
    """Every id in [0, vocab) (or equal to ignore_index): one process's lookup raises an
    IndexError for any other, and a vocabulary split over ranks would mask it on every rank (a
    zero row, a target with logit 0: a silent difference). On the CPU a ParallelizeError naming
    the first such id; on an accelerator an asynchronous device assert (no host sync, as one
    process's kernel asserts there)."""
    if vocab <= 0 or ids.device.type == "meta":
        return
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.device.type != "cpu":
        torch._assert_async(~bad.any(), f"fxtron: a {what} outside the vocabulary [0, {vocab})")
        return
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ParallelizeError(
            f"{what} {int(ids[at])} at index {at} is outside the vocabulary [0, {vocab}) of the vocab-parallel "
            f"layer{'' if ignore_index is None else f' (and is not ignore_index={ignore_index})'}; one process "
            "raises an IndexError there: the data holds ids the model's vocab_size does not (another "
            "tokenizer, a corrupt file): check the data or enlarge the vocabulary")


@torch.library.custom_op("fxtron::vocab_parallel_embedding", mutates_args=())
def vocab_parallel_embedding(weight: Tensor, ids: Tensor, vocab_start: int, padding_idx: int = -1,
                             vocab_size: int = -1) -> Tensor:
    """In: weight [V/tp, h], this rank's rows [vocab_start, vocab_start + V/tp) of the table;
    ids (any shape, global token ids); padding_idx: a global id whose row gets no gradient (as
    F.embedding's), -1 for none; vocab_size: V, the ids' bound (check_ids), -1 for unchecked.
    Out: [*ids.shape, h], the looked-up rows for ids in this rank's range and zeros elsewhere:
    a PARTIAL sum, which an all_reduce (or reduce_scatter) after it completes. Backward: the
    weight's gradient only (rows of in-range ids summed into their rows); ids get none."""
    check_ids(ids, vocab_size, "token id")
    per = weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + per)
    local = (ids - vocab_start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight)
    return out.masked_fill_(outside.unsqueeze(-1), 0)


@vocab_parallel_embedding.register_fake
def _(weight, ids, vocab_start, padding_idx=-1, vocab_size=-1):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _setup_embedding(ctx, inputs, output):
    weight, ids, ctx.vocab_start, ctx.padding_idx, _ = inputs
    ctx.weight_rows = weight.shape[0]
    ctx.save_for_backward(ids)


def _vocab_parallel_embedding_bwd(ctx, grad):
    (ids,) = ctx.saved_tensors
    per, start = ctx.weight_rows, ctx.vocab_start
    outside = (ids < start) | (ids >= start + per)
    if ctx.padding_idx >= 0:
        outside = outside | (ids == ctx.padding_idx)   # the padding row learns nothing
    local = (ids - start).masked_fill(outside, 0).reshape(-1)
    rows = grad.masked_fill(outside.unsqueeze(-1), 0).reshape(-1, grad.shape[-1])
    grad_weight = grad.new_zeros((per, grad.shape[-1])).index_add_(0, local, rows)
    return grad_weight, None, None, None, None


vocab_parallel_embedding.register_autograd(_vocab_parallel_embedding_bwd, setup_context=_setup_embedding)


# ---------------------------------------------------------------------------------------------
# vocab-parallel cross entropy (Megatron's vocab_parallel_cross_entropy)
#
# custom_op's autograd can keep only inputs and outputs, and the backward must reuse the forward's
# softmax (a recomputation would need the all-reduces again), so the op with the autograd formula,
# `vocab_parallel_cross_entropy_with_softmax`, returns (loss, softmax). The public
# `vocab_parallel_cross_entropy` returns the loss alone: it is CompositeImplicitAutograd over the
# former, so it is one node in the compiler's graphs and decomposes into the former under
# autograd, fake tensors and make_fx/AOT tracing.


def _ce_forward(logits, target, vocab_start, ignore_index, reduction, label_smoothing, group):
    if reduction not in (REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM):
        raise ValueError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), not {reduction}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), not {label_smoothing}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
                         f"logits must be [*target.shape, V/tp]")
    pg = T.resolve(group)
    world = 1 if pg is None else pg.size()
    logits = logits.float()
    per = logits.shape[-1]
    target = target.long()
    check_ids(target, per * world, "target", ignore_index)

    m = logits.amax(dim=-1)                                                  # [N]
    if pg is not None:
        T.all_reduce(m, pg, dist.ReduceOp.MAX)                                # 1
    shifted = logits - m.unsqueeze(-1)
    outside = (target < vocab_start) | (target >= vocab_start + per)
    local = (target - vocab_start).masked_fill(outside, 0)
    pred = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0)
    exp = shifted.exp()
    sums = exp.sum(dim=-1)
    if label_smoothing > 0:
        # torch's smoothing needs the sum of the logits over the whole vocabulary: it travels in
        # the sum-exp all-reduce, so the count stays 3
        sums = torch.stack([sums, shifted.sum(dim=-1)], dim=-1)
    if pg is not None:
        T.all_reduce(pred, pg)                                                # 2
        T.all_reduce(sums, pg)                                                # 3
    sum_exp = sums[..., 0] if label_smoothing > 0 else sums
    log_z = sum_exp.log()
    loss = log_z - pred
    if label_smoothing > 0:
        vocab = per * world
        mean_log_prob = sums[..., 1] / vocab - log_z
        loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
    softmax = exp.div_(sum_exp.unsqueeze(-1))
    valid = target != ignore_index
    loss = loss.masked_fill(~valid, 0.0)
    if reduction == REDUCTION_SUM:
        loss = loss.sum()
    elif reduction == REDUCTION_MEAN:
        loss = loss.sum() / valid.sum()
    return loss, softmax


@torch.library.custom_op("fxtron::vocab_parallel_cross_entropy_with_softmax", mutates_args=())
def vocab_parallel_cross_entropy_with_softmax(
        logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int, reduction: int,
        label_smoothing: float, group: str) -> tuple[Tensor, Tensor]:
    """`vocab_parallel_cross_entropy` that also returns the float32 softmax [*target.shape, V/tp]
    its backward uses (the op that carries the autograd formula; see there)."""
    return _ce_forward(logits, target, vocab_start, ignore_index, reduction, label_smoothing, group)


@vocab_parallel_cross_entropy_with_softmax.register_fake
def _(logits, target, vocab_start, ignore_index, reduction, label_smoothing, group):
    loss_shape = target.shape if reduction == REDUCTION_NONE else ()
    return (logits.new_empty(loss_shape, dtype=torch.float32),
            logits.new_empty(logits.shape, dtype=torch.float32))


def _setup_ce(ctx, inputs, output):
    logits, target, ctx.vocab_start, ctx.ignore_index, ctx.reduction, ctx.label_smoothing, group = inputs
    ctx.logits_dtype = logits.dtype
    ctx.group = group       # the vocabulary's size (label smoothing) is asked of it in backward only
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(target, output[1])


def _ce_bwd(ctx, grad_loss, grad_softmax):
    target, softmax = ctx.saved_tensors
    target = target.long()
    per, start, a = softmax.shape[-1], ctx.vocab_start, ctx.label_smoothing
    outside = (target < start) | (target >= start + per)
    local = (target - start).masked_fill(outside, 0)
    grad = softmax.clone()
    hit = (~outside).to(grad.dtype) * (1.0 - a)
    grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))   # softmax - (1-a) * onehot
    if a > 0:
        grad.sub_(a / (per * T.group_size(ctx.group)))
    valid = target != ctx.ignore_index
    if ctx.reduction == REDUCTION_MEAN:
        scale = (grad_loss / valid.sum()).expand(target.shape)
    else:
        scale = grad_loss.expand(target.shape)
    scale = torch.where(valid, scale, torch.zeros((), dtype=scale.dtype, device=scale.device))
    grad.mul_(scale.unsqueeze(-1))
    return grad.to(ctx.logits_dtype), None, None, None, None, None, None


vocab_parallel_cross_entropy_with_softmax.register_autograd(_ce_bwd, setup_context=_setup_ce)

_lib = torch.library.Library("fxtron", "FRAGMENT")
_lib.define("vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_start, int ignore_index, "
            "int reduction, float label_smoothing, str group) -> Tensor")


def _vocab_parallel_cross_entropy(logits, target, vocab_start, ignore_index, reduction, label_smoothing, group):
    return torch.ops.fxtron.vocab_parallel_cross_entropy_with_softmax(
        logits, target, vocab_start, ignore_index, reduction, label_smoothing, group)[0]


_lib.impl("vocab_parallel_cross_entropy", _vocab_parallel_cross_entropy, "CompositeImplicitAutograd")


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int,
                                 reduction: int, label_smoothing: float, group: str) -> Tensor:
    """Cross entropy of logits split by vocabulary over `group` (Megatron's algorithm).

    In: logits [*, V/tp] (any float dtype), this rank's vocabulary columns [vocab_start,
    vocab_start + V/tp); target [*] global class ids (int64), the same on every rank;
    ignore_index: targets equal to it get zero loss and zero gradient; reduction: 0 none,
    1 mean over non-ignored targets (torch's F.cross_entropy: sum / count; nan if none), 2 sum;
    label_smoothing in [0, 1).
    Out: float32 loss (computed in float32 whatever the logits dtype, like Megatron's
    logits.float(); this differs from torch, whose loss has the logits' dtype): [*] for
    reduction 0, a scalar otherwise, the same on every rank.

    Forward: exactly 3 all-reduces over `group` (MAX of the row maxima, SUM of the target
    logits, SUM of the exp sums); backward: none, it uses the saved softmax (float32, the size
    of the logits): grad = (softmax - onehot) * grad_loss, scaled by 1/count for mean, cast to
    the logits' dtype. Label smoothing follows torch's F.cross_entropy, loss = (1-a) * nll +
    a * mean over all V classes of -log p; the sum of the logits it needs rides in the third
    all-reduce. (Megatron's formula instead averages over this rank's V/tp classes only, which
    makes the loss depend on the rank; fxtron replaces torch's cross entropy, so it matches torch.)
    A target outside [0, V) other than ignore_index is an error (check_ids), as in one process.
    """
    return torch.ops.fxtron.vocab_parallel_cross_entropy(
        logits, target, vocab_start, ignore_index, reduction, label_smoothing, group)


register(OpSpec("vocab_parallel_embedding"))
register(OpSpec("vocab_parallel_cross_entropy", axis_arg=6, forward=Comm("all_reduce", "rows", count=3)))
register(OpSpec("vocab_parallel_cross_entropy_with_softmax", axis_arg=6,
                forward=Comm("all_reduce", "rows", count=3)))

__all__ = ["REDUCTION_MEAN", "REDUCTION_NONE", "REDUCTION_SUM", "check_ids", "vocab_parallel_cross_entropy",
           "vocab_parallel_cross_entropy_with_softmax", "vocab_parallel_embedding"]
