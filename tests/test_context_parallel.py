"""Context parallel (mesh.cp > 1): the sequence split over the cp ranks with Megatron's load
balancing, attention across the split by all-gather, by ring, by Ulysses' all-to-all and by
a2a+p2p (all-to-all inside groups of cp ranks, the ring across them), composed with tp (with
and without sequence parallel), pp, dp and zero=1; packed documents (transformers' position ids
restarting per document) with their scans split and the mask's empty blocks skipped.

Without processes: the layout (a rank's global positions, the zigzag reorder and its
gradient), the all-gather attention op against causal attention over the whole sequence in
float64, the balance of the attention work, the compiled graph (placements, attention ops,
collectives and their bytes as formulas: K and V gathered, (cp-1)/cp of 2*b*s*h_kv elements a
layer; the ring, cp-1 transfers of 2*b*(s/cp)*h_kv), and the errors a user can cause.

Then two gloo jobs train two AdamW steps (global batches of 4, sequence lengths 16 then 8,
labels with ignore_index over the first quarter of two samples: unevenly over the cp chunks)
and compare with one process: losses within 2e-6, first-step gradients within 1e-6, weights
within 1e-5 (Adam's eps 1e-4, as test_zoo.py explains). Two more (one a cp size) train attention
written out under masks of each shape scaled_dot_product_attention broadcasts ((T, T),
(1, 1, T, T), (B, 1, T, T); boolean and additive) with p2p, a2a+p2p and all_gather, held to
the same tolerances; the ring's planner on every shape is checked without processes first.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxtron
from fxtron.compiler.report import count
from fxtron.ops.cp import pieces as cp_pieces
from fxtron.ops.cp.all_gather import attention_all_gather
from fxtron.ops.cp.blocks import _block, _block_backward, _merge
from fxtron.ops.cp.layout import document_order, document_positions, positions, score_elements, zigzag
from fxtron.ops.cp.masked import masked_attention
from fxtron.ops.cp.pieces import grouped, rectangles, ring_blocks
from fxtron.ops.cp.ring import keep_mask, ring_attention
from fxtron.runtime.batch import BatchSlicer
from fxtron.tools.testing import (adamw, assert_trains_like, max_abs_diff, ranks_of, reference_training, run_cases,
                            run_on_ranks, train_program)
from tp_models import batch, batches, make

SEQS = [16, 8]


# ----------------------------------------------------------------------------- the layout
def test_positions_are_megatrons_load_balanced_chunks():
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7]          # Megatron's get_batch_on_this_cp_rank: cp=2, s=8
    assert positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for r in range(4):                                                  # cp=4, s=16: chunks r and 7-r
        assert positions(16, 4, r).tolist() == [2 * r, 2 * r + 1, 2 * (7 - r), 2 * (7 - r) + 1]
    every = torch.cat([positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_then_a_plain_split_gives_each_rank_its_positions(world):
    x = torch.randn(3, 8 * world, 5, dtype=torch.float64, requires_grad=True)
    z = zigzag(x, 1, 1, world, False)
    for r, piece in enumerate(z.chunk(world, dim=1)):
        assert torch.equal(piece, x[:, positions(8 * world, world, r)])
    assert torch.equal(zigzag(z, 1, 1, world, True), x)
    g = torch.randn_like(z)
    z.backward(g)                                       # the gradient goes back to natural order
    assert torch.equal(x.grad, zigzag(g, 1, 1, world, True))
    folded = x.detach().flatten(0, 1)                   # batch and sequence folded: 3 blocks
    zf = zigzag(folded, 0, 3, world, False)
    assert torch.equal(zf.view(3, world, -1, 5)[:, 1].reshape(-1, 5),
                       x.detach()[:, positions(8 * world, world, 1)].reshape(-1, 5))


def _whole_attention(world: int, gqa: bool, seq: int | None = None, **sdpa) -> tuple:
    """float64 q, k, v (B=2, 4 heads, 2 of keys with gqa, S = seq or 8 x world, d=8), an upstream
    gradient, attention over the whole sequence and its input gradients (the leaves' .grad
    cleared for the ranks' ops to accumulate into)."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, seq or 8 * world, 8
    hkv = 2 if gqa else h
    q = torch.randn(b, h, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(b, h, s, d, dtype=torch.float64, generator=g)
    full = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **sdpa)
    (full * weight).sum().backward()
    ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return q, k, v, weight, full.detach(), ref


@pytest.mark.parametrize("world,gqa", [(2, False), (4, True)])
def test_all_gather_attention_equals_causal_attention_rows(world, gqa):
    q, k, v, weight, full, ref = _whole_attention(world, gqa, is_causal=True)
    s = q.shape[2]
    for r in range(world):                              # each rank: its rows, its gradients' share
        pos = positions(s, world, r)
        out = attention_all_gather(q[:, :, pos], k, v, 0.0, None, gqa, r, world)
        torch.testing.assert_close(out, full[:, :, pos], rtol=0, atol=1e-12)
        (out * weight[:, :, pos]).sum().backward()
    for t, want in zip((q, k, v), ref):                 # summed over ranks: the reduce-scatter's sum
        torch.testing.assert_close(t.grad, want, rtol=0, atol=1e-12)


def _doc_mask(docs: list[int]) -> torch.Tensor:
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    p = torch.arange(len(doc))
    return (doc[:, None] == doc[None, :]) & (p[:, None] >= p[None, :])


@pytest.mark.parametrize("world,gqa,additive,per_row", [(2, False, False, False), (4, True, False, False),
                                                       (4, False, True, False), (2, True, False, True),
                                                       (4, False, False, True)])
def test_masked_attention_skips_empty_blocks_and_equals_attention(world, gqa, additive, per_row, monkeypatch):
    """all_gather under a document mask (ops/cp/masked.py masked_attention): each rank's rows against
    the gathered keys, block by block as the ring visits them, in float64 against the whole
    attention; its gradients summed over ranks are the whole's. Blocks whose documents never
    meet are skipped (ring_blocks), by the ring as well -- also under an additive mask of
    finfo.min (transformers' eager masks), where every query sees some key, and where the batch
    rows pack different documents (each row's own pieces). Blocks computed document by document
    (no small pieces merged: the ring's jobs run them merged)."""
    monkeypatch.setattr(cp_pieces, "SMALL_PIECE", 0)
    s, d = 8 * world, 8
    mask = _doc_mask([4, 2 * world + 1, s - 2 * world - 5])[None, None]    # the first ends at the first chunk's edge
    if per_row:
        mask = torch.cat([mask, _doc_mask([4, 1, s - 5])[None, None]])
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    q, k, v, weight, full, ref = _whole_attention(world, gqa, attn_mask=mask)
    skipped = 0
    for r in range(world):
        pos = positions(s, world, r)
        rows = mask[..., pos, :]
        out, _, _ = masked_attention(q[:, :, pos], k, v, rows, d ** -0.5, world, r)
        torch.testing.assert_close(out, full[:, :, pos], rtol=0, atol=1e-12)
        (out * weight[:, :, pos]).sum().backward()
        blocks = ring_blocks(rows, False, world, r)
        skipped += sum(1 for _, n in blocks if n == 0)
        for src, n in blocks:       # a block is skipped exactly when no query of it sees a key of it
            live = rows[..., positions(s, world, src)]
            live = live if not additive else live > torch.finfo(torch.float64).min
            assert (n == 0) == (not live.any())
    assert skipped > 0
    for t, want in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world,dv", [(2, 8), (4, 8), (2, 12)], ids=["cp2", "cp4", "cp2-matmuls"])
def test_a_query_that_sees_no_key_is_uniform_over_its_keys(world, dv):
    """An additive mask of the dtype's lowest value (transformers' eager masks) where a query
    sees no key -- a left-padded sequence's padding: softmax gives it uniform weights over its
    keys, and the blockwise merge, whose log-sum-exp cannot carry log(keys) at -1.8e308, gives
    the same (the blocks' means weighted by their keys). float64 against eager softmax, forward
    and gradients, on torch's flash kernel and in matmuls (a value head size not the query's)."""
    g = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 2, 8 * world, 8
    low = torch.finfo(torch.float64).min
    q, k = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, dv, dtype=torch.float64, generator=g, requires_grad=True)
    pos = torch.arange(s)
    pad = torch.tensor([3, 0])[:, None]                       # row 0 left-padded by 3 tokens
    seen = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] >= pad[:, :, None])   # (B, S, S)
    mask = torch.zeros(b, 1, s, s, dtype=torch.float64).masked_fill(~seen[:, None], low)
    assert (mask[0, 0, :3] == low).all()                      # the padding queries see no key
    scores = q @ k.transpose(-1, -2) * d ** -0.5 + mask
    full = torch.softmax(scores, -1) @ v
    weight = torch.randn(full.shape, dtype=torch.float64, generator=g)
    (full * weight).sum().backward()
    ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for r in range(world):
        at = positions(s, world, r)
        out, _, _ = masked_attention(q[:, :, at], k, v, mask[..., at, :], d ** -0.5, world, r)
        torch.testing.assert_close(out, full[:, :, at].detach(), rtol=0, atol=1e-12)
        (out * weight[:, :, at]).sum().backward()
    for t, want in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=1e-12)


def test_documents_order_keeps_each_document_in_order():
    """cp_documents (Megatron's THD without padding): each row reordered stably by the chunk of
    its document a token falls in; a rank's share of the reordered row holds about chunks r and
    2cp-1-r of every document, each document's tokens still in order. One document: the plain
    split."""
    assert document_order(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]), 2).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    one = torch.zeros(1, 16, dtype=torch.long)
    assert torch.equal(document_positions(one, 2, 1)[0], positions(16, 2, 1))
    doc = torch.tensor([[0] * 8 + [1] * 24 + [2] * 16, [5] * 4 + [7] * 44])      # ids need not be 0, 1, ...
    for world in (2, 4):
        order = document_order(doc, world)
        for row in range(2):
            assert sorted(order[row].tolist()) == list(range(48))
            for d in doc[row].unique():
                mine = order[row][doc[row][order[row]] == d]
                assert torch.equal(mine, mine.sort().values)            # a document keeps its order
        for r in range(world):
            at = document_positions(doc, world, r)[0]
            for d, n in ((0, 8), (1, 24), (2, 16)):                      # chunks r and 2cp-1-r of each
                start = doc[0].tolist().index(d)
                c = n // (2 * world)
                want = [start + i for k in (r, 2 * world - 1 - r) for i in range(k * c, (k + 1) * c)]
                assert sorted(x for x in at.tolist() if doc[0, x] == d) == want


@pytest.mark.parametrize("world", [2, 4])
def test_reordered_documents_are_computed_document_by_document(world, monkeypatch):
    """The rows of packed documents reordered for THD (cp_documents), as the ring gets them:
    masked attention on each rank's share of the reordered sequence, under the mask built in
    reordered coordinates (document equality & causal order, which the reordering keeps inside
    a document), equals float64 attention on the original rows, forward and gradients. The
    block's rows and columns grouped by document (ops/cp/pieces.py grouped), each piece lies in one
    document, and the busiest rank computes less than under the plain split."""
    monkeypatch.setattr(cp_pieces, "SMALL_PIECE", 0)
    docs = [5, 11, 3, 7 * world, 9 * world - 3]
    s, d = sum(docs), 8
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    mask = _doc_mask(docs)
    q, k, v, weight, full, ref = _whole_attention(world, True, attn_mask=mask[None, None], seq=s)
    order = document_order(doc[None], world)[0]
    p = torch.arange(s)
    moved = (doc[order][:, None] == doc[order][None, :]) & (p[:, None] >= p[None, :])    # built on the reordered rows
    assert torch.equal(moved, mask[order][:, order])
    busiest = {}
    for how, perm in (("zigzag", p), ("thd", order)):
        work = []
        for r in range(world):
            pos = positions(s, world, r)
            at = perm[pos]                                        # the rank's tokens' original positions
            rows = mask[perm][:, perm][pos][None, None]
            out, _, _ = masked_attention(q[:, :, at], k[:, :, perm], v[:, :, perm], rows, d ** -0.5, world, r)
            torch.testing.assert_close(out, full[:, :, at], rtol=0, atol=1e-12)
            if how == "thd":
                (out * weight[:, :, at]).sum().backward()
            work.append(sum(n for _, n in ring_blocks(rows, False, world, r)))
            for src in range(world):
                live = rows[0, 0][:, positions(s, world, src)]
                theirs = perm[positions(s, world, src)]
                g_rows, g_cols = grouped(live)
                for rr, cc in rectangles(live[g_rows][:, g_cols], small=0):
                    assert len(set(doc[at[g_rows[rr]]].tolist()) | set(doc[theirs[g_cols[cc]]].tolist())) == 1
        busiest[how] = max(work)
    for t, want in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=1e-12)
    assert busiest["thd"] < busiest["zigzag"], busiest


@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_computes_document_by_document(world):
    """A block under a document mask is computed in pieces (ops/cp/pieces.py rectangles), as a
    variable-length kernel computes it: each piece's query rows and key columns lie in one
    document (pieces of a few elements not merged), the pieces cover every pair attended, and no
    row is in two. Merged, a run of one-token documents (padding) is a few pieces, not one
    each."""
    docs = [5, 11, 3, 7 * world, 9 * world - 3]
    s = sum(docs)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    mask = _doc_mask(docs)
    computed = dense = 0
    for r in range(world):
        mine = positions(s, world, r)
        for src in range(world):
            theirs = positions(s, world, src)
            live = mask[mine][:, theirs]
            covered = torch.zeros_like(live)
            used = torch.zeros(len(mine), dtype=torch.bool)
            for rows, cols in rectangles(live, small=0):
                assert len(set(doc[mine[rows]].tolist()) | set(doc[theirs[cols]].tolist())) == 1
                assert not used[rows].any()
                used[rows] = True
                covered[rows, cols] = True
                computed += (rows.stop - rows.start) * (cols.stop - cols.start)
            assert torch.equal(covered | live, covered)
            dense += live.any(1).sum() * live.any(0).sum()
    assert computed < dense
    padded = _doc_mask([200] + [1] * 312)                 # 312 tokens of padding, each its own document
    pieces = rectangles(padded)
    assert len(pieces) <= 2 + 312 // 64
    covered = torch.zeros_like(padded)
    for rows, cols in pieces:
        covered[rows, cols] = True
    assert torch.equal(covered | padded, covered)


@pytest.mark.parametrize("world", [2, 4])
def test_masked_attention_with_dropout_is_attention_under_its_masks(world):
    """all_gather under a document mask with attention dropout: each rank's blocks dropped by
    the masks its seed gives (ops/cp/ring.py keep_mask, as the ring draws them); put together, float64
    attention with the assembled (B, H, S, S) mask on its probabilities, gradients included."""
    p, s, d = 0.25, 8 * world, 8
    mask = _doc_mask([4, 2 * world + 1, s - 2 * world - 5])
    q, k, v, weight, _, _ = _whole_attention(world, True, attn_mask=mask)
    keep = torch.zeros(2, 4, s, s, dtype=torch.float64)
    outs = []
    for r in range(world):
        pos = positions(s, world, r)
        torch.manual_seed(r)
        out, _, seed = masked_attention(q[:, :, pos], k, v, mask[pos][None, None], d ** -0.5, world, r, p)
        (out * weight[:, :, pos]).sum().backward()
        outs.append(out.detach())
        for src in range(world):
            cols = positions(s, world, src)
            keep[:, :, pos[:, None], cols[None, :]] = keep_mask(int(seed), p, src, (2, 4, s // world, s // world),
                                                                q.device, torch.float64)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * d ** -0.5
    ref = (scores.masked_fill(~mask, float("-inf")).softmax(-1) * keep) @ v.repeat_interleave(2, 1)
    (ref * weight).sum().backward()
    for r in range(world):
        torch.testing.assert_close(outs[r], ref.detach()[:, :, positions(s, world, r)], rtol=0, atol=1e-12)
    for t, got in zip((q, k, v), grads):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=1e-12)


def test_load_balanced_split_gives_every_rank_the_same_attention_work():
    s = 4096
    for world in (2, 4, 8):
        balanced = [score_elements(s, world, r) for r in range(world)]
        contiguous = [score_elements(s, world, r, balanced=False) for r in range(world)]
        assert len(set(balanced)) == 1 and sum(balanced) == sum(contiguous) == s * (s + 1) // 2
        assert max(contiguous) / min(contiguous) == pytest.approx(2 * world - 1, rel=1e-2)


def test_a_sequence_the_cp_ranks_cannot_split_is_refused_at_the_step():
    pm = _pm("gpt", fxtron.Mesh(2, cp=2))
    slicer = BatchSlicer(fxtron.core.meta.info(pm.traced), dp=1, dp_index=0, microbatches=1, device=None,
                         cp=2, cp_index=0)
    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(fxtron.ParallelizeError, match=r"sequence of 10 tokens.*multiple of 4.*8 or 12"):
        slicer.local((ids, ids))
    args, _ = slicer.local((torch.arange(16).repeat(2, 1), torch.arange(16).repeat(2, 1)))
    assert args[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and args[1].shape == (2, 8)
    # with sequence parallel (tp=2) too: each cp rank's tokens in 2 parts -> a multiple of 4 here,
    # of 8 at cp=4 x tp=2 (chunks of 2cp = 8, each rank's 2 chunks in 2 parts)
    info = fxtron.core.meta.info(pm.traced)
    for cp, tp, bad, near in ((1, 2, 7, "6 or 8"), (2, 2, 6, "4 or 8"), (4, 2, 12, "8 or 16"), (2, 3, 18, "12 or 24")):
        sp = BatchSlicer(info, dp=1, dp_index=0, microbatches=1, device=None, cp=cp, cp_index=0, seq_split=tp)
        ids = torch.zeros(2, bad, dtype=torch.long)
        with pytest.raises(fxtron.ParallelizeError, match=f"sequence parallel.*the nearest are {near}"):
            sp.local((ids, ids))


# ----------------------------------------------------------------------------- compiled graphs
def _pm(name, mesh, **kw):
    args, kwargs = batch(name, 2, 8, seed=0)
    return fxtron.parallelize(make(name), mesh, example_inputs=args, example_kwargs=kwargs, **kw)


def test_graph_splits_the_sequence_and_only_attention_communicates():
    for comm, op in (("all_gather", "attention_all_gather"), ("p2p", "fxtron.ring_attention")):
        pm = _pm("llama", fxtron.Mesh(2, cp=2), cp_comm_type=comm)
        text = pm.graph(1)
        assert "cp 1/2" in text and "cp:S(1)" in text and "cp:S(2)" in text
        ops = [line.split()[1] for line in text.splitlines() if line.startswith("%")]
        assert ops.count(op) == 2, comm                           # one per layer
        assert "fxtron.zigzag" in ops                             # positions reach the rank's tokens
        rg = pm.compiled(1)
        assert all(not p.shards and p.grad_group == "dp-cp" for p in rg.local.values())
        assert not pm.gathers(1) and not pm.fallbacks(1)


def _ops(pm, rank=0):
    return [line.split()[1] for line in pm.graph(rank).splitlines() if line.startswith("%")]


def test_attention_written_out_under_all_gather_attends_the_rank_queries_to_gathered_keys():
    pm = _pm("nanogpt", fxtron.Mesh(2, cp=2), cp_comm_type="all_gather")
    lines = [line for line in pm.graph(0).splitlines() if line.startswith("%")]
    scores = [line for line in lines if line.split()[1] == "matmul"]
    assert len(scores) == 4 and all("cp:S(2)" in line for line in scores)     # q @ k^T, att @ v: the rank's rows
    assert _ops(pm).count("fxtron.gather_from_sequence") == 4                  # K and V, 2 layers
    assert not pm.gathers(0) and not pm.fallbacks(0)


@pytest.mark.parametrize("name", ["nanogpt", "hf-gpt2-eager"])
def test_attention_written_out_joins_the_ring(name):
    # softmax(q k^T * scale, masked by a -inf masked_fill or an additive mask) @ v: one attention
    ops = _ops(_pm(name, fxtron.Mesh(2, cp=2), cp_comm_type="p2p"))
    assert ops.count("fxtron.ring_attention") == 2
    assert "softmax.int" not in ops and "matmul" not in ops and "fxtron.gather_from_sequence" not in ops


def test_attention_the_ring_cannot_take_is_reported():
    # einsum-written attention stays as written: its keys are gathered, and the user is told
    args = batch("einsum-attn", 2, 8, 0)[0]
    with pytest.warns(fxtron.ParallelizeWarning, match="written out by hand.*all-gather"):
        pm = fxtron.parallelize(make("einsum-attn"), fxtron.Mesh(2, cp=2), example_inputs=args, cp_comm_type="p2p")
        pm.compiled(0)
    assert "attention written out by hand gathers its keys instead" in pm.summary()
    strict = fxtron.parallelize(make("einsum-attn"), fxtron.Mesh(2, cp=2), example_inputs=args, strict=True)
    with pytest.raises(fxtron.ParallelizeError, match="cp_comm_type='all_gather'"):
        strict.compiled(0)


@pytest.mark.parametrize("comm,attention", [("all_gather", "attention_all_gather"),
                                            ("a2a", "scaled_dot_product_attention"),
                                            ("p2p", "fxtron.ring_attention")])
def test_dropout_draws_differ_across_cp_ranks(comm, attention):
    model = make("gpt", dropout=0.1)
    pm = fxtron.parallelize(model, fxtron.Mesh(2, cp=2), example_inputs=batch("gpt", 2, 8, 0)[0],
                            cp_comm_type=comm)
    random = [line for line in pm.graph(0).splitlines() if " rng]" in line]
    assert random and all("[sharded:cp rng]" in line for line in random)   # the rank's own stream (ops/rng.py)
    assert any(line.split()[1] == attention for line in random)   # (a2a: the rank's heads over every token)


def test_written_out_attention_with_dropout_takes_the_ring():
    """GPT-2 eager's attention written out with its dropout of the probabilities becomes one
    attention op with that dropout, drawn inside the ring from the rank's own stream."""
    args, kwargs = batch("hf-gpt2-eager", 2, 8, 0)
    pm = fxtron.parallelize(make("hf-gpt2-eager", dropout=0.1), fxtron.Mesh(2, cp=2), example_inputs=args,
                            example_kwargs=kwargs, cp_comm_type="p2p")
    rings = [line for line in pm.graph(0).splitlines() if line.split()[1:2] == ["fxtron.ring_attention"]]
    assert len(rings) == 2 and all("[sharded:cp rng]" in line for line in rings)     # (random: dropout_p > 0)
    assert "gathers its keys instead" not in pm.summary()


def test_collective_bytes_are_the_formulas():
    # llama: 8 heads, 4 kv heads of 8: h_kv = 32 elements a token, float32
    b, s, cp, h_kv = 2, 16, 2, 32
    recs = _pm("llama", fxtron.Mesh(2, cp=cp), cp_comm_type="all_gather").collectives(0, graphs_only=True)
    gathers = [r for r in recs if r.op == "gather_from_sequence" and r.phase == "forward"]
    assert len(gathers) == 2 * 2                                 # K and V, two layers
    per_layer = sum(r.evaluate(b, s)[1] for r in gathers) / 2     # wire bytes
    assert per_layer == (cp - 1) / cp * 2 * b * s * h_kv * 4
    assert count(recs, "reduce_scatter", "backward") == 4        # dK, dV reduce-scattered
    for world in (2, 4):
        recs = _pm("llama", fxtron.Mesh(world, cp=world), cp_comm_type="p2p").collectives(0, graphs_only=True)
        ring = [r for r in recs if r.op == "ring_attention" and r.phase == "forward"]
        assert len(ring) == 2 and all(r.count == world - 1 for r in ring)
        assert ring[0].evaluate(b, s)[1] == (world - 1) * 2 * b * (s // world) * h_kv * 4
    # the loss: the summed losses and the count of counted tokens, one float each
    assert [r.shape for r in recs if r.kind == "all_reduce"] == [(), ()]


def test_a2a_sends_heads_and_refuses_what_it_cannot_split():
    """cp_comm_type="a2a" (Ulysses): per attention 4 all-to-alls forward (q, k and v to a head
    split, the output back) and 4 backward, each moving (n-1)/n of its input; grouped-query
    keys and values go un-repeated (llama: 4 of the 8 heads, half a query's bytes). Heads
    that cp does not divide are a ParallelizeError naming the fix."""
    pm = _pm("llama", fxtron.Mesh(2, cp=2), cp_comm_type="a2a")
    recs = [r for r in pm.collectives(0, graphs_only=True) if r.op == "cp_all_to_all"]
    layers = 2
    assert len([r for r in recs if r.phase == "forward"]) == 4 * layers
    assert len([r for r in recs if r.phase == "backward"]) == 4 * layers
    # at B=2, S=16: q (2, 8 heads, 8 tokens, head dim) fp32, k and v 4 heads, the output as q;
    # (n-1)/n = 1/2 of each on the wire
    head_dim = make("llama").config.dim // 8
    q_bytes = 2 * 8 * 8 * head_dim * 4
    per_layer = sum(r.evaluate(2, 16)[1] for r in recs if r.phase == "forward") / layers
    assert per_layer == (q_bytes + q_bytes // 2 + q_bytes // 2 + q_bytes) / 2
    ops = _ops(pm)
    assert ops.count("fxtron.cp_all_to_all") == 4 * layers and "fxtron.ring_attention" not in ops
    assert sum("scaled_dot_product_attention" in o for o in ops) == layers
    with pytest.raises(fxtron.ParallelizeError, match="do not divide by cp=8"):
        _pm("llama", fxtron.Mesh(8, cp=8), cp_comm_type="a2a").compiled(0)


def test_a2a_p2p_sends_heads_inside_groups_and_rings_across_them():
    """cp_comm_type="a2a+p2p" with cp_a2a_size=2 at cp=4 (Megatron's hierarchical cp): one op
    per attention; its all-to-alls (q, k, v and the output, 4 forward, 4 backward) stay inside
    the group of 2 consecutive cp ranks, (a-1)/a of each on the wire; the keys and values of
    the head split (as many elements as the rank's own) go around the ring of the 2 groups: 1
    step forward, 3 backward. A cp_a2a_size that does not divide cp or the heads, or that comes
    without a2a+p2p, is a ParallelizeError naming the fix."""
    pm = _pm("llama", fxtron.Mesh(4, cp=4), cp_comm_type="a2a+p2p", cp_a2a_size=2)
    layers = 2
    assert _ops(pm).count("fxtron.hierarchical_attention") == layers
    recs = [r for r in pm.collectives(1, graphs_only=True) if r.op == "hierarchical_attention"]
    head_dim = make("llama").config.dim // 8
    q_bytes = 2 * 8 * 4 * head_dim * 4                  # B=2, 8 heads, S/cp = 4 tokens, fp32
    kv_bytes = 2 * (q_bytes // 2)                       # k and v: 4 key/value heads
    for phase, steps in (("forward", 1), ("backward", 3)):
        a2a = [r for r in recs if r.phase == phase and r.kind == "all_to_all"]
        ring = [r for r in recs if r.phase == phase and r.kind == "send_recv"]
        assert len(a2a) == len(ring) == layers
        assert a2a[0].group == "cp/shard:2" and a2a[0].ranks == (0, 1) and a2a[0].count == 4
        assert ring[0].group == "cp/replicate:2" and ring[0].ranks == (1, 3) and ring[0].count == steps
        assert a2a[0].evaluate(2, 16)[1] == (2 * q_bytes + kv_bytes) / 2
        assert ring[0].evaluate(2, 16)[1] == steps * kv_bytes
    assert "a2a inside groups of 2 cp ranks" in pm.summary()
    with pytest.raises(fxtron.ParallelizeError, match="cp_a2a_size=3 must divide cp=4"):
        _pm("llama", fxtron.Mesh(4, cp=4), cp_comm_type="a2a+p2p", cp_a2a_size=3).compiled(0)
    with pytest.raises(fxtron.ParallelizeError, match="set both, or neither"):
        _pm("llama", fxtron.Mesh(4, cp=4), cp_comm_type="p2p", cp_a2a_size=2)
    with pytest.raises(fxtron.ParallelizeError, match="do not divide by cp_a2a_size=8"):
        _pm("llama", fxtron.Mesh(16, cp=16), cp_comm_type="a2a+p2p", cp_a2a_size=8).compiled(0)


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_a_position_table_looks_up_the_rank_positions(name):
    """A learned position table read at arange(S) is looked up at the rank's positions (the
    ids split first, as Megatron slices position ids): no all-gather of the rows' gradient in
    backward; the table's gradient is the rank's partial sum, summed over dp-cp with the rest
    (training equal to one process: test_trains_like_one_process, gpt and hf-gpt2)."""
    pm = _pm(name, fxtron.Mesh(2, cp=2), cp_comm_type="p2p")
    table = next(n for n in pm.compiled(0).local if "wpe" in n)
    assert not [r for r in pm.collectives(0, graphs_only=True) if r.kind == "all_gather" and r.phase == "backward"]
    rows = [line for line in pm.graph(0).splitlines() if line.split()[1:2] == ["embedding"]
            and f"%{table.replace('.', '_')}" in line]
    assert rows and all("cp:S" in line for line in rows), rows
    assert pm.compiled(0).local[table].grad_whole_on == ()


class _Select(torch.nn.Module):
    """top-k and sort along the features of sequence-split tokens (a router's choice)."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        v, _ = torch.topk(x.softmax(-1), 2, dim=-1)
        s, _ = torch.sort(x, dim=-1)
        x = x + self.up(s) * v.sum(-1, keepdim=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_topk_and_sort_along_another_dim_stay_split():
    idx = torch.randint(0, 16, (2, 8))
    pm = fxtron.parallelize(_Select(), fxtron.Mesh(2, cp=2), example_inputs=(idx, idx), strict=True)
    lines = [line for line in pm.graph(0).splitlines() if line.split()[1:2] in (["topk"], ["sort"])]
    assert len(lines) == 2 and all("cp:(S(1), S(1))" in line for line in lines)
    assert not [r for r in pm.collectives(0, graphs_only=True) if r.kind == "all_gather"]


def test_user_mistakes_raise():
    with pytest.raises(fxtron.ParallelizeError, match="cp_comm_type"):
        _pm("gpt", fxtron.Mesh(2, cp=2), cp_comm_type="ring")


# ----------------------------------------------------------------------------- equal to one process
CASES = {
    2: [(dict(cp=2), "gpt", "p2p", {}), (dict(cp=2), "llama", "all_gather", dict(zero=1)),
        (dict(cp=2), "hf-llama", "p2p", {}), (dict(cp=2), "hf-gpt2", "all_gather", {}),
        # attention written out: nanoGPT's registered tril buffer, GPT-2's eager matmuls
        (dict(cp=2), "nanogpt", "p2p", {}), (dict(cp=2), "hf-gpt2-eager", "all_gather", {}),
        # Ulysses: grouped-query keys sent un-repeated (llama: 8 query heads, 4 key/value heads)
        (dict(cp=2), "llama", "a2a", {}), (dict(cp=2), "hf-llama", "a2a", {}), (dict(cp=2), "gpt", "a2a", {}),
        (dict(cp=2), "hf-gpt2-eager", "a2a", {}),
        # mixtures of experts: each rank routes its own tokens (sorted by expert in a rank-local
        # order), the load-balancing loss's statistics summed over cp; with ep, drawn from cp
        (dict(cp=2), "hf-mixtral-aux", "p2p", dict(strict=True)), (dict(cp=2), "moe", "all_gather", dict(strict=True)),
        (dict(cp=2), "hf-qwen3moe", "a2a", dict(strict=True)), (dict(cp=2), "hf-deepseekv3", "p2p", dict(strict=True)),
        (dict(cp=2, ep=2), "hf-mixtral", "p2p", dict(strict=True)), (dict(cp=2, ep=2), "moe", "p2p", dict(strict=True))],
    4: [(dict(cp=4), "llama", "p2p", {}),
        (dict(cp=4), "llama", "a2a", {}),
        (dict(cp=2, tp=2), "llama", "a2a", {}),
        (dict(cp=2, tp=2), "gpt", "a2a", dict(sequence_parallel=True)),
        (dict(cp=2, pp=2), "llama", "a2a", dict(microbatches=2)),
        (dict(cp=2), "llama", "a2a", dict(zero=1)),                                   # cp x dp=2
        (dict(cp=2), "gpt", "all_gather", dict(zero=1)),                              # cp x dp=2
        (dict(cp=2, tp=2), "gpt", "p2p", dict(sequence_parallel=True)),
        (dict(cp=2, tp=2), "llama", "all_gather", {}),
        (dict(cp=2, pp=2), "llama", "p2p", dict(microbatches=2)),
        # a2a+p2p: Ulysses inside groups of 2 cp ranks, the ring across the 2 groups
        (dict(cp=4), "llama", "a2a+p2p", dict(cp_a2a_size=2)), (dict(cp=4), "hf-llama", "a2a+p2p", dict(cp_a2a_size=2)),
        (dict(cp=4), "gpt", "a2a+p2p", dict(cp_a2a_size=2)), (dict(cp=4), "hf-gpt2-eager", "a2a+p2p", dict(cp_a2a_size=2)),
        # experts: ep=2 inside cp=2 x dp=2 (the aux loss's statistics summed over dp and cp),
        # ep=4 over all of them, and the experts split over tp beside cp
        (dict(cp=2, ep=2), "hf-mixtral-aux", "p2p", {}), (dict(cp=2, ep=4), "moe", "p2p", {}),
        (dict(cp=2, tp=2), "hf-mixtral", "p2p", dict(sequence_parallel=True))],
    8: [(dict(cp=4, tp=2), "llama", "a2a+p2p", dict(cp_a2a_size=2)),
        (dict(cp=4, tp=2), "gpt", "a2a+p2p", dict(cp_a2a_size=2, sequence_parallel=True)),
        (dict(cp=4, pp=2), "llama", "a2a+p2p", dict(cp_a2a_size=2, microbatches=2)),
        (dict(cp=4), "llama", "a2a+p2p", dict(cp_a2a_size=2, zero=1))],                   # cp4 x dp2
}


class Case:
    def __init__(self, axes, name, comm, kw):
        self.axes, self.name, self.comm, self.kw = axes, name, comm, kw
        self.key = f"{name}-{comm}-" + "-".join(f"{a}{n}" for a, n in {**axes, **kw}.items())


def _batches(name):
    out = batches(name, 4, SEQS, seed=10)
    for (args, kwargs), s in zip(out, SEQS):
        labels = kwargs["labels"] if "labels" in kwargs else args[1]
        for row in (0, 2):                 # even over dp's halves of the batch, uneven over cp's chunks
            labels[row, : s // 4] = -100
    return out


_opt = adamw(eps=1e-4)


def _run_case(rank, mesh, case):
    pm = _pm(case.name, mesh, cp_comm_type=case.comm, **case.kw)
    prog = pm.program(rank)
    opt = _opt(prog.parameters())
    out = train_program(prog, _batches(case.name), opt)
    if case.axes.get("ep", 1) > 1:     # the last step's copies per expert, over the global batch
        out["load"] = {k: v.tolist() for k, v in prog.expert_load().items()}
    if isinstance(case, Saved):       # the checkpoint of a cp=2 run (zero=1: optimizer state over dp-cp)
        prog.save(case.path, opt)
    return out


class Saved(Case):
    path = ""


class Bf16(Case):
    pass


def _run_bf16(rank, mesh, case):
    pm = _pm(case.name, mesh, cp_comm_type=case.comm, dtype=torch.bfloat16)
    prog = pm.program(rank)
    return train_program(prog, _batches(case.name), _opt(prog.parameters()))


BF16 = [Bf16(dict(cp=2), "llama", "p2p", {}), Bf16(dict(cp=2), "gpt", "all_gather", {})]


class RingDropout(Case):
    """The ring op itself with attention dropout (p=0.25), float64, on each rank's chunks."""


RING_DROPOUT = {2: RingDropout(dict(cp=2), "ring", "p2p", {}), 4: RingDropout(dict(cp=4), "ring", "p2p", {})}
P_DROP = 0.25


def _run_ring_dropout(rank, mesh, case):
    world = mesh.cp
    q, k, v, weight, _, _ = _whole_attention(world, True, is_causal=True)
    pos = positions(q.shape[2], world, rank)
    mine = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(100 + rank)                     # outside a program: the seed from torch's own stream
    from fxtron.runtime.groups import groups_for
    group = groups_for(mesh).group("cp").group_name
    out, _, seed = ring_attention(*mine, None, 8 ** -0.5, True, world, group, P_DROP)
    (out * weight[:, :, pos]).sum().backward()
    return {"out": out.detach(), "seed": int(seed), "grads": [t.grad for t in mine]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_dropout_is_attention_under_its_masks(trained, world):
    """Attention dropout inside the ring: each block's mask is regenerated from the seed the
    rank drew and the key block's rank (ops/cp/ring.py keep_mask), in forward and backward. Put
    together from every rank's seed, the masks are one (B, H, S, S) mask; the ranks' outputs
    and gradients (each rank's dK, dV of its own keys, after the ring brought them home) equal
    float64 attention with that mask applied to its probabilities -- dropout of the whole
    softmax, not of each block's."""
    got = ranks_of(trained, fxtron.Mesh(world, cp=world), RING_DROPOUT[world])
    q, k, v, weight, _, _ = _whole_attention(world, True, is_causal=True)
    b, h, s, _ = q.shape
    c = s // (2 * world)
    keep = torch.zeros(b, h, s, s, dtype=torch.float64)
    for r, res in enumerate(got):
        rows = positions(s, world, r)
        for src in range(world):
            cols = positions(s, world, src)
            keep[:, :, rows[:, None], cols[None, :]] = keep_mask(res["seed"], P_DROP, src, (b, h, 2 * c, 2 * c),
                                                                 q.device, torch.float64)
    assert 0.15 < (keep == 0).double().mean() < 0.35 and len({res["seed"] for res in got}) == world
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 8 ** -0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    ref = (scores.softmax(-1) * keep) @ v.repeat_interleave(2, 1)
    (ref * weight).sum().backward()
    for r, res in enumerate(got):
        pos = positions(s, world, r)
        torch.testing.assert_close(res["out"], ref.detach()[:, :, pos], rtol=0, atol=1e-12)
        for t, grad in zip((q, k, v), res["grads"]):
            torch.testing.assert_close(grad, t.grad[:, :, pos], rtol=0, atol=1e-12)


EOD = 3


def packed(b: int, s: int, seed: int, name: str = "hf-llama") -> tuple:
    """Packed documents (2 or 3 a row, cut at random): for transformers' models position ids
    restarting at each document, from which transformers builds a block-diagonal causal mask
    (with use_cache=False, its training setup); for the shipped ones an end-of-document token
    ending each but the last, and the position and document ids the trainer derives from it
    (Megatron's --reset-position-ids / --reset-attention-mask)."""
    from fxtron.data.gpt import position_and_document_ids
    args, kwargs = batch(name, b, s, seed)
    g = torch.Generator().manual_seed(seed)
    if not name.startswith("hf-"):
        idx = args[0]
        idx[idx == EOD] = EOD + 1
        for row in range(b):
            idx[row, sorted(torch.randperm(s - 1, generator=g)[:2].tolist())] = EOD
        pos, doc = position_and_document_ids(idx, EOD)
        return args, {"position_ids": pos, "document_ids": doc}
    pos = torch.zeros(b, s, dtype=torch.long)
    for row in range(b):
        starts = [0] + sorted(torch.randperm(s - 1, generator=g)[:2].add(1).tolist())
        for i, st in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else s
            pos[row, st:end] = torch.arange(end - st)
    return args, {**kwargs, "position_ids": pos, "use_cache": False}


def _packed_batches(name: str = "hf-llama"):
    out = [packed(4, s, 10 + i, name) for i, s in enumerate(SEQS)]
    for (args, kwargs), s in zip(out, SEQS):
        (kwargs["labels"] if "labels" in kwargs else args[1])[0, : s // 4] = -100
    return out


class Packed(Case):
    pass


PACKED = [Packed(dict(cp=2), "hf-llama", "p2p", dict(strict=True)),
          Packed(dict(cp=2), "hf-llama", "all_gather", dict(strict=True)),
          # the shipped models with the trainer's packed samples: Llama's rotary and GPT's learned
          # table at the restarted positions, attention inside each document
          Packed(dict(cp=2), "llama", "p2p", dict(strict=True)),
          Packed(dict(cp=2), "gpt", "all_gather", dict(strict=True))]
# THD (cp_documents): each row reordered by its documents before the split, with every comm type
# and beside tp (sp), dp (zero=1) and pp
DOCS = dict(cp_documents="document_ids")
THD = {2: [Packed(dict(cp=2), "llama", "p2p", dict(strict=True, **DOCS)),
           Packed(dict(cp=2), "gpt", "all_gather", dict(strict=True, **DOCS))],
       4: [Packed(dict(cp=4), "llama", "p2p", DOCS), Packed(dict(cp=4), "gpt", "a2a", DOCS),
           Packed(dict(cp=4), "llama", "a2a+p2p", dict(cp_a2a_size=2, **DOCS)),
           Packed(dict(cp=2, tp=2), "llama", "p2p", dict(sequence_parallel=True, **DOCS)),
           Packed(dict(cp=2), "gpt", "p2p", dict(zero=1, **DOCS)),                        # cp x dp=2
           Packed(dict(cp=2, pp=2), "llama", "all_gather", dict(microbatches=2, **DOCS))]}


def _run_packed(rank, mesh, case):
    args, kwargs = packed(2, 8, 0, case.name)
    pm = fxtron.parallelize(make(case.name), mesh, example_inputs=args, example_kwargs=kwargs, cp_comm_type=case.comm,
                            **case.kw)
    prog = pm.program(rank)
    return train_program(prog, _packed_batches(case.name), _opt(prog.parameters()))


class _Documents(torch.nn.Module):
    """A one-layer attention model over packed documents, written wrong in one way (`how`, the
    comments below) or right ('ok'). Each wrong one changes its loss when rows are reordered."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, idx, targets, *, document_ids):
        how, s = self.how, idx.shape[1]
        x = self.emb(idx)
        if how == "row0":                     # every row gets row 0's token at its position
            x = x + x[0]
        if how == "batch-softmax":            # a softmax over the batch, position by position
            x = F.softmax(x, dim=0)
        if how == "swap":                     # a reshape that reads (B, h, S) as (h, B, S)
            x = x + x.transpose(1, 2).reshape(8, -1, s)[0].unsqueeze(-1)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        docs = document_ids.bool() if how == "cast" else document_ids      # (a lossy cast of the ids)
        same = docs.unsqueeze(2) == docs.unsqueeze(1)
        if how == "window":                   # a sliding window of 2: the tokens' distance
            i = torch.arange(s)
            causal = causal & (i[None, :] + 2 > i[:, None])
        if how == "across":                   # the causal order across documents only
            same = ~same
        if how == "band":                     # tril(-2): the tokens' distance
            causal = torch.ones(s, s, dtype=torch.bool).tril(-2)
        mask = same & causal
        if how == "order":                    # the causal order alone
            mask = causal & (document_ids >= 0).unsqueeze(2)
        if how == "flip":                     # flipped along the sequence
            mask = mask.flip(1)
        mask = mask.unsqueeze(1)
        if how == "causal":                   # is_causal, the documents ignored
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.out(y.squeeze(1))
        extra = 0.0
        if how == "sort":                     # sorted along the sequence (the default dim, -1)
            extra = (torch.sort(logits[..., 0])[1] * logits[..., 0]).sum()
        if how == "span":                     # a span loss: the sequence as the classes
            extra = F.cross_entropy(logits[..., 0], targets.sum(1) % s)
        if how == "boolmask":                 # the tokens kept by a mask, in the layout's order
            extra = logits[targets >= 0].cumsum(0).sum()
        if how == "shifted":                  # labels shifted inside the model
            return F.cross_entropy(logits[:, :-1].reshape(-1, 16), targets[:, 1:].reshape(-1))
        return F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1)) + extra


def test_documents_order_is_proved_not_to_change_the_model():
    """cp_documents reorders each row's tokens; passes/cp_documents.py lets it only where the model
    cannot tell. Accepted: the shipped Llama and GPT with the trainer's position and document
    ids, and a model whose mask is the documents' equality ANDed with the causal order.
    Refused, naming the op: GPT's positions from an arange (a learned table read at the
    reordered index), no such input, and each of _Documents' mistakes -- each of which does
    compute another loss on the reordered rows."""
    from fxtron.compiler.trace import trace
    from fxtron.passes.cp_documents import check_documents
    for name in ("llama", "gpt"):
        args, kwargs = packed(2, 8, 0, name)
        pm = fxtron.parallelize(make(name), fxtron.Mesh(2, cp=2), example_inputs=args, example_kwargs=kwargs,
                                cp_documents="document_ids", strict=True)
        assert "balanced document by document (Megatron's THD)" in pm.summary()
        info, doc = fxtron.core.meta.info(pm.traced), kwargs["document_ids"]
        moved = False
        for r in range(2):                 # what a step gives cp rank r (and dp rank 1 of 2): rows by documents
            mine = document_positions(doc, 2, r)
            _, kw = BatchSlicer(info, dp=2, dp_index=1, microbatches=1, device=None, cp=2, cp_index=r).local(args, kwargs)
            for key in ("document_ids", "position_ids"):
                assert torch.equal(kw[key], kwargs[key][1:].gather(1, mine[1:]))
            moved |= not torch.equal(mine, positions(8, 2, r).expand(2, 4))
        assert moved
        with pytest.raises(fxtron.ParallelizeError, match="positions in the sequence|a table sliced to the sequence"):
            fxtron.parallelize(make(name), fxtron.Mesh(2, cp=2), example_inputs=args,
                               example_kwargs={"document_ids": kwargs["document_ids"]}, cp_documents="document_ids")
    with pytest.raises(fxtron.ParallelizeError, match="traced with the keyword inputs .'document_ids', 'position_ids'."):
        fxtron.parallelize(make("llama"), fxtron.Mesh(2, cp=2), example_inputs=args, example_kwargs=kwargs,
                           cp_documents="documents")
    idx = torch.randint(16, (2, 8))
    doc = torch.tensor([[0] * 3 + [1] * 3 + [2] * 2, [0] * 6 + [1] * 2])
    assert check_documents(trace(_Documents("ok"), (idx, idx), example_kwargs={"document_ids": doc}),
                           "document_ids") == 2
    for how, why in (("shifted", "slices the sequence"), ("causal", r"causal attention \(is_causal=True\)"),
                     ("order", "not ANDed with the documents' equality"),
                     ("flip", "acts along the sequence or the batch"), ("window", "positions in the sequence"),
                     ("band", "a diagonal other than the main one"), ("across", "not ANDed with the documents"),
                     ("row0", "out of its batch rows"), ("batch-softmax", "reduces over the batch"),
                     ("swap", r"reshapes \(8, B, S\)|reshapes \(B, 8, S\)"), ("cast", "not ANDed with the documents"),
                     ("sort", "acts along the sequence or the batch"), ("span", "the sequence as its classes"),
                     ("boolmask", "depends on the values|selects by a mask")):
        model = _Documents(how)
        gm = trace(model, (idx, idx), example_kwargs={"document_ids": doc})
        with pytest.raises(fxtron.ParallelizeError, match=why):
            check_documents(gm, "document_ids")
        order = document_order(doc, 2)
        with torch.no_grad():                 # and the refusal is needed: reordered rows compute otherwise
            moved = model(idx.gather(1, order), idx.gather(1, order), document_ids=doc.gather(1, order))
            assert (moved - model(idx, idx, document_ids=doc)).abs() > 1e-6, how


def test_reordering_the_documents_changes_only_what_the_proof_refuses():
    """One process, float64: Llama's loss and gradients on rows reordered by their documents
    (each input gathered by document_order, as the ranks get them) equal those on the
    rows -- and GPT's, whose positions come from an arange, do not: the refusal above is needed."""
    args, kwargs = packed(2, 16, 3, "llama")
    order = document_order(kwargs["document_ids"], 4)
    assert not torch.equal(order, torch.arange(16).expand(2, 16))
    take = lambda x: x.gather(1, order)                  # noqa: E731

    def run(name, kw, reorder):
        torch.manual_seed(0)
        model = make(name).double()
        a = tuple(take(x) for x in args) if reorder else args
        k = {key: take(x) for key, x in kw.items()} if reorder else kw
        loss = model(*a, **k)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}
    loss, grads = run("llama", kwargs, False)
    moved, moved_grads = run("llama", kwargs, True)
    assert abs(loss - moved) < 1e-12 and max_abs_diff(moved_grads, grads)[0] < 1e-12
    gpt = {"document_ids": kwargs["document_ids"]}
    assert abs(run("gpt", gpt, False)[0] - run("gpt", gpt, True)[0]) > 1e-3


def test_experts_route_each_ranks_own_tokens():
    """transformers' Mixtral at cp=2 under strict=True: the copies of the rank's tokens sorted by
    expert in its own order (histc of them a partial sum, the grouped GEMMs over the rank's
    rows), transformers' inverse permutation (index_put_ of an arange) an argsort of the sort's
    indices, which puts the rows back in the tokens' split. Nothing in the experts communicates
    over cp; with ep=2 the dispatch moves the rank's rows and brings them back."""
    from fxtron.core import meta
    from fxtron.core.placement import describe
    for mesh in (fxtron.Mesh(2, cp=2), fxtron.Mesh(2, cp=2, ep=2)):
        pm = _pm("hf-mixtral", mesh, strict=True)
        gm = pm.compiled(1).gm
        placed = {n.name: describe(meta.placement(n, "cp")) for n in gm.graph.nodes
                  if meta.get(n, meta.MODULE, "").startswith("model.layers.0.mlp")}
        assert placed["sort"] == "(S(0,by %sort), S(0,by %sort))" and placed["histc"] == "P(sum)"
        assert placed["argsort_stable"] == "S(0,inverse %sort)"
        gemms = [k for k in placed if k.startswith("grouped_mm")]
        rows = "S(0,by %sort dispatched)" if mesh.ep > 1 else "S(0,by %sort)"     # (the rows ep gave the rank)
        assert len(gemms) == 2 and all(placed[k] == rows for k in gemms)
        assert placed["reshape_7"] == "S(1)"                  # (B, S/2, h): the layer's output, split as it came
        ops = _ops(pm)
        assert not any(op.startswith("index_put") for op in ops) and ops.count("argsort.stable") == 2
        moe = [r for r in pm.collectives(0, graphs_only=True) if r.module.startswith("model.layers.0.mlp")]
        assert all(r.group != "cp" for r in moe) and bool(moe) == (mesh.ep > 1)
        summary = pm.summary()
        assert "run replicated" not in summary
        assert "run on each rank's own tokens (a mixture of experts routing them, in a rank-local order): " \
               "model.layers.0.mlp.experts, model.layers.1.mlp.experts" in summary


def test_packed_documents_split_their_scans_and_skip_empty_blocks():
    """Packed hf Llama at cp=2 under strict=True: the position ids' diff and the document
    index's cumsum run on the split sequence (shard_prev, shard_cumsum: the chunks' edges
    all-gathered, B x 2 values a rank), nothing runs replicated; p2p takes the document mask
    into the ring, all_gather into the block-wise masked attention (which skips empty blocks)."""
    args, kwargs = packed(2, 8, 0)
    for comm, attention in (("p2p", "fxtron.ring_attention"), ("all_gather", "fxtron.masked_attention")):
        pm = fxtron.parallelize(make("hf-llama"), fxtron.Mesh(2, cp=2), example_inputs=args, example_kwargs=kwargs,
                                cp_comm_type=comm, strict=True)
        ops = _ops(pm)
        assert ops.count("fxtron.shard_prev") == 1 and ops.count("fxtron.shard_cumsum") == 1
        assert ops.count(attention) == 2 and "diff" not in ops and "cumsum" not in ops
        edges = [r for r in pm.collectives(0, graphs_only=True) if r.op in ("shard_prev", "shard_cumsum")]
        # every rank's B x 2 edges, int64 (the position ids; the document flags' running sums)
        assert len(edges) == 2 and all(r.evaluate(2, 8)[0] == 2 * 2 * 2 * 8 for r in edges)
        assert "run replicated" not in pm.summary()


def _jobs(saved):
    jobs = {}
    for world, cases in CASES.items():
        for axes, name, comm, kw in cases:
            mesh = fxtron.Mesh(world, **axes)
            jobs.setdefault(world, []).append((mesh, [Case(axes, name, comm, kw)]))
    jobs[2] += [(fxtron.Mesh(2, cp=2), [saved] + BF16 + PACKED + THD[2] + [RING_DROPOUT[2]])]
    for case in THD[4]:
        jobs[4].append((fxtron.Mesh(4, **case.axes), [case]))
    jobs[4] += [(fxtron.Mesh(4, cp=4), [RING_DROPOUT[4]])]
    return jobs


def _dispatch(rank, mesh, case):
    run = (_run_bf16 if isinstance(case, Bf16) else _run_packed if isinstance(case, Packed)
           else _run_ring_dropout if isinstance(case, RingDropout) else _run_case)
    return run(rank, mesh, case)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    case = Saved(dict(cp=2), "llama", "all_gather", dict(zero=1))
    case.key, case.path = "saved", str(tmp_path_factory.mktemp("cp") / "ckpt")
    return case


@pytest.fixture(scope="module")
def trained(saved):
    # with every collective compared across its group before it runs, through gloo
    # (tests/test_collective_order.py): cp, cp x tp (sp), cp x dp (zero=1), cp x pp
    return run_cases(_jobs(saved), _dispatch, check_collectives=True, shm_transport=False)


@pytest.mark.slow
@pytest.mark.parametrize("world,case", [(w, Case(*c)) for w, cases in CASES.items() for c in cases],
                         ids=lambda x: x.key if isinstance(x, Case) else str(x))
def test_trains_like_one_process(trained, world, case):
    ref = reference_training(make(case.name), _batches(case.name), _opt)
    got_all = ranks_of(trained, fxtron.Mesh(world, **case.axes), case)
    for rank, got in enumerate(got_all):
        assert_trains_like(got, ref, rank=rank)
    if case.name == "moe" and "load" in got_all[0]:
        # the expert load counts every cp rank's tokens (each routes its own): the same on every
        # rank, each layer's copies the last batch's tokens x top_k (2)
        (args, _) = _batches(case.name)[-1]
        assert all(got["load"] == got_all[0]["load"] for got in got_all), [got["load"] for got in got_all]
        assert {sum(c) for c in got_all[0]["load"].values()} == {2 * args[0].numel()}, got_all[0]["load"]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", [(2, c) for c in PACKED] + [(w, c) for w, cs in THD.items() for c in cs],
                         ids=lambda x: x.key if isinstance(x, Case) else str(x))
def test_packed_documents_train_like_one_process(trained, world, case):
    """The document mask matters (one process without the position ids trains otherwise), and
    cp with it equals one process with it -- also with each row reordered by its documents
    (cp_documents)."""
    ref = reference_training(make(case.name), _packed_batches(case.name), _opt)
    plain = reference_training(make(case.name), [(a, {k: v for k, v in kw.items()
                                                      if k not in ("position_ids", "document_ids")})
                                                  for a, kw in _packed_batches(case.name)], _opt)
    # (100x the tolerance on losses below, 2e-6)
    assert abs(plain["losses"][0] - ref["losses"][0]) > 2e-4 and max_abs_diff(plain["grads"], ref["grads"])[0] > 1e-4
    for rank, got in enumerate(ranks_of(trained, fxtron.Mesh(world, **case.axes), case)):
        assert_trains_like(got, ref, rank=rank)


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16, ids=lambda c: c.key)
def test_bf16_trains_like_the_same_policy_in_one_process(trained, case):
    ref = reference_training(make(case.name), _batches(case.name), _opt, dtype=torch.bfloat16)
    gmax = max(g.abs().max().item() for g in ref["grads"].values())
    for rank, got in enumerate(ranks_of(trained, fxtron.Mesh(2, cp=2), case)):
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 2.0**-6 * abs(b), (rank, got["losses"], ref["losses"])
        dg, where = max_abs_diff(got["grads"], ref["grads"])
        assert dg <= 2.0**-5 * gmax, f"rank {rank}: gradient of {where} off by {dg:.3g} (max {gmax:.3g})"
        dw, where = max_abs_diff(got["state"], {k: v for k, v in ref["state"].items() if k in got["state"]})
        assert dw <= 2 * len(SEQS) * 1e-3, f"rank {rank}: weight {where} off by {dw:.3g}"


@pytest.mark.slow
def test_a_checkpoint_saved_at_cp2_loads_at_cp1(trained, saved):
    got = ranks_of(trained, fxtron.Mesh(2, cp=2), saved)[0]
    full = fxtron.load_full_state_dict(saved.path)
    dw, where = max_abs_diff({k: v for k, v in full.items() if k in got["state"]}, got["state"])
    assert dw == 0, f"{where} differs by {dw:.3g} in the checkpoint"
    pm = _pm("llama", fxtron.Mesh(1))
    prog = pm.program(0)
    opt = _opt(prog.parameters())
    prog.load(saved.path, opt)                 # one process: the weights and AdamW's moments
    assert max_abs_diff(prog.full_state_dict(), got["state"])[0] == 0
    moments = [st["exp_avg_sq"] for st in opt.state.values()]
    assert len(moments) == len(list(prog.parameters())) and all(m.abs().sum() > 0 for m in moments)
    # and it trains on at cp=1 exactly as the reference does after its two steps
    ref_model = make("llama")
    ref_opt = _opt(ref_model.parameters())
    for args, kwargs in _batches("llama"):
        ref_opt.zero_grad()
        ref_model(*args, **kwargs).backward()
        ref_opt.step()
    args, kwargs = _batches("llama")[0]
    loss = prog.train_step(args, opt, kwargs=kwargs)
    ref_opt.zero_grad()
    ref_loss = ref_model(*args, **kwargs)
    ref_loss.backward()
    ref_opt.step()
    assert abs(loss - ref_loss.item()) < 2e-6
    assert max_abs_diff(prog.full_state_dict(), dict(ref_model.state_dict()))[0] < 1e-5


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "matmuls"])
def test_ring_blocks_merge_to_attention_over_every_key(fused):
    """The ring's pieces in float64, one process: a query block against two key blocks (one
    under a mask that hides some rows from every key), merged through the log-sum-exp, then
    each block's backward from the merged output and log-sum-exp: equal to attention over the
    concatenated keys, values and gradients."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.rand(2, 1, 6, 10, generator=g) > 0.4
    mask[..., 0, :4] = False                       # row 0 sees no key of the first block
    mask[..., 1, :] = True
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    do = torch.randn_like(full)
    (full * do).sum().backward()
    out = torch.zeros(2, 3, 6, 8, dtype=torch.float64)
    lse = torch.full((2, 3, 6), float("-inf"), dtype=torch.float64)
    blocks = [slice(0, 4), slice(4, 10)]
    for cols in blocks:
        o, l = _block(q.detach(), k.detach()[..., cols, :], v.detach()[..., cols, :], 0.3, mask[..., cols],
                      False, fused=fused)
        _merge(out, lse, o.double(), l.double())
    torch.testing.assert_close(out, full.detach(), rtol=0, atol=1e-12)
    dq = torch.zeros_like(q)
    for cols in blocks:
        dqb, dk, dv = _block_backward(do, q.detach(), k.detach()[..., cols, :], v.detach()[..., cols, :],
                                      full.detach(), lse, 0.3, mask[..., cols], False, fused=fused)
        dq += dqb.double()
        torch.testing.assert_close(dk.double(), k.grad[..., cols, :], rtol=0, atol=1e-12)
        torch.testing.assert_close(dv.double(), v.grad[..., cols, :], rtol=0, atol=1e-12)
    torch.testing.assert_close(dq, q.grad, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- masks of every broadcast shape
# scaled_dot_product_attention broadcasts its mask to the scores (B, H, S, S): (S, S), (H, S, S),
# (1, 1, S, S), (B, 1, S, S), (B, H, S, S), boolean or additive; the ring's planner takes each
MASK_SHAPES = ["TT", "HTT", "11TT", "B1TT", "BHTT"]


def _shaped_mask(shape: str, b: int, h: int, s: int, additive: bool, dtype=torch.float64) -> torch.Tensor:
    """A mask of `shape` over S = s positions: causal (TT), a causal sliding window per head
    (HTT), packed documents (11TT), a causal window per batch row (B1TT) or per row and head
    (BHTT) -- every query sees its own key. Additive: 0 where seen, the dtype's lowest elsewhere
    (transformers' eager masks)."""
    i = torch.arange(s)
    causal = i[:, None] >= i[None, :]
    if shape == "TT":
        seen = causal
    elif shape == "HTT":
        seen = causal & (i[:, None] - i[None, :] < 2 + torch.arange(h)[:, None, None])
    elif shape == "11TT":
        doc = (i >= 3).long() + (i >= s // 2 + 2).long()         # three documents, from positions (traceable)
        seen = (causal & (doc[:, None] == doc[None, :]))[None, None]
    elif shape == "B1TT":
        seen = causal & (i[:, None] - i[None, :] < 3 + 2 * torch.arange(b)[:, None, None, None])
    else:
        seen = causal & (i[:, None] - i[None, :] < 2 + torch.arange(b * h).view(b, h, 1, 1))
    if not additive:
        return seen
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("shape", MASK_SHAPES)
def test_the_planner_takes_a_mask_of_any_broadcast_shape(shape, additive, monkeypatch):
    """The ring's blocks (ops/cp/pieces.py, through masked_attention: the ring's steps without
    processes) under a mask of each shape scaled_dot_product_attention broadcasts: in float64,
    every rank's output and the ranks' summed gradients equal attention over the whole sequence
    under that mask; the planner plans the rows of a mask as it plans them made 4-d (a (T, T)
    mask once crashed it: its leading dims were taken for batch and heads)."""
    monkeypatch.setattr(cp_pieces, "SMALL_PIECE", 0)
    for world in (2, 4):
        mask = _shaped_mask(shape, 2, 4, 8 * world, additive)
        q, k, v, weight, full, ref = _whole_attention(world, True, attn_mask=mask)
        s = q.shape[2]
        for r in range(world):
            pos = positions(s, world, r)
            rows = mask[..., pos, :]
            out, _, _ = masked_attention(q[:, :, pos], k, v, rows, 8 ** -0.5, world, r)
            torch.testing.assert_close(out, full[:, :, pos], rtol=0, atol=1e-12)
            (out * weight[:, :, pos]).sum().backward()
            four = rows.reshape((1,) * (4 - rows.dim()) + tuple(rows.shape))
            assert ring_blocks(rows, False, world, r) == ring_blocks(four, False, world, r)
        for t, want in zip((q, k, v), ref):
            torch.testing.assert_close(t.grad, want, rtol=0, atol=1e-12)


class _MaskedAttention(torch.nn.Module):
    """Attention written out as matmuls (it joins the ring: fuse_written_out_attention) under a
    mask the model builds of one broadcast `shape` (_shaped_mask's: "TT" is the held-out model's
    causal (T, T) mask, no batch dim), masked_fill'ed with -inf where False, or `additive`:
    added to the scores."""

    def __init__(self, shape: str, additive: bool, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.shape, self.additive, self.heads = shape, additive, heads
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(64, dim)
        self.attn = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = _shaped_mask(self.shape, b, self.heads, t, self.additive, x.dtype).to(idx.device)
        for qkv, proj in zip(self.attn, self.proj):
            q, k, v = qkv(x).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / k.shape[-1] ** 0.5)
            att = att + mask if self.additive else att.masked_fill(~mask, float("-inf"))
            x = x + proj((att.softmax(dim=-1) @ v).transpose(1, 2).contiguous().view(b, t, -1))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


class MaskCase(Case):
    """_MaskedAttention with the mask `name` ("TT", "11TT", "B1TT"; "+" additive)."""


def _masked_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return _MaskedAttention(name.rstrip("+"), name.endswith("+"))


def _mask_batches():
    return _batches("nanogpt")        # (idx, targets) of a 64-token vocabulary, some labels ignored


# every comm type meets every shape both boolean and additive: p2p and all_gather half of them at
# each cp size, a2a+p2p (its groups lie strictly between 1 and cp) all of them at cp=4; one job a cp size
_BOOL_FIRST, _ADDITIVE_FIRST = ("TT", "11TT+", "B1TT"), ("TT+", "11TT", "B1TT+")
_A2A = dict(cp_a2a_size=2)
MASK_CASES = {2: [MaskCase(dict(cp=2), n, comm, {})
                  for comm, names in (("p2p", _BOOL_FIRST), ("all_gather", _ADDITIVE_FIRST)) for n in names],
              4: [MaskCase(dict(cp=4), n, comm, kw)
                  for comm, kw, names in (("p2p", {}, _ADDITIVE_FIRST), ("all_gather", {}, _BOOL_FIRST),
                                          ("a2a+p2p", _A2A, _BOOL_FIRST + _ADDITIVE_FIRST)) for n in names]}


def _run_mask_case(rank, mesh, case):
    args, _ = batch("nanogpt", 2, 8, seed=0)
    pm = fxtron.parallelize(_masked_model(case.name), mesh, example_inputs=args, cp_comm_type=case.comm, **case.kw)
    prog = pm.program(rank)
    return train_program(prog, _mask_batches(), _opt(prog.parameters()))


@pytest.fixture(scope="module")
def masks_trained():
    # one gloo job a cp size with all its mask cases (not in `trained`'s jobs: -k runs them alone)
    return run_cases({w: [(fxtron.Mesh(w, **c.axes), [c]) for c in cases] for w, cases in MASK_CASES.items()},
                     _run_mask_case)


@pytest.mark.slow
@pytest.mark.parametrize("world,case", [(w, c) for w, cases in MASK_CASES.items() for c in cases],
                         ids=lambda x: x.key if isinstance(x, Case) else str(x))
def test_masks_of_every_shape_train_like_one_process(masks_trained, world, case):
    """Written-out attention under a (T, T), (1, 1, T, T) or (B, 1, T, T) mask, boolean or
    additive, with p2p, a2a+p2p and all_gather at cp=2 and cp=4: losses, first-step gradients
    and weights equal one process's."""
    ref = reference_training(_masked_model(case.name), _mask_batches(), _opt)
    for rank, got in enumerate(ranks_of(masks_trained, fxtron.Mesh(world, **case.axes), case)):
        assert_trains_like(got, ref, rank=rank)


class _SoftTargets(torch.nn.Module):
    """Token logits under a cross entropy against class probabilities, flat (B*S, C) or laid
    out as the logits (B, C, S)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 5)

    def forward(self, ids, probs):
        logits = self.head(self.emb(ids))                                   # (B, S, C)
        if self.layout == "flat":
            return F.cross_entropy(logits.flatten(0, 1), probs.flatten(0, 1), label_smoothing=0.1)
        return F.cross_entropy(logits.transpose(1, 2), probs.transpose(1, 2))


def _soft(layout: str):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 8))
    probs = torch.softmax(torch.randn(2, 8, 5, dtype=torch.float64), -1)
    return _SoftTargets(layout).double(), (ids, probs)


def _soft_steps(rank, mesh):
    out = {}
    for layout in ("flat", "classes-first"):
        model, batch_ = _soft(layout)
        prog = fxtron.parallelize(model, mesh, example_inputs=batch_).program(rank)
        out[layout] = (prog.train_step(batch_, torch.optim.SGD(prog.parameters(), lr=0.1)), prog.full_state_dict(),
                       prog.eval_step(batch_))
    return out


class _WeightedTargets(torch.nn.Module):
    """Token logits under a class-weighted mean cross entropy (the weights a buffer), a third of
    the labels ignored."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 5)
        self.register_buffer("weight", torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25]))

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=self.weight, label_smoothing=0.1)


def _weighted():
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 16, (4, 8)), torch.randint(0, 5, (4, 8))
    labels[torch.rand(4, 8) < torch.tensor([0.7, 0.5, 0.1, 0.0])[:, None]] = -100
    return _WeightedTargets().double(), (ids, labels)


class _NllTargets(_WeightedTargets):
    """An nll loss of log-probabilities, flat (B*S, C) or laid out (B, C, S), with and without
    the class weights."""

    def __init__(self, layout: str, weighted: bool):
        super().__init__()
        self.layout, self.weighted = layout, weighted

    def forward(self, ids, labels):
        lp = F.log_softmax(self.head(self.emb(ids)), -1)
        w = self.weight if self.weighted else None
        if self.layout == "flat":
            return F.nll_loss(lp.flatten(0, 1), labels.flatten(), weight=w)
        return F.nll_loss(lp.transpose(1, 2), labels, weight=w)


_LOSSES = {"ce-weighted": lambda: _WeightedTargets(), "nll-flat": lambda: _NllTargets("flat", False),
           "nll-flat-weighted": lambda: _NllTargets("flat", True),
           "nll-classes-first": lambda: _NllTargets("classes-first", False)}


def _token_loss(name: str):
    model, batch_ = _weighted()
    torch.manual_seed(1)
    other = _LOSSES[name]().double()
    other.load_state_dict(model.state_dict())
    return other, batch_


def _weighted_steps(rank, mesh):
    out = {}
    for name in _LOSSES:
        for m in (1, 2):
            model, batch_ = _token_loss(name)
            prog = fxtron.parallelize(model, mesh, example_inputs=batch_, microbatches=m, strict=True).program(rank)
            out[name, m] = (prog.train_step(batch_, torch.optim.SGD(prog.parameters(), lr=0.1)),
                            prog.full_state_dict(), prog.eval_step(batch_))
    return out


@pytest.mark.slow
def test_a_class_weighted_cross_entropy_and_nll_losses_divide_by_the_counted_tokens():
    """cp=2, with 1 and 2 microbatches: a class-weighted mean cross entropy divides by the global
    batch's counted targets' weights (it was refused at cp, and each microbatch's own with
    microbatches, 0.2 off the loss); an nll loss of flat (B*S, C) log-probabilities, weighted or
    not, is a mean over every rank's counted tokens (refused at cp: the flat tokens' cp shard
    could not be gathered), and laid out (B, C, S) no longer gathers them. Loss, updated weights
    and evaluation equal one process's (float64)."""
    got = run_on_ranks(_weighted_steps, fxtron.Mesh(2, cp=2), fxtron.Mesh(2, cp=2))
    for name in _LOSSES:
        model, batch_ = _token_loss(name)
        loss = model(*batch_)
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        model.eval()
        with torch.no_grad():
            evaluated = model(*batch_).item()
        for rank, out in enumerate(got):
            for m in (1, 2):
                assert abs(out[name, m][0] - loss.item()) < 1e-12, (name, rank, m, out[name, m][0], loss.item())
                assert max_abs_diff(out[name, m][1], model.state_dict())[0] < 1e-12, (name, rank, m)
                assert abs(out[name, m][2] - evaluated) < 1e-12, (name, rank, m)


@pytest.mark.slow
def test_a_cross_entropy_against_class_probabilities_is_a_mean_over_the_tokens():
    """cp=2: the mean divided by the target's elements (tokens x classes: 1/5 of the loss, without a
    word), and targets laid out as (B, C, S) were split on their class dim (a crash at the step);
    now both train like one process (float64)."""
    got = run_on_ranks(_soft_steps, fxtron.Mesh(2, cp=2), fxtron.Mesh(2, cp=2))[0]
    for layout in ("flat", "classes-first"):
        model, batch_ = _soft(layout)
        loss = model(*batch_)
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert abs(got[layout][0] - loss.item()) < 1e-12, (layout, got[layout][0], loss.item())
        assert max_abs_diff(got[layout][1], model.state_dict())[0] < 1e-12, layout
        model.eval()
        with torch.no_grad():
            assert abs(got[layout][2] - model(*batch_).item()) < 1e-12, layout
