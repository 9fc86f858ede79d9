"""Ops, context parallel, the ring (cp_comm_type="p2p"): attention with the keys and values split.

`ring_attention`: each rank's (k, v) travels around the cp group by batch_isend_irecv while the
block in hand is computed (blocks.py), in the pieces the mask leaves (pieces.py), and the
blocks' partial results merge through their log-sum-exp; backward sends the key blocks around
again, their dK and dV accumulating on the way home. Attention dropout draws one seed per ring
from the program's random stream; each block's mask comes from that seed and the key block's
rank (`keep_mask`), the same in forward, backward and recomputation. The steps
(`_step_forward`, `_step_backward`) are shared with masked.py and hierarchical.py.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.cp.blocks import (_acc, _block, _block_backward, _expand_kv, _floor_keys, _keys, _lowest, _merge,
                                  sdpa_like_output)
from fxtron.ops.cp.pieces import _step_plan
from fxtron.ops.registry import Comm, OpSpec, register
from fxtron.ops.rng import draws_at, rng_call


@torch.library.custom_op("fxtron::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool,
                   world: int, group: str, dropout_p: float = 0.0, *, rng_region: str | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of this cp rank's queries over the whole sequence with the keys and values
    split: each rank's (k, v) travels around the cp group (`world` ranks of `group`) by
    batch_isend_irecv while the block in hand is computed, and the blocks' partial results
    merge through their log-sum-exp. q (B, H, 2c, D), k and v (B, Hkv, 2c, D): the rank's
    load-balanced chunks. `mask` (optional): the rows of the rank's queries against every key
    in natural order (B or 1, H or 1, 2c, S), or any shape that broadcasts to it as
    scaled_dot_product_attention's mask does ((2c, S), (H, 2c, S)); `causal`: the causal mask
    by position. Backward
    sends the key blocks around again, with their dK and dV accumulating on the way home.
    `dropout_p`: attention dropout, each block's mask drawn from a seed the op draws from the
    program's `rng_region` stream (`keep_mask`), regenerated in backward. Returns the output,
    laid out as scaled_dot_product_attention's, the rows' log-sum-exp (B, H, 2c) in fp32 and
    the dropout seed (1,), which backward reuses."""
    seed = _draw_seed(dropout_p, rng_region, q.device)
    out, lse = _ring_forward(q, k, v, mask, scale, causal, world, group, _drop(dropout_p, seed))
    return out, lse, seed


def _drop(dropout_p: float, seed: Tensor):
    return (float(dropout_p), int(seed.item())) if dropout_p else None


def keep_mask(seed: int, p: float, src: int, shape, device, dtype=torch.float32) -> Tensor:
    """Attention dropout's mask of the ring's block of cp rank `src`'s keys for a rank whose
    ring drew `seed`: the whole block (B, H, 2c, 2c) drawn from its own generator (the same in
    forward, backward and recomputation, whichever of it is computed), kept entries 1/(1-p),
    dropped ones 0."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + src) % (2 ** 63))
    keep = torch.rand(shape, generator=g, device=device) >= p
    return keep.to(dtype) / (1.0 - p)


def _draw_seed(dropout_p: float, rng_region: str | None, device) -> Tensor:
    """The seed of an attention's dropout masks, drawn from the program's `rng_region` stream
    (independent per cp rank; ops/rng.py); zero without dropout."""
    if not dropout_p:
        return torch.zeros(1, dtype=torch.int64, device=device)
    draw = functools.partial(torch.randint, 0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    return rng_call(rng_region, draw) if rng_region else draw()


def _step(q, kv, rank, src, world, causal, mask, drop=None) -> list[tuple]:
    """One block of the ring, planned: its pieces, each (batch rows, query rows, key columns,
    the piece's keys and values with grouped-query heads repeated, its mask or None, whether it
    is the causal diagonal, dropout's scaled keep-mask of it or None) -- none where the mask
    leaves the block empty. `drop`: (p, seed) with attention dropout."""
    c, heads = q.shape[-2] // 2, q.shape[1]
    pieces, m = _step_plan(rank, src, world, c, causal, mask, 2 * c * world, q.device)
    if not pieces:
        return []
    diag = isinstance(m, str)
    keep = None if drop is None else keep_mask(drop[1], drop[0], src, (q.shape[0], heads, 2 * c, 2 * c), q.device,
                                               _acc(q))
    out = []
    for b, rows, cols in pieces:
        kb, vb = (_expand_kv(t[b], heads)[..., cols, :] for t in kv)
        mb = None if diag or m is None else (m[b] if m.shape[0] > 1 else m)[..., rows, :][..., cols]
        out.append((b, rows, cols, kb, vb, mb, diag, None if keep is None else keep[b][..., rows, :][..., cols]))
    return out


def _step_forward(q, kv, rank, src, world, causal, mask, scale, out, lse, drop=None) -> None:
    """One block of the ring: this rank's queries against the keys and values `kv` of cp rank
    `src`'s positions, merged into `out` and `lse` piece by piece (nothing where the mask leaves
    it empty)."""
    for b, rows, _, kb, vb, m, diag, keep in _step(q, kv, rank, src, world, causal, mask, drop):
        o, l = _block(q[b][..., rows, :], kb, vb, scale, m, diag, keep=keep)
        additive = m is not None and m.dtype != torch.bool
        ob, lb = out[b][..., rows, :], lse[b][..., rows]        # views of a run; copies of grouped rows
        _merge(ob, lb, o, l, _keys(m) if additive else None, _lowest(m.dtype) if additive else float("-inf"))
        if not isinstance(rows, slice):
            out[b][..., rows, :], lse[b][..., rows] = ob, lb


def _step_backward(dout, q, kv, out, lse, rank, src, world, causal, mask, scale, dq, dkv, drop=None) -> None:
    """The gradients of one block: dq accumulated, the block's dK and dV added into `dkv`
    (nothing where the mask leaves it empty)."""
    heads, hkv = q.shape[1], kv[0].shape[1]
    norm = _floor_keys(mask, lse)
    for b, rows, cols, kb, vb, m, diag, keep in _step(q, kv, rank, src, world, causal, mask, drop):
        dqb, dk, dv = _block_backward(dout[b][..., rows, :], q[b][..., rows, :], kb, vb, out[b][..., rows, :],
                                      lse[b][..., rows], scale, m, diag, keep=keep,
                                      norm=None if norm is None else norm.expand_as(lse)[b][..., rows])
        dq[b][..., rows, :] += dqb
        if hkv != heads:                                     # grouped-query: sum the repeated heads
            dk = dk.unflatten(1, (hkv, heads // hkv)).sum(2)
            dv = dv.unflatten(1, (hkv, heads // hkv)).sum(2)
        dkv[0][b][..., cols, :] += dk
        dkv[1][b][..., cols, :] += dv


def _ring_forward(q, k, v, mask, scale, causal, world, group, drop=None):
    pg = T.resolve(group)
    T.check_world(pg, world, "ring_attention", group)
    rank = pg.rank() if pg is not None else 0
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    for i in range(world):
        src = (rank - i) % world
        pending = T.start_ring_exchange(kv, pg) if i + 1 < world else None   # the next block, while this computes
        _step_forward(q, kv, rank, src, world, causal, mask, scale, out, lse, drop)
        if pending is not None:
            works, kv = pending
            for w in works:
                w.wait()
    result = sdpa_like_output(q, v)
    result.copy_(_normed(out, mask, lse))
    return result, lse


def _normed(out: Tensor, mask: Tensor | None, lse: Tensor) -> Tensor:
    """The merged output, the rows that see no key under an additive mask divided by their keys."""
    norm = _floor_keys(mask, lse)
    return out if norm is None else out / norm.unsqueeze(-1)


@ring_attention.register_fake
def _(q, k, v, mask, scale, causal, world, group, dropout_p=0.0, *, rng_region=None):
    return sdpa_like_output(q, v), q.new_empty(q.shape[:-1], dtype=_acc(q)), q.new_empty((1,), dtype=torch.int64)


def _ring_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, scale, causal, world, group, dropout_p = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.scale, ctx.causal, ctx.world, ctx.group, ctx.dropout_p = scale, causal, world, group, dropout_p


def _ring_backward(ctx, dout, *_):
    q, k, v, mask, out, lse, seed = ctx.saved_tensors
    scale, causal, world = ctx.scale, ctx.causal, ctx.world
    drop = _drop(ctx.dropout_p, seed)
    pg = T.resolve(ctx.group)
    rank = pg.rank() if pg is not None else 0
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(t.shape, dtype=_acc(q), device=t.device) for t in (k, v)]
    for i in range(world):
        src = (rank - i) % world
        pending = T.start_ring_exchange(kv, pg) if i + 1 < world else None
        _step_backward(dout, q, kv, out, lse, rank, src, world, causal, mask, scale, dq, dkv, drop)
        # this block's dK, dV go on with it: the next rank adds its share, the owner gets the sum
        if world > 1:
            works, dkv = T.start_ring_exchange(dkv, pg)
            for w in works:
                w.wait()
        if pending is not None:
            works, kv = pending
            for w in works:
                w.wait()
    # after `world` steps each rank holds the dK, dV of its own block, every rank's share in it
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)
draws_at(8)(torch.ops.fxtron.ring_attention.default)
register(OpSpec("ring_attention", axis_arg=7, forward=Comm("send_recv", "ring"), backward=Comm("send_recv", "ring")))


__all__ = ["keep_mask", "ring_attention"]
