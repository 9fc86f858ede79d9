"""Ops: context parallel -- the sequence split over the cp ranks with Megatron's load balancing,
and attention across the split.

The layout. A sequence of F tokens over n cp ranks is viewed as 2n equal chunks and rank r
holds chunks r and 2n-1-r, in that order (Megatron's get_batch_on_this_cp_rank): under a causal
mask chunk i attends to i+1 chunks, so every rank's queries see 2n+1 chunks of keys. `zigzag`
reorders a dim so that a plain split over n ranks gives this layout (chunks in the order 0,
2n-1, 1, 2n-2, ...), and its inverse restores the natural order after an all-gather. A dim of
k blocks (batch and sequence folded into one) is reordered block by block. It moves no data
between ranks.

Attention with the keys gathered (cp_comm_type="all_gather", Llama 3's choice):
`attention_all_gather(q, k, v, ...)` takes this rank's queries (its two chunks) and the whole
sequence's keys and values in natural order, and computes causal attention of each query chunk
against only the keys before it: the rank's score elements are (2n+1) c^2 for chunks of c
tokens, equal on every rank. Its backward is autograd's; the keys' gather before it is
`gather_from_sequence`, whose backward reduce-scatters dK and dV.

Attention over a head split (cp_comm_type="a2a", DeepSpeed-Ulysses): `cp_all_to_all` turns
q, k and v from the rank's sequence chunks of every head into every token of 1/n of the heads;
the sequence is put in natural order (zigzag), attention runs as the model wrote it, and the
inverse all-to-all brings the rank's chunks of every head back.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from fxtron.ops import transport as T
from fxtron.ops.registry import Comm, OpSpec, register
from fxtron.ops.rng import draws_at, rng_call


def chunk_order(world: int) -> list[int]:
    """The chunks of a load-balanced dim in the order the ranks hold them: rank r's pair
    (r, 2*world-1-r) at position 2r, 2r+1. world=2: [0, 3, 1, 2]."""
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


def positions(seq: int, world: int, rank: int) -> Tensor:
    """The global positions of the tokens cp rank `rank` of `world` holds of a sequence of
    `seq`: chunks rank and 2*world-1-rank of 2*world. seq=8, world=2, rank=0: [0, 1, 6, 7]."""
    if seq % (2 * world):
        raise ValueError(f"a sequence of {seq} does not split into 2 x cp = {2 * world} chunks")
    c = seq // (2 * world)
    a, b = rank * c, (2 * world - 1 - rank) * c
    return torch.cat([torch.arange(a, a + c), torch.arange(b, b + c)])


def document_order(documents: Tensor, world: int) -> Tensor:
    """(B, S) int64: each row of token positions reordered by the chunk of its document a token
    falls in, stably (Megatron's THD load balancing without padding, passes/cp_documents.py). A
    token at offset o of a document of L tokens (the tokens of the row with its id) is in chunk
    floor(2 world o / L); the load-balanced split of the reordered row then gives rank r about
    chunks r and 2 world - 1 - r of every document. documents=[[0, 0, 0, 0, 1, 1, 1, 1]],
    world=2: [[0, 4, 1, 5, 2, 6, 3, 7]]."""
    rows = []
    for row in documents:
        _, doc, counts = torch.unique(row, return_inverse=True, return_counts=True)
        grouped = torch.argsort(doc, stable=True)                 # each document's tokens, in order
        start = (torch.cumsum(counts, 0) - counts)[doc[grouped]]
        offset = torch.empty_like(grouped)
        offset[grouped] = torch.arange(row.numel(), device=row.device) - start
        chunk = torch.div(2 * world * offset, counts[doc], rounding_mode="floor")
        rows.append(torch.argsort(chunk, stable=True))
    return torch.stack(rows) if rows else documents.new_zeros(documents.shape, dtype=torch.long)


def document_positions(documents: Tensor, world: int, rank: int) -> Tensor:
    """(B, S / world): the row positions of the tokens cp rank `rank` holds when each row is
    reordered by its documents (`document_order`), in the order the rank holds them."""
    pick = positions(documents.shape[1], world, rank).to(documents.device)
    return document_order(documents, world)[:, pick]


def _reorder(x: Tensor, dim: int, blocks: int, world: int, order: list[int]) -> Tensor:
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % (blocks * 2 * world):
        raise ValueError(f"fxtron::zigzag: dim {dim} of size {size} does not split into {blocks} block(s) of "
                         f"2 x cp = {2 * world} chunks")
    idx = torch.tensor(order, device=x.device)
    y = x.unflatten(dim, (blocks, 2 * world, size // (blocks * 2 * world)))
    return y.index_select(dim + 1, idx).flatten(dim, dim + 2)


def _order(world: int, inverse: bool) -> list[int]:
    order = chunk_order(world)
    if not inverse:
        return order
    back = [0] * len(order)
    for i, c in enumerate(order):
        back[c] = i
    return back


@torch.library.custom_op("fxtron::zigzag", mutates_args=())
def zigzag(x: Tensor, dim: int, blocks: int, world: int, inverse: bool) -> Tensor:
    """Reorder `dim` (k=`blocks` blocks, each 2*world chunks) so that a plain split over
    `world` ranks gives the load-balanced layout (inverse=False), or back to natural order
    (inverse=True). Backward: the opposite reordering of the gradient."""
    if world == 1:
        return x.clone()
    return _reorder(x, dim, blocks, world, _order(world, inverse))


@zigzag.register_fake
def _(x, dim, blocks, world, inverse):
    return torch.empty_like(x)


def _zigzag_bwd(ctx, grad):
    return zigzag(grad, ctx.dim, ctx.blocks, ctx.world, not ctx.inverse), None, None, None, None


def _zigzag_setup(ctx, inputs, output):
    _, ctx.dim, ctx.blocks, ctx.world, ctx.inverse = inputs


zigzag.register_autograd(_zigzag_bwd, setup_context=_zigzag_setup)
register(OpSpec("zigzag"))


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


def sdpa_like_output(q: Tensor, v: Tensor) -> Tensor:
    """An empty (B, H, Sq, Dv) output laid out as scaled_dot_product_attention lays out its own
    ((B, Sq, H, Dv) in memory): the graph may view its transpose without a copy."""
    b, h, s, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# the ring (cp_comm_type="p2p")


def _additive(mask: Tensor | None, dtype) -> Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _acc(q: Tensor) -> torch.dtype:
    """The dtype the ring accumulates in: fp32, or the inputs' if wider (float64 in tests)."""
    return torch.promote_types(q.dtype, torch.float32)


def _fused(q: Tensor, v: Tensor) -> bool:
    """Does a block run on torch's CPU flash kernel (with its log-sum-exp)?"""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _block(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None,
           causal: bool, fused: bool | None = None, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q against one block of keys: (out (B,H,Lq,Dv), lse (B,H,Lq)) in fp32 (or
    the inputs' wider dtype); a row that sees no key has lse -inf and out 0. `causal`: the top-left causal mask
    (the diagonal step: the rank's own chunks against themselves). On CPU torch's flash
    kernel, which returns the log-sum-exp; elsewhere (or `fused=False`) the same in plain
    matmuls (fp32), also where the values' head size differs from the queries' (DeepSeek's MLA),
    which the flash kernel does not take. `keep`: attention dropout's mask of the block, scaled
    by 1/(1-p) (`_keep`): the probabilities are dropped, the log-sum-exp is the undropped
    softmax's (plain matmuls)."""
    if keep is None and (_fused(q, v) if fused is None else fused):
        bias = _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        lse = lse.to(_acc(q))
        if bias is not None:        # the kernel gives a row that sees no key lse 0: make it -inf
            dead = torch.isinf(bias).all(-1) & (bias < 0).all(-1)
            lse = lse.masked_fill(dead.expand_as(lse), float("-inf"))
        return torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, out.to(_acc(q))), lse
    acc = _acc(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    keys = _floor_keys(mask, lse)            # a row that sees no key: the mean of its keys, as the flash kernel's
    if keys is not None:
        p = p / keys.unsqueeze(-1)
    return torch.matmul(p if keep is None else p * keep, v.to(acc)), lse


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                    mask: Tensor | None, causal: bool, fused: bool | None = None,
                    keep: Tensor | None = None, norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, in fp32 (or wider), given the rows' final output and log-sum-exp (the
    block's probabilities are exp(scores - lse): its share of the whole softmax). With dropout's
    scaled mask `keep` (FlashAttention-2's backward): dV = (P*keep)^T dO, and the scores'
    gradient P * ((dO V^T) * keep - rowsum(dO * O)), O the dropped output. `norm` (B, H, Lq): what
    each row's exp(scores - lse) is divided by (`_floor_keys`: a row that sees no key)."""
    if keep is None and norm is None and (_fused(q, v) if fused is None else fused):
        lse = torch.where(torch.isinf(lse), 0.0, lse)    # a row that sees no key anywhere: no gradient
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(q.dtype) if q.dtype == torch.float64 else lse, 0.0,
            causal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq.to(_acc(q)), dk.to(_acc(q)), dv.to(_acc(q))
    acc = _acc(q)
    qf, kf, vf, do = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    if norm is not None:
        p = p / norm.to(acc).unsqueeze(-1)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    dv = torch.matmul((p if keep is None else p * keep).transpose(-1, -2), do)
    ds = p * ((dp if keep is None else dp * keep) - delta)
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, dv


def _merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor, keys: Tensor | None = None,
           low: float = float("-inf")) -> None:
    """Fold a block's (o, l) into the running (out, lse) in place (online softmax). `keys`: the
    block's keys per row under an additive mask whose lowest value is below `low`: a row whose
    every key is at that value (a query that sees none) has softmax uniform over its keys, but
    its log-sum-exp cannot carry log(keys) at -3.4e38 -- such rows add the blocks' means
    weighted by their keys, divided by the row's keys at the end (`_floor_keys`)."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), 0.0, new)
    a = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - safe))
    b = torch.where(torch.isinf(l), 0.0, torch.exp(l - safe))
    if keys is not None:
        b = torch.where((l <= low) & (new <= low) & ~torch.isinf(l), keys.to(b.dtype), b)
    out.mul_(a.unsqueeze(-1)).add_(o * b.unsqueeze(-1))
    lse.copy_(new)


CAUSAL = "causal"


def _step_plan(rank: int, src: int, world: int, c: int, causal: bool, mask: Tensor | None, seq: int, device):
    """For the key block of cp rank `src`: the pieces it is computed in -- (batch rows, query
    rows of this rank, key columns of the block) -- and the mask between them (Megatron's ring
    under the load-balanced split: its own block under the causal mask; an earlier rank's first
    chunk against all queries; a later rank's whole block against the second query chunk only).
    Under an explicit mask, one piece per run of rows that see the same keys (`rectangles`): a
    document mask's block is computed document by document, no pair of documents that never
    meet, as a variable-length kernel computes it; none where the block is empty."""
    whole, both = slice(None), slice(0, 2 * c)
    if mask is not None:                       # an explicit mask: its columns of src's positions
        m = mask.index_select(-1, positions(seq, world, src).to(device))
        return _pieces(m, _floor(mask)), m
    if not causal:
        return [(whole, both, both)], None
    if src == rank:            # chunks (r, 2n-1-r) against themselves: exactly the top-left causal mask
        return [(whole, both, both)], CAUSAL
    if src < rank:
        return [(whole, both, slice(0, c))], None
    return [(whole, slice(c, 2 * c), both)], None


def _lowest(dtype: torch.dtype) -> float:
    """At or below this an additive mask's entry (or a row's log-sum-exp) is at the dtype's lowest
    value, finfo.min, which transformers' eager masks add: half of it."""
    return torch.finfo(dtype).min / 2


def _keys(mask: Tensor) -> Tensor:
    """Each row's keys under an additive mask: its entries above -inf."""
    return (mask > float("-inf")).sum(-1)


def _floor_keys(mask: Tensor | None, lse: Tensor) -> Tensor | None:
    """Under an additive mask, the rows whose every key is at the mask's lowest value (a query
    that sees no key: softmax is uniform over its keys, transformers' eager masks) get their
    number of keys, the others 1 (B, H, rows); None where there are none. Forward divides
    those rows' summed means by it, backward the probabilities exp(s - lse)."""
    if mask is None or mask.dtype == torch.bool:
        return None
    at_floor = (lse <= _lowest(mask.dtype)) & ~torch.isinf(lse)
    if not bool(at_floor.any()):
        return None
    return torch.where(at_floor, _keys(mask).to(lse.dtype), 1.0)


def _floor(mask: Tensor) -> float:
    """The value at or below which an additive mask's entry hides its key: -inf, and also the
    dtype's lowest (transformers' eager masks add finfo.min) where every query row of the mask
    sees some key above it -- then such an entry's probability is exactly 0 (exp underflows),
    while a row that sees none gets SDPA's uniform weights over its keys, which only computing
    every block gives."""
    if mask.dtype == torch.bool:
        return 0.0
    low = _lowest(mask.dtype)
    return low if bool((mask > low).any(-1).all()) else float("-inf")


Index = "slice | Tensor"     # a piece's rows or columns: a run, or positions (int64) in the block


def _pieces(m: Tensor, floor: float) -> list[tuple[slice, Index, Index]]:
    """The pieces of a mask block (B or 1, H or 1, rows, cols) a rank computes: `rectangles` of
    its entries attended (an additive mask: above `floor`) in any head, over its rows and
    columns grouped by what they attend (`grouped`) -- for all batch rows at once where every
    row's are the same, else row by row."""
    live = (m if m.dtype == torch.bool else m > floor).any(1)
    per = [_grouped_rectangles(b) for b in live]
    if all(_same(p, per[0]) for p in per[1:]):
        return [(slice(None), rows, cols) for rows, cols in per[0]]
    return [(slice(b, b + 1), rows, cols) for b, p in enumerate(per) for rows, cols in p]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        type(x) is type(y) and (x == y if isinstance(x, slice) else torch.equal(x, y))
        for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def grouped(live: Tensor) -> tuple[Tensor, Tensor]:
    """Orders of a block's rows and columns (rows, cols) that put each document's together: rows
    by the first column they attend, columns by the first of those rows attending them, both
    stable. A block in position order is left as it is; one whose rows hold the chunks of many
    documents one after the other (the documents' order, passes/cp_documents.py) gets each
    document's rows and columns in one run, which `rectangles` computes as one piece."""
    n_rows, n_cols = live.shape
    first = torch.where(live, torch.arange(n_cols, device=live.device), n_cols).amin(-1)
    rows = torch.argsort(first, stable=True)
    at = torch.empty_like(rows)
    at[rows] = torch.arange(n_rows, device=live.device)
    cols = torch.argsort(torch.where(live, at[:, None], n_rows).amin(0), stable=True)
    return rows, cols


def _index(order: Tensor, run: slice) -> Index:
    """The block's positions of a run of the grouped order: a slice where they are one run."""
    picked = order[run]
    if picked.numel() and int(picked[-1]) - int(picked[0]) == picked.numel() - 1 and \
            bool((picked.diff() == 1).all()):
        return slice(int(picked[0]), int(picked[-1]) + 1)
    return picked


def _grouped_rectangles(live: Tensor) -> list[tuple[Index, Index]]:
    rows, cols = grouped(live)
    pieces = rectangles(live[rows][:, cols], SMALL_PIECE)
    return [(_index(rows, r), _index(cols, c)) for r, c in pieces]


#: score elements under which neighbouring pieces of a block are computed as one (many documents
#: of a few tokens -- padding, each token its own -- would otherwise be as many kernel calls)
SMALL_PIECE = 64 * 64


def rectangles(live: Tensor, small: int = SMALL_PIECE) -> list[tuple[slice, slice]]:
    """A block's pieces: (row run, column span) covering every True entry of `live` (rows,
    cols), each row in at most one. A run of rows goes on while the next row's first column
    lies before the furthest column seen so far: over rows and columns in position order a
    causal document mask gives one piece per document (its rows against its columns), the work
    a variable-length kernel does, where a dense block computes every pair of documents.
    Neighbouring pieces whose span together holds at most `small` elements are one."""
    alive = live.any(-1)
    if not bool(alive.any()):
        return []
    n_rows, n_cols = live.shape
    col = torch.arange(n_cols, device=live.device)
    lo = torch.where(live, col, n_cols).amin(-1)
    hi = torch.where(live, col + 1, 0).amax(-1)
    reach = hi.cummax(0).values
    before = F.pad(alive[:-1], (1, 0), value=False)
    start = alive & (~before | (lo >= F.pad(reach[:-1], (1, 0), value=0)))
    rows = torch.nonzero(alive).flatten()
    group = (start.cumsum(0) - 1)[rows]
    n = int(start.sum())

    def reduce(values, how, init):
        return torch.full((n,), init, dtype=torch.long, device=live.device).scatter_reduce(
            0, group, values, how, include_self=False).tolist()
    first, last = reduce(rows, "amin", n_rows), reduce(rows, "amax", 0)
    lo, hi = reduce(lo[rows], "amin", n_cols), reduce(hi[rows], "amax", 0)
    out: list[list[int]] = []
    for a, b, x, y in zip(first, last, lo, hi):
        if out and (b + 1 - out[-1][0]) * (max(y, out[-1][3]) - min(x, out[-1][2])) <= small:
            out[-1] = [out[-1][0], b + 1, min(x, out[-1][2]), max(y, out[-1][3])]
        else:
            out.append([a, b + 1, x, y])
    return [(slice(a, b), slice(x, y)) for a, b, x, y in out]


def ring_blocks(mask: Tensor | None, causal: bool, world: int, rank: int) -> list[tuple[int, int]]:
    """The blocks cp rank `rank`'s ring computes, one per step: (the key block's rank, the score
    elements computed per head, summed over the mask's batch rows) -- 0 where the block is
    skipped. `mask`: the rank's query rows against every key (B or 1, H or 1, 2c, S), as the ring
    takes it; None: the causal plan (or every block whole), counted in chunks (c = 1)."""
    c = (mask.shape[-2] // 2) if mask is not None else 1
    batch = mask.shape[0] if mask is not None else 1
    out = []
    for i in range(world):
        src = (rank - i) % world
        pieces, _ = _step_plan(rank, src, world, c, causal, mask, 2 * c * world, torch.device("cpu"))
        span = lambda s, n: len(range(*s.indices(n))) if isinstance(s, slice) else len(s)  # noqa: E731
        out.append((src, sum(span(b, batch) * span(r, 2 * c) * span(k, 2 * c) for b, r, k in pieces)))
    return out


def _expand_kv(k: Tensor, heads: int) -> Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


@torch.library.custom_op("fxtron::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool,
                   world: int, group: str, dropout_p: float = 0.0, *, rng_region: str | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of this cp rank's queries over the whole sequence with the keys and values
    split: each rank's (k, v) travels around the cp group (`world` ranks of `group`) by
    batch_isend_irecv while the block in hand is computed, and the blocks' partial results
    merge through their log-sum-exp. q (B, H, 2c, D), k and v (B, Hkv, 2c, D): the rank's
    load-balanced chunks. `mask` (optional): the rows of the rank's queries against every key
    in natural order (B or 1, H or 1, 2c, S); `causal`: the causal mask by position. Backward
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


# ---------------------------------------------------------------------------------------------
# all_gather under an explicit mask (a document mask): the ring's blocks, without the ring


@torch.library.custom_op("fxtron::masked_attention", mutates_args=())
def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, world: int, rank: int,
                     dropout_p: float = 0.0, *, rng_region: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """This cp rank's queries (its load-balanced chunks, B, H, 2c, D) against the whole
    sequence's keys and values (gathered, natural order; grouped-query heads un-repeated) under
    `mask` (the rows of the rank's queries against every key), block by block as the ring
    computes them -- the keys of each rank's chunks in turn -- so that the blocks a document
    mask leaves empty are not computed. `dropout_p`: attention dropout, each block's mask as
    the ring draws it (`keep_mask`). Returns the output, laid out as
    scaled_dot_product_attention's, the rows' log-sum-exp and the dropout seed, which backward
    reuses."""
    seed = _draw_seed(dropout_p, rng_region, q.device)
    drop = _drop(dropout_p, seed)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)
    seq = k.shape[-2]
    for src in range(world):
        at = positions(seq, world, src).to(q.device)
        _step_forward(q, [k.index_select(-2, at), v.index_select(-2, at)], rank, src, world, False, mask, scale,
                      out, lse, drop)
    result = sdpa_like_output(q, v)
    result.copy_(_normed(out, mask, lse))
    return result, lse, seed


@masked_attention.register_fake
def _(q, k, v, mask, scale, world, rank, dropout_p=0.0, *, rng_region=None):
    return sdpa_like_output(q, v), q.new_empty(q.shape[:-1], dtype=_acc(q)), q.new_empty((1,), dtype=torch.int64)


def _masked_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, scale, world, rank, dropout_p = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.scale, ctx.world, ctx.rank, ctx.dropout_p = scale, world, rank, dropout_p


def _masked_backward(ctx, dout, *_):
    q, k, v, mask, out, lse, seed = ctx.saved_tensors
    drop = _drop(ctx.dropout_p, seed)
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=_acc(q), device=t.device) for t in (k, v))
    seq = k.shape[-2]
    for src in range(ctx.world):
        at = positions(seq, ctx.world, src).to(q.device)
        dkv = [torch.zeros(k.shape[:-2] + (len(at), k.shape[-1]), dtype=_acc(q), device=q.device),
               torch.zeros(v.shape[:-2] + (len(at), v.shape[-1]), dtype=_acc(q), device=q.device)]
        _step_backward(dout, q, [k.index_select(-2, at), v.index_select(-2, at)], out, lse, ctx.rank, src, ctx.world,
                       False, mask, ctx.scale, dq, dkv, drop)
        dk.index_add_(-2, at, dkv[0])
        dv.index_add_(-2, at, dkv[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


masked_attention.register_autograd(_masked_backward, setup_context=_masked_setup)
draws_at(7)(torch.ops.fxtron.masked_attention.default)
register(OpSpec("masked_attention"))


# ---------------------------------------------------------------------------------------------
# Ulysses (cp_comm_type="a2a"): from a sequence split to a head split and back


@torch.library.custom_op("fxtron::cp_all_to_all", mutates_args=())
def cp_all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, world: int, group: str) -> Tensor:
    """DeepSpeed-Ulysses' all-to-all over the cp group: x cut into `world` equal parts along
    `scatter_dim`, part j sent to rank j; the parts every rank sent this one, in rank order,
    joined along `gather_dim`. (B, H, S/n, D) with scatter 1, gather 2 -> (B, H/n, S, D), the
    sequence in the ranks' order (load-balanced chunks: zigzag restores it). Backward: the
    inverse all-to-all (the dims swapped)."""
    pg = T.resolve(group)
    T.check_world(pg, world, "cp_all_to_all", group)
    return _a2a(x, scatter_dim, gather_dim, world, pg)


def _a2a(x: Tensor, scatter_dim: int, gather_dim: int, world: int, pg) -> Tensor:
    if pg is None:
        return x.clone()
    parts = torch.stack(x.chunk(world, dim=scatter_dim))          # (world, ...) in rank order
    got = T.all_to_all_single(parts, [1] * world, [1] * world, pg)
    out = _laid_out(x, scatter_dim, gather_dim, world)
    return out.copy_(torch.cat(got.unbind(0), dim=gather_dim))


def _laid_out(x: Tensor, scatter_dim: int, gather_dim: int, world: int) -> Tensor:
    """The empty output: x's shape with scatter_dim / world and gather_dim x world. Heads
    gathered back (gather_dim before scatter_dim) lie in memory after the sequence, as
    attention's own output (B, H, S, D) lies over (B, S, H, D): the model's transpose and view
    after the attention rely on it."""
    shape = list(x.shape)
    shape[scatter_dim] //= world
    shape[gather_dim] *= world
    order = list(range(x.dim()))
    if gather_dim < scatter_dim:
        order[gather_dim], order[scatter_dim] = scatter_dim, gather_dim
    back = [order.index(d) for d in range(x.dim())]
    return x.new_empty([shape[d] for d in order]).permute(back)


@cp_all_to_all.register_fake
def _(x, scatter_dim, gather_dim, world, group):
    return _laid_out(x, scatter_dim, gather_dim, world)


def _a2a_bwd(ctx, grad):
    return cp_all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.world, ctx.group), None, None, None, None


def _a2a_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.world, ctx.group = inputs


cp_all_to_all.register_autograd(_a2a_bwd, setup_context=_a2a_setup)
register(OpSpec("cp_all_to_all", axis_arg=4, forward=Comm("all_to_all", "input"),
                backward=Comm("all_to_all", "grad_output")))


# ---------------------------------------------------------------------------------------------
# a2a+p2p (Megatron's hierarchical cp): Ulysses inside groups of k consecutive cp ranks, the
# ring across the groups


def _to_heads(x: Tensor, k: int, pg) -> Tensor:
    """(B, H, 2c, D) of this rank's chunks -> (B, H/k, 2kc, D): all the group's tokens of 1/k
    of the heads, in the ring's layout over the groups. Group g of k consecutive ranks holds
    chunks gk..gk+k-1 and 2n-k-gk..2n-1-gk of 2n; the all-to-all joins them in the order
    0, 2k-1, 1, 2k-2, ... of those 2k, which zigzag's inverse over k puts in order: super-chunk
    g then super-chunk 2m-1-g of 2m (m = n/k groups), the load-balanced layout of the ring
    over the groups."""
    return _reorder(_a2a(x.contiguous(), 1, 2, k, pg), 2, 1, k, _order(k, True))


def _from_heads(x: Tensor, k: int, pg) -> Tensor:
    return _a2a(_reorder(x, 2, 1, k, _order(k, False)).contiguous(), 2, 1, k, pg)


def _group_mask(mask: Tensor | None, heads: int, k: int, inner: int, m: int, outer: int) -> Tensor | None:
    """The whole mask's rows of the group's queries (super-chunks `outer` and 2m-1-outer), and
    its heads of this rank's 1/k where it has a head per query head."""
    if mask is None:
        return None
    rows = mask.index_select(-2, positions(mask.shape[-2], m, outer).to(mask.device))
    if rows.dim() == 4 and rows.shape[1] == heads and heads > 1:
        rows = rows.narrow(1, inner * heads // k, heads // k)
    return rows


@torch.library.custom_op("fxtron::hierarchical_attention", mutates_args=())
def hierarchical_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool,
                           a2a_size: int, world: int, group: str, inner: str, outer: str, dropout_p: float = 0.0,
                           *, rng_region: str | None = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """cp_comm_type="a2a+p2p" over `world` cp ranks (`group`): inside each group of `a2a_size`
    consecutive ranks (`inner`) an all-to-all turns q, k and v (the rank's load-balanced chunks
    of every head, grouped-query keys un-repeated) into the group's tokens of 1/a2a_size of the
    heads; the ring of ring_attention runs over the world / a2a_size groups (`outer`: the
    ranks at this one's place in every group), and the inverse all-to-all brings this rank's
    chunks of every head back. `mask`: the whole mask (every query against every key, in
    natural order), or None. `dropout_p`: attention dropout inside the ring, as ring_attention
    draws it. Returns the output, laid out as scaled_dot_product_attention's, and what backward
    reuses: the rows' log-sum-exp, q, k, v and the output in the head split, and the dropout
    seed."""
    pin, pout = T.resolve(inner), T.resolve(outer)
    T.check_world(T.resolve(group), world, "hierarchical_attention", group)
    T.check_world(pin, a2a_size, "hierarchical_attention", inner)
    m = world // a2a_size
    T.check_world(pout, m, "hierarchical_attention", outer)
    q2, k2, v2 = (_to_heads(t, a2a_size, pin) for t in (q, k, v))
    rows = _group_mask(mask, q.shape[1], a2a_size, pin.rank() if pin is not None else 0, m,
                       pout.rank() if pout is not None else 0)
    seed = _draw_seed(dropout_p, rng_region, q.device)
    out2, lse = _ring_forward(q2, k2, v2, rows, scale, causal, m, outer, _drop(dropout_p, seed))
    result = sdpa_like_output(q, v)
    result.copy_(_from_heads(out2, a2a_size, pin))
    return result, lse, q2, k2, v2, out2, seed


def _split_heads(x: Tensor, k: int) -> Tensor:
    shape = list(x.shape)
    shape[1] //= k
    shape[2] *= k
    return x.new_empty(shape)


@hierarchical_attention.register_fake
def _(q, k, v, mask, scale, causal, a2a_size, world, group, inner, outer, dropout_p=0.0, *, rng_region=None):
    q2 = _split_heads(q, a2a_size)
    return (sdpa_like_output(q, v), q2.new_empty(q2.shape[:-1], dtype=_acc(q)), q2,
            _split_heads(k, a2a_size), _split_heads(v, a2a_size), _split_heads(sdpa_like_output(q, v), a2a_size),
            q.new_empty((1,), dtype=torch.int64))


def _hierarchical_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, scale, causal, a2a_size, world, group, inner, outer, dropout_p = inputs
    _, lse, q2, k2, v2, out2, seed = output
    ctx.save_for_backward(q2, k2, v2, mask, out2, lse, seed)
    ctx.dropout_p = dropout_p
    ctx.scale, ctx.causal, ctx.world, ctx.group = scale, causal, world // a2a_size, outer
    ctx.a2a_size, ctx.inner, ctx.heads = a2a_size, inner, q.shape[1]


def _hierarchical_backward(ctx, dout, *_):
    q2, k2, v2, mask, out2, lse, seed = ctx.saved_tensors
    pin, pout = T.resolve(ctx.inner), T.resolve(ctx.group)
    k = ctx.a2a_size
    rows = _group_mask(mask, ctx.heads, k, pin.rank() if pin is not None else 0, ctx.world,
                       pout.rank() if pout is not None else 0)
    ring = types.SimpleNamespace(saved_tensors=(q2, k2, v2, rows, out2, lse, seed), scale=ctx.scale,
                                 causal=ctx.causal, world=ctx.world, group=ctx.group, dropout_p=ctx.dropout_p)
    dq2, dk2, dv2, *_ = _ring_backward(ring, _to_heads(dout, k, pin), None)
    dq, dk, dv = (_from_heads(t, k, pin) for t in (dq2, dk2, dv2))
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


hierarchical_attention.register_autograd(_hierarchical_backward, setup_context=_hierarchical_setup)
draws_at(11)(torch.ops.fxtron.hierarchical_attention.default)
register(OpSpec("hierarchical_attention", axis_arg=8, group_args=(9, 10), forward=Comm("all_to_all", "hierarchical"),
                backward=Comm("all_to_all", "hierarchical")))


def score_elements(seq: int, world: int, rank: int, *, balanced: bool = True) -> int:
    """The causal attention scores cp rank `rank` of `world` needs per (batch, head) over a
    sequence of `seq`: a query at position p attends p + 1 keys. Under the load-balanced split
    every rank needs the same; under a contiguous split (`balanced=False`, rank r holds block r
    of seq/world tokens) the last rank needs about 2*world-1 times what the first does."""
    if balanced:
        pos = positions(seq, world, rank).tolist()
    else:
        b = seq // world
        pos = range(rank * b, (rank + 1) * b)
    return sum(p + 1 for p in pos)


__all__ = ["attention_all_gather", "chunk_order", "cp_all_to_all", "document_order", "document_positions",
           "hierarchical_attention", "masked_attention", "positions",
           "keep_mask", "rectangles", "ring_attention", "ring_blocks", "score_elements", "zigzag"]
