"""Benchmark support: a pytest-benchmark timer that replays durations measured elsewhere (in
worker processes, or in a loop that alternates variants), so pytest-benchmark's statistics
are those of the measured runs."""
from __future__ import annotations


class ReplayTimer:
    """Each round's end-minus-start equals the next recorded duration."""

    __name__ = "replayed_measured_times"

    def __init__(self):
        self._durations: list[float] = []
        self._clock = 0.0
        self._at_start = True

    def load(self, durations: list[float]) -> None:
        self._durations = list(durations)
        self._at_start = True

    def __call__(self) -> float:
        if not self._at_start and self._durations:
            self._clock += self._durations.pop(0)
        self._at_start = not self._at_start
        return self._clock


def noop():
    return None


def eager_step(model, optimizer):
    """One plain eager training step of `model` with `optimizer` (the baselines), as a function
    of the batch returning the loss."""
    def step(b):
        optimizer.zero_grad(set_to_none=True)
        loss = model(*b)
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


def timed_job(job, mesh, systems: list[str], timeout_s: float = 900, args: tuple = ()) -> dict:
    """Run `job(rank, mesh, *args)` on the mesh's gloo processes (one torch thread each) and return
    rank 0's result with the job's wall time ("job_s") and each system's median step time
    ("median", from its "times")."""
    import statistics
    import time

    import fxtron
    t0 = time.perf_counter()
    res = fxtron.launch(job, mesh, args=(mesh, *args), backend="gloo", timeout_s=timeout_s, collective_timeout_s=300,
                        threads_per_rank=1)
    out = res[0]
    out["job_s"] = time.perf_counter() - t0
    out["median"] = {s: statistics.median(out["times"][s]) for s in systems}
    return out


def token_batches(vocab: int, batch: int, seq: int, n: int = 3, seed: int = 1) -> list:
    """n (tokens, targets) batches of random ids, targets shifted by one; the same every call."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].clone(), ids[:, 1:].clone()))
    return out


def interleaved(run: dict, batches: list, *, warmup: int, rounds: int, steps_per_round: int, sync=None,
                after=None) -> tuple[dict, dict]:
    """Each system's steps (run: name -> step(batch) -> loss) after `warmup` untimed ones, timed
    in `rounds` blocks of `steps_per_round`, the systems' order rotating every round so load on
    the machine falls on all alike; `sync()` before and `after()` after every timed step (a
    barrier across ranks). Returns (losses, step times in seconds) by system."""
    import time
    losses = {n: [] for n in run}
    times = {n: [] for n in run}
    for name, step in run.items():
        for i in range(warmup):
            losses[name].append(step(batches[i % len(batches)]))
    order = list(run)
    for r in range(rounds):
        order = order[1:] + order[:1]
        for name in order:
            for i in range(steps_per_round):
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                losses[name].append(run[name](batches[(warmup + r * steps_per_round + i) % len(batches)]))
                times[name].append(time.perf_counter() - t0)
                if after is not None:
                    after()
    return losses, times
