"""Expert-parallel benchmark (CPU, gloo): a mixture-of-experts training step at ep=2 against
the unmodified model in one process, and the all-to-all bytes each rank sent against the
formula.

    .venv/bin/python -m pytest benchmarks/bench_moe.py --benchmark-only   # ~1 min on 2 cores

One job of 2 gloo processes (one torch thread each) trains the shipped MoE model (CFG: hidden
128, 4 layers, 8 SwiGLU experts of 256, top-2, a shared expert; 3.8M parameters, 3.1M in
experts) on global batches of 8 x 64 tokens:

  ep2             fxtron.parallelize(model, Mesh(2, ep=2)): each rank holds 4 experts, its dp
                  half of the batch; tokens dispatched and combined by all-to-all (dropless)
  single_process  the unmodified model in rank 0's process on the whole batch (rank 1 idles in
                  a gloo barrier), the batch in the two halves the ep ranks take (their losses
                  averaged: the same arithmetic, each half's load-balancing loss its own)

After warm-up the timed steps alternate (ROUNDS x STEPS_PER_ROUND, order rotating). Reported:
the median step and its ratio to one process; per step, the bytes rank 0's all-to-alls sent
(prog.last_dispatch.bytes_sent, from the real counts) against pm.collectives' formula under
uniform routing, 4 (e-1)/e k T h x 4 B per layer plus the counts; and the load
imbalance (busiest expert over the mean, worst layer). Times are never asserted; the losses of
both must agree.
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.models.moe import MoEConfig, MoETransformer
from replay import ReplayTimer, interleaved, noop, token_batches

CFG = MoEConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=4, n_kv_head=2, dim=128, ffn_dim=256,
                n_experts=8, top_k=2, shared_ffn_dim=256, aux_loss_coef=0.01)
BATCH, SEQ = 8, 64
WARMUP, ROUNDS, STEPS_PER_ROUND = 2, 4, 3
SYSTEMS = ("ep2", "single_process")


def _model():
    torch.manual_seed(0)
    return MoETransformer(CFG)


def _job(rank: int, mesh: fxtron.Mesh) -> dict:
    torch.set_num_threads(1)
    data = token_batches(CFG.vocab_size, BATCH, SEQ, 3)
    pm = fxtron.parallelize(_model(), mesh, example_inputs=data[0])
    prog = pm.program(rank)
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
    one = _model() if rank == 0 else None
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3) if one is not None else None

    def single(batch):
        if one is None:
            return None
        one_opt.zero_grad(set_to_none=True)
        x, y = batch
        loss = sum(one(x[i:i + BATCH // 2], y[i:i + BATCH // 2]) for i in (0, BATCH // 2)) / 2
        loss.backward()
        one_opt.step()
        return float(loss.detach())

    def parallel(batch):
        loss = prog.train_step(batch, opt)
        load = prog.expert_load()
        info["sent"].append(prog.last_dispatch.bytes_sent)
        info["imbalance"].append(max(float(c.max()) / float(c.float().mean()) for c in load.values()))
        return loss

    info = {"sent": [], "imbalance": []}
    # rank 1 idles in the barrier after each step while rank 0 runs one process
    losses, times = interleaved({"ep2": parallel, "single_process": single}, data, warmup=WARMUP, rounds=ROUNDS,
                                steps_per_round=STEPS_PER_ROUND, sync=dist.barrier, after=dist.barrier)
    recs = [r for r in pm.collectives(rank) if r.kind == "all_to_all"]
    per_rank = BATCH // mesh.dp
    formula = sum(r.evaluate(per_rank, SEQ)[1] for r in recs)
    return {"times": times, "losses": losses, "info": info, "formula": formula, "all_to_alls": len(recs),
            "params": sum(p.numel() for p in _model().parameters()),
            "expert_params": sum(p.numel() for n, p in _model().named_parameters() if ".experts." in n)}


REPLAY = ReplayTimer()


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(2, ep=2)
    return fxtron.launch(_job, mesh, args=(mesh,), backend="gloo", timeout_s=900, collective_timeout_s=300,
                         threads_per_rank=1)[0]


@pytest.mark.benchmark(group="MoE training step, ep=2 (worker-measured)", timer=REPLAY)
@pytest.mark.parametrize("system", list(SYSTEMS))
def test_moe_step(benchmark, results, bench_report, system):
    losses = results["losses"]
    assert max(abs(a - b) for a, b in zip(losses["ep2"], losses["single_process"])) < 1e-4, losses
    times = results["times"][system]
    median = statistics.median(times)
    ratio = median / statistics.median(results["times"]["single_process"])
    REPLAY.load(times)
    benchmark.pedantic(noop, rounds=len(times), iterations=1)
    info = results["info"]
    sent = statistics.median(info["sent"])
    extra = {"median_step_s": median, "ratio_vs_single_process": ratio}
    if system == "ep2":
        extra.update(bytes_sent_median=sent, bytes_formula_uniform=results["formula"],
                     sent_vs_formula=sent / results["formula"], imbalance_median=statistics.median(info["imbalance"]),
                     all_to_alls_per_step=results["all_to_alls"])
    benchmark.extra_info.update(extra)
    section = bench_report.setdefault("mixture of experts, ep=2 on gloo", {
        "headers": ["system", "step ms", "vs one process", "all-to-all sent / step (rank 0)", "formula (uniform)",
                    "busiest expert / mean"],
        "rows": [], "notes": [f"MoE hidden {CFG.dim}, {CFG.n_layer} layers, {CFG.n_experts} experts of {CFG.ffn_dim}, "
                              f"top-{CFG.top_k}, shared expert; {results['params'] / 1e6:.1f}M parameters "
                              f"({results['expert_params'] / 1e6:.1f}M in experts); batch {BATCH} x {SEQ}; formula "
                              f"4 (e-1)/e k T h x 4 B per layer + counts"]})
    if system == "ep2":
        section["rows"].append([system, f"{median * 1e3:.0f}", f"{ratio:.2f}x", f"{sent / 2**10:.1f} KiB",
                                f"{results['formula'] / 2**10:.1f} KiB ({sent / results['formula']:.2f}x)",
                                f"{statistics.median(info['imbalance']):.2f}"])
    else:
        section["rows"].append([system, f"{median * 1e3:.0f}", "1.00x", "-", "-", "-"])
