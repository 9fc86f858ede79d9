"""Runtime: Megatron's tensor-parallel communication as traceable torch custom ops (fxtron::*).

Each op is registered with torch.library, so it appears in a per-rank FX graph as
`torch.ops.fxtron.<name>.default`, has a fake (meta) implementation that computes shapes with
no process group, and an autograd formula whose backward is the conjugate op (MEGATRON.md 2.1):

    op (schema)                                                    forward           backward
    copy_to_region(Tensor x, str group)                            identity          all-reduce  (f)
    all_reduce(Tensor x, str group)                                all-reduce SUM    identity    (g)
    all_gather(Tensor x, int dim, int[] interleave, int world, str group)
                                                                   all-gather        slice
    scatter(Tensor x, int dim, int[] interleave, int world, str group)
                                                                   slice             all-gather
    reduce_scatter(Tensor x, int dim, int world, str group)        reduce-scatter    all-gather  (SP g)
    gather_from_sequence(Tensor x, int dim, int world, str group)  all-gather        reduce-scatter (SP f)
    vocab_parallel_embedding(Tensor weight, Tensor ids, int vocab_start)
                                                                   masked lookup     index_add into weight
    vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_start, int ignore_index,
                                 int reduction, float label_smoothing, str group)
                                                                   3 all-reduces     local (saved softmax)

`group` is a process-group name (`ProcessGroup.group_name`, resolved with torch.distributed's
`_resolve_process_group`). The empty string "" or a group of one rank means no communication:
the op is then the identity (or a plain slice), and ops that take `world` require world == 1.
`world` is the group's size, passed explicitly so the fake implementation needs no group.
Gathered and sliced dims use the interleaved layout of `fxtron.runtime.shard` (rank = the
rank's index in the group; `interleave` is [k] for k equal blocks or the blocks' proportions,
shard.to_list). Outputs never alias inputs. `COLLECTIVE_OPS` describes every op's
communication for the compiler's collective counts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.runtime import shm
from fxtron.runtime.shard import check_divisible, from_list, shard, unshard

# reduction codes of vocab_parallel_cross_entropy (torch's own enum order)
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2
_REDUCTIONS = {"none": REDUCTION_NONE, "mean": REDUCTION_MEAN, "sum": REDUCTION_SUM}


def reduction_code(reduction: str) -> int:
    """torch's reduction string ("none" | "mean" | "sum") -> the int the CE op takes."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, not {reduction!r}")
    return _REDUCTIONS[reduction]


# ---------------------------------------------------------------------------------------------
# process groups and the three primitive collectives (the only places that call torch.distributed)


def _group(group: str):
    """The ProcessGroup named `group`, or None when no communication is needed ("" or 1 rank)."""
    if not group:
        return None
    pg = dist.distributed_c10d._resolve_process_group(group)
    return None if pg.size() == 1 else pg


def _group_size(group: str) -> int:
    pg = _group(group)
    return 1 if pg is None else pg.size()


def _check_world(pg, world: int, op: str, group: str) -> None:
    size = 1 if pg is None else pg.size()
    if world != size:
        raise ValueError(f"fxtron::{op}: world={world} but group {group!r} has {size} rank(s); "
                         f"pass the group's size as world")


def _all_reduce(t: Tensor, pg, op=dist.ReduceOp.SUM, out: Tensor | None = None) -> Tensor:
    """All-reduce contiguous `t` over `pg` into `out` (a contiguous tensor of t's shape; default
    t itself, which must then be a fresh tensor); returns out. Through the group's shared-memory
    channel where it has one (runtime/shm.py), which reads t directly: no copy of t first."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        return comm.all_reduce(t, shm.OP_MAX if op == dist.ReduceOp.MAX else shm.OP_SUM, out=out)
    if out is not None:
        t = out.copy_(t)
    dist.all_reduce(t, op=op, group=pg)
    return t


def _start_all_reduce(t: Tensor, pg):
    """Begin an all-reduce SUM of contiguous `t` in place; returns a work whose wait()
    completes it. Only local computation may run before the wait (no other collective)."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        return comm.start_all_reduce(t)
    return dist.all_reduce(t, group=pg, async_op=True)


def _all_gather(t: Tensor, pg) -> list[Tensor]:
    """Every rank's `t` (same shape everywhere), in group-rank order."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        return comm.all_gather(t)
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(pg.size())]
    dist.all_gather(out, t, group=pg)
    return out


def _gather(t: Tensor, dim: int, pg) -> Tensor:
    """Every rank's `t` concatenated along `dim` in group-rank order (a new tensor)."""
    comm = shm.channel(pg.group_name)
    if comm is not None:
        return comm.gather(t, dim)
    return unshard(_all_gather(t, pg), dim, 1)


def _reduce_scatter(t: Tensor, dim: int, pg) -> Tensor:
    """Sum of `t` over the ranks, then this rank's 1/world slice along `dim` (a new tensor)."""
    world, rank = pg.size(), dist.get_rank(pg)
    comm = shm.channel(pg.group_name)
    if comm is not None:
        return comm.reduce_scatter(t, dim)
    if dist.get_backend(pg) == "nccl":
        src = t.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // world, *src.shape[1:]))
        dist.reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM, group=pg)
        return out.movedim(0, dim).contiguous()
    # gloo has no reduce_scatter_tensor on every build: all-reduce the whole tensor, keep a slice
    total = _all_reduce(t.clone(memory_format=torch.contiguous_format), pg)
    return shard(total, dim, world, rank)


def _norm(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % max(ndim, 1)


# ---------------------------------------------------------------------------------------------
# f and g


@torch.library.custom_op("fxtron::copy_to_region", mutates_args=())
def copy_to_region(x: Tensor, group: str) -> Tensor:
    """Megatron's f (enter a tp region). In: x, replicated. Out: a copy of x. Backward:
    all-reduce SUM of the gradient over `group`."""
    return x.clone()


@copy_to_region.register_fake
def _(x, group):
    return torch.empty_like(x)


def _copy_to_region_bwd(ctx, grad):
    from fxtron.codegen.linear import active_queue
    queue, pg = active_queue(), _group(ctx.group)
    if pg is None or queue is None or not queue.jobs:
        return all_reduce(grad, ctx.group), None
    # the input gradient's all-reduce runs while the queued weight-gradient GEMMs compute
    # (Megatron's async dgrad all-reduce overlapping the wgrad GEMM)
    out = grad.clone(memory_format=torch.contiguous_format)
    work = _start_all_reduce(out, pg)
    queue.drain()
    work.wait()
    return out, None


def _setup_group(ctx, inputs, output):
    ctx.group = inputs[-1]


copy_to_region.register_autograd(_copy_to_region_bwd, setup_context=_setup_group)


@torch.library.custom_op("fxtron::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    """Megatron's g (leave a tp region). In: x, this rank's partial sum. Out: a new tensor, the
    sum over `group`. Backward: identity."""
    return _summed(x, _group(group))


def _summed(x: Tensor, pg) -> Tensor:
    """A new contiguous tensor: the sum of x over pg (a copy of x without a group)."""
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    return _all_reduce(x, pg, out=torch.empty_like(x))


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_bwd(ctx, grad):
    return grad, None


all_reduce.register_autograd(_all_reduce_bwd)


class _CopyToRegion(torch.autograd.Function):
    """copy_to_region as a program runs it: the op's forward and backward without the
    dispatcher's trips through Python (see codegen/linear.py _Linear). Forward is a view, not
    a copy: a program's graph is functional, nothing writes into it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    backward = staticmethod(_copy_to_region_bwd)


class _AllReduce(torch.autograd.Function):
    """all_reduce as a program runs it (see _CopyToRegion)."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, _group(group))

    backward = staticmethod(_all_reduce_bwd)


# op -> its run-time form; a program's graph calls these (compiler/pipeline.py _bind_groups)
EAGER = {torch.ops.fxtron.copy_to_region.default: lambda x, group: _CopyToRegion.apply(x, group),
         torch.ops.fxtron.all_reduce.default: lambda x, group: _AllReduce.apply(x, group)}


# ---------------------------------------------------------------------------------------------
# gather / slice along a dim (interleaved layout of shard.py)


def _gathered_shape(x: Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[_norm(dim, x.dim())] *= world
    return shape


def _sliced_shape(x: Tensor, dim: int, interleave: list[int], world: int, op: str) -> list[int]:
    shape = list(x.shape)
    d = _norm(dim, x.dim())
    if isinstance(shape[d], int):
        check_divisible(shape[d], world, from_list(interleave), f"fxtron::{op} input dim {d} of shape {tuple(shape)}")
    shape[d] //= world
    return shape


@torch.library.custom_op("fxtron::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, interleave: list[int], world: int, group: str) -> Tensor:
    """In: this rank's shard (dim of size k*part). Out: the full tensor, dim world times larger,
    assembled with the interleave (shard.unshard of every rank's x). Backward: this rank's shard
    of the gradient (a slice, no communication)."""
    pg = _group(group)
    _check_world(pg, world, "all_gather", group)
    dim = _norm(dim, x.dim())
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return unshard(_all_gather(x, pg), dim, from_list(interleave))


@all_gather.register_fake
def _(x, dim, interleave, world, group):
    return x.new_empty(_gathered_shape(x, dim, world))


def _all_gather_bwd(ctx, grad):
    return scatter(grad, ctx.dim, ctx.interleave, ctx.world, ctx.group), None, None, None, None


def _setup_dim(ctx, inputs, output):
    ctx.dim, ctx.interleave, ctx.world, ctx.group = inputs[1:]


all_gather.register_autograd(_all_gather_bwd, setup_context=_setup_dim)


@torch.library.custom_op("fxtron::scatter", mutates_args=())
def scatter(x: Tensor, dim: int, interleave: list[int], world: int, group: str) -> Tensor:
    """In: the full tensor, the same on every rank. Out: this rank's shard along dim (shard.shard
    with rank = this rank's index in `group`), a new tensor. Backward: all-gather."""
    pg = _group(group)
    _check_world(pg, world, "scatter", group)
    dim = _norm(dim, x.dim())
    check_divisible(x.shape[dim], world, from_list(interleave), f"fxtron::scatter input dim {dim} of shape {tuple(x.shape)}")
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return shard(x, dim, world, dist.get_rank(pg), from_list(interleave))


@scatter.register_fake
def _(x, dim, interleave, world, group):
    return x.new_empty(_sliced_shape(x, dim, interleave, world, "scatter"))


def _scatter_bwd(ctx, grad):
    return all_gather(grad, ctx.dim, ctx.interleave, ctx.world, ctx.group), None, None, None, None


scatter.register_autograd(_scatter_bwd, setup_context=_setup_dim)


# ---------------------------------------------------------------------------------------------
# sequence parallel: reduce-scatter (SP g) and all-gather with a reduce-scatter backward (SP f)


@torch.library.custom_op("fxtron::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """Megatron's SP g. In: this rank's partial sum, dim divisible by world. Out: this rank's
    1/world slice along dim (plain split, no interleave) of the sum over `group`. Backward:
    all-gather along dim."""
    pg = _group(group)
    _check_world(pg, world, "reduce_scatter", group)
    dim = _norm(dim, x.dim())
    check_divisible(x.shape[dim], world, 1, f"fxtron::reduce_scatter input dim {dim} of shape {tuple(x.shape)}")
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return _reduce_scatter(x, dim, pg)


@reduce_scatter.register_fake
def _(x, dim, world, group):
    return x.new_empty(_sliced_shape(x, dim, [1], world, "reduce_scatter"))


def _setup_dim_world(ctx, inputs, output):
    ctx.dim, ctx.world, ctx.group = inputs[1:]


def _reduce_scatter_bwd(ctx, grad):
    return all_gather(grad, ctx.dim, [1], ctx.world, ctx.group), None, None, None


reduce_scatter.register_autograd(_reduce_scatter_bwd, setup_context=_setup_dim_world)


@torch.library.custom_op("fxtron::gather_from_sequence", mutates_args=())
def gather_from_sequence(x: Tensor, dim: int, world: int, group: str) -> Tensor:
    """Megatron's SP f (`gather_from_sequence_parallel_region`). In: this rank's slice along dim
    (e.g. [s/tp, b, h]). Out: the full tensor (dim world times larger). Backward: reduce-scatter
    SUM along dim (the consumers' gradients are partial sums)."""
    pg = _group(group)
    _check_world(pg, world, "gather_from_sequence", group)
    dim = _norm(dim, x.dim())
    if pg is None:
        return x.clone(memory_format=torch.contiguous_format)
    return _gather(x, dim, pg)


@gather_from_sequence.register_fake
def _(x, dim, world, group):
    return x.new_empty(_gathered_shape(x, dim, world))


def _gather_from_sequence_bwd(ctx, grad):
    from fxtron.codegen.linear import active_queue
    queue, pg = active_queue(), _group(ctx.group)
    if pg is None or queue is None or not queue.jobs:
        return reduce_scatter(grad, ctx.dim, ctx.world, ctx.group), None, None, None
    # the reduce-scatter of the input gradient runs while the queued weight-gradient GEMMs
    # compute (Megatron's async reduce-scatter under sequence parallel)
    world, rank, dim = pg.size(), dist.get_rank(pg), _norm(ctx.dim, grad.dim())
    comm = shm.channel(pg.group_name)
    if comm is not None:
        # shared memory: the gradient is published now, each rank sums its slice after the GEMMs
        work = comm.start_reduce_scatter(grad, dim)
        queue.drain()
        return work.wait(), None, None, None
    if dist.get_backend(pg) == "nccl":
        src = grad.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // world, *src.shape[1:]))
        work = dist.reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        queue.drain()
        work.wait()
        return out.movedim(0, dim).contiguous(), None, None, None
    total = grad.clone(memory_format=torch.contiguous_format)
    work = _start_all_reduce(total, pg)   # gloo: all-reduce, then keep a slice
    queue.drain()
    work.wait()
    return shard(total, dim, world, rank), None, None, None


gather_from_sequence.register_autograd(_gather_from_sequence_bwd, setup_context=_setup_dim_world)


# ---------------------------------------------------------------------------------------------
# vocab-parallel embedding (MEGATRON.md 2.5), without its reduction


@torch.library.custom_op("fxtron::vocab_parallel_embedding", mutates_args=())
def vocab_parallel_embedding(weight: Tensor, ids: Tensor, vocab_start: int, padding_idx: int = -1) -> Tensor:
    """In: weight [V/tp, h], this rank's rows [vocab_start, vocab_start + V/tp) of the table;
    ids (any shape, global token ids); padding_idx: a global id whose row gets no gradient (as
    F.embedding's), -1 for none. Out: [*ids.shape, h], the looked-up rows for ids in this
    rank's range and zeros elsewhere: a PARTIAL sum, which an all_reduce (or reduce_scatter)
    after it completes. Backward: the weight's gradient only (rows of in-range ids summed into
    their rows); ids get none."""
    per = weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + per)
    local = (ids - vocab_start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight)
    return out.masked_fill_(outside.unsqueeze(-1), 0)


@vocab_parallel_embedding.register_fake
def _(weight, ids, vocab_start, padding_idx=-1):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _setup_embedding(ctx, inputs, output):
    weight, ids, ctx.vocab_start, ctx.padding_idx = inputs
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
    return grad_weight, None, None, None


vocab_parallel_embedding.register_autograd(_vocab_parallel_embedding_bwd, setup_context=_setup_embedding)


# ---------------------------------------------------------------------------------------------
# vocab-parallel cross entropy (MEGATRON.md 2.6)
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
    pg = _group(group)
    world = 1 if pg is None else pg.size()
    logits = logits.float()
    per = logits.shape[-1]
    target = target.long()

    m = logits.amax(dim=-1)                                                  # [N]
    if pg is not None:
        _all_reduce(m, pg, dist.ReduceOp.MAX)                                # 1
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
        _all_reduce(pred, pg)                                                # 2
        _all_reduce(sums, pg)                                                # 3
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
    ctx.vocab = logits.shape[-1] * _group_size(group)
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
        grad.sub_(a / ctx.vocab)
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
    Targets outside [0, V) other than ignore_index are not checked: they count as logit 0.
    """
    return torch.ops.fxtron.vocab_parallel_cross_entropy(
        logits, target, vocab_start, ignore_index, reduction, label_smoothing, group)


# ---------------------------------------------------------------------------------------------

#: For every fxtron op (key: the name in torch.ops.fxtron): the collective kind its forward and
#: its backward issue ("all_reduce" | "all_gather" | "reduce_scatter" | None), how many of them,
#: and which tensor's size is the payload of each collective: "input"/"output" of the op in its
#: forward ("grad_output"/"grad_input" in backward), or "rows" for the cross entropy, whose
#: all-reduces each carry one float32 per row of the logits (the third carries two per row when
#: label_smoothing > 0). On nccl reduce_scatter is a native reduce-scatter; on gloo it runs as an
#: all-reduce of the input followed by a slice.
COLLECTIVE_OPS: dict[str, dict] = {
    "copy_to_region": {"forward": None, "forward_count": 0, "backward": "all_reduce",
                       "backward_count": 1, "backward_payload": "grad_output"},
    "all_reduce": {"forward": "all_reduce", "forward_count": 1, "forward_payload": "input",
                   "backward": None, "backward_count": 0},
    "all_gather": {"forward": "all_gather", "forward_count": 1, "forward_payload": "output",
                   "backward": None, "backward_count": 0},
    "scatter": {"forward": None, "forward_count": 0, "backward": "all_gather",
                "backward_count": 1, "backward_payload": "grad_input"},
    "reduce_scatter": {"forward": "reduce_scatter", "forward_count": 1, "forward_payload": "input",
                       "backward": "all_gather", "backward_count": 1, "backward_payload": "grad_input"},
    "gather_from_sequence": {"forward": "all_gather", "forward_count": 1, "forward_payload": "output",
                             "backward": "reduce_scatter", "backward_count": 1,
                             "backward_payload": "grad_output"},
    "vocab_parallel_embedding": {"forward": None, "forward_count": 0, "backward": None, "backward_count": 0},
    "vocab_parallel_cross_entropy": {"forward": "all_reduce", "forward_count": 3, "forward_payload": "rows",
                                     "backward": None, "backward_count": 0},
    "vocab_parallel_cross_entropy_with_softmax": {"forward": "all_reduce", "forward_count": 3,
                                                  "forward_payload": "rows", "backward": None,
                                                  "backward_count": 0},
}

__all__ = ["COLLECTIVE_OPS", "REDUCTION_MEAN", "REDUCTION_NONE", "REDUCTION_SUM", "all_gather",
           "all_reduce", "copy_to_region", "gather_from_sequence", "reduce_scatter", "reduction_code",
           "scatter", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_with_softmax",
           "vocab_parallel_embedding"]
