"""Passes: make a graph local to a rank -- the sizes written into it (view shapes, split sizes,
slice bounds) become this rank's, and export's metadata asserts, which pin global sizes and
the traced dtype, go."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxtron.core import layout, meta, opsets
from fxtron.core.axes import MeshView
from fxtron.core.placement import Shard
from fxtron.errors import ParallelizeError

aten = torch.ops.aten
_SIZE_ARG_VIEWS = opsets.RESHAPES | {aten.expand.default, aten.broadcast_to.default,
                   aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}


def drop_metadata_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove export's `_assert_tensor_metadata` checks: they pin the traced dtype (a mixed-
    precision program computes in 16 bits), the traced device (a meta model's fake CPU) and global
    sizes (a rank holds shards) -- in gm and in every graph nested in it (a higher-order op's
    body). Edits gm in place and returns it."""
    for g in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(g.graph.nodes):
            if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default:
                g.graph.erase_node(node)
        g.recompile()
    return gm


def drop_dead_values(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove the values nothing the forward returns depends on (Gemma 4's wrapper computes
    where(image_mask, weight[pad_id], embeds) for text alone and drops it): a rank would
    otherwise make their inputs whole for nothing (the pad row of a vocab-parallel table: the
    whole table gathered). Ops that mutate or have effects stay (torch.fx's is_impure). Edits gm
    in place and returns it."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def localize(gm: fx.GraphModule, *, mesh: MeshView) -> fx.GraphModule:
    """Rewrite sizes written into the graph to this rank's (a view to (B, S, 4, 16) of a value
    sharded on the heads dim over 2 ranks becomes (B, S, 2, 16)), on every axis the graph has
    placements on, and drop `_assert_tensor_metadata` checks that carry global sizes. Edits gm
    in place and returns it."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten._assert_tensor_metadata.default:
            g.erase_node(node)
            continue
        for axis in meta.graph_axes(gm):
            _localize(g, node, axis, mesh.size(axis))
    gm.recompile()
    return gm


def _localize(g: fx.Graph, node: fx.Node, axis: str, n: int) -> None:
    t = node.target
    pl = meta.placement(node, axis)
    if t == aten.sym_size.int:
        src = meta.placement(node.args[0], axis)
        if (isinstance(src, Shard) and node.args[1] % node.args[0].meta["val"].dim() == src.dim and n > 1
                and not meta.get(node, meta.OWN_SIZE)):
            # the graph means the global size (the whole sequence of cp-split tokens): the rank's times n
            with g.inserting_after(node):
                full = g.call_function(operator.mul, (node, n))
            meta.set(full, meta.PROVENANCE, meta.Provenance("localize", f"global size of dim {src.dim}, split over {axis}"))
            node.replace_all_uses_with(full, delete_user_cb=lambda u: u is not full)
        return
    if t in _SIZE_ARG_VIEWS and isinstance(pl, Shard):
        sizes = list(node.args[1])
        s = sizes[pl.dim]
        if isinstance(s, int) and s != -1:
            sizes[pl.dim] = _div(s, n, node, axis)
        elif isinstance(s, fx.Node):   # a size read at run time (the sequence length): divide it there
            with g.inserting_before(node):
                local = g.call_function(operator.floordiv, (s, n))
            meta.set(local, meta.PROVENANCE, meta.Provenance("localize", f"local size of dim {pl.dim} over {axis}"))
            sizes[pl.dim] = local
        node.args = (node.args[0], sizes) + tuple(node.args[2:])
    elif t == aten.unflatten.int and isinstance(pl, Shard):
        # x.unflatten(dim, sizes): the shard lands on one of `sizes` (the view rule's choice)
        d = node.args[1] % node.args[0].meta["val"].dim()
        if d <= pl.dim < d + len(node.args[2]) and node.args[2][pl.dim - d] != -1:
            sizes = list(node.args[2])
            sizes[pl.dim - d] = _div(sizes[pl.dim - d], n, node, axis)
            node.args = (node.args[0], node.args[1], sizes, *node.args[3:])
    elif t in (aten.split.Tensor, aten.split_with_sizes.default):
        src = meta.placement(node.args[0], axis)
        nd = node.args[0].meta["val"].dim()
        dim = node.args[2] if len(node.args) > 2 else 0
        if isinstance(src, Shard) and (dim + nd if dim < 0 else dim) == src.dim:
            sizes = node.args[1]
            new = [_div(s, n, node, axis) for s in sizes] if isinstance(sizes, (list, tuple)) else _div(sizes, n, node, axis)
            node.args = (node.args[0], new) + tuple(node.args[2:])
    elif t == aten.slice.Tensor and isinstance(meta.placement(node.args[0], axis), Shard) and \
            meta.placement(node.args[0], axis).whole:
        src = meta.placement(node.args[0], axis)
        full = int(node.args[0].meta["val"].shape[src.dim])
        bounds, local = [0], [0]
        for b, lb in zip(layout.block_sizes(full, src.interleave),
                         layout.local_block_sizes(full, n, src.interleave, src.whole)):
            bounds.append(bounds[-1] + b)
            local.append(local[-1] + lb)
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = min(node.args[3], full) if len(node.args) > 3 and node.args[3] is not None else full
        # block-aligned (the slice rule checked): the same blocks of this rank's piece
        node.args = (node.args[0], node.args[1], local[bounds.index(start)], local[bounds.index(end)], *node.args[4:])
    elif t == aten.slice.Tensor and isinstance(pl, Shard):
        src = meta.placement(node.args[0], axis)
        nd = node.args[0].meta["val"].dim()
        dim = node.args[1] if len(node.args) > 1 else 0
        if isinstance(src, Shard) and src.interleave != 1 and (dim + nd if dim < 0 else dim) == src.dim:
            # whole blocks of a fused projection: each block holds 1/n of its rows here
            bounds = [b if b is None or b >= 2**62 else _div(b, n, node, axis) for b in node.args[2:4]]
            node.args = (node.args[0], node.args[1], *bounds, *node.args[4:])
    elif t == aten.repeat_interleave.self_int and isinstance(pl, Shard) and node.kwargs.get("output_size") \
            and _repeated_dim(node) == pl.dim:       # (split on another dim: the repeated one is whole)
        kw = dict(node.kwargs)
        kw["output_size"] = _div(kw["output_size"], n, node, axis)
        node.kwargs = kw


def _repeated_dim(node: fx.Node) -> int | None:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    return None if dim is None else dim % node.meta["val"].dim()


def _div(size, n: int, node: fx.Node, axis: str):
    if not isinstance(size, int):
        raise ParallelizeError(f"node %{node.name}: cannot divide the symbolic size {size} over {axis}={n}")
    if size % n:
        raise ParallelizeError(f"node %{node.name} ({meta.get(node, meta.MODULE)}): size {size} is not divisible by {axis}={n}")
    return size // n


__all__ = ["drop_dead_values", "drop_metadata_asserts", "localize"]
