"""Passes, tensor parallel step 3: insert the collectives, and make the graph local to a rank.

`insert_collectives` rebuilds the graph by interpretation: where an input's placement differs
from what its consumer expects it emits the redistribution (Megatron's conjugate pairs as
fxtron custom ops, visible by name), where a replicated value that carries gradient feeds a
sharded computation it emits `copy_to_region` (identity forward, all-reduce backward; one per
value, shared by all its sharded consumers, as Megatron's fused QKV shares one), and it swaps
in the vocab-parallel embedding and cross entropy. `localize` then rewrites the sizes written
into the graph (view shapes, split sizes) to this rank's and drops export's metadata asserts.

| from \\ to    | Replicate                 | Shard(d)                 |
|--------------|---------------------------|--------------------------|
| Replicate    | copy_to_region (if sharded consumer) | scatter (slice; bwd all-gather) |
| Partial      | all_reduce (bwd identity) | reduce_scatter (bwd all-gather) |
| Shard(d)     | all_gather (bwd slice)    | all_gather + scatter     |
"""
from __future__ import annotations


import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.compiler import meta
from fxtron.errors import ParallelizeError
from fxtron.passes.placement import PARTIAL, REPLICATE, Partial, Replicate, Shard
from fxtron.passes.propagate import _PARTIAL_THROUGH, _is_tensor
from fxtron.runtime.shard import to_list

aten = torch.ops.aten
TP_GROUP = "tp"   # replaced by the real process group's name when a program is built


def _fx():
    import fxtron.runtime.collectives  # noqa: F401 - registers torch.ops.fxtron
    return torch.ops.fxtron


def _requires_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a parameter (so a gradient flows back through them)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        spec = meta.get(node, meta.INPUT)
        if spec is not None:
            if spec.kind == "parameter":
                out.add(node)
            continue
        if any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


class _Emitter:
    def __init__(self, graph: fx.Graph, tp: int, tp_rank: int):
        self.g, self.tp, self.tp_rank = graph, tp, tp_rank
        self.cache: dict[tuple, fx.Node] = {}

    def call(self, target, args, like: fx.Node, placement, reason: str, kwargs=None,
             module_of: fx.Node | None = None) -> fx.Node:
        n = self.g.call_function(target, tuple(args), kwargs or {})
        val = like.meta.get("val")
        if val is not None:
            n.meta["val"] = val
        for k in ("nn_module_stack", "stack_trace"):
            if k in like.meta:
                n.meta[k] = like.meta[k]
        meta.set(n, meta.MODULE, meta.get(module_of or like, meta.MODULE) or "")
        meta.set(n, meta.PLACEMENT, placement)
        meta.set(n, meta.PROVENANCE, meta.Provenance("insert_collectives", reason))
        return n

    def redistribute(self, src: fx.Node, value: fx.Node, have, want, consumer: fx.Node) -> fx.Node:
        key = (src, str(have), str(want))
        if key in self.cache:
            return self.cache[key]
        ops = _fx()
        why = f"%{src.name} {have} -> {want} for %{consumer.name}"
        origin = src   # a partial sum belongs to the layer that made it, not to the cast after it
        while isinstance(have, Partial) and origin.op == "call_function" and origin.target in _PARTIAL_THROUGH:
            origin = origin.args[0]
        tp, g = self.tp, TP_GROUP
        if isinstance(have, Partial) and isinstance(want, Replicate):
            out = self.call(ops.all_reduce.default, (value, g), src, want, why, module_of=origin)
        elif isinstance(have, Replicate) and isinstance(want, Shard):
            out = self.call(ops.scatter.default, (value, want.dim, to_list(want.interleave), tp, g), src, want, why)
        elif isinstance(have, Shard) and isinstance(want, Replicate):
            out = self.call(ops.all_gather.default, (value, have.dim, to_list(have.interleave), tp, g), src, want, why)
        elif isinstance(have, Partial) and isinstance(want, Shard) and want.interleave == 1:
            out = self.call(ops.reduce_scatter.default, (value, want.dim, tp, g), src, want, why)
        elif isinstance(have, Partial) and isinstance(want, Shard):
            mid = self.call(ops.all_reduce.default, (value, g), src, REPLICATE, why)
            out = self.call(ops.scatter.default, (mid, want.dim, to_list(want.interleave), tp, g), src, want, why)
        elif isinstance(have, Shard) and isinstance(want, Shard):
            mid = self.call(ops.all_gather.default, (value, have.dim, to_list(have.interleave), tp, g), src, REPLICATE, why)
            out = self.call(ops.scatter.default, (mid, want.dim, to_list(want.interleave), tp, g), src, want, why)
        else:
            raise ParallelizeError(f"cannot redistribute %{src.name} from {have} to {want} (for %{consumer.name})")
        self.cache[key] = out
        return out

    def gather_for_region(self, src: fx.Node, value: fx.Node, have: Shard, consumer: fx.Node) -> fx.Node:
        key = (src, "gather_from_sequence")
        if key not in self.cache:
            if have.interleave != 1:
                raise ParallelizeError(f"%{src.name}: cannot gather an interleaved shard into a region")
            self.cache[key] = self.call(_fx().gather_from_sequence.default, (value, have.dim, self.tp, TP_GROUP),
                                        src, REPLICATE, f"%{src.name} {have} -> R entering a tensor-parallel "
                                        "region (all-gather; reduce-scatter of its gradient)", module_of=consumer)
        return self.cache[key]

    def copy_to_region(self, src: fx.Node, value: fx.Node, consumer: fx.Node) -> fx.Node:
        key = (src, "f")
        if key not in self.cache:
            self.cache[key] = self.call(_fx().copy_to_region.default, (value, TP_GROUP), src, REPLICATE,
                                        f"%{src.name} enters a tensor-parallel region (all-reduce its gradient)",
                                        module_of=consumer)
        return self.cache[key]


def _params_summed_after_backward(gm: fx.GraphModule) -> set[fx.Node]:
    """Replicated parameters whose every use produces a sharded value (a norm's weight on
    sequence shards): each tp rank computes a partial gradient. Instead of an all-reduce in
    backward at every use (Megatron's f), their gradients are summed over tp once per step
    after backward (Megatron's _allreduce_layernorm_grads in finalize_model_grads)."""
    out = set()
    for node in gm.graph.nodes:
        spec = meta.get(node, meta.INPUT)
        if node.op != "placeholder" or spec is None or spec.kind != "parameter":
            continue
        if not isinstance(meta.get(node, meta.PLACEMENT), Replicate) or not node.users:
            continue
        if all(_sharded(meta.get(u, meta.PLACEMENT)) and u.op == "call_function" for u in node.users):
            out.add(node)
    return out


def _sharded(pl) -> bool:
    return isinstance(pl, (Shard, Partial)) or (isinstance(pl, tuple) and any(isinstance(p, (Shard, Partial)) for p in pl))


def insert_collectives(gm: fx.GraphModule, *, tp: int, tp_rank: int) -> fx.GraphModule:
    """A new GraphModule in which every input of every op has the placement its rule expects.
    Reads fxtron_placement / fxtron_expects written by `propagate`."""
    grad = _requires_grad(gm)
    deferred = _params_summed_after_backward(gm)
    new = fx.Graph()
    em = _Emitter(new, tp, tp_rank)
    env: dict[fx.Node, fx.Node] = {}
    seen: dict[fx.Node, object] = {}   # the placement each old node's env value has
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = new.node_copy(node, lambda n: env[n])
            seen[node] = meta.get(node, meta.PLACEMENT)
            if node in deferred:
                meta.set(env[node], meta.GRAD_REDUCE, "tp")
            continue
        expects = meta.get(node, meta.EXPECTS) or ()
        out_pl = meta.get(node, meta.PLACEMENT)
        sharded_out = isinstance(out_pl, (Shard, Partial)) or (
            isinstance(out_pl, tuple) and any(isinstance(p, (Shard, Partial)) for p in out_pl))
        tensors = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and _is_tensor(a)]
        mapping: dict[fx.Node, fx.Node] = {}
        for i, a in enumerate(tensors):
            have = seen[a]
            want = expects[i] if i < len(expects) and expects[i] is not None else have
            value = env[a]
            enters_region = sharded_out and isinstance(want, Replicate) and a in grad and node.op != "output"
            if enters_region and isinstance(have, Shard):
                # sequence parallel's gather before a colwise linear: all-gather forward,
                # reduce-scatter backward, one op (Megatron's gather_from_sequence_parallel_region)
                value = em.gather_for_region(a, value, have, node)
            else:
                if want != have:
                    value = em.redistribute(a, value, have, want, node)
                if enters_region and a not in deferred:
                    value = em.copy_to_region(a, value, node)
            mapping[a] = value
        if node.op == "output":
            new.output(pytree.tree_map(lambda x: mapping.get(x, env.get(x)) if isinstance(x, fx.Node) else x,
                                       node.args[0]))
            continue
        remap = lambda n: mapping.get(n, env[n])  # noqa: E731
        copied = _rewrite(node, em, remap, seen, tp, tp_rank) or new.node_copy(node, remap)
        env[node] = copied
        seen[node] = out_pl
        redist = meta.get(node, meta.REDISTRIBUTE_OUT)
        if redist is not None:   # colwise with gather_output: every consumer sees the gathered value
            env[node] = em.redistribute(node, copied, out_pl, redist, node)
            seen[node] = redist
    out = fx.GraphModule(gm, new)
    out.meta.update(gm.meta)
    out.graph.lint()
    return out


def _rewrite(node: fx.Node, em: _Emitter, remap, seen, tp: int, tp_rank: int) -> fx.Node | None:
    """Ops that become a different op on sharded inputs: vocab-parallel embedding and cross
    entropy. Returns the new node, or None to copy the node as it is."""
    ops = _fx()
    if node.target == aten.embedding.default and isinstance(seen[node.args[0]], Shard) and seen[node.args[0]].dim == 0:
        w, ids = node.args[:2]
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        per = int(w.meta["val"].shape[0]) // tp
        return em.call(ops.vocab_parallel_embedding.default,
                       (remap(w), remap(ids), tp_rank * per, -1 if padding_idx is None else padding_idx), node,
                       PARTIAL, f"vocab-parallel embedding, rows [{tp_rank * per}, {(tp_rank + 1) * per})")
    if node.target == aten.cross_entropy_loss.default and isinstance(seen[node.args[0]], Shard):
        logits, target = node.args[:2]
        args = list(node.args) + [None] * (6 - len(node.args))
        weight = node.kwargs.get("weight", args[2])
        reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
        ignore_index = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
        smoothing = node.kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
        if weight is not None:
            raise ParallelizeError(f"node %{node.name}: class weights in a vocab-parallel cross entropy are not "
                                   "supported; replicate the LM head in the plan")
        per = int(logits.meta["val"].shape[1]) // tp
        return em.call(ops.vocab_parallel_cross_entropy.default,
                       (remap(logits), remap(target), tp_rank * per, ignore_index, reduction, float(smoothing), TP_GROUP),
                       node, REPLICATE, "vocab-parallel cross entropy: the full logits are never gathered")
    return None


# ----------------------------------------------------------------------------- random streams
def assign_rng_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Wrap every random op in `rng_call(region, op, ...)`: "sharded" when its output is
    sharded over tp (independent draws per rank), "replicated" otherwise (the same draws on
    every tp rank). Edits gm in place and returns it."""
    from fxtron.runtime.rng import is_random, rng_call

    for node in list(gm.graph.nodes):
        if not is_random(node):
            continue
        region = "sharded" if isinstance(meta.get(node, meta.PLACEMENT), Shard) else "replicated"
        node.args = (region, node.target) + tuple(node.args)
        node.target = rng_call
        meta.set(node, meta.PROVENANCE, meta.Provenance("assign_rng_regions", f"{region} random stream"))
    gm.recompile()
    return gm


# ----------------------------------------------------------------------------- localize
def drop_metadata_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove export's `_assert_tensor_metadata` checks: they pin the traced dtype (a mixed-
    precision program computes in 16 bits) and global sizes (a rank holds shards). Edits gm in
    place and returns it."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


_SIZE_ARG_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def localize(gm: fx.GraphModule, *, tp: int) -> fx.GraphModule:
    """Rewrite sizes written into the graph to this rank's (a view to (B, S, 4, 16) of a value
    sharded on the heads dim becomes (B, S, 4/tp, 16)), and drop `_assert_tensor_metadata`
    checks that carry global sizes. Edits gm in place and returns it."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t == aten._assert_tensor_metadata.default:
            g.erase_node(node)
            continue
        pl = meta.get(node, meta.PLACEMENT)
        if t in _SIZE_ARG_VIEWS and isinstance(pl, Shard):
            sizes = list(node.args[1])
            s = sizes[pl.dim]
            if isinstance(s, int) and s != -1:
                sizes[pl.dim] = _div(s, tp, node)
            elif isinstance(s, fx.Node):   # a size read at run time (the sequence length): divide it there
                with g.inserting_before(node):
                    local = g.call_function(operator.floordiv, (s, tp))
                meta.set(local, meta.PROVENANCE, meta.Provenance("localize", f"local size of dim {pl.dim}"))
                sizes[pl.dim] = local
            node.args = (node.args[0], sizes) + tuple(node.args[2:])
        elif t in (aten.split.Tensor, aten.split_with_sizes.default):
            src = meta.get(node.args[0], meta.PLACEMENT)
            nd = node.args[0].meta["val"].dim()
            dim = node.args[2] if len(node.args) > 2 else 0
            if isinstance(src, Shard) and (dim + nd if dim < 0 else dim) == src.dim:
                sizes = node.args[1]
                new = [_div(s, tp, node) for s in sizes] if isinstance(sizes, (list, tuple)) else _div(sizes, tp, node)
                node.args = (node.args[0], new) + tuple(node.args[2:])
        elif t == aten.slice.Tensor and isinstance(pl, Shard):
            src = meta.get(node.args[0], meta.PLACEMENT)
            nd = node.args[0].meta["val"].dim()
            dim = node.args[1] if len(node.args) > 1 else 0
            if isinstance(src, Shard) and src.interleave != 1 and (dim + nd if dim < 0 else dim) == src.dim:
                # whole blocks of a fused projection: each block holds 1/tp of its rows here
                bounds = [b if b is None or b >= 2**62 else _div(b, tp, node) for b in node.args[2:4]]
                node.args = (node.args[0], node.args[1], *bounds, *node.args[4:])
        elif t == aten.repeat_interleave.self_int and isinstance(pl, Shard) and node.kwargs.get("output_size"):
            kw = dict(node.kwargs)
            kw["output_size"] = _div(kw["output_size"], tp, node)
            node.kwargs = kw
    gm.recompile()
    return gm


def _div(size, tp: int, node: fx.Node):
    if not isinstance(size, int):
        raise ParallelizeError(f"node %{node.name}: cannot divide the symbolic size {size} over tp={tp}")
    if size % tp:
        raise ParallelizeError(f"node %{node.name} ({meta.get(node, meta.MODULE)}): size {size} is not divisible by tp={tp}")
    return size // tp
