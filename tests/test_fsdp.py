"""Sharded data parallel: zero=2 (gradients reduce-scattered, only the shards kept) and zero=3
(FSDP: parameters held as 1/d pieces, each layer gathered before use and again in backward,
its gradients reduce-scattered as backward completes them), composed with every axis.

Two gloo jobs (2 and 4 processes) train shipped and transformers models for 3 AdamW steps per
configuration and compare with the single-process model: losses, the first step's gradients
(gathered to full shape), the final weights and, with clipping, the global norms. Structure:
what a rank holds between steps (parameters, gradients, Adam's state) against 1/d, the
gathered bytes held at once against the layers gathered at once, the graph's gather and free
nodes and their bytes in pm.collectives (1.5x an all-reduce), and checkpoints between zero=3
and plain data parallel on other meshes.
"""
from __future__ import annotations

import os

import pytest
import torch

import fxtron
from fxtron.tools.testing import adamw, cases_fixture, max_abs_diff, ranks_of, reference_training, shared_dir, \
    shared_dir_path
from tp_models import batch, batches, make

pytestmark = pytest.mark.slow      # gloo jobs of 2 and 4 processes

SEQS = [16, 12, 16]
LR = 1e-3
LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 2e-6, 1e-6, 1e-5
SMALL = 20_000
_opt = adamw(LR)
_CKPT = os.path.join(shared_dir_path("fsdp"), "ckpt")    # (carried to the ranks by the cases)


def _batches(name):
    return batches(name, 8, SEQS, seed=10)


class Case:
    def __init__(self, name="gpt", tag="", **kw):
        self.name, self.tag, self.kw = name, tag, kw
        self.where = _CKPT

    @property
    def key(self) -> str:
        return f"{self.name}{self.tag}:" + ",".join(f"{k}={v}" for k, v in sorted(self.kw.items(), key=str))

    @property
    def reference_key(self):
        return (self.name, self.kw.get("clip_grad"), self.kw.get("dtype"))


def _train(prog, opt, items):
    losses, norms, grads = [], [], None
    for step, (args, kwargs) in enumerate(items):
        losses.append(prog.train_step(args, opt, kwargs=kwargs))
        norms.append(prog.last_grad_norm)
        if step == 0:
            grads = prog.full_grads()
    return losses, norms, grads


def _held(prog, opt) -> dict:
    """What the rank holds between steps, in elements: parameters, gradients, Adam's moments."""
    params = sum(p.numel() for p in prog.parameters())
    grads = sum(p.grad.numel() for p in prog.parameters() if p.grad is not None)
    inner = prog.zero.optimizer if prog.zero is not None else opt
    state = sum(t.numel() for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    if prog.zero is not None:
        grads = sum(s.grad.numel() for s in prog.zero.shards if s.grad is not None)
    buffer = sum(b.data.untyped_storage().nbytes() for b in prog.grad_buffers.values())
    return {"params": params, "grads": grads, "state": state, "buffer_bytes": buffer}


def _run(rank: int, mesh: fxtron.Mesh, case: Case) -> dict:
    args, kwargs = batch(case.name, 2, 8, 0)
    kw = dict(case.kw)
    if case.tag == "load":          # a zero=3 (or plain) checkpoint of 2 steps, resumed here for the third
        pm = fxtron.parallelize(make(case.name, layers=4), mesh, example_inputs=args, example_kwargs=kwargs or None, **kw)
        prog = pm.program(rank)
        opt = _opt(prog.parameters())
        prog.load(case.where + str(kw.get("zero", 0)), opt)
        losses, norms, _ = _train(prog, opt, _batches(case.name)[2:])
        return {"losses": losses, "state": prog.full_state_dict()}
    if case.tag == "pretrained":     # transformers' weights into the pieces, and back out
        return _pretrained(rank, mesh, case, args, kwargs)
    pm = fxtron.parallelize(make(case.name, layers=4), mesh, example_inputs=args, example_kwargs=kwargs or None, **kw)
    prog = pm.program(rank)
    opt = _opt(prog.parameters())
    items = _batches(case.name)
    if case.tag == "save":
        losses, norms, grads = _train(prog, opt, items[:2])
        prog.save(case.where + str(3 - kw.get("zero", 0)), opt)      # read by the other zero level's "load"
        return {"losses": losses}
    losses, norms, grads = _train(prog, opt, items)
    out = {"losses": losses, "grads": grads, "state": prog.full_state_dict(), "norms": norms,
           "held": _held(prog, opt), "total": sum(p.numel() for p in make(case.name, layers=4).parameters())}
    if prog.zero is not None:
        out.update(waited=list(prog.zero.last_waited), buckets=sum(len(part.buf.buckets) for part in prog.zero.parts))
    if prog.fsdp is not None:
        units = list(prog.fsdp.units.values())
        table = sum(float(r.wire_bytes) for r in pm.collectives(rank) if r.op == "fsdp_gather")
        out.update(peak=prog.fsdp.peak_held, gathers=prog.fsdp.gathers, sent=prog.fsdp.bytes_sent, table=table,
                   largest=max(sum(u.numels) for u in units) * 4, units=len(units))
    return out


def _pretrained(rank, mesh, case, args, kwargs) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    src, out = case.where + "-hf", case.where + "-hf-out"
    torch.manual_seed(7)
    model = make(case.name, layers=4)
    if rank == 0:
        model.save_pretrained(src)
    dist.barrier()
    pm = fxtron.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs or None, **case.kw)
    prog = pm.program(rank, seed=123)          # its own init first: the load must overwrite every piece
    prog.load_pretrained(src)
    loaded = prog.full_state_dict()
    prog.save_pretrained(out)
    dist.barrier()
    back = AutoModelForCausalLM.from_pretrained(out).state_dict() if rank == 0 else None
    return {"loaded": loaded, "want": model.state_dict(), "back": back,
            "pieces": {n: tuple(p.shape) for n, p in prog.named_parameters()}}


JOBS = {
    2: [(fxtron.Mesh(2), [Case(zero=3), Case(zero=3, microbatches=2, clip_grad=0.5),
                          Case(zero=2, clip_grad=0.5, bucket_size=SMALL), Case(zero=2, microbatches=2),
                          Case(zero=3, dtype=torch.bfloat16, clip_grad=0.5),
                          Case(zero=3, gather_per_step=True, microbatches=2),
                          Case("llama", zero=3, recompute="selective", clip_grad=0.5),
                          Case("hf-llama", zero=3, recompute="full"), Case("hf-llama", tag="pretrained", zero=3),
                          Case(zero=1, overlap_param_gather=True, bucket_size=SMALL, clip_grad=0.5),
                          Case(zero=2, overlap_param_gather=True, bucket_size=SMALL, dtype=torch.bfloat16)])],
    4: [(fxtron.Mesh(4), [Case(zero=3, clip_grad=0.5), Case(zero=2), Case("hf-qwen2-tied", zero=3),
                          Case(zero=3, dp_shard=2, clip_grad=0.5), Case("llama", zero=3, dp_shard=2, microbatches=2),
                          Case(tag="save", zero=3)]),
        (fxtron.Mesh(4, tp=2), [Case(zero=3, sequence_parallel=True, clip_grad=0.5),
                                Case(zero=2, sequence_parallel=True),
                                Case(tag="load", zero=0), Case(tag="save", zero=0)]),
        (fxtron.Mesh(4, pp=2), [Case(zero=3, microbatches=2, clip_grad=0.5),
                                Case("llama", zero=3, microbatches=4, schedule="zb-h1"),
                                Case(zero=2, microbatches=2),
                                Case(zero=1, overlap_param_gather=True, microbatches=2, bucket_size=SMALL)]),
        (fxtron.Mesh(4), [Case(tag="load", zero=3)]),
        (fxtron.Mesh(4, cp=2), [Case(zero=3), Case(zero=3, dp_shard=2)]),
        (fxtron.Mesh(4, ep=2), [Case("hf-mixtral", zero=3, clip_grad=0.5), Case("hf-mixtral", zero=2, clip_grad=0.5)])],
}
CASES = [(str(mesh), case) for plan in JOBS.values() for mesh, cases in plan for case in cases
         if case.tag not in ("save", "load", "pretrained")]


results = cases_fixture(JOBS, _run, timeout_s=1500)


@pytest.fixture(scope="module", autouse=True)
def _checkpoints():
    """The module's checkpoints, removed after it."""
    with shared_dir("fsdp") as path:
        yield path


@pytest.fixture(scope="module")
def reference():
    out = {}
    for _, case in CASES + [("", Case())]:
        if case.reference_key not in out:
            name, clip, dtype = case.reference_key
            out[case.reference_key] = reference_training(make(name, layers=4), _batches(name), _opt, dtype=dtype,
                                                         clip_grad=clip)
    return out


@pytest.mark.parametrize("mesh_key,case", CASES, ids=[f"{m}-{c.key}" for m, c in CASES])
def test_equivalence(results, reference, mesh_key, case):
    ref = reference[case.reference_key]
    for res in ranks_of(results, mesh_key, case):
        dl = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        dg, where = max_abs_diff(res["grads"], ref["grads"])
        state = {k: v for k, v in ref["state"].items() if k in res["state"]}
        dw, wwhere = max_abs_diff(res["state"], state)
        if case.kw.get("dtype") is not None:      # bf16 compute: the mixed-precision tests' tolerances
            gmax = max(g.abs().max().item() for g in ref["grads"].values())
            assert dl <= 2.0**-6 * max(abs(x) for x in ref["losses"])
            assert dg <= 2.0**-5 * gmax, f"gradient of {where} off by {dg}"
            assert dw <= 2 * len(SEQS) * LR, f"{wwhere} off by {dw}"
        else:
            assert dl < LOSS_TOL, (res["losses"], ref["losses"])
            assert dg < GRAD_TOL, f"gradient of {where} differs by {dg}"
            assert dw < WEIGHT_TOL, f"{wwhere} differs by {dw}"
        if case.kw.get("clip_grad"):       # (bf16: norms of bf16-computed gradients, within their rounding)
            rel = 2.0**-6 if case.kw.get("dtype") is not None else 1e-5
            for got, want in zip(res["norms"], ref["norms"]):
                assert abs(got - want) <= rel * want, (res["norms"], ref["norms"])
    print(f"{mesh_key} {case.key}: loss {dl:.1e} grad {dg:.1e} weight {dw:.1e}")   # pytest -s


def _case(results, mesh, **kw):
    key = next(c for m, c in CASES if m == str(mesh) and c.kw == kw)
    return ranks_of(results, mesh, key)


def test_zero3_holds_a_quarter_at_dp4(results):
    """Between steps a dp=4 rank holds a quarter of the parameters (padding to a multiple of 4
    aside), of their gradients and of Adam's two moments."""
    for res in _case(results, fxtron.Mesh(4), zero=3, clip_grad=0.5):
        total, held = res["total"], res["held"]
        assert total / 4 <= held["params"] <= total / 4 + 4 * 30, (held, total)
        assert held["grads"] == held["params"]
        assert held["state"] == 2 * held["params"]
        print(f"dp=4 zero=3: holds {held['params']:,} of {total:,} parameters, state {held['state']:,}")


def test_zero2_keeps_only_gradient_shards(results):
    """zero=2: between steps the gradient buffer's memory is given back and a rank holds 1/dp
    of the gradients; zero=1's keeps the whole buffer."""
    for res in _case(results, fxtron.Mesh(4), zero=2):
        held = res["held"]
        assert held["buffer_bytes"] == 0
        assert held["grads"] <= res["total"] / 4 + 4 * 8, held
        assert held["state"] == 2 * held["grads"]


def test_zero3_gathers_a_layer_at_a_time(results):
    """The gathered parameter bytes a rank holds at once stay within the largest layer held, the
    next one prefetched and the tied embedding (held from the lookup to the LM head), far below
    the whole model; each unit is gathered twice a step (forward, backward) per microbatch, and
    once with gather_per_step."""
    for res in _case(results, fxtron.Mesh(2), zero=3):
        whole = res["total"] * 4
        assert res["peak"] <= 3 * res["largest"] + 256 * 64 * 4, (res["peak"], res["largest"])
        assert res["peak"] < 0.6 * whole
        assert res["gathers"] <= 2 * res["units"]
        print(f"dp=2 zero=3: peak gathered {res['peak']:,} B of {whole:,} B, largest layer {res['largest']:,} B")
    for res in _case(results, fxtron.Mesh(2), zero=3, gather_per_step=True, microbatches=2):
        assert res["gathers"] == res["units"]


def test_collective_table_is_what_zero3_sends(results):
    """pm.collectives' gathers and reduce-scatters of a zero=3 rank add up to the bytes the step
    sent (ring algorithms), at dp=2 and dp=4 and with HSDP's replica all-reduce."""
    for mesh, kw in ((fxtron.Mesh(2), dict(zero=3)), (fxtron.Mesh(4), dict(zero=3, clip_grad=0.5)),
                     (fxtron.Mesh(4), dict(zero=3, dp_shard=2, clip_grad=0.5))):
        for res in _case(results, mesh, **kw):
            assert res["sent"] == pytest.approx(res["table"], rel=1e-9, abs=8), (kw, res["sent"], res["table"])


def test_checkpoint_between_zero3_and_plain(results, reference):
    """A zero=3 checkpoint (dp=4) resumes at tp=2 x dp=2 without zero, and a plain tp=2 x dp=2
    one resumes at dp=4 with zero=3: the third step equals the uninterrupted run's."""
    ref = reference[("gpt", None, None)]
    for mesh, zero in ((fxtron.Mesh(4, tp=2), 0), (fxtron.Mesh(4), 3)):
        for res in ranks_of(results, mesh, Case(tag="load", zero=zero)):
            assert abs(res["losses"][0] - ref["losses"][2]) < LOSS_TOL, (res["losses"], ref["losses"])
            state = {k: v for k, v in ref["state"].items() if k in res["state"]}
            dw, where = max_abs_diff(res["state"], state)
            assert dw < WEIGHT_TOL, f"{where} differs by {dw}"


def test_gathers_and_frees_in_the_graph():
    """zero=3 is in the per-rank graph: one gather before each layer's first use, one free after
    its last; pm.collectives lists per layer the forward all-gather and backward's all-gather and
    reduce-scatter, 1.5x the bytes of zero=0's gradient all-reduce (but for the position table,
    which backward does not gather again); the summary's parameters are the rank's pieces."""
    args, _ = batch("gpt", 2, 8, 0)
    plain = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(4, tp=2), example_inputs=args)
    pm = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(4, tp=2), example_inputs=args, zero=3)
    g = pm.compiled(0).gm
    gathers = [n for n in g.graph.nodes if n.target == torch.ops.fxtron.fsdp_gather.default]
    frees = [n for n in g.graph.nodes if n.target == torch.ops.fxtron.fsdp_free.default]
    assert [n.args[1] for n in gathers] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f"]
    assert sorted(n.args[1] for n in frees) == sorted(n.args[1] for n in gathers)
    order = {n: i for i, n in enumerate(g.graph.nodes)}
    for gather in gathers:
        free = next(f for f in frees if f.args[1] == gather.args[1])
        users = [u for item in gather.users for u in item.users if u is not free]
        assert users and all(order[gather] < order[u] < order[free] for u in users)
    text = pm.graph(0)
    assert "fsdp_gather" in text and "fsdp_free" in text
    recs = [r for r in pm.collectives(0) if r.op == "fsdp_gather"]
    assert sorted({(r.phase, r.kind) for r in recs}) == [("backward", "all_gather"), ("backward", "reduce_scatter"),
                                                        ("forward", "all_gather")]
    assert all(r.group == "dp" and len(r.ranks) == 2 for r in recs)
    wire = float(sum(r.wire_bytes for r in recs))
    local = plain.compiled(0).local
    padded = {n: -(-torch.Size(p.local_shape).numel() // 2) * 2 for n, p in local.items()}
    allreduce = 2 * (2 - 1) / 2 * sum(padded.values()) * 4      # ring all-reduce of the fp32 gradients over dp=2
    lookup = (2 - 1) / 2 * padded["wpe.weight"] * 4     # the position table, read by a lookup, is not gathered again
    assert wire == pytest.approx(1.5 * allreduce - lookup, rel=1e-9)
    held = {n: p.held_shape for n, p in pm.compiled(0).local.items()}
    assert all(len(s) == 1 and s[0] == -(-torch.Size(local[n].local_shape).numel() // 2) for n, s in held.items())
    total = sum(s[0] for s in held.values())
    assert f"{total:,}" in pm.summary()


def test_pretrained_into_pieces_and_back(results):
    """load_pretrained under zero=3 fills each rank's flat pieces (reading only the rows they
    span) with transformers' own weights, exactly; save_pretrained gathers them back into files
    transformers loads to the same tensors."""
    for rank, res in enumerate(ranks_of(results, fxtron.Mesh(2), Case("hf-llama", tag="pretrained", zero=3))):
        assert all(len(shape) == 1 for shape in res["pieces"].values())
        d, where = max_abs_diff({k: v for k, v in res["loaded"].items() if k in res["want"]},
                                {k: v for k, v in res["want"].items() if k in res["loaded"]})
        assert d == 0.0, f"{where} differs by {d}"
        if rank == 0:
            d, where = max_abs_diff(res["back"], res["want"])
            assert d == 0.0, f"{where} differs by {d}"


def test_overlap_param_gather_waits_bucket_by_bucket(results):
    """zero=1/2 with overlap_param_gather: nothing waits for the updated parameters before the
    forward; each layer's param_wait waits for its own buckets as the forward reaches it --
    every bucket once during the forward, the first layer's first (the buffer holds the buckets
    last-used first: the highest index)."""
    for kw in (dict(zero=1, overlap_param_gather=True, bucket_size=SMALL, clip_grad=0.5),
               dict(zero=2, overlap_param_gather=True, bucket_size=SMALL, dtype=torch.bfloat16)):
        for res in _case(results, fxtron.Mesh(2), **kw):
            assert res["buckets"] >= 6
            assert sorted(res["waited"]) == list(range(res["buckets"])), res["waited"]   # each in the forward
            assert res["waited"][0] == res["buckets"] - 1, res["waited"]     # the first layer's bucket first
    args, _ = batch("gpt", 2, 8, 0)
    pm = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2), example_inputs=args, zero=1,
                            overlap_param_gather=True)
    waits = [n.args[1] for n in pm.compiled(0).gm.graph.nodes if n.target == torch.ops.fxtron.param_wait.default]
    assert waits == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f"]
    with pytest.raises(fxtron.ParallelizeError, match="overlap_param_gather=True .* zero=0 has none"):
        fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2), example_inputs=args, overlap_param_gather=True)


def test_hybrid_sharding(results):
    """HSDP (dp_shard=2 at dp=4): a rank holds half of the parameters and of Adam's state (its
    shard group's piece, the same as its replica's); pm.collectives adds each layer's all-reduce
    of the reduced pieces over the replicas."""
    for res in _case(results, fxtron.Mesh(4), zero=3, dp_shard=2, clip_grad=0.5):
        total, held = res["total"], res["held"]
        assert total / 2 <= held["params"] <= total / 2 + 2 * 30, (held, total)
        assert held["state"] == 2 * held["params"]
    args, _ = batch("gpt", 2, 8, 0)
    pm = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(4), example_inputs=args, zero=3, dp_shard=2)
    recs = [r for r in pm.collectives(1) if r.op == "fsdp_gather"]
    assert {(r.kind, r.group, r.ranks) for r in recs} == {("all_gather", "dp/shard:2", (0, 1)),
                                                         ("reduce_scatter", "dp/shard:2", (0, 1)),
                                                         ("all_reduce", "dp/replicate:2", (1, 3))}
    with pytest.raises(fxtron.ParallelizeError, match="dp_shard=3 must divide the 4 data-parallel ranks"):
        fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(4), example_inputs=args, zero=3, dp_shard=3)
    with pytest.raises(fxtron.ParallelizeError, match="dp_shard=2 shards zero=3's parameters"):
        fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(4), example_inputs=args, zero=1, dp_shard=2)


def test_zero_without_data_parallel_ranks_says_so():
    """zero on a mesh with one data-parallel rank shards nothing: a warning and a summary line,
    an error under strict; the fix it names (zero=0) is accepted."""
    args, _ = batch("gpt", 2, 8, 0)
    with pytest.warns(fxtron.ParallelizeWarning, match=r"zero=3 .* \(dp=1 x cp=1\): nothing is sharded"):
        pm = fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2, tp=2), example_inputs=args, zero=3)
    assert "data parallel: zero=3" in pm.summary()
    with pytest.raises(fxtron.ParallelizeError, match="use a mesh with dp x cp > 1, or zero=0"):
        fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2, tp=2), example_inputs=args, zero=3, strict=True)
    fxtron.parallelize(make("gpt", layers=2), fxtron.Mesh(2, tp=2), example_inputs=args, zero=0, strict=True)


# ------------------------------------------------------------------------------ the end of a run
def _dropped(rank, mesh, zero):
    """A program trained and dropped goes (nothing keeps it: not its parameters' hooks, not
    the records its pieces carry), and once the groups are destroyed no gloo thread is left."""
    import gc
    import weakref

    from fxtron.runtime import groups as G
    model = make("gpt", layers=2)
    prog = fxtron.parallelize(model, mesh, example_inputs=batch("gpt", 4, 8, 0)[0], zero=zero).program(rank)
    opt = adamw()(prog.parameters())
    prog.train_step(batch("gpt", 4, 8, 0)[0], opt)
    prog.settle()
    gone = [weakref.ref(prog), weakref.ref(prog.grads)] + ([weakref.ref(prog.fsdp)] if prog.fsdp is not None else [])
    del prog, opt
    gc.collect()
    alive = [type(r()).__name__ for r in gone if r() is not None]
    G.destroy()
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return {"alive": alive, "threads": threads}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from /proc")
@pytest.mark.parametrize("zero", [1, 3])
def test_a_dropped_program_and_destroyed_groups_leave_no_thread(zero):
    """A zero=1/3 program held itself through its parameters' hooks and records, and with it its
    process groups: their gloo threads lived on into interpreter exit, where a run whose work
    was done could abort ('terminate called without an active exception')."""
    from fxtron.tools.testing import run_on_ranks
    mesh = fxtron.Mesh(2)
    for rank, out in enumerate(run_on_ranks(_dropped, mesh, mesh, zero, timeout_s=300)):
        assert out["alive"] == [], f"rank {rank}: still alive after the program was dropped: {out['alive']}"
        assert not [t for t in out["threads"] if "gloo" in t], f"rank {rank}: threads left: {out['threads']}"
