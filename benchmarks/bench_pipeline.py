"""Pipeline-parallel benchmarks (CPU, gloo): the measured bubble of each schedule next to its
formula, and the step time against one process.

    .venv/bin/python -m pytest benchmarks/bench_pipeline.py --benchmark-only     # ~2 min on 2 cores

One job of 2 gloo processes (pp=2, one torch thread each) trains a GPT (CFG: hidden 256,
4 layers, vocab 256) on a global batch of 8 x 64 tokens with each schedule in CASES
(GPipe, 1F1B, interleaved with 2 virtual stages, ZB-H1, ZB-V; 4 and 8 microbatches). Every step
records each rank's timeline (runtime/pp/executor.py: every F, B, W with start and end); from it:

  measured bubble   per rank, (time from the step's start to its last pass) - (time in
                    passes), over the time in passes: Narayanan's "bubble / ideal"; the mean
                    over ranks and timed steps is reported (includes waiting on gloo messages)
  formula           (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved (Narayanan et al.
                    2021), (p-1)(T_F+T_B-T_W) / (m(T_F+T_B+T_W)) for ZB-H1 (Qi et al. 2023)
                    with the measured mean pass times; ZB-V's (p-1)/(6m) at T_F = T_B = T_W
                    (Qi et al. 2024: the ramp-up only; it has no closed form for other times)
  simulated         the unit-time simulator (runtime/pp/schedules.py) run on the same orders
                    with the measured mean T_F, T_B, T_W: what the order would give with free
                    communication

One more step per schedule tracks memory (runtime/memory.py): each rank's peak of the bytes
saved for backward against the schedule's in-flight bound times one microbatch's.

The single-process baseline trains the unmodified model with the same microbatches (gradient
accumulation) in rank 0's process while rank 1 waits in a barrier; `ratio_vs_single_process`
is the pipelined step's median over the baseline's (ideal: (m + p - 1) / (m p) of it for
1F1B with free communication). Charts of a measured step per schedule are written to
.benchmarks/pipeline_<schedule>_m<m>.png. Nothing is asserted about time; the losses of every
schedule must equal the baseline's (the schedules train the same model).
"""
from __future__ import annotations

import os
import statistics
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.models.gpt import GPT, GPTConfig
from fxtron.runtime.pp import schedules
from replay import ReplayTimer, noop, token_batches

CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
BATCH, SEQ = 8, 64
PP = 2
CASES = [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4), ("zb-h1", 1, 4), ("zb-v", 1, 4),
         ("1f1b", 1, 8), ("interleaved", 2, 8), ("zb-h1", 1, 8), ("zb-v", 1, 8)]
WARMUP, STEPS = 2, 6
OUT = ".benchmarks"


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def _batches(n=3):
    return token_batches(CFG.vocab_size, BATCH, SEQ, n)


def _key(schedule, v, m):
    return f"{schedule}{'-v' + str(v) if v > 1 else ''}-m{m}"


def _pass_times(events):
    by = {"F": [], "B": [], "W": []}
    for e in events:
        if e.kind in by:
            by[e.kind].append(e.end - e.start)
    return {k: statistics.mean(v) if v else 0.0 for k, v in by.items()}


def _bubble(events) -> float:
    passes = [e for e in events if e.kind in "FBW"]
    busy = sum(e.end - e.start for e in passes)
    return (max(e.end for e in passes) - busy) / busy


def _job(rank: int, mesh: fxtron.Mesh) -> dict:
    torch.set_num_threads(1)
    data = _batches()
    out = {}
    for schedule, v, m in CASES:
        pm = fxtron.parallelize(_model(), mesh, example_inputs=data[0], microbatches=m, schedule=schedule,
                                virtual_stages=v)
        prog = pm.program(rank)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        losses, times, timelines = [], [], []
        for step in range(WARMUP + STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(prog.train_step(data[step % len(data)], opt))
            if step >= WARMUP:
                times.append(time.perf_counter() - t0)
                timelines.append(prog.timeline())
        # one more step with the memory tracked (untimed): the peak of the bytes saved for
        # backward against the schedule's in-flight bound x one microbatch's (its first F's)
        prog.track_memory = True
        prog.train_step(data[0], opt)
        samples = prog.memory_timeline()
        prog.track_memory = False
        first_f = next(i for i, smp in enumerate(samples) if smp.phase == "F")
        per_microbatch = samples[first_f].activations - samples[first_f - 1].activations
        memory = {"peak": max(smp.activations for smp in samples), "per_microbatch": per_microbatch,
                  "bound": schedules.in_flight_bound(schedule, mesh.pp, m, mesh.coords(rank)["pp"], v)}
        out[_key(schedule, v, m)] = {"losses": losses, "times": times, "timelines": timelines, "memory": memory}
    # the single-process baseline: the whole model, same microbatches, rank 1 idles
    for m in sorted({m for _, _, m in CASES}):
        losses, times = [], []
        if rank == 0:
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(WARMUP + STEPS):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                idx, tgt = data[step % len(data)]
                total = 0.0
                for x, y in zip(idx.chunk(m), tgt.chunk(m)):
                    loss = model(x, y) / m
                    loss.backward()
                    total += float(loss.detach())
                opt.step()
                losses.append(total)
                if step >= WARMUP:
                    times.append(time.perf_counter() - t0)
        dist.barrier()
        out[f"single-m{m}"] = {"losses": losses, "times": times}
    return out


REPLAY = ReplayTimer()


@pytest.fixture(scope="module")
def results():
    mesh = fxtron.Mesh(PP, pp=PP)
    res = fxtron.launch(_job, mesh, args=(mesh,), backend="gloo", timeout_s=900, collective_timeout_s=300,
                        threads_per_rank=1)
    return res


@pytest.mark.benchmark(group="pipeline step, pp=2 (worker-measured)", timer=REPLAY)
@pytest.mark.parametrize("schedule,v,m", CASES, ids=[_key(*c) for c in CASES])
def test_pipeline_step(benchmark, results, bench_report, schedule, v, m):
    key = _key(schedule, v, m)
    rank0 = results[0][key]
    base = results[0][f"single-m{m}"]
    for got, want in zip(rank0["losses"], base["losses"]):
        assert abs(got - want) < 1e-4, (key, rank0["losses"], base["losses"])
    bubbles = [_bubble(tl) for r in results for tl in r[key]["timelines"]]
    measured = statistics.mean(bubbles)
    times = {k: statistics.mean(_pass_times(tl)[k] for r in results for tl in r[key]["timelines"]) for k in "FBW"}
    t_f, t_b, t_w = (Fraction(times[k]).limit_denominator(10**6) for k in "FBW")
    formula = float(schedules.bubble_fraction_formula(schedule, PP, m, v) if schedule == "zb-v" else
                    schedules.bubble_fraction_formula(schedule, PP, m, v, t_f=t_f, t_b=t_b, t_w=t_w))
    simulated = float(schedules.simulate(schedule, PP, m, v, t_f=t_f, t_b=t_b, t_w=t_w).bubble_fraction)
    step = statistics.median(rank0["times"])
    ratio = step / statistics.median(base["times"])

    REPLAY.load(rank0["times"])
    benchmark.pedantic(noop, rounds=len(rank0["times"]), iterations=1)
    benchmark.extra_info.update({"bubble_measured": measured, "bubble_formula": formula,
                                 "bubble_simulated": simulated, "pass_times_s": times,
                                 "median_step_s": step, "ratio_vs_single_process": ratio})
    os.makedirs(OUT, exist_ok=True)
    from fxtron.tools import chart
    chart.draw_timelines([r[key]["timelines"][-1] for r in results], os.path.join(OUT, f"pipeline_{key}.png"),
                         title=f"{schedule}: pp={PP}, m={m}" + (f", v={v}" if v > 1 else ""))

    section = bench_report.setdefault("pipeline schedules, pp=2 on gloo (bubble = idle / time in passes)", {
        "headers": ["schedule", "m", "bubble measured", "formula", "simulated (measured pass times)",
                    "T_F / T_B / T_W ms", "step ms", "vs 1 process",
                    "peak saved, rank 0 / 1 (x in-flight bound x one microbatch)"],
        "rows": [], "notes": [f"GPT hidden {CFG.n_embd}, {CFG.n_layer} layers, batch {BATCH} x {SEQ}; "
                              "formula: (p-1)/m, (p-1)/(vm), ZB-H1 (p-1)(F+B-W)/(m(F+B+W)), ZB-V (p-1)/(6m) at F=B=W; "
                              "charts in .benchmarks/; ZB-V's passes are a chunk's (half a stage)",
                              "peak saved: the most bytes saved for backward at once in a tracked step, over the "
                              "schedule's in-flight bound (1F1B pp-r, GPipe m, ZB-H1 pp, ZB-V 2pp chunks, interleaved its "
                              "own) times the first F's bytes (interleaved, ZB-V: one chunk's)"]})
    peaks = [r[key]["memory"] for r in results]
    held = [mem["peak"] / (mem["bound"] * mem["per_microbatch"]) for mem in peaks]
    benchmark.extra_info.update({"peak_saved_bytes": [mem["peak"] for mem in peaks],
                                 "peak_over_in_flight_bound": held})
    section["rows"].append([schedule + (f" v={v}" if v > 1 else ""), m, f"{measured:.3f}", f"{formula:.3f}",
                            f"{simulated:.3f}", " / ".join(f"{times[k] * 1e3:.1f}" for k in "FBW"),
                            f"{step * 1e3:.0f}", f"{ratio:.2f}x",
                            " / ".join(f"{mem['peak'] / 2**20:.1f} MiB = {h:.2f} x {mem['bound']}" for mem, h in zip(peaks, held))])


_noop = noop
