"""Ops, context parallel, attention with the keys gathered (cp_comm_type="all_gather", Llama 3's
choice).

`attention_all_gather(q, k, v, ...)` takes this rank's queries (its two chunks) and the whole
sequence's keys and values in natural order, and computes causal attention of each query chunk
against only the keys before it: the rank's score elements are (2n+1) c^2 for chunks of c
tokens, equal on every rank. Without dropout on CPU its blocks run on the flash kernel and
merge through their log-sum-exp (`_GatheredCausal`, blocks.py), with their own backward;
otherwise its backward is autograd's. The keys' gather before it is `gather_from_sequence`,
whose backward reduce-scatters dK and dV. Under an explicit mask, masked.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxtron.ops.cp.blocks import _acc, _additive, _block, _block_backward, _expand_kv, _merge, sdpa_like_output
from fxtron.ops.rng import draws_at, rng_call


def _causal_block_mask(rows: int, cols: int, offset: int, device) -> Tensor:
    """Query rows at positions offset + a against keys 0..cols-1: True where key <= query."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(offset)


@draws_at(3)
def attention_all_gather(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float | None,
                         enable_gqa: bool, rank: int, world: int, *, rng_region: str | None = None) -> Tensor:
    """Causal attention of this cp rank's queries against the whole sequence.

    In: q (B, H, 2c, D), the rank's two chunks (rank and 2*world-1-rank of 2*world, each c
    tokens); k, v (B, Hkv, 2*world*c, D), every position in natural order. Out: (B, H, 2c, D),
    equal to those rows of causal attention over the whole sequence. Each query chunk i is
    computed against keys [0, (i+1)c) only, under its block of the causal mask. With dropout,
    the masks are drawn from the program's `rng_region` stream (ops/rng.py: independent per cp
    rank, whose tokens differ). On CPU without dropout, each chunk's keys are two blocks --
    those before the chunk, whole, and the chunk's own under the square causal mask --
    computed by the flash kernel and merged through their log-sum-exp (_GatheredCausal), so no
    masked-out score is computed; otherwise scaled_dot_product_attention under the chunk's
    rows of the causal mask (on CUDA its memory-efficient kernel)."""
    if not dropout_p and q.device.type == "cpu":
        return _GatheredCausal.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, rank, world)
    c = q.shape[-2] // 2
    out = sdpa_like_output(q, v)
    for half, chunk in enumerate((rank, 2 * world - 1 - rank)):
        qi = q.narrow(-2, half * c, c)
        n_keys = (chunk + 1) * c
        # an additive mask in q's dtype: the CPU flash kernel takes it, a boolean one falls to math
        mask = _additive(_causal_block_mask(c, n_keys, chunk * c, q.device), q.dtype)
        args = (qi, k.narrow(-2, 0, n_keys), v.narrow(-2, 0, n_keys))
        kw = dict(attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        part = (rng_call(rng_region, F.scaled_dot_product_attention, *args, **kw) if dropout_p and rng_region
                else F.scaled_dot_product_attention(*args, **kw))
        out.narrow(-2, half * c, c).copy_(part)
    return out


def _gathered_pieces(rank: int, world: int, c: int):
    """Per query chunk of the rank: (its rows, [(key columns, causal?)...]) over the whole
    sequence's keys -- the keys before the chunk whole, the chunk's own under the causal mask."""
    for half, chunk in enumerate((rank, 2 * world - 1 - rank)):
        pieces = ([(slice(0, chunk * c), False)] if chunk else []) + [(slice(chunk * c, (chunk + 1) * c), True)]
        yield slice(half * c, (half + 1) * c), pieces


class _GatheredCausal(torch.autograd.Function):
    """attention_all_gather without dropout: blocks on the flash kernel, merged (see there)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, rank, world):
        c, heads = q.shape[-2] // 2, q.shape[1]
        kx, vx = _expand_kv(k, heads), _expand_kv(v, heads)
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc(q), device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
        for rows, pieces in _gathered_pieces(rank, world, c):
            for cols, causal in pieces:
                o, l = _block(q[..., rows, :], kx[..., cols, :], vx[..., cols, :], scale, None, causal)
                _merge(out[..., rows, :], lse[..., rows], o, l)
        result = sdpa_like_output(q, v)
        result.copy_(out)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.scale, ctx.rank, ctx.world = scale, rank, world
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        c, heads, hkv = q.shape[-2] // 2, q.shape[1], k.shape[1]
        kx, vx = _expand_kv(k, heads), _expand_kv(v, heads)
        dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        dk = torch.zeros(kx.shape, dtype=_acc(q), device=q.device)
        dv = torch.zeros(vx.shape, dtype=_acc(q), device=q.device)
        for rows, pieces in _gathered_pieces(ctx.rank, ctx.world, c):
            for cols, causal in pieces:
                a, b, d = _block_backward(dout[..., rows, :], q[..., rows, :], kx[..., cols, :], vx[..., cols, :],
                                          out[..., rows, :], lse[..., rows], ctx.scale, None, causal)
                dq[..., rows, :] += a
                dk[..., cols, :] += b
                dv[..., cols, :] += d
        if hkv != heads:                                         # grouped-query: sum the repeated heads
            dk, dv = (t.unflatten(1, (hkv, heads // hkv)).sum(2) for t in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


__all__ = ["attention_all_gather"]
