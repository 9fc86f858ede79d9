"""The shared-memory transport (ops/shm.py) of the tp group's collectives and of data
parallel's gradient buckets.

One 2-rank gloo job (Mesh(2, tp=2), whose tp group gets a channel) checks: all-reduce SUM / MAX,
all-gather and reduce-scatter against float64 sums of every rank's input, in several dtypes and
for inputs larger than one slot (sent in pieces); every rank gets bit-identical results; the
split all-reduce; a diverged program (ranks calling different ops) and a missing peer raise
clear errors instead of returning garbage or hanging; a segment that cannot be made leaves the
group on gloo on every rank; and tp=2 training through shared memory equals the same training
through gloo bit for bit (two ranks: a + b == b + a), while the channel carried every
collective of the programs (gloo carried none of theirs); collectives left open while others
start complete correctly; and dp=2 training, its buckets (zero=0's all-reduces, zero=1's
reduce-scatters) published during backward through the dp group's channel, equals gloo's bit
for bit; and a step that failed after publishing buckets leaves nothing in the next ones.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.ops import shm
from fxtron.runtime.groups import groups_for
from fxtron.tools.testing import run_on_ranks
from tp_models import batch, make

pytestmark = pytest.mark.slow      # a 2-process gloo job

BIG = shm.CAPACITY // 4 + 1000        # fp32 elements: more than one slot


def _input(rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if dtype in (torch.int64, torch.int32):
        return (x * 100).round().to(dtype)
    return x.to(dtype)


def _primitives(rank: int, comm: shm.ShmComm) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for n in (1, 1000, BIG):
            for op in (shm.OP_SUM, shm.OP_MAX):
                t = _input(rank, n, dtype)
                comm.all_reduce(t, op)
                out[("ar", str(dtype), n, op)] = t
    t = _input(rank, 2 * 3 * 4, torch.float32).view(2, 12)
    work = comm.start_all_reduce(t)
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))      # local work between the halves
    work.wait()
    out["split"] = t
    for n in (6, BIG + 1):
        x = _input(rank, 3 * n, torch.float32).view(3, n)
        out[("ag", n)] = torch.stack(comm.all_gather(x))
        y = _input(rank, 2 * 3 * n, torch.float32).view(3, 2 * n)
        out[("rs", n)] = comm.reduce_scatter(y, 1)
        out[("cat", n)] = comm.gather(x, 1)
        work = comm.start_reduce_scatter(y, 1)
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
        out[("rs-split", n)] = work.wait()
    # split-phase collectives left open while others run (gradient buckets started during
    # backward, a gather in between): the next collective completes the open one first
    a, b = _input(rank, 10, torch.float32), _input(rank, BIG, torch.float32)
    wa = comm.start_all_reduce(a)
    wb = comm.start_reduce_scatter(_input(rank, 12, torch.float32).view(2, 6), 0)
    c = comm.gather(_input(rank, 4, torch.float32), 0)
    wc = comm.start_all_reduce(b)                          # larger than a slot: reduced at once
    out["open"] = (wb.wait(), wa.wait(), a, c, wc.wait(), b, wb.wait())
    return out


def _errors(rank: int, pg) -> dict:
    out = {}
    comm = shm.channel(pg.group_name)
    # a diverged program: every rank sees the mismatch at the same collective and says so
    try:
        comm.all_reduce(torch.ones(5 + rank))
    except RuntimeError as e:
        out["diverged"] = str(e)
    comm.all_reduce(torch.ones(3))                 # the channel stays usable, in step
    # a missing peer: rank 0 waits alone on a channel with a short timeout, completing a split
    # all-reduce as its next collective starts; the split one's wait() then raises too (it never
    # got its sum)
    short = shm.ShmComm.create(pg, timeout_s=0.5)
    if rank == 0:
        work = short.start_all_reduce(torch.ones(3))
        try:
            short.all_reduce(torch.ones(4))
        except TimeoutError as e:
            out["timeout"] = str(e)
        try:
            work.wait()
        except TimeoutError as e:
            out["wait_after_timeout"] = str(e)
    short.close()
    dist.barrier(group=pg)
    # a reduce-scatter of a dim the group does not divide: refused before anything is published
    try:
        comm.reduce_scatter(torch.ones(3, 2), 0)
    except ValueError as e:
        out["indivisible"] = str(e)
    # a split all-reduce discarded (its step failed): the tensor is left as it is, the channel in step
    t = torch.full((4,), float(rank + 1))
    comm.start_all_reduce(t).discard()
    after = torch.full((2,), float(rank + 1))
    comm.all_reduce(after)
    out["discarded"] = (t.tolist(), after.tolist())
    # no segment can be made (the slots would need 2**50 bytes): every rank stays on gloo
    out["too_big"] = shm.ShmComm.create(pg, timeout_s=5.0, capacity=1 << 50)
    return out


def _train_both(rank: int, mesh: fxtron.Mesh, name: str, kind: str, **options) -> dict:
    """The same three steps through the `kind` group's shared-memory channel and through gloo:
    losses, weights after, and the collectives the channel carried."""
    comm = shm.channel((groups_for(mesh) or fxtron.init_distributed(mesh)).group(kind).group_name)
    args, _ = batch(name, 2, 8, seed=0)
    pm = fxtron.parallelize(make(name), mesh, example_inputs=args, **options)
    res = {}
    for transport in ("shm", "gloo"):
        prog = pm.program(rank)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        ops0 = comm.ops
        with (shm.disabled() if transport == "gloo" else contextlib.nullcontext()):
            losses = [prog.train_step(batch(name, 4, s, seed=10 + i)[0], opt) for i, s in enumerate((16, 12, 16))]
        res[transport] = {"losses": losses, "state": {k: v.clone() for k, v in prog.state_dict().items()},
                          "shm_ops": comm.ops - ops0, "buckets": len(prog.grads.buffer.buckets),
                          "early": prog.grads.buffer.started_early}
    return res


def _train(rank: int, mesh: fxtron.Mesh, name: str, sp: bool) -> dict:
    return _train_both(rank, mesh, name, "tp", sequence_parallel=sp)


def _train_dp(rank: int, mesh: fxtron.Mesh, zero: int) -> dict:
    """dp=2: the gradient buckets go through the dp group's channel, started during backward."""
    return _train_both(rank, mesh, "gpt", "dp", zero=zero, bucket_size=5000)


def _train_after_a_failed_step(rank: int, zero: int) -> dict:
    """dp=2 through the dp group's channel: a step whose backward fails on every rank after its
    first buckets were published (the error caught, the step dropped), then two good steps;
    against the same two steps without the failed one. The buckets the failed step started must
    not land in the next step's gradients."""
    mesh = fxtron.Mesh(2)
    args, _ = batch("gpt", 2, 8, seed=0)
    pm = fxtron.parallelize(make("gpt"), mesh, example_inputs=args, zero=zero, bucket_size=5000)
    steps = [batch("gpt", 4, 16, seed=20 + i)[0] for i in range(2)]
    res = {}
    for failed_first in (True, False):
        prog = pm.program(rank)
        opt = torch.optim.AdamW(prog.parameters(), lr=1e-3)
        if failed_first:      # the embedding's gradient is backward's last: the layers' buckets started
            emb = dict(prog.named_parameters())["wte.weight"]
            hook = emb.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
            try:
                prog.train_step(batch("gpt", 4, 16, seed=19)[0], opt)
            except RuntimeError as e:
                res["error"] = str(e)
            hook.remove()
            res["started_before_failing"] = prog.grads.buffer.started_early
        losses = [prog.train_step(b, opt) for b in steps]
        res[failed_first] = {"losses": losses, "state": {k: v.clone() for k, v in prog.state_dict().items()}}
    return res


def _job(rank: int, mesh: fxtron.Mesh) -> dict:
    pg = groups_for(mesh).group("tp")
    comm = shm.channel(pg.group_name)
    assert comm is not None and comm.size == 2 and comm.index == rank
    out = {"prim": _primitives(rank, comm), "err": _errors(rank, pg)}
    for name, sp in (("llama", False), ("gpt", True)):
        out[(name, sp)] = _train(rank, mesh, name, sp)
    for zero in (0, 1):
        out[("dp", zero)] = _train_dp(rank, fxtron.Mesh(2), zero)
    for zero in (0, 1, 3):
        out[("failed", zero)] = _train_after_a_failed_step(rank, zero)
    return out


@pytest.fixture(scope="module")
def ranks():
    mesh = fxtron.Mesh(2, tp=2)
    return run_on_ranks(_job, mesh, mesh, timeout_s=300)


def _ref_inputs(n, dtype, world=2):
    return [_input(r, n, dtype) for r in range(world)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64], ids=str)
@pytest.mark.parametrize("n", [1, 1000, BIG])
def test_all_reduce_sum_and_max(ranks, dtype, n):
    xs = _ref_inputs(n, dtype)
    for op, ref in ((shm.OP_SUM, xs[0].double() + xs[1].double()),
                    (shm.OP_MAX, torch.maximum(xs[0], xs[1]).double())):
        got = [r["prim"][("ar", str(dtype), n, op)] for r in ranks]
        assert got[0].dtype == dtype and torch.equal(got[0], got[1])          # identical bits on every rank
        tol = {torch.bfloat16: 2 ** -7 * ref.abs().max().item()}.get(dtype, 0.0 if dtype == torch.int64 else 1e-6)
        torch.testing.assert_close(got[0].double(), ref, rtol=0, atol=tol)


def test_split_all_reduce(ranks):
    xs = [_input(r, 24, torch.float32).view(2, 12) for r in range(2)]
    for r in ranks:
        torch.testing.assert_close(r["prim"]["split"], xs[0] + xs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [6, BIG + 1])
def test_all_gather_and_reduce_scatter(ranks, n):
    xs = [_input(r, 3 * n, torch.float32).view(3, n) for r in range(2)]
    ys = [_input(r, 6 * n, torch.float32).view(3, 2 * n) for r in range(2)]
    total = ys[0].double() + ys[1].double()
    for rank, r in enumerate(ranks):
        assert torch.equal(r["prim"][("ag", n)], torch.stack(xs))
        assert torch.equal(r["prim"][("cat", n)], torch.cat(xs, 1))
        for key in ("rs", "rs-split"):
            torch.testing.assert_close(r["prim"][(key, n)].double(), total[:, rank * n:(rank + 1) * n], rtol=0, atol=1e-6)


def test_open_collectives_complete_when_the_next_one_starts(ranks):
    a = [_input(r, 10, torch.float32) for r in range(2)]
    y = [_input(r, 12, torch.float32).view(2, 6) for r in range(2)]
    c = torch.cat([_input(r, 4, torch.float32) for r in range(2)])
    b = [_input(r, BIG, torch.float32) for r in range(2)]
    for rank, r in enumerate(ranks):
        rs, done_a, got_a, got_c, done_b, got_b, rs_again = r["prim"]["open"]
        assert done_a is True and done_b is True and rs_again is rs        # a second wait() changes nothing
        torch.testing.assert_close(got_a, a[0] + a[1], rtol=0, atol=1e-6)
        torch.testing.assert_close(rs, (y[0] + y[1])[rank:rank + 1], rtol=0, atol=1e-6)
        assert torch.equal(got_c, c)
        torch.testing.assert_close(got_b, b[0] + b[1], rtol=0, atol=1e-6)


def test_diverged_program_and_missing_peer_raise(ranks):
    for rank, r in enumerate(ranks):
        msg = r["err"]["diverged"]
        assert "diverged" in msg and "5 x torch.float32" in msg and "6 x torch.float32" in msg, msg
        assert r["err"]["too_big"] is None
    msg = ranks[0]["err"]["timeout"]
    assert "ranks [1] of the group did not arrive within 0.5 s" in msg, msg
    assert ranks[0]["err"]["wait_after_timeout"] == msg
    for rank, r in enumerate(ranks):
        assert "dim 0 of shape (3, 2) cannot be split over the 2 ranks" in r["err"]["indivisible"]
        assert r["err"]["discarded"] == ([rank + 1.0] * 4, [3.0, 3.0])


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_failed_step_leaves_no_gradient_behind(ranks, zero):
    """A step whose backward raised after publishing buckets (zero=3: after starting its units'
    reduce-scatters; the caller caught it and went on): the next steps train exactly as
    without it."""
    for r in ranks:
        res = r[("failed", zero)]
        assert res["error"] == "injected" and (res["started_before_failing"] > 0 or zero == 3)
        assert res[True]["losses"] == res[False]["losses"]
        for k, v in res[True]["state"].items():
            assert torch.equal(v, res[False]["state"][k]), k


@pytest.mark.parametrize("case", [("llama", False), ("gpt", True)], ids=["llama", "gpt+sp"])
def test_training_through_shared_memory_equals_gloo_bit_for_bit(ranks, case):
    for r in ranks:
        res = r[case]
        assert res["shm"]["shm_ops"] > 0 and res["gloo"]["shm_ops"] == 0
        assert res["shm"]["losses"] == res["gloo"]["losses"]
        for k, v in res["shm"]["state"].items():
            assert torch.equal(v, res["gloo"]["state"][k]), k


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_buckets_through_shared_memory_equal_gloo_bit_for_bit(ranks, zero):
    """dp=2 on one host: each bucket is published as backward completes it (zero=0's all-reduce,
    zero=1's reduce-scatter), the channel carrying them all; the same training as through gloo."""
    for r in ranks:
        res = r[("dp", zero)]
        assert res["shm"]["buckets"] > 2 and res["shm"]["early"] > 0
        assert res["shm"]["shm_ops"] >= 3 * res["shm"]["buckets"] and res["gloo"]["shm_ops"] == 0
        assert res["shm"]["losses"] == res["gloo"]["losses"]
        for k, v in res["shm"]["state"].items():
            assert torch.equal(v, res["gloo"]["state"][k]), k
