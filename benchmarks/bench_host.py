"""Host-cost benchmark: what one rank's uncompiled step costs its CPU beyond the unmodified
model's eager step (issue 48, item 4: fxtron at world 1 no dearer than eager).

    .venv/bin/python -m pytest benchmarks/bench_host.py --benchmark-only      # ~30 s

On a GPU the step of a model of realistic size is host-bound when its kernels are short: the
GPU waits for the Python that launches them. On a CPU the same host work is measurable where the
kernels are tiny: a Llama of hidden 64 (4 layers, 4 query / 2 key-value heads, SwiGLU 128,
vocab 256) on a batch of 2 x 32 tokens, one thread, where the arithmetic is a small share of the
step. Two systems, the same weights and batch, their steps interleaved (one each, 200 rounds)
so that load from other work falls on both alike:

    eager     the unmodified model: zero_grad, forward, backward, AdamW (foreach) step, loss.item()
    fxtron    fxtron.parallelize(model, Mesh(1)).program(0).train_step with the same AdamW:
              the traced graph interpreted op by op, its linears fxtron::linear (the weight
              gradient written into the fp32 main_grad), the gradient buffer, the step's checks

Each step is timed with `time.thread_time` (this thread's CPU time: waiting for a core shared
with other work is not counted). The table gives the 10th percentile of each (the least
disturbed) and their ratio, also of forward alone and forward + backward; the issue's target,
fxtron <= 1.0x eager, is reported, never asserted. The losses of the two are checked to agree.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

import fxtron
from fxtron.models.llama import Llama, LlamaConfig
from replay import ReplayTimer, noop

CFG = LlamaConfig(vocab_size=256, max_seq_len=64, n_layer=4, n_head=4, n_kv_head=2, dim=64, ffn_dim=128)
BATCH, SEQ, ROUNDS = 2, 32, 200
SYSTEMS = ["eager", "fxtron"]
REPLAY = ReplayTimer()


def _p10(times: list[float]) -> float:
    return sorted(times)[len(times) // 10]


@pytest.fixture(scope="module")
def host_results() -> dict:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Llama(CFG)
        x, y = torch.randint(0, CFG.vocab_size, (BATCH, SEQ)), torch.randint(0, CFG.vocab_size, (BATCH, SEQ))
        eager = copy.deepcopy(model)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, foreach=True)
        prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(x, y)).program(0)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3, foreach=True)
        flat = prog._flat_inputs(*prog.local_batch((x, y)))

        def eager_forward():
            out = eager(x, y)
            return out[1] if isinstance(out, tuple) else out

        def eager_step():
            opt_e.zero_grad(set_to_none=True)
            loss = eager_forward()
            loss.backward()
            opt_e.step()
            return loss.item()

        def fxtron_forward_backward():
            with prog.grads.accumulation():
                prog._run_graph(flat).backward()

        steps = {"eager": eager_step, "fxtron": lambda: prog.train_step((x, y), opt)}
        parts = {"forward": {"eager": eager_forward, "fxtron": lambda: prog._run_graph(flat)},
                 "forward+backward": {"eager": lambda: eager_forward().backward(), "fxtron": fxtron_forward_backward}}
        losses = {s: [steps[s]() for _ in range(3)] for s in SYSTEMS}     # warm-up, and the same training
        times = {s: [] for s in SYSTEMS}
        for _ in range(ROUNDS):
            for s in SYSTEMS:
                t0 = time.thread_time()
                steps[s]()
                times[s].append(time.thread_time() - t0)
        part_times = {}
        for part, fns in parts.items():
            for s, fn in fns.items():
                ts = []
                for _ in range(ROUNDS // 2):
                    t0 = time.thread_time()
                    fn()
                    ts.append(time.thread_time() - t0)
                part_times[(part, s)] = _p10(ts)
        eager.zero_grad(set_to_none=True)
        return {"times": times, "losses": losses, "parts": part_times}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.benchmark(group="host cost of a world-1 step (thread CPU time)", timer=REPLAY)
@pytest.mark.parametrize("system", SYSTEMS)
def test_host_step(benchmark, host_results, bench_report, system):
    losses = host_results["losses"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses["fxtron"], losses["eager"])), losses
    times = host_results["times"]
    REPLAY.load(times[system])
    benchmark.pedantic(noop, rounds=len(times[system]), iterations=1)
    p10 = {s: _p10(times[s]) for s in SYSTEMS}
    ratio = p10[system] / p10["eager"]
    benchmark.extra_info.update({"p10_step_s": p10[system], "ratio_vs_eager": ratio,
                                 "target": "fxtron <= 1.0x eager", "meets_target": ratio <= 1.0})
    section = bench_report.setdefault("host cost of a world-1 step (CPU time, tiny Llama: the host's share)", {
        "headers": ["system", "step ms (p10)", "vs eager", "forward ms", "forward+backward ms", "target"],
        "rows": [],
        "notes": [f"Llama hidden {CFG.dim}, {CFG.n_layer} layers, batch {BATCH}x{SEQ}, AdamW, one thread; "
                  f"{ROUNDS} interleaved steps each, this thread's CPU time; target (issue 48 item 4): "
                  "fxtron <= 1.0x eager, reported, not asserted"],
    })
    parts = host_results["parts"]
    section["rows"].append([system, f"{1e3 * p10[system]:.2f}", f"{ratio:.2f}x",
                            f"{1e3 * parts[('forward', system)]:.2f}",
                            f"{1e3 * parts[('forward+backward', system)]:.2f}",
                            "" if system == "eager" else ("met" if ratio <= 1.0 else "MISSED") + " (<= 1.0x)"])
