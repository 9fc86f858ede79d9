"""Runtime: pipeline schedules as data — the order in which each pipeline rank runs the
forward (F), backward (B) and weight-gradient (W) passes of every microbatch — and a
unit-time simulator that executes those orders against their data dependencies.

A schedule is a list of `Action`s per pipeline rank. The executor (runtime/pp/executor.py) runs
exactly these lists; the simulator runs the same lists with given pass durations, so the
bubble it reports is the bubble of the order fxtron executes, checked against the closed forms
of the papers (Narayanan et al. 2021 for GPipe / 1F1B / interleaved, Qi et al. 2023 for
ZB-H1, Qi et al. 2024 §6 for ZB-V).

Virtual stages: with v model chunks per rank, stage `j` of the pp*v-stage chain lives on rank
`j % pp` as chunk `j // pp` (Megatron's interleaved layout). ZB-V places 2pp stages in a V:
rank r holds stage r (chunk 0) and stage 2pp-1-r (chunk 1), so rank 0 runs the first and the
last stage, and stage pp-1 hands its output to stage pp on the same rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from fxtron.config import PipelineConfig

Kind = Literal["F", "B", "W"]
#: schedules whose B is the input gradient only, the weight gradients deferred into W passes
SPLIT_BACKWARD = ("zb-h1", "zb-v")


def chunks(schedule: str, virtual: int = 1) -> int:
    """Model chunks per pipeline rank: virtual_stages interleaved, two for ZB-V, else one."""
    return 2 if schedule == "zb-v" else virtual if schedule == "interleaved" else 1


def stage_of(schedule: str, pp: int, pp_rank: int, chunk: int) -> int:
    """The pipeline stage chunk `chunk` of rank `pp_rank` runs: the loop layout (chunk*pp + r)
    or ZB-V's V (r, then 2pp-1-r)."""
    if schedule == "zb-v":
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def rank_of(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that runs `stage`."""
    if schedule == "zb-v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass(frozen=True, order=True)
class Action:
    """One pass of one microbatch through one model chunk on a rank. Under zb-h1, B is the
    input gradient only and W the deferred weight gradient; otherwise B is the whole backward
    and there is no W."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def check(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> None:
    """ParallelizeError unless (schedule, pp, microbatches, virtual) can run (the rules are
    config.PipelineConfig's)."""
    PipelineConfig(microbatches=microbatches, schedule=schedule, virtual_stages=virtual).check_pp(pp)


def actions(schedule: str, pp: int, microbatches: int, pp_rank: int, virtual: int = 1) -> list[Action]:
    """The ordered passes pipeline rank `pp_rank` runs in one training step."""
    check(schedule, pp, microbatches, virtual)
    m, r = microbatches, pp_rank
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved(pp, m, r, virtual)
    if schedule == "zb-v":
        return _zb_v(pp, m, r)
    order = _one_f_one_b(pp, m, r)
    if schedule == "1f1b":
        return order
    # zb-h1: the 1F1B order of F and B; on stage r the weight gradient of microbatch i runs
    # right after the backward of microbatch i + r (so every stage holds pp microbatches'
    # activations, as 1F1B's first stage does), the rest at the end
    out: list[Action] = []
    done_w = 0
    for a in order:
        out.append(a)
        if a.kind == "B" and a.microbatch - done_w >= r:
            out.append(Action("W", done_w))
            done_w += 1
    out += [Action("W", i) for i in range(done_w, m)]
    return out


def _one_f_one_b(pp: int, m: int, r: int) -> list[Action]:
    warmup = min(pp - r - 1, m)                       # Megatron: pp - pp_rank - 1 forwards first
    out = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):                       # steady state: one forward, one backward
        out += [Action("F", warmup + i), Action("B", i)]
    out += [Action("B", i) for i in range(m - warmup, m)]   # cool-down
    return out


def _interleaved(pp: int, m: int, r: int, v: int) -> list[Action]:
    """Megatron's forward_backward_pipelining_with_interleaving, microbatch groups of N = pp:
    virtual microbatch k runs (microbatch, chunk) = table[k] forward, and chunk v-1-chunk
    backward; warm-up 2(pp - r - 1) + (v - 1)N forwards."""
    n = pp
    table = [(mb, c) for m0 in range(0, m, n) for c in range(v) for mb in range(m0, min(m0 + n, m))]
    total = m * v
    warmup = min((pp - r - 1) * 2 + (v - 1) * n, total)

    def fwd(k):
        mb, c = table[k]
        return Action("F", mb, c)

    def bwd(k):
        mb, c = table[k]
        return Action("B", mb, v - 1 - c)

    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(k + warmup), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def _zb_v(pp: int, m: int, r: int) -> list[Action]:
    """ZB-V's order on rank r (Qi et al. 2024 §6; chunk 0 is stage r, chunk 1 stage 2pp-1-r):
    - warm-up: 2(pp-r)-1 forwards of chunk 0, then r times a forward of chunk 1 and one of
      chunk 0, then pp-r times chunk 1's F, B and W (the first backwards start at rank 0,
      which holds the last stage);
    - steady state: chunk 0's F, B, W, then chunk 1's F, B, W, until every forward ran;
    - cool-down: r times the two chunks' B (their W postponed into the ramp-down), pp-r times
      chunk 0's B and W, then the W passes left, chunk 1's first.
    Built for max(m, 2pp-1) microbatches, the passes of those past m dropped (fewer leave
    bubbles no order can fill). At F = B = W, m >= 2pp-1, the only idle time left is the
    ramp-up, (pp-1) chunk forwards; with B and W unequal the bubble is half of ZB-H1's in the
    cases tests/test_schedules.py runs. Peak: 2pp microbatch-chunks in flight (forward run,
    W not yet), pp whole stages' activations -- 1F1B's first stage."""
    n = max(m, 2 * pp - 1)
    done = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}
    out: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        out.append(Action(kind, done[kind][chunk], chunk))
        done[kind][chunk] += 1

    for _ in range(2 * (pp - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(pp - r):
        for kind in "FBW":
            run(kind, 1)
    while done["F"][1] < done["F"][0] or done["F"][0] < n:
        if done["F"][0] < n:
            run("F", 0)
        for kind, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            run(kind, chunk)
    for _ in range(r):
        run("B", 0)
        run("B", 1)
    for _ in range(pp - r):
        run("B", 0)
        run("W", 0)
    for chunk in (1, 0):
        while done["W"][chunk] < done["B"][chunk]:
            run("W", chunk)
    return [a for a in out if a.microbatch < m]


def in_flight(order: list[Action], deferred_w: bool) -> int:
    """The most microbatch-chunks whose activations the order holds at once: forward done,
    backward (or, with deferred weight gradients, W) not yet."""
    live = peak = 0
    for a in order:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == ("W" if deferred_w else "B"):
            live -= 1
    return peak


def in_flight_bound(schedule: str, pp: int, microbatches: int, pp_rank: int, virtual: int = 1) -> int:
    """The schedule's bound on microbatch-chunks in flight on a rank: GPipe m; 1F1B
    min(pp - r, m); ZB-H1 min(pp, m) on every stage; ZB-V min(2pp, 2m) chunks (pp whole stages);
    interleaved its warm-up plus one."""
    m = microbatches
    if schedule == "zb-v":
        return min(2 * pp, 2 * m)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - pp_rank, m)
    if schedule == "zb-h1":
        return min(pp, m)
    return min((pp - pp_rank - 1) * 2 + (virtual - 1) * pp + 1, m * virtual)


# ----------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class Simulation:
    """The outcome of running every rank's order with fixed pass durations: each action's
    (start, end) per rank, the makespan, and the bubble (idle time of a rank: makespan minus
    its busy time; equal on every rank since every rank does the same work)."""

    spans: list[list[tuple[Action, Fraction, Fraction]]]
    makespan: Fraction
    busy: Fraction

    @property
    def bubble(self) -> Fraction:
        return self.makespan - self.busy

    @property
    def bubble_fraction(self) -> Fraction:
        """Bubble over ideal time (Narayanan's (p-1)/m); the zero-bubble paper's "bubble
        rate" is bubble / makespan instead."""
        return self.bubble / self.busy


def simulate(schedule: str, pp: int, microbatches: int, virtual: int = 1, *,
             t_f=1, t_b=1, t_w=1) -> Simulation:
    """Run the schedule's per-rank orders against the dependencies (F of a microbatch on stage
    j after its F on stage j-1; B on stage j after B on stage j+1 and its own F; W after its
    B), with communication free. t_f, t_b, t_w are one whole pipeline stage's pass times (a
    chunk of the interleaved schedule takes 1/v of them); t_w is added to B unless the
    schedule splits it out (zb-h1, zb-v). Unit costs by default: F = B (input gradient) = W (weight
    gradient) = 1, so a schedule's backward takes 2 and ZB-H1's W shows as its own pass."""
    t_f, t_b, t_w = Fraction(t_f), Fraction(t_b), Fraction(t_w)
    if schedule not in SPLIT_BACKWARD:
        t_b, t_w = t_b + t_w, Fraction(0)
    virtual = chunks(schedule, virtual)
    dur = {"F": t_f / virtual, "B": t_b / virtual, "W": t_w / virtual}
    last = pp * virtual - 1
    orders = [actions(schedule, pp, microbatches, r, virtual) for r in range(pp)]
    end: dict[tuple[str, int, int], Fraction] = {}      # (kind, microbatch, stage) -> end time
    free = [Fraction(0)] * pp
    nxt = [0] * pp
    spans: list[list] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                a = orders[r][nxt[r]]
                stage = stage_of(schedule, pp, r, a.chunk)
                deps = []
                if a.kind == "F" and stage > 0:
                    deps.append(("F", a.microbatch, stage - 1))
                if a.kind == "B":
                    deps.append(("F", a.microbatch, stage))
                    if stage < last:
                        deps.append(("B", a.microbatch, stage + 1))
                if a.kind == "W":
                    deps.append(("B", a.microbatch, stage))
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                finish = start + dur[a.kind]
                end[(a.kind, a.microbatch, stage)] = finish
                spans[r].append((a, start, finish))
                free[r] = finish
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][nxt[r]]) for r in range(pp) if nxt[r] < len(orders[r])}
            raise AssertionError(f"schedule {schedule} deadlocks: ranks wait at {stuck}")
    makespan = max(free)
    busy = microbatches * (t_f + t_b + t_w)
    return Simulation(spans, makespan, busy)


def bubble_formula(schedule: str, pp: int, microbatches: int, virtual: int = 1, *,
                   t_f=1, t_b=1, t_w=1) -> Fraction:
    """The closed-form bubble (idle time per rank): (p-1)(t_f+t_b) for GPipe and 1F1B,
    divided by v interleaved (Narayanan et al. 2021); (p-1)(T_F+T_B-T_W) for ZB-H1 (Qi et al.
    2023, T_B the input-gradient pass only); for ZB-V at T_F = T_B = T_W and m >= 2p-1 the
    ramp-up's (p-1) chunk forwards, (p-1)T_F/2 (Qi et al. 2024 call it zero: no bubble in the
    steady state; other times or fewer microbatches: simulate). t_b excludes t_w."""
    p = pp
    t_f, t_b, t_w = Fraction(t_f), Fraction(t_b), Fraction(t_w)
    if schedule == "zb-v":
        if not t_f == t_b == t_w:
            raise ValueError("ZB-V's bubble has a closed form at T_F = T_B = T_W only; simulate() gives the others")
        return (p - 1) * t_f / 2
    if schedule == "zb-h1":
        return (p - 1) * (t_f + t_b - t_w)
    full = (p - 1) * (t_f + t_b + t_w)
    return full / virtual if schedule == "interleaved" else full


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> Fraction:
    """The bubble over ideal time of fxtron's own order of `schedule` at unit pass times (F = B
    = W = 1): `simulate`'s, which is the closed form (`bubble_fraction_formula`) where that
    holds, and the order's own where it does not (ZB-V and ZB-H1 with few microbatches)."""
    return simulate(schedule, pp, microbatches, virtual).bubble_fraction


def bubble_fraction_formula(schedule: str, pp: int, microbatches: int, virtual: int = 1, *,
                            t_f=1, t_b=1, t_w=1) -> Fraction:
    """Bubble over ideal time: (p-1)/m (GPipe, 1F1B), (p-1)/(v m) interleaved, (p-1)/(6m) ZB-V."""
    ideal = microbatches * (Fraction(t_f) + Fraction(t_b) + Fraction(t_w))
    return bubble_formula(schedule, pp, microbatches, virtual, t_f=t_f, t_b=t_b, t_w=t_w) / ideal
