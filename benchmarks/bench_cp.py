"""Context-parallel benchmarks (CPU, gloo).

    .venv/bin/python -m pytest benchmarks/bench_cp.py --benchmark-only      # ~2 min on 2 cores

1. Attention work per cp rank (test_attention_work): for a causal sequence of 4096 tokens at
   cp = 2, 4, 8, the score elements each rank needs (a query at position p attends p + 1
   keys) under Megatron's load-balanced split (rank r: chunks r and 2cp-1-r of 2cp) and under a
   contiguous split (rank r: block r), and those the cp attention op computes (whole blocks,
   the diagonal block's masked half included). Balanced: equal on every rank; contiguous: the
   last rank needs about 2cp-1 times the first's.

2. Training step, cp=2 against one process (test_train_step), on a long sequence where
   attention dominates: the shipped Llama with hidden 64 (4 query / 2 key-value heads of 16),
   2 layers, ffn 172, vocab 256, one sequence of 4096 tokens, AdamW; one job of 2 gloo
   processes, one torch thread each:
     fxtron_cp2_p2p         parallelize(model, Mesh(2, cp=2), cp_comm_type="p2p"): the ring
     fxtron_cp2_all_gather  the same with cp_comm_type="all_gather"
     fxtron_cp2_a2a         the same with cp_comm_type="a2a" (Ulysses: heads split over cp)
     single_process         the unmodified model in rank 0's process while rank 1 waits in a
                            barrier (no CPU)
   All start from the same weights and see the same batches; timed blocks are interleaved
   (rounds x steps, order rotating); rank 0's perf_counter per step; the losses must agree.
   Beside each: its cp bytes per step from pm.collectives (formulas in B and S, evaluated),
   and the issue's formulas per layer: all_gather (cp-1)/cp x 2*b*s*h_kv elements forward,
   p2p (cp-1) transfers of 2*b*(s/cp)*h_kv, a2a (cp-1)/cp x b*(s/cp)*(2h + 2h_kv). Ratios are
   reported, never asserted.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.models.llama import Llama, LlamaConfig
from fxtron.ops.cp.layout import document_order, positions, score_elements
from fxtron.ops.cp.pieces import ring_blocks
from replay import ReplayTimer, eager_step, noop, timed_job, token_batches

CFG = LlamaConfig(vocab_size=256, max_seq_len=4096, n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_dim=172)
BATCH, SEQ = 1, 4096
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND = 1, 3, 2
SYSTEMS = ["fxtron_cp2_p2p", "fxtron_cp2_all_gather", "fxtron_cp2_a2a", "single_process"]
H_KV = CFG.n_kv_head * (CFG.dim // CFG.n_head)       # key (or value) elements per token


def make_model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


# ---------------------------------------------------------------- 1. work balance
def _computed(seq: int, world: int, rank: int, balanced: bool) -> int:
    """Score elements a rank's attention computes per (batch, head): whole blocks."""
    if balanced:
        c = seq // (2 * world)
        return sum(c * (i + 1) * c for i in (rank, 2 * world - 1 - rank))
    b = seq // world
    return b * (rank + 1) * b


@pytest.mark.parametrize("world", [2, 4, 8])
def test_attention_work(world, bench_report, benchmark):
    benchmark.pedantic(noop, rounds=1, iterations=1)
    need_bal = [score_elements(SEQ, world, r) for r in range(world)]
    need_con = [score_elements(SEQ, world, r, balanced=False) for r in range(world)]
    comp_bal = [_computed(SEQ, world, r, True) for r in range(world)]
    comp_con = [_computed(SEQ, world, r, False) for r in range(world)]
    info = {"needed_balanced": need_bal, "needed_contiguous": need_con, "computed_balanced": comp_bal,
            "computed_contiguous": comp_con,
            "max_over_min_balanced": max(need_bal) / min(need_bal),
            "max_over_min_contiguous": max(need_con) / min(need_con)}
    benchmark.extra_info.update(info)
    section = bench_report.setdefault(f"attention score elements per cp rank (causal, {SEQ} tokens, per head)", {
        "headers": ["cp", "split", "needed per rank (rank 0 ..)", "computed per rank", "max/min needed"],
        "rows": [], "notes": ["needed: a query at position p attends p+1 keys; computed: whole blocks "
                              "(the cp op's chunks against the keys before them)"]})
    section["rows"].append([world, "load-balanced", need_bal, comp_bal, f"{info['max_over_min_balanced']:.3f}"])
    section["rows"].append([world, "contiguous", need_con, comp_con,
                            f"{info['max_over_min_contiguous']:.3f} (2cp-1 = {2 * world - 1})"])


# ---------------------------------------------------------------- 2. training step
def _train_job(rank: int, mesh: fxtron.Mesh) -> dict:
    batches = token_batches(CFG.vocab_size, BATCH, SEQ, n=2)
    runners, setup, wire = {}, {}, {}
    for comm in ("p2p", "all_gather", "a2a"):
        t0 = time.perf_counter()
        pm = fxtron.parallelize(make_model(), mesh, example_inputs=token_batches(CFG.vocab_size, 2, 8, n=1)[0],
                                cp_comm_type=comm)
        prog = pm.program(rank)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        runners[f"fxtron_cp2_{comm}"] = (lambda p, o: (lambda b: p.train_step(b, o)))(prog, opt)
        setup[f"fxtron_cp2_{comm}"] = time.perf_counter() - t0
        recs = pm.collectives(rank)
        wire[f"fxtron_cp2_{comm}"] = {
            "forward": sum(r.evaluate(BATCH, SEQ)[1] for r in recs if r.phase == "forward"),
            "backward": sum(r.evaluate(BATCH, SEQ)[1] for r in recs if r.phase == "backward")}
    if rank == 0:
        model = make_model()
        runners["single_process"] = eager_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times = {s: [] for s in SYSTEMS}
    losses = {s: [] for s in SYSTEMS}
    steps = {s: 0 for s in SYSTEMS}

    def run_block(system: str, n: int, timed: bool) -> None:
        dist.barrier()
        if system not in runners:
            dist.barrier()
            return
        for _ in range(n):
            b = batches[steps[system] % len(batches)]
            t0 = time.perf_counter()
            losses[system].append(runners[system](b))
            if timed:
                times[system].append(time.perf_counter() - t0)
            steps[system] += 1
        if system == "single_process":
            dist.barrier()

    for system in SYSTEMS:
        run_block(system, WARMUP_STEPS, timed=False)
    for r in range(ROUNDS):
        for system in SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]:
            run_block(system, STEPS_PER_ROUND, timed=True)
    dist.barrier()
    return {"times": times, "losses": losses, "setup_s": setup, "wire": wire}


REPLAY = ReplayTimer()


@pytest.fixture(scope="module")
def train_results():
    return timed_job(_train_job, fxtron.Mesh(2, cp=2), SYSTEMS)


def _formula(comm: str, cp: int = 2) -> int:
    """The issue's forward bytes per layer (fp32): K and V gathered, or sent around the ring."""
    if comm == "all_gather":
        return int((cp - 1) / cp * 2 * BATCH * SEQ * H_KV * 4)
    if comm == "a2a":        # q and the output (every head), k and v (the key/value heads), (cp-1)/cp of each
        return int((cp - 1) / cp * BATCH * (SEQ // cp) * (2 * CFG.dim + 2 * H_KV) * 4)
    return (cp - 1) * 2 * BATCH * (SEQ // cp) * H_KV * 4


@pytest.mark.benchmark(group="cp2 train step (worker-measured)", timer=REPLAY)
@pytest.mark.parametrize("system", SYSTEMS)
def test_train_step(benchmark, train_results, bench_report, system):
    times, med, losses = train_results["times"][system], train_results["median"], train_results["losses"]
    ref = losses["single_process"]
    assert abs(losses[system][0] - ref[0]) < 1e-4, (system, losses[system][0], ref[0])
    assert abs(losses[system][-1] - ref[-1]) < 1e-2, (system, losses[system][-1], ref[-1])
    REPLAY.load(times)
    benchmark.pedantic(noop, rounds=len(times), iterations=1)
    info = {"median_step_s": med[system], "ratio_vs_single_process": med[system] / med["single_process"],
            "min_ratio_vs_single_process": min(times) / min(train_results["times"]["single_process"]),
            "loss_first": losses[system][0], "loss_last": losses[system][-1]}
    comm = system.removeprefix("fxtron_cp2_")
    if system in train_results["wire"]:
        w = train_results["wire"][system]
        info.update(wire_forward_bytes=w["forward"], wire_backward_bytes=w["backward"],
                    formula_forward_bytes_per_layer=_formula(comm), setup_s=train_results["setup_s"][system])
    benchmark.extra_info.update(info)
    section = bench_report.setdefault(f"context parallel training step (cp=2, gloo, 1 thread/process, {SEQ} tokens)", {
        "headers": ["system", "median step ms", "min ms", "vs single process (median / min)",
                    "cp fwd bytes/step", "formula fwd bytes/layer x layers", "cp bwd bytes/step"],
        "rows": [], "notes": [f"model: Llama hidden {CFG.dim}, {CFG.n_layer} layers, {CFG.n_head}/{CFG.n_kv_head} heads, "
                              f"ffn {CFG.ffn_dim}; batch {BATCH}x{SEQ}; job {train_results['job_s']:.0f} s; fwd bytes "
                              "include the loss's two all-reduced floats"]})
    row = [system, f"{med[system] * 1e3:.0f}", f"{min(times) * 1e3:.0f}",
           f"{info['ratio_vs_single_process']:.2f} / {info['min_ratio_vs_single_process']:.2f}"]
    if system in train_results["wire"]:
        row += [f"{info['wire_forward_bytes']:,}", f"{_formula(comm) * CFG.n_layer:,}", f"{info['wire_backward_bytes']:,}"]
    else:
        row += ["-", "-", "-"]
    section["rows"].append(row)


# ---------------------------------------------------------------- 3. packed documents
def packed_documents(seq: int, seed: int, mean: float = 6.0, sigma: float = 1.0) -> list[int]:
    """Document lengths filling `seq` tokens (packing, the last one cut): log-normal, median
    e^mean (~400 tokens), as pretraining corpora's are roughly."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], seq
    while left > 0:
        n = int(torch.empty(1).log_normal_(mean, sigma, generator=g).clamp(min=16).item())
        out.append(min(n, left))
        left -= out[-1]
    return out


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _needed(doc: torch.Tensor, pos: torch.Tensor) -> int:
    """Score elements queries at global positions `pos` need: keys of their document before them."""
    start = torch.zeros_like(doc)
    change = torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1
    for c in change.tolist():
        start[c:] = c
    return int(sum(int(p) - int(start[p]) + 1 for p in pos))


def _ring_computed(mask: torch.Tensor, order: torch.Tensor, world: int, rank: int) -> int:
    """Score elements the ring computes for a rank when the row is laid out in `order` (positions;
    THD: cp_documents' reordering), each block in its pieces (ops/cp/pieces.py: rows and columns
    grouped by document, a piece per document, small ones merged), empty ones skipped."""
    rows = mask[order][:, order][positions(len(order), world, rank)]
    return sum(n for _, n in ring_blocks(rows[None, None], False, world, rank))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_packed_documents(world, bench_report, benchmark):
    """Packed batches: the document-causal score elements each cp rank needs under the plain
    load-balanced split and under THD (cp_documents: each row reordered so a rank holds chunks
    r and 2cp-1-r of every document, Megatron's per-document split without its padding), and
    those the ring computes (its blocks in pieces of one document each, the empty ones skipped:
    ops/cp/pieces.py ring_blocks) -- over 8 random packings of SEQ tokens. The step waits for the
    busiest rank: max / mean is the loss, and the busiest rank's computed elements under each
    split say which one the ring runs faster."""
    benchmark.pedantic(noop, rounds=1, iterations=1)
    rows = {"zigzag": [], "thd": [], "ring": [], "ring_dense": []}
    skipped = total = 0
    busiest = {"zigzag": [], "thd": []}
    for seed in range(8):
        lengths = packed_documents(SEQ, seed)
        doc = _doc_ids(lengths)
        p = torch.arange(SEQ)
        mask = (doc[:, None] == doc[None, :]) & (p[:, None] >= p[None, :])
        zig = [_needed(doc, positions(SEQ, world, r)) for r in range(world)]
        order = document_order(doc[None], world)[0]
        thd = [_needed(doc, order[positions(SEQ, world, r)]) for r in range(world)]
        ring, dense = [], []
        for r in range(world):
            blocks = ring_blocks(mask[positions(SEQ, world, r)][None, None], False, world, r)
            ring.append(sum(n for _, n in blocks))
            dense.append(len(blocks) * (SEQ // world) ** 2)
            skipped += sum(1 for _, n in blocks if n == 0)
            total += len(blocks)
        for k, v in (("zigzag", zig), ("thd", thd), ("ring", ring), ("ring_dense", dense)):
            rows[k].append(max(v) / (sum(v) / len(v)))
        busiest["zigzag"].append(max(ring))
        busiest["thd"].append(max(_ring_computed(mask, order, world, r) for r in range(world)))
    imb = {k: sum(v) / len(v) for k, v in rows.items()}
    info = {"max_over_mean_zigzag": imb["zigzag"], "max_over_mean_thd": imb["thd"],
            "max_over_mean_ring_computed": imb["ring"], "blocks_skipped": skipped, "blocks": total,
            "thd_gain": imb["zigzag"] / imb["thd"] - 1,
            "thd_computed_over_zigzag": sum(busiest["thd"]) / sum(busiest["zigzag"])}
    benchmark.extra_info.update(info)
    section = bench_report.setdefault(f"packed documents: attention work per cp rank ({SEQ} tokens, 8 packings)", {
        "headers": ["cp", "max/mean needed, zigzag", "max/mean needed, THD", "THD's gain", "max/mean ring computes",
                    "ring blocks skipped", "busiest rank's ring work, THD / zigzag"],
        "rows": [], "notes": ["documents log-normal, median ~400 tokens; needed: keys of the query's document "
                              "before it; the ring computes a block document by document "
                              "(a piece per document, as a variable-length kernel) and skips the empty ones; THD "
                              "(cp_documents) is adopted: it beats the zigzag by more than 10% in what the ring computes"]})
    section["rows"].append([world, f"{imb['zigzag']:.3f}", f"{imb['thd']:.3f}", f"{info['thd_gain']:+.1%}",
                            f"{imb['ring']:.3f}", f"{skipped} of {total}", f"{info['thd_computed_over_zigzag']:.3f}"])
