"""Passes: insert the redistributions -- where a value's placement on an axis differs from what
its consumer expects, the collective that turns one into the other.

`insert_redistributions` rebuilds the graph by interpretation, axis by axis for every axis the
graph has placements on: where an input's placement differs from what its consumer expects it
emits the redistribution (Megatron's conjugate pairs as fxtron ops over that axis, visible by
name), where a replicated value that carries gradient feeds a sharded computation it emits
`copy_to_region` (identity forward, all-reduce backward; one per value, shared by all its
sharded consumers, as Megatron's fused QKV shares one), and it applies the registered
lowerings (the vocab-parallel embedding and cross entropy).

| from \\ to    | Replicate                 | Shard(d)                 |
|--------------|---------------------------|--------------------------|
| Replicate    | copy_to_region (if sharded consumer) | scatter (slice; bwd all-gather) |
| Partial      | all_reduce (bwd identity) | reduce_scatter (bwd all-gather) |
| Shard(d)     | all_gather (bwd slice)    | all_gather + scatter     |
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import fxtron.ops  # noqa: F401 - registers torch.ops.fxtron
from fxtron.core import meta, opsets
from fxtron.core.axes import MeshView
from fxtron.core.layout import is_symbolic, to_list
from fxtron.core.placement import NESTED, REPLICATE, Partial, Replicate, Shard, is_sharded
from fxtron.errors import ParallelizeError
from fxtron.ops import registry
from fxtron.passes.rules import CASTS, PARTIAL_THROUGH, is_tensor, lowerings_for, tensor_inputs
from fxtron.passes.rules.registry import expr, split_sources
from fxtron.passes.rules.views import head_repeat

ops = torch.ops.fxtron


class _Emitter:
    """Makes the new graph's communication nodes, one per (value, axis, redistribution)."""

    def __init__(self, graph: fx.Graph, mesh: MeshView, grad: set[fx.Node] = frozenset(),
                 balanced: tuple[str, ...] = (), axes: tuple[str, ...] = (), options: dict | None = None):
        self.g, self.mesh, self.grad, self.balanced, self.axes = graph, mesh, grad, balanced, axes
        self.options = options or {}       # axis -> the choices propagate was given (cp_comm_type)
        self.replaced: list[fx.Node] = []  # new nodes superseded by a local form (erased if unused)
        self.cache: dict[tuple, fx.Node] = {}

    def call(self, target, args, like: fx.Node, placements: meta.PerAxis, reason: str, kwargs=None,
             module_of: fx.Node | None = None) -> fx.Node:
        n = self.g.call_function(target, tuple(args), kwargs or {})
        val = like.meta.get("val")
        if val is not None:
            n.meta["val"] = val
        for k in ("nn_module_stack", "stack_trace"):
            if k in like.meta:
                n.meta[k] = like.meta[k]
        meta.set(n, meta.MODULE, meta.get(module_of or like, meta.MODULE) or "")
        meta.set(n, meta.PLACEMENT, placements)
        meta.set(n, meta.PROVENANCE, meta.Provenance("insert_redistributions", reason))
        return n

    def redistribute(self, src: fx.Node, value: fx.Node, placed: meta.PerAxis, axis: str, want,
                     consumer: fx.Node) -> fx.Node:
        """`value` (the new graph's node for `src`, placed `placed`) with its placement on
        `axis` turned into `want`."""
        have = placed.get(axis)
        key = (src, axis, str(placed), str(want))   # the value's placement on every axis: one per state
        if key in self.cache:
            return self.cache[key]
        why = f"%{src.name} {axis}:{have} -> {axis}:{want} for %{consumer.name}"
        if getattr(have, "order", "") or getattr(want, "order", ""):
            raise ParallelizeError(
                f"{why}: a value in a rank-local order (each {axis} rank sorted its own tokens, rules/order.py) has "
                f"no global layout to move it to or from; %{consumer.name} ({consumer.target}, module "
                f"{meta.get(consumer, meta.MODULE) or '(top level)'}) must take it in that order, which only "
                f"elementwise and row-wise ops, sums and the sort's inverse permutation do")
        origin = src   # a partial sum belongs to the layer that made it, not to the cast after it
        while isinstance(have, Partial) and origin.op == "call_function" and origin.target in PARTIAL_THROUGH:
            origin = origin.args[0]
        n = self.mesh.size(axis)
        done = placed.with_axis(axis, want)
        mid_r = placed.with_axis(axis, REPLICATE)
        if axis in self.balanced and (isinstance(have, Shard) or isinstance(want, Shard)):
            out = self._redistribute_balanced(src, value, placed, axis, want, consumer, why)
            self.cache[key] = out
            return out
        if is_symbolic(getattr(have, "interleave", 1)) or is_symbolic(getattr(want, "interleave", 1)):
            out = self._redistribute_blocks(src, value, placed, axis, want, consumer, why)
            self.cache[key] = out
            return out
        if isinstance(have, Partial) and isinstance(want, Replicate):
            out = self.call(ops.all_reduce.default, (value, axis), src, done, why, module_of=origin)
        elif isinstance(have, Replicate) and isinstance(want, Shard) and _broadcast_at(src, want):
            # a value expanded along the dim to shard (DeepSeek's rotary key, one for all heads):
            # expand to this rank's part instead of slicing the whole; the gradient, summed over
            # the local part, is then partial: the expanded value enters the region
            inp = env_value = value.args[0]
            if src.args[0] in self.grad:
                env_value = self.copy_to_region(src.args[0], inp, placed, axis, consumer)
            out = self.call(src.target, (env_value, *value.args[1:]), src, done, why + " (expanded locally)")
        elif isinstance(have, Replicate) and isinstance(want, Shard):
            out = self.call(ops.scatter.default, (value, want.dim, to_list(want.interleave), n, axis), src, done, why)
        elif isinstance(have, Shard) and isinstance(want, Replicate):
            out = self.call(ops.all_gather.default, (value, have.dim, to_list(have.interleave), n, axis), src, done, why)
            if consumer is not src and meta.get(consumer, meta.FALLBACK) is None:
                # not the plan's gather_output, nor a fallback's (reported as such)
                meta.set(out, meta.GATHERED, _gathered(why, src, consumer, axis))
        elif isinstance(have, Partial) and isinstance(want, Shard) and want.interleave == 1:
            out = self.call(ops.reduce_scatter.default, (value, want.dim, n, axis), src, done, why)
        elif isinstance(have, Partial) and isinstance(want, Shard):
            mid = self.call(ops.all_reduce.default, (value, axis), src, mid_r, why)
            out = self.call(ops.scatter.default, (mid, want.dim, to_list(want.interleave), n, axis), src, done, why)
        elif isinstance(have, Shard) and isinstance(want, Shard):
            mid = self.call(ops.all_gather.default, (value, have.dim, to_list(have.interleave), n, axis), src, mid_r, why)
            if meta.get(consumer, meta.FALLBACK) is None:
                meta.set(mid, meta.GATHERED, _gathered(why, src, consumer, axis))
            out = self.call(ops.scatter.default, (mid, want.dim, to_list(want.interleave), n, axis), src, done, why)
        else:
            raise ParallelizeError(f"cannot redistribute %{src.name} from {axis}:{have} to {axis}:{want} "
                                   f"(for %{consumer.name})")
        self.cache[key] = out
        return out

    def _redistribute_balanced(self, src: fx.Node, value: fx.Node, placed: meta.PerAxis, axis: str, want,
                               consumer: fx.Node, why: str) -> fx.Node:
        """On a load-balanced axis (cp, ops/cp/layout.py) a shard is the rank's chunks r and 2n-1-r: a
        value is reordered (`zigzag`) before it is split and restored to natural order after it
        is gathered, so the split and gather themselves are the plain ones."""
        have, n = placed.get(axis), self.mesh.size(axis)
        if isinstance(want, Shard) and is_symbolic(want.interleave) and not isinstance(have, Shard):
            folded = self._split_before_fold(src, value, placed, axis, want, why)
            if folded is not None:
                return folded
        for sh in (have, want):
            if isinstance(sh, Shard) and not isinstance(sh.interleave, int):
                raise ParallelizeError(
                    f"%{src.name}: {axis}:{have} -> {axis}:{want} for %{consumer.name}: a {axis} shard of "
                    f"{'a batch-and-sequence fold' if is_symbolic(sh.interleave) else 'unequal blocks'} cannot be "
                    f"moved; the op needs it whole, which context parallel does not do (module "
                    f"{meta.get(consumer, meta.MODULE) or '(top level)'}"
                    + (f", {meta.source(consumer)}" if meta.source(consumer) else "") + "): the model mixes this "
                    "rank's tokens with values over the whole batch and sequence there; compute it per token, or "
                    "leave context parallel off (cp=1) for this model")
        if isinstance(have, Partial) and isinstance(want, Shard) and want.interleave == 1:
            ordered = self.call(ops.zigzag.default, (value, want.dim, 1, n, False), src, placed,
                                why + " (load-balanced order)")
            return self.call(ops.reduce_scatter.default, (ordered, want.dim, n, axis), src,
                             placed.with_axis(axis, want), why)
        if isinstance(have, Shard):
            gathered = self.call(ops.all_gather.default, (value, have.dim, to_list(have.interleave), n, axis), src,
                                 placed.with_axis(axis, REPLICATE), why)
            if meta.get(consumer, meta.FALLBACK) is None and src.meta["val"].is_floating_point():
                # (integers -- token ids, labels shifted by one -- are the data's, B x S of them)
                meta.set(gathered, meta.GATHERED, _gathered(why, src, consumer, axis))
            value = self.call(ops.zigzag.default, (gathered, have.dim, have.interleave, n, True), src,
                              placed.with_axis(axis, REPLICATE), why + " (natural order)")
            placed = placed.with_axis(axis, REPLICATE)
            if isinstance(want, Replicate):
                return value
        if isinstance(want, Shard):
            if isinstance(placed.get(axis), Partial):
                value = self.call(ops.all_reduce.default, (value, axis), src, placed.with_axis(axis, REPLICATE), why)
                placed = placed.with_axis(axis, REPLICATE)
            return self._split_balanced(src, value, placed, axis, want, why)
        raise ParallelizeError(f"cannot redistribute %{src.name} from {axis}:{have} to {axis}:{want} "
                               f"(for %{consumer.name})")

    def _split_before_fold(self, src, value, placed, axis, want: Shard, why: str) -> fx.Node | None:
        """A whole value folded (B, S, ...) -> (B*S, ...), perhaps then cast, wanted split over a
        load-balanced axis (labels shifted inside the model, for a loss over split tokens): split
        it on the sequence before the fold and fold the rank's part. None if `src` is no such fold."""
        chain = []
        node, new = src, value
        while node.op == "call_function" and node.target in CASTS | {torch.ops.aten.to.dtype_layout}:
            chain.append((node, new))
            node, new = node.args[0], new.args[0]
        if not (node.op == "call_function" and node.target in _FOLDS and new.target == node.target):
            return None
        x, x_new = node.args[0], new.args[0]
        ins, outs = _shape(x), _shape(node)
        if want.dim != 0 or len(ins) != len(outs) + 1 or sympy.simplify(ins[0] * ins[1] - outs[0]) != 0 \
                or sympy.simplify(want.interleave - ins[0]) != 0:
            return None
        split = self._split_balanced(x, x_new, placed, axis, Shard(1), why + " (split before the fold)")
        out = self.call(new.target, (split, *new.args[1:]), node, placed.with_axis(axis, want), why,
                        kwargs=dict(new.kwargs))
        for n_old, n_new in reversed(chain):
            out = self.call(n_new.target, (out, *n_new.args[1:]), n_old, placed.with_axis(axis, want), why,
                            kwargs=dict(n_new.kwargs))
        return out

    def _lookup_of_split_ids(self, src, value, placed, axis, want: Shard, why: str) -> fx.Node | None:
        """A whole table looked up at whole ids (a learned position table at arange(S)) wanted
        split on an ids dim: split the ids and look up the rank's rows, as Megatron slices the
        position ids before the embedding. The table's gradient is then the rank's partial sum,
        summed over the axis after backward (meta.GRAD_REDUCE) instead of an all-gather of the
        looked-up rows' gradient in backward. Only for a table with this one lookup, whose
        output has this one use; None otherwise."""
        chain = []                       # casts after the lookup (GPT-2's .to(device)): made on the rank's rows
        while (src.op == "call_function" and src.target in _CAST_LIKE and _uses(src) == 1
               and value.op == "call_function" and value.target == src.target):
            chain.append((src, value))
            src, value = src.args[0], value.args[0]
        if not (src.op == "call_function" and src.target == torch.ops.aten.embedding.default and _uses(src) == 1
                and value.op == "call_function" and value.target == src.target):
            return None
        w, ids = src.args[:2]
        w_new, ids_new = value.args[:2]
        if (ids in self.grad or not meta.is_param(w) or len(w.users) != 1 or w_new.op != "placeholder"
                or not isinstance(placed.get(axis), Replicate) or want.dim >= ids.meta["val"].dim()):
            return None
        split = self._split_balanced(ids, ids_new, placed, axis, want, why + " (the ids, before the lookup)")
        out = self.call(src.target, (w_new, split, *value.args[2:]), src, placed.with_axis(axis, want),
                        why + " (the rank's rows looked up)", kwargs=dict(value.kwargs))
        for n_old, n_new in reversed(chain):
            out = self.call(n_new.target, (out, *n_new.args[1:]), n_old, placed.with_axis(axis, want), why,
                            kwargs=dict(n_new.kwargs))
        meta.set(w_new, meta.GRAD_REDUCE, tuple(meta.get(w_new, meta.GRAD_REDUCE) or ()) + (axis,))
        self.replaced += [n for _, n in chain] + [value]       # users before what they use
        return out

    def _split_balanced(self, src, value, placed, axis, want: Shard, why: str) -> fx.Node:
        n = self.mesh.size(axis)
        local = self._lookup_of_split_ids(src, value, placed, axis, want, why)
        if local is not None:
            return local
        if src.op == "call_function" and _broadcast_at(src, want) and src.args[0] not in self.grad:
            # expanded along the split dim: any order is the same; expand to the local part
            return self.call(src.target, (value.args[0], *value.args[1:]), src, placed.with_axis(axis, want),
                             why + " (expanded locally)")
        ordered = self.call(ops.zigzag.default, (value, want.dim, want.interleave, n, False), src, placed,
                            why + " (load-balanced order)")
        return self.call(ops.scatter.default, (ordered, want.dim, to_list(want.interleave), n, axis), src,
                         placed.with_axis(axis, want), why)

    def _redistribute_blocks(self, src: fx.Node, value: fx.Node, placed: meta.PerAxis, axis: str, want,
                             consumer: fx.Node, why: str) -> fx.Node:
        """A dim split into a symbolic count of equal blocks (BLOOM's B*heads, see core/layout.py)
        made whole or split: unflatten it into (blocks, block), move the second dim, flatten."""
        have = placed.get(axis)
        if isinstance(have, Partial):
            value = self.call(ops.all_reduce.default, (value, axis), src, placed.with_axis(axis, REPLICATE), why)
            have = REPLICATE
        if isinstance(have, Shard) and isinstance(want, Shard) and have == want:
            return value
        if isinstance(have, Shard):                      # gather first
            value = self._blocks(src, value, placed, axis, have, "gather", why, consumer)
            have = REPLICATE
        if isinstance(want, Replicate):
            return value
        return self._blocks(src, value, placed.with_axis(axis, REPLICATE), axis, want, "scatter", why, consumer)

    def _blocks(self, src, value, placed, axis, sh: Shard, how: str, why: str, consumer) -> fx.Node:
        n, d, k = self.mesh.size(axis), sh.dim, sh.interleave
        val = src.meta["val"]
        gm = src.graph.owning_module
        size = meta.info(gm).expr(val.shape[d]) if gm is not None and meta.TRACE_INFO in gm.meta else expr(val.shape[d])
        block = sympy.simplify(size / k)
        if not block.is_Integer or int(block) % n:
            raise ParallelizeError(f"%{src.name}: dim {d} of {tuple(val.shape)} in {k} blocks: no whole blocks of a "
                                   f"static size divisible by {axis}={n} (for %{consumer.name})")
        block = int(block)
        local = block // n if how == "gather" else block
        unflat = self.call(torch.ops.aten.unflatten.int, (value, d, [-1, local]), src,
                           placed.with_axis(axis, Shard(d + 1) if how == "gather" else REPLICATE),
                           why + f" (dim {d} as blocks of {block})")
        unflat.meta["val"] = val.unflatten(d, (-1, block))
        if how == "gather":
            moved = self.call(ops.all_gather.default, (unflat, d + 1, [1], n, axis), src, placed.with_axis(axis, REPLICATE),
                              why)
            if meta.get(consumer, meta.FALLBACK) is None:
                meta.set(moved, meta.GATHERED, _gathered(why, src, consumer, axis))
        else:
            moved = self.call(ops.scatter.default, (unflat, d + 1, [1], n, axis), src, placed.with_axis(axis, Shard(d + 1)),
                              why)
        moved.meta["val"] = unflat.meta["val"]
        out = self.call(torch.ops.aten.flatten.using_ints, (moved, d, d + 1), src,
                        placed.with_axis(axis, REPLICATE if how == "gather" else sh), why)
        return out

    def gather_for_region(self, src: fx.Node, value: fx.Node, placed: meta.PerAxis, axis: str,
                          consumer: fx.Node) -> fx.Node:
        """Sequence parallel's gather before a region: all-gather forward, reduce-scatter of the
        gradient backward, one op (Megatron's gather_from_sequence_parallel_region)."""
        key = (src, axis, str(placed), "gather_from_sequence")
        repeat = head_repeat(src) if axis in self.balanced and key not in self.cache else None
        if repeat is not None:
            # keys of grouped-query attention: gather them before their heads are repeated
            x, chain = repeat
            news = [value]
            for _ in chain[1:]:
                news.append(news[-1].args[0])
            x_new = news[-1].args[0]
            out = self.gather_for_region(x, x_new, placed, axis, consumer)
            for old, new in zip(chain, reversed(news)):
                out = self.call(new.target, (out, *new.args[1:]), old, placed.with_axis(axis, REPLICATE),
                                f"%{old.name} on the gathered %{x.name}", kwargs=dict(new.kwargs), module_of=consumer)
            self.cache[key] = out
        if key not in self.cache:
            have = placed.get(axis)
            if have.interleave != 1:
                raise ParallelizeError(f"%{src.name}: cannot gather an interleaved shard ({have}) into a region "
                                       f"(for %{consumer.name})")
            out = self.call(ops.gather_from_sequence.default, (value, have.dim, self.mesh.size(axis), axis),
                            src, placed.with_axis(axis, REPLICATE),
                            f"%{src.name} {axis}:{have} -> {axis}:R entering a parallel region "
                            "(all-gather; reduce-scatter of its gradient)", module_of=consumer)
            if axis in self.balanced:
                out = self.call(ops.zigzag.default, (out, have.dim, 1, self.mesh.size(axis), True), src,
                                placed.with_axis(axis, REPLICATE), f"%{src.name} gathered over {axis}, in natural order",
                                module_of=consumer)
            self.cache[key] = out
        return self.cache[key]

    def copy_to_region(self, src: fx.Node, value: fx.Node, placed: meta.PerAxis, axis: str,
                       consumer: fx.Node) -> fx.Node:
        key = (src, axis, str(placed), "f")
        if key not in self.cache and _picks_more_rows(src, value, self.grad):
            # rows picked with repeats (an MoE's tokens, k copies each): enter the region before
            # the pick, so the gradient all-reduced is the tokens', not their copies'
            entered = self.copy_to_region(src.args[0], value.args[0], placed, axis, consumer)
            self.cache[key] = self.call(value.target, (entered, *value.args[1:]), src, placed,
                                        f"%{src.name} picked again from the region's copy of %{src.args[0].name}",
                                        kwargs=dict(value.kwargs), module_of=consumer)
        if key not in self.cache:
            self.cache[key] = self.call(ops.copy_to_region.default, (value, axis), src, placed,
                                        f"%{src.name} enters a region parallel over {axis} (all-reduce its gradient)",
                                        module_of=consumer)
        return self.cache[key]


class Lower:
    """What a lowering (passes/rules registry) may use: the axis, its size and this rank's
    coordinate, an input's placement on the axis, the new graph's node for an input, and
    `call` to emit the replacement."""

    def __init__(self, em: _Emitter, axis: str, remap, placed: dict, node: fx.Node):
        self.axis, self.size, self.coord = axis, em.mesh.size(axis), em.mesh.coord(axis)
        self.balanced = axis in em.balanced        # shards are load-balanced chunks (cp)
        self.options = em.options.get(axis, {})     # the axis's choices (cp_comm_type)
        self._em, self._remap, self._placed, self._node = em, remap, placed, node

    def placement(self, arg: fx.Node):
        return self._placed[arg].get(self.axis)

    def carries_grad(self, arg: fx.Node) -> bool:
        """Does `arg` (a node of the graph being lowered) take a gradient?"""
        return arg in self._em.grad

    def on(self, axis: str) -> "Lower":
        """The same lowering's view of another axis (an op split on two: vocab and tokens)."""
        return Lower(self._em, axis, self._remap, self._placed, self._node)

    def axes(self) -> tuple[str, ...]:
        return self._em.axes

    def remap(self, arg):
        return self._remap(arg)

    def call(self, target, args, like: fx.Node, placement, reason: str, kwargs=None) -> fx.Node:
        placements = meta.get(like, meta.PLACEMENT).with_axis(self.axis, placement)
        return self._em.call(target, args, like, placements, reason, kwargs=kwargs)


def _uses(node: fx.Node) -> int:
    """Users of node, not counting export's metadata asserts."""
    return sum(1 for u in node.users if u.target != torch.ops.aten._assert_tensor_metadata.default)


_CAST_LIKE = CASTS | {torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default, torch.ops.aten.alias.default}
_FOLDS = opsets.FLATTENS


def _picks_more_rows(src: fx.Node, value: fx.Node, grad) -> bool:
    """Is `src` (copied as `value`) x[idx] or x.index_select(0, idx) of a value that takes a
    gradient, by indices that take none, giving more rows than x has -- or a cast of one?"""
    if src.op != "call_function" or value.op != "call_function" or value.target != src.target:
        return False
    if src.target in CASTS:
        return (isinstance(src.args[0], fx.Node) and isinstance(value.args[0], fx.Node)
                and _picks_more_rows(src.args[0], value.args[0], grad))
    if src.target == torch.ops.aten.index.Tensor:
        idx = src.args[1]
        if len(idx) != 1 or not isinstance(idx[0], fx.Node) or idx[0] in grad:
            return False
    elif src.target == torch.ops.aten.index_select.default:
        if src.args[1] != 0 or src.args[2] in grad:
            return False
    else:
        return False
    x = src.args[0]
    if x not in grad:
        return False
    a, b = expr(x.meta["val"].shape[0]), expr(src.meta["val"].shape[0])
    return bool(sympy.simplify(b - a).is_positive)


def _shape(node: fx.Node) -> tuple:
    """A node's global shape in the trace's symbols (B, S)."""
    gm = node.graph.owning_module
    ti = meta.info(gm) if gm is not None and meta.TRACE_INFO in gm.meta else None
    return tuple(ti.expr(s) if ti is not None else expr(s) for s in node.meta["val"].shape)


def _gathered(why: str, src: fx.Node, consumer: fx.Node, axis: str) -> str:
    """What the summary says of an all-gather a rule forced: the value, the op that needs it
    whole, and the layers whose split made it split (the plan keys that would keep it whole)."""
    sources = split_sources(src, axis) or ([meta.param_name(src).rpartition(".")[0]] if meta.is_param(src) else [])
    return f"{why} ({consumer.target})" + (f", split by {', '.join(sources)}" if sources else "")


def _broadcast_at(src: fx.Node, want: Shard) -> bool:
    """Is `src` an expand whose input has size 1 on the dim `want` shards (evenly)?"""
    if not (src.op == "call_function" and want.interleave == 1
            and src.target in (torch.ops.aten.expand.default, torch.ops.aten.broadcast_to.default)):
        return False
    inp = src.args[0].meta["val"]
    d = want.dim - (src.meta["val"].dim() - inp.dim())
    return d < 0 or (not isinstance(inp.shape[d], torch.SymInt) and int(inp.shape[d]) == 1)


def _params_summed_after_backward(gm: fx.GraphModule, axis: str) -> set[fx.Node]:
    """Parameters replicated over `axis` whose every use takes the whole weight into a value
    sharded there (a norm's weight on sequence shards, or on the heads of its rank): each rank
    of the axis computes a partial gradient. Instead of an all-reduce in backward at every use
    (Megatron's f), their gradients are summed over the axis once per step after backward
    (Megatron's _allreduce_layernorm_grads / non-tensor-parallel grads in finalize_model_grads).
    Returned with the values computed from such a parameter alone (Gemma's `1 + weight`, a
    cast), which are then no region entries either.

    A use that takes only this rank's slice of the weight (it is expected Shard: a norm's weight
    over a feature dim that is split, as q_norm after a column-split q projection) is not
    partial: the slice's gradient is exact and the scatter's backward all-gathers the slices.
    Summing it again would multiply the gradient by the axis size."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if not meta.is_param(node) or not node.users:
            continue
        if not isinstance(meta.placement(node, axis), Replicate):
            continue
        chain, uses, frontier = {node}, [], [node]
        while frontier:
            cur = frontier.pop()
            for u in cur.users:
                if u in chain:
                    continue
                if (u.op == "call_function" and isinstance(meta.placement(u, axis), Replicate)
                        and all(a in chain for a in tensor_inputs(u))):
                    chain.add(u)          # computed from the parameter alone, still whole
                    frontier.append(u)
                else:
                    uses.append((u, cur))
        if uses and all(u.op == "call_function" and is_sharded(meta.placement(u, axis)) and _takes_whole(u, via, axis)
                        for u, via in uses):
            out |= chain
    return out


def _takes_whole(user: fx.Node, param: fx.Node, axis: str) -> bool:
    expects = meta.expects(user, axis)
    wants = {e for a, e in zip(tensor_inputs(user), expects) if a is param}
    return all(e is None or isinstance(e, Replicate) for e in wants)


def _axis_order(axes: tuple[str, ...], now: meta.PerAxis, wants: dict) -> list[str]:
    """The order to redistribute one input over its axes. A dim split over several axes is
    split over the outer one first (NESTED: cp, then tp within each cp rank's tokens), so
    gathers go inner axis first and splits outer axis first, gathers before splits."""
    def key(axis: str) -> int:
        return NESTED.index(axis) if axis in NESTED else len(NESTED)
    splits = [a for a in axes if isinstance(wants[a], Shard) and wants[a] != now.get(a)]
    rest = [a for a in axes if a not in splits]
    return sorted(rest, key=lambda a: -key(a)) + sorted(splits, key=key)


def _check_write_into_copy(node: fx.Node, have: meta.PerAxis, want: meta.PerAxis) -> None:
    """An op writing in place into a value its rule wants placed otherwise writes into the
    redistributed copy: harmless when only the op's own result is read afterwards (export
    reads `x` after `x.add_(y)` there), wrong when the memory is read later under another name
    (the base of a slice written in place, a view made before)."""
    readers = meta.read_after(node)
    if readers:
        dst = node.args[0]
        where = meta.get(node, meta.MODULE) or "the model's top level"
        raise ParallelizeError(
            f"%{node.name} ({node.target}, in {where}) writes in place into %{dst.name}, which is {have} where the op "
            f"computes on {want}: the write would land on a redistributed copy, and %{readers[0].name} reads the "
            f"written memory afterwards (it would see the old values); write it out of place (y = x.{node.target._opname.rstrip('_')}(...)"
            f" and read y), or give the written value the placement of the others")


def insert_redistributions(gm: fx.GraphModule, *, mesh: MeshView) -> fx.GraphModule:
    """A new GraphModule in which every input of every op has, on every axis the graph has
    placements on, the placement its rule expects. Reads the placements and expectations
    `propagate` wrote; parameters whose gradient is summed after backward get
    meta.GRAD_REDUCE (the axes)."""
    axes = meta.graph_axes(gm)
    grad = meta.carries_grad(gm)
    deferred = {axis: _params_summed_after_backward(gm, axis) for axis in axes}
    new = fx.Graph()
    em = _Emitter(new, mesh, grad, meta.balanced_axes(gm), axes, {a: meta.axis_options(gm, a) for a in axes})
    env: dict[fx.Node, fx.Node] = {}
    placed: dict[fx.Node, meta.PerAxis] = {}   # the placements each old node's env value has
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = new.node_copy(node, lambda n: env[n])
            placed[node] = meta.get(node, meta.PLACEMENT, meta.PerAxis())
            summed = tuple(axis for axis in axes if node in deferred[axis])
            if summed:
                meta.set(env[node], meta.GRAD_REDUCE, summed)
            continue
        out_pl = meta.get(node, meta.PLACEMENT, meta.PerAxis())
        tensors = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and is_tensor(a)]
        mapping: dict[fx.Node, fx.Node] = {}
        for i, a in enumerate(tensors):
            value, now = env[a], placed[a]
            wants = {}
            for axis in axes:
                expects = meta.expects(node, axis)
                wants[axis] = expects[i] if i < len(expects) and expects[i] is not None else now.get(axis)
            for axis in _axis_order(axes, now, wants):
                have, want = now.get(axis), wants[axis]
                enters_region = (is_sharded(out_pl.get(axis)) and isinstance(want, Replicate) and a in grad
                                 and node.op != "output")
                if enters_region and isinstance(have, Shard):
                    value = em.gather_for_region(a, value, now, axis, node)
                else:
                    if want != have:
                        value = em.redistribute(a, value, now, axis, want, node)
                    if enters_region and a not in deferred[axis] and not registry.sums_grad(a, axis):
                        value = em.copy_to_region(a, value, now.with_axis(axis, want), axis, node)
                now = meta.get(value, meta.PLACEMENT, now) if value is not env[a] else now
            if i == 0 and value is not env[a] and meta.writes_first(node):
                _check_write_into_copy(node, placed[a], now)
            mapping[a] = value
        if node.op == "output":
            new.output(pytree.tree_map(lambda x: mapping.get(x, env.get(x)) if isinstance(x, fx.Node) else x,
                                       node.args[0]))
            continue
        remap = lambda n: mapping.get(n, env[n])  # noqa: E731
        copied = None
        for axis in axes:
            for lower in lowerings_for(node.target):
                copied = lower(node, Lower(em, axis, remap, placed, node))
                if copied is not None:
                    break
            if copied is not None:
                break
        copied = copied or new.node_copy(node, remap)
        env[node] = copied
        placed[node] = out_pl
        for axis in axes:
            redist = meta.redistribute_out(node, axis)
            if redist is not None:   # colwise with gather_output: every consumer sees the gathered value
                env[node] = em.redistribute(node, env[node], placed[node], axis, redist, node)
                placed[node] = placed[node].with_axis(axis, redist)
    for n in em.replaced:
        for u in list(n.users):
            if u.target == torch.ops.aten._assert_tensor_metadata.default:
                new.erase_node(u)             # export's check of a value no longer computed
        if not n.users:
            new.erase_node(n)
    out = fx.GraphModule(gm, new)
    out.meta.update(gm.meta)
    out.graph.lint()
    return out


__all__ = ["Lower", "insert_redistributions"]
