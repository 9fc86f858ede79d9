"""Data-parallel benchmarks (CPU, gloo): bucket all-reduce overlapped with backward against
all-reduce after backward, the bytes each rank sends, and the distributed optimizer's memory.

    .venv/bin/python -m pytest benchmarks/bench_data_parallel.py --benchmark-only   # ~1 min on 2 cores

One job of 2 gloo processes (dp=2, one torch thread each) trains the shipped GPT (CFG: hidden
256, 4 layers, vocab 256; 3.2M parameters, 12.6 MiB of fp32 gradients) on a global batch of
8 x 64 tokens, four ways, their timed steps interleaved (ROUNDS x STEPS_PER_ROUND, order
rotating) so load on the machine falls on all alike:

  overlap        buckets of BUCKET elements, each all-reduce started during backward as soon
                 as its gradients are complete (overlap_grad_reduce=True)
  after_backward the same buckets, all-reduced once backward has returned
  one_bucket     the whole buffer as one bucket (nothing can start before backward ends)
  zero1          overlap with the distributed optimizer (reduce-scatter, shard update,
                 all-gather of parameters)

Reported per system: the median step, the ratio to after_backward, the buckets started during
backward, the bytes each rank sent per step next to the ring formula 2(n-1)/n x gradient
bytes (n-1)/n for reduce-scatter), and the optimizer state each rank holds (zero1 against the
others: 1/dp). Times are never asserted; the losses of all four must agree.
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.models.gpt import GPT, GPTConfig
from replay import ReplayTimer, interleaved, noop, token_batches

CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
BATCH, SEQ = 8, 64
BUCKET = 500_000
SYSTEMS = {"overlap": dict(bucket_size=BUCKET), "after_backward": dict(bucket_size=BUCKET, overlap_grad_reduce=False),
           "one_bucket": dict(), "zero1": dict(bucket_size=BUCKET, zero=1)}
WARMUP, ROUNDS, STEPS_PER_ROUND = 2, 5, 3


def _batches(n=3):
    return token_batches(CFG.vocab_size, BATCH, SEQ, n)


def _job(rank: int, mesh: fxtron.Mesh) -> dict:
    torch.set_num_threads(1)
    data = _batches()
    progs, opts = {}, {}
    for name, kw in SYSTEMS.items():
        torch.manual_seed(0)
        pm = fxtron.parallelize(GPT(CFG), mesh, example_inputs=data[0], **kw)
        progs[name] = pm.program(rank)
        opts[name] = torch.optim.AdamW(progs[name].parameters(), lr=1e-3)
    run = {name: (lambda b, name=name: progs[name].train_step(b, opts[name])) for name in SYSTEMS}
    losses, times = interleaved(run, data, warmup=WARMUP, rounds=ROUNDS, steps_per_round=STEPS_PER_ROUND,
                                sync=dist.barrier)
    out = {"times": times, "losses": losses, "info": {}}
    for name, prog in progs.items():
        buf = prog.grad_buffer
        zero = prog.zero
        state = zero.state_bytes() if zero is not None else sum(
            t.numel() * t.element_size() for st in opts[name].state.values() for t in st.values() if torch.is_tensor(t))
        out["info"][name] = {"buckets": len(buf.buckets), "early": buf.started_early, "sent": buf.bytes_sent,
                             "grad_bytes": sum(p.numel() * 4 for p in prog.parameters()), "optimizer_bytes": state}
    return out


REPLAY = ReplayTimer()


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(2)
    return fxtron.launch(_job, mesh, args=(mesh,), backend="gloo", timeout_s=900, collective_timeout_s=300,
                         threads_per_rank=1)[0]


@pytest.mark.benchmark(group="data-parallel step, dp=2 (worker-measured)", timer=REPLAY)
@pytest.mark.parametrize("system", list(SYSTEMS))
def test_data_parallel_step(benchmark, results, bench_report, system):
    losses = results["losses"]
    ref = losses["after_backward"]
    assert max(abs(a - b) for a, b in zip(losses[system], ref)) < 1e-4, (system, losses[system], ref)
    times = results["times"][system]
    info = results["info"][system]
    n = 2
    zero = SYSTEMS[system].get("zero") == 1
    formula = (n - 1) / n * info["grad_bytes"] * (1 if zero else 2)
    median = statistics.median(times)
    ratio = median / statistics.median(results["times"]["after_backward"])
    state_ratio = info["optimizer_bytes"] / results["info"]["after_backward"]["optimizer_bytes"]
    REPLAY.load(times)
    benchmark.pedantic(noop, rounds=len(times), iterations=1)
    benchmark.extra_info.update({"median_step_s": median, "ratio_vs_after_backward": ratio, **info,
                                 "ring_formula_bytes": formula, "optimizer_state_ratio": state_ratio})
    section = bench_report.setdefault("data parallel, dp=2 on gloo", {
        "headers": ["system", "step ms", "vs after_backward", "buckets (started in backward)",
                    "sent / step", "ring formula", "optimizer state / rank"],
        "rows": [], "notes": [f"GPT hidden {CFG.n_embd}, {CFG.n_layer} layers, batch {BATCH} x {SEQ}; buckets of "
                              f"{BUCKET:,} elements; formula 2(n-1)/n x gradient bytes ((n-1)/n: reduce-scatter)"]})
    section["rows"].append([system, f"{median * 1e3:.0f}", f"{ratio:.2f}x", f"{info['buckets']} ({info['early']})",
                            f"{info['sent'] / 2**20:.2f} MiB", f"{formula / 2**20:.2f} MiB",
                            f"{info['optimizer_bytes'] / 2**20:.1f} MiB ({state_ratio:.2f}x)"])


_noop = noop
