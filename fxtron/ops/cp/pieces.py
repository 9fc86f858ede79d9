"""Ops, context parallel, the mask's pieces: which parts of a key block a cp rank computes.

Per step of the ring (`_step_plan`): under the causal mask by position, Megatron's plan over
the load-balanced split (the rank's own block under the causal mask, an earlier rank's first
chunk against all queries, a later rank's whole block against the second query chunk only);
under an explicit mask (a document mask), one piece per run of rows that see the same keys
(`rectangles`, over rows and columns put in document order by `grouped`), none where the
block is empty -- the work a variable-length kernel does. `ring_blocks` counts what each step
computes. Neighbouring pieces that together span at most `SMALL_PIECE` score elements are
computed as one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxtron.ops.cp.blocks import _floor
from fxtron.ops.cp.layout import positions


CAUSAL = "causal"


def _step_plan(rank: int, src: int, world: int, c: int, causal: bool, mask: Tensor | None, seq: int, device):
    """For the key block of cp rank `src`: the pieces it is computed in -- (batch rows, query
    rows of this rank, key columns of the block) -- and the mask between them (Megatron's ring
    under the load-balanced split: its own block under the causal mask; an earlier rank's first
    chunk against all queries; a later rank's whole block against the second query chunk only).
    Under an explicit mask (any shape that broadcasts to the scores, `batched`), one piece per
    run of rows that see the same keys (`rectangles`): a document mask's block is computed
    document by document, no pair of documents that never meet, as a variable-length kernel
    computes it; none where the block is empty. The mask returned is 4-d."""
    whole, both = slice(None), slice(0, 2 * c)
    if mask is not None:                       # an explicit mask: its columns of src's positions
        m = batched(mask).index_select(-1, positions(seq, world, src).to(device))
        return _pieces(m, _floor(mask)), m
    if not causal:
        return [(whole, both, both)], None
    if src == rank:            # chunks (r, 2n-1-r) against themselves: exactly the top-left causal mask
        return [(whole, both, both)], CAUSAL
    if src < rank:
        return [(whole, both, slice(0, c))], None
    return [(whole, slice(c, 2 * c), both)], None


def batched(mask: Tensor) -> Tensor:
    """An attention mask of any shape that broadcasts to the scores (B, H, rows, cols) --
    (rows, cols), (H or 1, rows, cols), (B or 1, H or 1, rows, cols) -- as a 4-d view, its
    missing leading dims 1, as scaled_dot_product_attention broadcasts it: the pieces are
    planned per batch row and any head, which a mask without those dims would not have."""
    return mask[(None,) * (4 - mask.dim())] if mask.dim() < 4 else mask


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
    takes it, or any shape that broadcasts to that (`batched`); None: the causal plan (or every
    block whole), counted in chunks (c = 1)."""
    mask = None if mask is None else batched(mask)
    c = (mask.shape[-2] // 2) if mask is not None else 1
    batch = mask.shape[0] if mask is not None else 1
    out = []
    for i in range(world):
        src = (rank - i) % world
        pieces, _ = _step_plan(rank, src, world, c, causal, mask, 2 * c * world, torch.device("cpu"))
        span = lambda s, n: len(range(*s.indices(n))) if isinstance(s, slice) else len(s)  # noqa: E731
        out.append((src, sum(span(b, batch) * span(r, 2 * c) * span(k, 2 * c) for b, r, k in pieces)))
    return out


__all__ = ["batched", "grouped", "rectangles", "ring_blocks"]
