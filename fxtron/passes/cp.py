"""Passes, context parallel: what the cp axis adds to the generic SPMD passes.

Its layout: every user input that carries the sequence (token ids, labels, masks, position
ids) is split on that dim, load-balanced (a rank holds chunks r and 2n-1-r of 2n,
ops/cp/layout.py); parameters are whole. From there the generic passes do the rest: every token-wise op runs on
the rank's tokens; whatever the model derives from positions inside the graph (an arange of
position ids, learned position embeddings, rotary tables sliced from a buffer, a causal mask
however built, labels shifted by one) is computed whole, in natural order, and reaches the
rank's tokens through a load-balanced split, which picks exactly the rank's global positions;
the keys of an attention are gathered (its gradient reduce-scattered) under the mask's rows of
the rank's queries; a mean loss over the tokens divides the summed losses by the summed count
of counted tokens. Each parameter's gradient is then a partial sum over the cp ranks, summed
after backward (meta.GRAD_REDUCE), as Megatron reduces over its dp-cp group.

Attention with `is_causal` lowers here to the cp attention of ops/cp/: with the keys
gathered ("all_gather") each query chunk attends only the keys before it.
"""
from __future__ import annotations

import operator
from typing import get_args

import torch
import torch.fx as fx

from fxtron.config import CPCommType
from fxtron.core import meta
from fxtron.core.placement import REPLICATE, Shard
from fxtron.errors import ParallelizeError
from fxtron.ops.cp.all_gather import attention_all_gather
from fxtron.passes.propagate import AxisLayout
from fxtron.passes.rules import CASTS, register_lowering
from fxtron.passes.rules.views import head_repeat

aten = torch.ops.aten
AXIS = "cp"
COMM_TYPES = get_args(CPCommType)


def cp_layout(info: meta.TraceInfo, *, comm_type: str = "p2p", a2a_size: int | None = None,
              strict: bool = False) -> AxisLayout:
    """The cp axis's AxisLayout: user inputs split on their sequence dim, load-balanced."""
    if comm_type not in COMM_TYPES:
        raise ParallelizeError(f"cp_comm_type must be one of {', '.join(map(repr, COMM_TYPES))}, not {comm_type!r}")
    inputs = {i: Shard(dims.index("seq")) for i, dims in enumerate(info.user_dims) if "seq" in dims}
    if not inputs:
        raise ParallelizeError("context parallel splits the sequence, but no input of the model has a sequence "
                               "dim (dim 1 of a token tensor); trace it with inputs of shape (batch, seq, ...)")
    return AxisLayout(AXIS, inputs=inputs, balanced=True, strict=strict,
                      options={"cp_comm_type": comm_type, "cp_a2a_size": a2a_size})


_MATMULS = {aten.matmul.default, aten.bmm.default}


def _through(node, targets):
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets and len(node.users) == 1:
        node = node.args[0]
    return node


def _single(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1


def _written_out_attention(out: fx.Node, grad: set):
    """If `out` is softmax(q @ k^T * scale [masked]) @ v written out -- nanoGPT's masked_fill
    of a causal buffer with -inf, GPT-2 eager's additive mask, casts around the softmax, a
    dropout of the probabilities -- return (q, k, v, mask, scale, is the mask boolean 'where
    not', the dropout probability in training); else None. Every intermediate value must have this one use, and the mask take no gradient (a
    learned bias stays written out: the attention ops treat masks as constants)."""
    if out.op != "call_function" or out.target not in _MATMULS or len(out.args) < 2:
        return None
    p, v = out.args[:2]
    p = _through(p, CASTS)
    dropout = 0.0
    if _single(p) and p.target == aten.dropout.default:
        dropout = float(p.args[1]) if p.args[2] else 0.0
        p = _through(p.args[0], CASTS)
    if not (_single(p) and p.target in (aten.softmax.int, aten._softmax.default)
            and p.args[1] % p.meta["val"].dim() == p.meta["val"].dim() - 1):
        return None
    s = _through(p.args[0], CASTS)
    mask, negate = None, False
    if _single(s) and s.target == aten.masked_fill.Scalar and s.args[2] == float("-inf"):
        s, mask, negate = s.args[0], s.args[1], True
    elif _single(s) and s.target == aten.add.Tensor and all(isinstance(a, fx.Node) for a in s.args[:2]):
        a, b = s.args[:2]
        s, mask = (a, b) if _through(a, {aten.mul.Tensor, aten.div.Tensor}).target in _MATMULS else (b, a)
    if mask is not None and mask in grad:
        return None
    scale = None
    if _single(s) and s.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(s.args[1], (int, float)):
        scale = float(s.args[1]) if s.target == aten.mul.Tensor else 1.0 / float(s.args[1])
        s = s.args[0]
    if not (_single(s) and s.target in _MATMULS):
        return None
    q, kt = s.args[:2]
    if not (_single(kt) and kt.target == aten.transpose.int and kt.meta["val"].dim() == 4
            and {a % 4 for a in kt.args[1:3]} == {2, 3} and q.meta["val"].dim() == 4 and v.meta["val"].dim() == 4):
        return None
    return q, kt.args[0], v, mask, 1.0 if scale is None else scale, negate, dropout


def fuse_written_out_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """Attention written out as matmuls becomes scaled_dot_product_attention (with its mask
    and scale), so that the cp ring takes it (cp_comm_type="p2p"); the same values to
    round-off. Edits gm in place and returns it."""
    g = gm.graph
    grad = meta.carries_grad(gm)
    for node in list(g.nodes):
        found = _written_out_attention(node, grad) if node.op == "call_function" else None
        if found is None:
            continue
        q, k, v, mask, scale, negate, dropout = found
        with g.inserting_before(node):
            if mask is not None and negate:
                keep = g.call_function(aten.logical_not.default, (mask,))
                keep.meta.update({"val": mask.meta["val"]})
                meta.set(keep, meta.MODULE, meta.get(node, meta.MODULE) or "")
                mask = keep
            sdpa = g.call_function(aten.scaled_dot_product_attention.default, (q, k, v, mask, dropout, False),
                                   {"scale": scale})
        sdpa.meta.update(node.meta)
        meta.set(sdpa, meta.PROVENANCE, meta.Provenance(
            "fuse_written_out_attention", "softmax(q k^T scale + mask) v written out: one attention the cp ring takes"))
        node.replace_all_uses_with(sdpa)
        dead = [node]
        while dead:
            n = dead.pop()
            if n.op == "call_function" and not n.users:
                inputs = n.all_input_nodes
                g.erase_node(n)
                dead.extend(inputs)
    gm.recompile()
    return gm


def _sdpa_args(node: fx.Node):
    args = list(node.args) + [None] * (6 - len(node.args))
    mask = node.kwargs.get("attn_mask", args[3])
    dropout = node.kwargs.get("dropout_p", args[4] if args[4] is not None else 0.0)
    causal = node.kwargs.get("is_causal", args[5] if args[5] is not None else False)
    return mask, dropout, causal, node.kwargs.get("scale"), node.kwargs.get("enable_gqa", False)


@register_lowering(aten.scaled_dot_product_attention.default)
def _context_parallel_attention(node: fx.Node, lower) -> fx.Node | None:
    """Attention whose queries are split on the sequence over a load-balanced axis: causal
    attention becomes the cp op (the mask is implied by the positions); with an explicit mask
    the plain op runs on the mask's rows of this rank's queries against every key."""
    q, k, v = node.args[:3]
    pq = lower.placement(q)
    if not (lower.balanced and isinstance(pq, Shard) and pq.dim == 2):
        return None
    mask, dropout, causal, scale, gqa = _sdpa_args(node)
    if causal and mask is not None:
        raise ParallelizeError(f"node %{node.name}: attention with both a mask and is_causal")
    if lower.options.get("cp_comm_type") == "a2a":
        return _ulysses(node, lower, mask, dropout, causal, scale)
    if lower.options.get("cp_comm_type") == "a2a+p2p":
        return _hierarchical(node, lower, mask, dropout, causal, scale)
    if isinstance(meta.expects(node, lower.axis)[1], Shard):   # the keys stay split: the ring
        return _ring(node, lower, mask, dropout, causal, scale)
    if mask is not None and not lower.carries_grad(mask):
        return _masked(node, lower, mask, scale, dropout)
    if not causal:
        return None
    return lower.call(attention_all_gather,
                      (lower.remap(q), lower.remap(k), lower.remap(v), float(dropout), scale, bool(gqa),
                       lower.coord, lower.size),
                      node, pq, f"causal attention of this rank's query chunks against the keys before them "
                                f"(keys gathered over {lower.axis})")


def _masked(node: fx.Node, lower, mask, scale, dropout) -> fx.Node:
    """cp_comm_type="all_gather" under an explicit mask: the rank's queries against the
    gathered keys block by block, the blocks the mask leaves empty (a document mask's) not
    computed (ops/cp/masked.py masked_attention), attention dropout drawn per block as the ring's."""
    q, k, v = node.args[:3]
    if scale is None:
        scale = float(q.meta["val"].shape[-1]) ** -0.5
    pq = lower.placement(q)
    op = lower.call(torch.ops.fxtron.masked_attention.default,
                    (lower.remap(q), lower.remap(k), lower.remap(v), lower.remap(mask), float(scale), lower.size,
                     lower.coord, float(dropout or 0.0)),
                    node, pq, "attention of this rank's query chunks against the gathered keys, block by block, "
                              "the blocks the mask leaves empty skipped")
    val = node.meta.get("val")
    if val is not None:
        op.meta["val"] = (val, val.new_empty(val.shape[:-1], dtype=torch.float32), val.new_empty((1,), dtype=torch.int64))
        meta.set(op, meta.PLACEMENT, meta.get(op, meta.PLACEMENT).with_axis(lower.axis, (pq, pq, REPLICATE)))
    return lower.call(operator.getitem, (op, 0), node, pq, "the attention output")


def _local_heads(x: fx.Node, lower) -> int:
    """Heads (dim 1) of x on this rank before cp: the whole count over the other axes that
    split them (tp)."""
    heads = int(x.meta["val"].shape[1])
    for axis in lower.axes():
        p = lower.on(axis).placement(x)
        if axis != lower.axis and isinstance(p, Shard) and p.dim == 1:
            heads //= lower.on(axis).size
    return heads


def _ulysses(node: fx.Node, lower, mask, dropout, causal, scale) -> fx.Node:
    """cp_comm_type="a2a" (DeepSpeed-Ulysses): q, k and v go from the rank's sequence chunks of
    every head to every token of 1/cp of the heads (grouped-query keys and values before their
    heads are repeated), in natural order; the attention runs there, with its own mask and
    causality, its dropout drawn from the rank's own stream (its heads differ from every other
    rank's); the inverse all-to-all brings back the rank's chunks of every head."""
    q, k, v = node.args[:3]
    where = f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'})"
    if mask is not None and lower.carries_grad(mask):
        raise ParallelizeError(f"{where}: an attention mask that takes a gradient (a learned bias) under "
                               "cp_comm_type='a2a' is not supported; use cp_comm_type='all_gather'")
    k, v = ((r[0] if (r := head_repeat(t)) is not None else t) for t in (k, v))
    n = lower.size
    _check_heads(where, lower, q, k, n, "a2a", f"cp={n}")
    heads = Shard(1)

    def to_heads(t: fx.Node) -> fx.Node:
        a2a = lower.call(torch.ops.fxtron.cp_all_to_all.default, (lower.remap(t), 1, 2, n, lower.axis), t, heads,
                         f"Ulysses: %{t.name} from the rank's sequence chunks to all tokens of 1/{n} of the heads")
        return lower.call(torch.ops.fxtron.zigzag.default, (a2a, 2, 1, n, True), t, heads,
                          "the gathered sequence in natural order")

    q2, k2, v2 = to_heads(q), to_heads(k), to_heads(v)
    kwargs = {"scale": scale} if scale is not None else {}
    if k.meta["val"].shape[1] != q.meta["val"].shape[1]:
        kwargs["enable_gqa"] = True          # the key/value heads repeated inside the attention
    out = lower.call(aten.scaled_dot_product_attention.default,
                     (q2, k2, v2, None if mask is None else lower.remap(mask), float(dropout), bool(causal)), node, heads,
                     f"attention of 1/{n} of the heads over the whole sequence", kwargs=kwargs)
    out = lower.call(torch.ops.fxtron.zigzag.default, (out, 2, 1, n, False), node, heads,
                     "the sequence in the ranks' load-balanced order")
    return lower.call(torch.ops.fxtron.cp_all_to_all.default, (out, 2, 1, n, lower.axis), node,
                      lower.placement(q), "Ulysses: back to the rank's sequence chunks of every head")


def _check_heads(where: str, lower, q: fx.Node, k: fx.Node, n: int, comm: str, what: str) -> None:
    for name, t in (("query", q), ("key/value", k)):
        heads = _local_heads(t, lower)
        if heads % n:
            raise ParallelizeError(f"{where}: cp_comm_type={comm!r} splits the {name} heads over {n} cp ranks, and "
                                   f"this rank's {heads} {name} head(s) do not divide by {what}; use a "
                                   f"{what.split('=')[0]} that divides {heads}, or cp_comm_type='p2p' / 'all_gather'")


def _hierarchical(node: fx.Node, lower, mask, dropout, causal, scale) -> fx.Node:
    """cp_comm_type="a2a+p2p" (Megatron's hierarchical cp): Ulysses inside groups of
    cp_a2a_size consecutive cp ranks, the ring across the groups -- one op
    (ops/cp/hierarchical.py hierarchical_attention) over the cp axis and its two split group kinds."""
    q, k, v = node.args[:3]
    where = f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'})"
    if mask is not None and lower.carries_grad(mask):
        raise ParallelizeError(f"{where}: an attention mask that takes a gradient (a learned bias) under "
                               "cp_comm_type='a2a+p2p' is not supported; use cp_comm_type='all_gather'")
    a = int(lower.options["cp_a2a_size"])
    k, v = ((r[0] if (r := head_repeat(t)) is not None else t) for t in (k, v))
    _check_heads(where, lower, q, k, a, "a2a+p2p", f"cp_a2a_size={a}")
    if scale is None:
        scale = float(q.meta["val"].shape[-1]) ** -0.5
    inner, outer = f"{AXIS}/shard:{a}", f"{AXIS}/replicate:{a}"
    pq = lower.placement(q)
    op = lower.call(torch.ops.fxtron.hierarchical_attention.default,
                    (lower.remap(q), lower.remap(k), lower.remap(v), None if mask is None else lower.remap(mask),
                     float(scale), bool(causal), a, lower.size, lower.axis, inner, outer, float(dropout or 0.0)),
                    node, pq, f"a2a+p2p: all-to-all over groups of {a} cp ranks, the ring over the "
                              f"{lower.size // a} groups")
    val = node.meta.get("val")
    if val is not None:
        # (whole-sequence shapes: split on the sequence over cp, each has a rank's elements)
        op.meta["val"] = (val, val.new_empty(val.shape[:-1], dtype=torch.float32), q.meta["val"], k.meta["val"],
                          v.meta["val"], val, val.new_empty((1,), dtype=torch.int64))
        meta.set(op, meta.PLACEMENT, meta.get(op, meta.PLACEMENT).with_axis(lower.axis, (pq,) * 6 + (REPLICATE,)))
    return lower.call(operator.getitem, (op, 0), node, pq, "the attention output")


def _ring(node: fx.Node, lower, mask, dropout, causal, scale) -> fx.Node:
    """cp_comm_type="p2p": the keys stay split and travel around the ring (ops/cp/ring.py); attention
    dropout inside it, each block's mask from the rank's own stream."""
    q, k, v = node.args[:3]
    if mask is not None and lower.carries_grad(mask):
        raise ParallelizeError(
            f"node %{node.name} ({meta.get(node, meta.MODULE) or 'top level'}): an attention mask that takes a gradient "
            "(a learned bias) inside the cp ring is not supported; use cp_comm_type='all_gather'")
    if scale is None:
        scale = float(q.meta["val"].shape[-1]) ** -0.5
    # grouped-query attention: the un-repeated keys and values travel (the op repeats each block)
    k, v = ((r[0] if (r := head_repeat(t)) is not None else t) for t in (k, v))
    ring = lower.call(torch.ops.fxtron.ring_attention.default,
                      (lower.remap(q), lower.remap(k), lower.remap(v), None if mask is None else lower.remap(mask),
                       float(scale), bool(causal), lower.size, lower.axis, float(dropout or 0.0)),
                      node, lower.placement(q), f"attention over the cp ring: key blocks travel around {lower.axis}")
    val = node.meta.get("val")
    if val is not None:
        ring.meta["val"] = (val, val.new_empty(val.shape[:-1], dtype=torch.float32), val.new_empty((1,), dtype=torch.int64))
        meta.set(ring, meta.PLACEMENT, meta.get(ring, meta.PLACEMENT).with_axis(
            lower.axis, (lower.placement(q), lower.placement(q), REPLICATE)))
    return lower.call(operator.getitem, (ring, 0), node, lower.placement(q), "the attention output")


__all__ = ["AXIS", "COMM_TYPES", "cp_layout", "fuse_written_out_attention"]
