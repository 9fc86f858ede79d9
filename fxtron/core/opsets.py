"""Core: the groups of aten ops the passes read, each named once (tinygrad's GroupOp).

A pass that looks through "a view" or "a cast" composes its set from these groups, adding by
name the ops that are its own business (a pad, a dropout), so that a group grows in one place
and every reader sees it.
"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

#: a new shape given as sizes (export writes view, reshape and _unsafe_view)
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
#: dims folded into one or unfolded from one
FOLDS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
#: reshapes that may fold dims into one: RESHAPES and flatten
FLATTENS = RESHAPES | {aten.flatten.using_ints}
#: another tensor's shape
RESHAPES_AS = frozenset({aten.view_as.default, aten.reshape_as.default})
#: unit dims added or removed
UNSQUEEZES = frozenset({aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
#: dims reordered
TRANSPOSES = frozenset({aten.transpose.int, aten.permute.default, aten.t.default, aten.movedim.int,
                        aten.swapaxes.default})
#: size-1 dims broadcast
EXPANDS = frozenset({aten.expand.default, aten.expand_as.default})
#: every view of the same elements in another shape or order
VIEWS = RESHAPES | FOLDS | RESHAPES_AS | UNSQUEEZES | TRANSPOSES | EXPANDS
#: part of a dim
SLICES = frozenset({aten.slice.Tensor, aten.select.int})
#: the same values in new memory, or the same memory under a new name
COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                    aten.lift_fresh_copy.default})
#: the same values in another dtype or on another device
CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default})
#: the copies and casts the sharding rules look through: a value's layout and meaning unchanged
LOOK_THROUGH = frozenset({aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default})
#: reductions over the dims in args[1] (all dims when absent) that a rank may compute on its own
#: shard, its output then a partial sum
SUMS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default})
#: every reduction of a value over some of its dims (a statistic, a softmax, a scan)
REDUCTIONS = SUMS | {
    aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction, aten.var_mean.correction,
    aten.logsumexp.default, aten.argmax.default, aten.argmin.default, aten._softmax.default, aten.softmax.int,
    aten._log_softmax.default, aten.log_softmax.int, aten.cumsum.default, aten.norm.ScalarOpt_dim,
    aten.linalg_vector_norm.default}

#: a sum or a difference of two values (fx's operator.add/sub over symbolic sizes included)
ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.add.Scalar,
                  aten.sub.Scalar, operator.add, operator.sub})
#: a negation
NEGS = frozenset({aten.neg.default, operator.neg})
#: a product of two values
MULS = frozenset({aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar, operator.mul})
#: a quotient of two values
DIVS = frozenset({aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, operator.truediv})

__all__ = ["ADDS", "CASTS", "COPIES", "DIVS", "MULS", "NEGS", "EXPANDS", "FLATTENS", "FOLDS", "LOOK_THROUGH", "REDUCTIONS", "RESHAPES", "RESHAPES_AS",
           "SLICES", "SUMS", "TRANSPOSES", "UNSQUEEZES", "VIEWS"]
