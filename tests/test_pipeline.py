"""Pipeline parallel: every schedule trains exactly like the unmodified model.

Three gloo jobs (2, 4 and 8 processes) run pp=2 and pp=4, alone and with tp=2 and dp=2, with
GPipe, 1F1B, interleaved (virtual stages), ZB-H1 and ZB-V (two chunks a rank in a V: the first
and the last stage, and the tied embedding and LM head, on rank 0), for the shipped GPT (tied
embedding and LM head on the first and last stage) and Llama and for transformers' GPT-2 and Llama; some cases
with sequence parallel, scatter/gather boundaries, or microbatches whose sequence lengths
differ. Each case runs 2 AdamW steps whose global sequence length changes, and is compared with
the single-process model: losses, the first step's gradients (gathered to full shape, across
stages) and the final weights. Each rank also reports how many microbatches' activations it
held at once, checked against the schedule's bound, and the bytes it sent between stages.
The 4-process job runs as NCCL pairs transfers (by order, tags unused) with the collective
order check on (tests/test_collective_order.py).
"""
from __future__ import annotations

import pytest

import fxtron
from fxtron.core.meta import BATCH as BATCH_SYM, SEQ as SEQ_SYM
from fxtron.ops import ledger, shm
from fxtron.runtime.pp import schedules
from fxtron.tools.testing import adamw, max_abs_diff, ranks_of, reference_training, run_cases
from tp_models import batch, batches, make

pytestmark = pytest.mark.slow      # gloo jobs of 2, 4 and 8 processes

SEQS = [16, 12]
BATCH = 8
VARYING = [16, 12, 8, 16]          # sequence lengths of the 4 microbatches of a Microbatches step
LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 2e-6, 1e-6, 1e-5
_opt = adamw()


def _steps(name: str, varying: bool, m: int) -> list:
    """Each step's input: a global batch (args, kwargs), or fxtron.Microbatches of m
    microbatches of different sequence lengths."""
    if not varying:
        return batches(name, BATCH, SEQS, seed=10)
    return [fxtron.Microbatches(batch(name, BATCH // m, s, seed=20 + 10 * i + j) for j, s in enumerate(VARYING[:m]))
            for i in range(len(SEQS))]


def _tokens(args, kwargs) -> int:
    """The tokens a microbatch's mean cross entropy counts: every target (the shipped models),
    every label but the last of each sequence (transformers' models shift them)."""
    if "labels" in kwargs:
        return kwargs["labels"][:, 1:].numel()
    return args[1].numel()


class Case:
    def __init__(self, name, schedule="1f1b", m=4, v=1, layers=4, varying=False, **kw):
        self.name, self.schedule, self.m, self.v, self.layers, self.varying, self.kw = (
            name, schedule, m, v, layers, varying, kw)

    @property
    def key(self) -> str:
        extra = "".join(f",{k}" for k, v in self.kw.items() if v)
        return (f"{self.name}:{self.schedule}:m{self.m}" + (f":v{self.v}" if self.v > 1 else "")
                + f":L{self.layers}" + (":varying" if self.varying else "") + extra)

    @property
    def reference_key(self) -> tuple:
        return (self.name, self.layers, self.m if self.varying else None, self.kw.get("clip_grad"))


def _run_case(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    model = make(case.name, layers=case.layers)
    args, kwargs = batch(case.name, 2, 8, seed=0)
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs, microbatches=case.m,
                            schedule=case.schedule, virtual_stages=case.v, **case.kw)
    prog = pm.program(rank)
    opt = _opt(prog.parameters())
    losses, grads = [], None
    steps = _steps(case.name, case.varying, case.m)
    for step, item in enumerate(steps):
        prog.track_memory = step == len(steps) - 1             # the last step's memory, pass by pass
        ledger.tally(reset=True)                               # what the last step sends, by group
        if isinstance(item, fxtron.Microbatches):
            losses.append(prog.train_step(item, opt))
        else:
            losses.append(prog.train_step(item[0], opt, kwargs=item[1]))
        if step == 0:
            grads = prog.full_grads()
    sent = ledger.tally()
    runner = prog.runner()
    pp_rank = mesh.coords(rank)["pp"]
    listed = {}
    if not case.varying:       # pm.collectives at the last step's microbatch (B, S)
        b = BATCH // (mesh.dp * case.m)
        for r in pm.collectives(rank):
            n, wire = listed.get((r.ranks, r.kind), (0, 0.0))
            times = case.m if r.per == "microbatch" else 1
            listed[(r.ranks, r.kind)] = (n + r.count * times, wire + times * float(r.wire_bytes.subs({BATCH_SYM: b, SEQ_SYM: SEQS[-1]})))
    return {"losses": losses, "grads": grads, "state": prog.full_state_dict(),
            "peak": runner.peak_in_flight,
            "order_peak": schedules.in_flight(runner.actions, case.schedule in schedules.SPLIT_BACKWARD),
            "bound": schedules.in_flight_bound(case.schedule, mesh.pp, case.m, pp_rank, case.v),
            "sent": runner.p2p.bytes_sent if runner.p2p is not None else 0,
            "freed": runner.freed_bytes,
            "events": [e.kind for e in prog.timeline()],
            "ledger": {k: (v[0], v[2]) for k, v in sent.items()}, "listed": listed,
            "shm": shm.channel(prog.groups.group("tp").group_name) is not None,
            "memory": [(m.phase, m.activations) for m in prog.memory_timeline()]}


ALL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]


def _every_schedule(name):
    return [Case(name, s, v=2 if s == "interleaved" else 1) for s in ALL]


JOBS = {
    2: [(fxtron.Mesh(2, pp=2), [c for n in ("gpt", "llama", "hf-gpt2") for c in _every_schedule(n)]
         + [Case("gpt", "1f1b", varying=True), Case("hf-llama", "1f1b"),
            # layers as two module lists (nanoGPT's attn[i], proj[i]): the cut falls inside a layer, stage 0
            # sends x on and feeds x to its own linear, so x's data must outlive the send
            Case("nanogpt", "1f1b", m=2, layers=2),
            # parameters the forward never reads: held by the first stage, kept by full_state_dict
            Case("gpt-unused", "zb-v", m=2)]),
        (fxtron.Mesh(2), [Case("gpt", "1f1b", m=2)])],           # dp=2, gradient accumulation
    4: [(fxtron.Mesh(4, pp=4), [Case("gpt", "1f1b"), Case("gpt", "gpipe", m=8), Case("gpt", "interleaved", v=2, layers=8),
                                Case("llama", "zb-h1", m=8), Case("hf-gpt2", "1f1b", m=2),
                                Case("gpt", "zb-v", m=8, layers=8), Case("hf-llama", "zb-v", m=4, layers=8)]),
        (fxtron.Mesh(4, tp=2, pp=2), [Case("gpt", "1f1b"), Case("llama", "interleaved", v=2), Case("hf-gpt2", "zb-h1"),
                                      Case("gpt", "gpipe", sequence_parallel=True),
                                      Case("llama", "1f1b", scatter_gather=True),
                                      Case("gpt", "zb-h1", varying=True, scatter_gather=True),
                                      Case("llama", "zb-v", sequence_parallel=True),
                                      Case("gpt", "zb-v", varying=True, scatter_gather=True)]),
        (fxtron.Mesh(4, pp=2), [Case("gpt", "1f1b", m=2), Case("llama", "interleaved", v=2, m=2),
                                Case("hf-gpt2", "zb-h1", m=2, varying=True), Case("gpt", "zb-v", m=2),
                                Case("llama", "zb-v", zero=1, recompute="selective")])],
    8: [(fxtron.Mesh(8, tp=2, pp=2), [Case("gpt", "1f1b", m=2), Case("llama", "zb-h1", m=2),
                                      Case("gpt", "interleaved", v=2, m=2, sequence_parallel=True),
                                      Case("gpt", "1f1b", m=2, sequence_parallel=True, zero=1, clip_grad=1.0)])],
}
CASES = [(str(mesh), case) for jobs in JOBS.values() for mesh, cases in jobs for case in cases]


@pytest.fixture(scope="module")
def results():
    out = run_cases({w: j for w, j in JOBS.items() if w != 4}, _run_case, timeout_s=1200)
    # the 4-process job (every schedule, tp x pp, dp x pp, varying lengths, scatter/gather) under
    # NCCL's rule: transfers paired by order alone (no tags), every collective of every group
    # compared across it before it runs and each step's transfers paired at its end, with all
    # collectives through gloo (FXTRON_SHM=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FXTRON_P2P_TAGS", "0")
        out.update(run_cases({4: JOBS[4]}, _run_case, timeout_s=1200, check_collectives=True, shm_transport=False))
    return out


@pytest.fixture(scope="module")
def reference():
    ref = {}
    for _, case in CASES:
        if case.reference_key in ref:
            continue
        # microbatches of different lengths: the token mean over the whole batch, each
        # microbatch's mean weighted by its tokens
        ref[case.reference_key] = reference_training(make(case.name, layers=case.layers),
                                                     _steps(case.name, case.varying, case.m), _opt, tokens=_tokens,
                                                     clip_grad=case.kw.get("clip_grad"))
    return ref


@pytest.mark.parametrize("mesh_key,case", CASES, ids=[f"{m}-{c.key}" for m, c in CASES])
def test_equivalence(results, reference, mesh_key, case):
    ref = reference[case.reference_key]
    ranks = ranks_of(results, mesh_key, case)
    assert ranks
    for res in ranks:
        loss_diff = max(abs(got - want) for got, want in zip(res["losses"], ref["losses"]))
        assert loss_diff < LOSS_TOL, (res["losses"], ref["losses"])
        grad_diff, where = max_abs_diff(res["grads"], ref["grads"])
        assert grad_diff < GRAD_TOL, f"gradient of {where} differs by {grad_diff}"
        assert set(res["state"]) == set(ref["state"]), set(res["state"]) ^ set(ref["state"])   # every weight kept
        weight_diff, where = max_abs_diff(res["state"], dict(ref["state"]))
        assert weight_diff < WEIGHT_TOL, f"{where} differs by {weight_diff} after {len(SEQS)} steps"
    print(f"{case.key}: loss {loss_diff:.1e} grad {grad_diff:.1e} weight {weight_diff:.1e}")   # pytest -s


@pytest.mark.parametrize("mesh_key,case", CASES, ids=[f"{m}-{c.key}" for m, c in CASES])
def test_activation_memory_within_schedule_bound(results, mesh_key, case):
    """Microbatches whose activations a rank holds at once: exactly what the schedule's order
    implies, and within its bound (min(pp - r, m) for 1F1B, pp for ZB-H1, m for GPipe)."""
    for res in ranks_of(results, mesh_key, case):
        assert res["peak"] == res["order_peak"] <= res["bound"]


def test_one_f_one_b_holds_at_most_pp(results):
    mesh_key, case = next((m, c) for m, c in CASES if m == str(fxtron.Mesh(4, pp=4)) and c.schedule == "1f1b")
    assert [r["peak"] for r in ranks_of(results, mesh_key, case)] == [4, 3, 2, 1]


def test_zero_bubble_runs_weight_passes(results):
    mesh_key, case = next((m, c) for m, c in CASES if c.schedule == "zb-h1")
    for res in ranks_of(results, mesh_key, case):
        assert res["events"].count("W") == case.m and res["events"].count("B") == case.m


def test_stage_boundary_bytes(results):
    """pp=2, GPT (hidden 64, fp32): each step sends, per microbatch and direction, one
    b x s x h message (Narayanan's bsh): stage 0 its outputs, stage 1 their gradients; with
    scatter/gather 1/tp of it."""
    mesh_key = str(fxtron.Mesh(2, pp=2))
    case = next(c for m, c in CASES if m == mesh_key and c.name == "gpt" and c.schedule == "1f1b" and not c.varying)
    per_step = [BATCH * s * 64 * 4 for s in SEQS]
    for res in ranks_of(results, mesh_key, case):
        assert res["sent"] == sum(per_step)
    mesh_key = str(fxtron.Mesh(4, tp=2, pp=2))
    case = next(c for m, c in CASES if m == mesh_key and c.kw.get("scatter_gather") and not c.varying)
    for res in ranks_of(results, mesh_key, case):
        assert res["sent"] == sum(per_step) // 2


def test_sent_outputs_are_released(results):
    """Megatron's deallocate_pipeline_outputs: once stage 0 of pp=2 (GPT, hidden 64, fp32) has
    posted a microbatch's output, its data is released and the tensor kept only as autograd's
    root (the equivalence tests hold with it): the last step frees every microbatch's b x s x h
    output, the whole batch's; the last stage sends none."""
    mesh_key = str(fxtron.Mesh(2, pp=2))
    case = next(c for m, c in CASES if m == mesh_key and c.name == "gpt" and c.schedule == "1f1b" and not c.varying)
    first, last = ranks_of(results, mesh_key, case)
    assert first["freed"] == BATCH * SEQS[-1] * 64 * 4, first["freed"]
    assert last["freed"] == 0


# (nanoGPT at this size: its first forward adds 7008 bytes, the second 6240 -- the causal mask's slice the
# microbatches share is 12% of one microbatch's activations, beyond the bound's 10% allowance for it)
ONE_CHUNK = [(m, c) for m, c in CASES if not c.varying and c.v == 1 and c.schedule != "zb-v" and c.name != "nanogpt"]


@pytest.mark.parametrize("mesh_key,case", ONE_CHUNK, ids=[f"{m}-{c.key}" for m, c in ONE_CHUNK])
def test_peak_memory_is_the_schedules_in_flight_bound(results, mesh_key, case):
    """The memory timeline (prog.memory_timeline(), the last step): each forward pass adds one
    microbatch's activations saved for backward (the same bytes for every microbatch; the
    first's a little more, a storage its successors share), its B (under ZB-H1 its W) gives
    them back, so the peak is the schedule's in-flight count of microbatches times one
    microbatch's -- 1F1B's pp - r, GPipe's m; under ZB-H1 at most that, a B keeping only what
    its W needs -- within 5% (the boundary buffer of the last message received, the input ids
    the caller keeps: what is still held at the step's end, a small part of a microbatch's)."""
    for res in ranks_of(results, mesh_key, case):
        mem = res["memory"]
        assert mem[0] == ("start", 0)
        added = [b[1] - a[1] for a, b in zip(mem, mem[1:]) if b[0] == "F"]
        per_mb = min(added)
        assert len(added) == case.m and per_mb > 0 and max(added) <= 1.1 * per_mb, str(mem)
        peak, bound = max(a for _, a in mem), res["order_peak"] * per_mb
        assert peak <= 1.05 * bound, (peak, res["order_peak"], str(mem))
        if case.schedule != "zb-h1":
            assert peak >= bound, (peak, res["order_peak"], str(mem))
        assert mem[-1][1] <= 0.15 * per_mb, str(mem)


def test_zb_v_memory_and_transfers(results):
    """ZB-V at pp=2, GPT, m=4: each rank holds at most 2p = 4 microbatch-chunks (the order's
    count, pp whole stages: 1F1B's first stage), so its activation peak is at most 4 times its
    largest chunk's per-microbatch bytes; every rank sends twice 1F1B's bytes (each microbatch
    crosses the pp ranks twice, down the V and back: Qi et al.'s 2x communication), and the
    hand-over from stage 1 to stage 2 on rank 1 sends nothing."""
    mesh_key = str(fxtron.Mesh(2, pp=2))
    pick = {c.schedule: c for m, c in CASES if m == mesh_key and c.name == "gpt" and not c.varying and c.m == 4}
    zbv, one = ranks_of(results, mesh_key, pick["zb-v"]), ranks_of(results, mesh_key, pick["1f1b"])
    for res, base in zip(zbv, one):
        assert res["peak"] == res["order_peak"] == 4
        added = [b[1] - a[1] for a, b in zip(res["memory"], res["memory"][1:]) if b[0] == "F"]
        assert len(added) == 2 * 4 and max(a for _, a in res["memory"]) <= 4 * max(added) * 1.05, res["memory"]
        assert res["sent"] == 2 * base["sent"]
    ratio = max(max(a for _, a in r["memory"]) for r in zbv) / max(max(a for _, a in r["memory"]) for r in one)
    print(f"zb-v peak activations / 1F1B's: {ratio:.3f}")    # pytest -s


NOT_VARYING = [(m, c) for m, c in CASES if not c.varying]


def case_tp(mesh_key: str) -> int:
    return next(mh.tp for jobs in JOBS.values() for mh, _ in jobs if str(mh) == mesh_key)


@pytest.mark.parametrize("mesh_key,case", NOT_VARYING, ids=[f"{m}-{c.key}" for m, c in NOT_VARYING])
def test_collective_list_is_what_the_run_sends(results, mesh_key, case):
    """pm.collectives(rank) -- the graphs' collectives, the pipeline's transfers and shape
    messages, the data-parallel buckets, the sums after backward, the loss's -- evaluated at the
    last step's microbatch and counted per microbatch or per step, is what the ledger counted
    the rank issue in that step: per group and kind, the same number of operations and the same
    bytes sent (ring algorithms; a receive sends nothing). A tp x pp x dp rank lists pp and dp
    entries."""
    for res in ranks_of(results, mesh_key, case):
        got, listed = res["ledger"], dict(res["listed"])
        if not res["shm"]:
            # gloo without fxtron's shared-memory channel has no reduce-scatter of a tensor:
            # an all-reduce of it and a slice (ops/transport.py), twice the ring's bytes
            for ranks, kind in [k for k in listed if k[1] == "reduce_scatter" and len(k[0]) == case_tp(mesh_key)]:
                n, wire = listed.pop((ranks, kind))
                m0, w0 = listed.get((ranks, "all_reduce"), (0, 0.0))
                listed[(ranks, "all_reduce")] = (m0 + n, w0 + 2 * wire)
        assert set(got) == set(listed), (sorted(got), sorted(listed))
        for key, (n, wire) in got.items():
            assert listed[key][0] == n and abs(listed[key][1] - wire) <= 1e-9 * max(1.0, wire), (key, got[key], listed[key])
    mesh = next(mh for jobs in JOBS.values() for mh, cases in jobs for c in cases if str(mh) == mesh_key and c is case)
    if mesh.pp > 1 and mesh.dp > 1:
        kinds = {k for res in ranks_of(results, mesh_key, case) for k in res["ledger"]}
        assert any(op == "send" for _, op in kinds) and any(len(r) == mesh.dp and op in ("all_reduce", "reduce_scatter")
                                                             for r, op in kinds)
