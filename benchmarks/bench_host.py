"""Host-cost benchmark: what one rank's uncompiled step costs its CPU beyond the unmodified
model's eager step (issue 48, item 4: fxtron at world 1 no dearer than eager).

    .venv/bin/python -m pytest benchmarks/bench_host.py --benchmark-only      # ~30 s

On a GPU the step of a model of realistic size is host-bound when its kernels are short: the
GPU waits for the Python that launches them. On a CPU the same host work is measurable where the
kernels are tiny: a Llama of hidden 64 (4 layers, 4 query / 2 key-value heads, SwiGLU 128,
vocab 256) on a batch of 2 x 32 tokens, one thread, where the arithmetic is a small share of the
step. Four systems, the same weights and batch, their steps interleaved (one each, 200 rounds)
so that load from other work falls on all alike:

    eager           the unmodified model: zero_grad, forward, backward, AdamW (foreach) step, loss.item()
    fxtron          fxtron.parallelize(model, Mesh(1)).program(0).train_step with the same AdamW:
                    the traced graph run op by op, its fp32 linears autograd's (nothing defers their
                    weight gradients at world 1: compiler/passmanager.py linears_to_autograd), every
                    gradient added into the fp32 buffer in place, the step's checks
    torch_compile   the unmodified model under torch.compile, stepped as eager
    fxtron_compiled the same program with compile=True (codegen/regions.py; at world 1 in fp32 its
                    linears are the region's own: the step is one compiled region)

Each step is timed with `time.thread_time` (this thread's CPU time: waiting for a core shared
with other work is not counted). The table gives the 10th percentile of each (the least
disturbed) and its ratio to its baseline (eager for the uncompiled systems, torch_compile for
the compiled ones), also of forward alone and forward + backward for the uncompiled pair. The
issue's targets -- fxtron <= 1.0x eager (item 4) and compiled fxtron <= 0.95x torch.compile
(the GPU goal; here its host share) -- are reported, never asserted. The losses of each pair
are checked to agree. The compilations (both, about 20 s on 2 cores) are in setup, not timed.
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
SYSTEMS = ["eager", "fxtron", "torch_compile", "fxtron_compiled"]
#: each system's baseline and the issue's target against it
BASELINE = {"eager": "eager", "fxtron": "eager", "torch_compile": "torch_compile", "fxtron_compiled": "torch_compile"}
TARGET = {"fxtron": 1.0, "fxtron_compiled": 0.95}
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
        compiled_model = torch.compile(copy.deepcopy(model))
        opt_c = torch.optim.AdamW(compiled_model.parameters(), lr=1e-3, foreach=True)
        prog_c = fxtron.parallelize(copy.deepcopy(model), fxtron.Mesh(1), example_inputs=(x, y),
                                    compile=True).program(0)
        opt_pc = torch.optim.AdamW(prog_c.parameters(), lr=1e-3, foreach=True)
        prog = fxtron.parallelize(model, fxtron.Mesh(1), example_inputs=(x, y)).program(0)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3, foreach=True)
        flat = prog._flat_inputs(*prog.local_batch((x, y)))

        def eager_forward():
            out = eager(x, y)
            return out[1] if isinstance(out, tuple) else out

        def plain_step(net, optimizer):
            def step():
                optimizer.zero_grad(set_to_none=True)
                out = net(x, y)
                loss = out[1] if isinstance(out, tuple) else out
                loss.backward()
                optimizer.step()
                return loss.item()
            return step

        def fxtron_forward_backward():
            with prog.grads.accumulation():
                prog._run_graph(flat).backward()

        steps = {"eager": plain_step(eager, opt_e), "fxtron": lambda: prog.train_step((x, y), opt),
                 "torch_compile": plain_step(compiled_model, opt_c),
                 "fxtron_compiled": lambda: prog_c.train_step((x, y), opt_pc)}
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
    base = BASELINE[system]
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses[system], losses[base])), (system, losses)
    times = host_results["times"]
    REPLAY.load(times[system])
    benchmark.pedantic(noop, rounds=len(times[system]), iterations=1)
    p10 = {s: _p10(times[s]) for s in SYSTEMS}
    ratio = p10[system] / p10[base]
    info = {"p10_step_s": p10[system], "baseline": base, f"ratio_vs_{base}": ratio}
    target = ""
    if system in TARGET:
        info.update(target=f"{system} <= {TARGET[system]}x {base}", meets_target=ratio <= TARGET[system])
        target = ("met" if ratio <= TARGET[system] else "MISSED") + f" (<= {TARGET[system]}x)"
    benchmark.extra_info.update(info)
    section = bench_report.setdefault("host cost of a world-1 step (CPU time, tiny Llama: the host's share)", {
        "headers": ["system", "step ms (p10)", "vs baseline", "forward ms", "forward+backward ms", "target"],
        "rows": [],
        "notes": [f"Llama hidden {CFG.dim}, {CFG.n_layer} layers, batch {BATCH}x{SEQ}, AdamW, one thread; "
                  f"{ROUNDS} interleaved steps each, this thread's CPU time; baselines: eager for fxtron, "
                  "torch_compile for fxtron_compiled; targets (issue 48): fxtron <= 1.0x eager (item 4), "
                  "fxtron_compiled <= 0.95x torch.compile (its GPU goal, here the host's share), reported, "
                  "not asserted"],
    })
    parts = host_results["parts"]
    section["rows"].append([system, f"{1e3 * p10[system]:.2f}", f"{ratio:.2f}x ({base})",
                            f"{1e3 * parts[('forward', system)]:.2f}" if ("forward", system) in parts else "-",
                            f"{1e3 * parts[('forward+backward', system)]:.2f}"
                            if ("forward+backward", system) in parts else "-", target])
