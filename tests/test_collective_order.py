"""Collective order checked the way NCCL needs it, and a flight recorder for hung collectives
(issue: reliability, items 2 and 3).

With the order check on (`check_collectives=True`, as FXTRON_CHECK_COLLECTIVES=1 sets it) and
the shared-memory channel off (every collective through gloo, as through NCCL), two ranks run
programs that diverge the ways a real job's do: a model of another width, another collective
of the same size (which NCCL would run and mix), one collective more (a norm only one rank
computes), a step that ends early on one rank, and pipeline transfers received in another
order with tags off (gloo then pairs them by order, as NCCL always does: the data would be
swapped without a word). Each is a ParallelizeError on both ranks naming the first differing
operation on each. A correct program with the check on runs unchanged and is checked.

Without the check, a rank that waits for a peer stuck elsewhere times out, and the job ends
with what every rank was waiting in (the flight recorder), the killed rank included.
(tests/test_pipeline.py runs its 4-process job with tags off and the check on: every schedule
under NCCL's pairing rule; tests/test_context_parallel.py runs with the check on.)
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
from torch import nn

import fxtron
from fxtron.errors import LaunchError, ParallelizeError
from fxtron.runtime.batch import check_same_batch
from fxtron.ops import ledger, transport
from fxtron.runtime.groups import groups_for
from fxtron.tools.testing import adamw, cases_fixture, ranks_of, run_on_ranks, scaled
from tp_models import batch, make

pytestmark = pytest.mark.slow      # gloo jobs


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return (x + self.down(torch.relu(self.up(x)))).pow(2).mean()


def _group(mesh, kind):
    return groups_for(mesh).group(kind)


def _case(rank, mesh, case):
    try:
        out = CASES[case](rank, mesh)
    except ParallelizeError as exc:
        return {"error": str(exc), "stats": ledger.stats()}
    return {"error": None, "out": out, "stats": ledger.stats()}


def _widths(rank, mesh):
    width = 16 if rank == 0 else 8          # rank 1 runs a model of another width
    model = MLP(width)
    x = torch.randn(4, 8, width)
    prog = fxtron.parallelize(model, mesh, example_inputs=(x,)).program(rank)
    prog.eval()
    prog(x)     # (its forward: train_step would first find the ranks' batches differ, check_same_batch)


def _ops(rank, mesh):
    t = torch.ones(4, 8)
    if rank == 0:
        transport.all_reduce(t, _group(mesh, "tp"))
    else:
        transport.all_gather(t, _group(mesh, "tp"))


def _extra(rank, mesh):
    model = make("gpt")
    args = batch("gpt", 4, 8, 0)[0]
    prog = fxtron.parallelize(model, mesh, example_inputs=args).program(rank)
    opt = torch.optim.SGD(prog.parameters(), lr=0.1)
    prog.train_step(args, opt)
    if rank == 0:
        prog.grad_norm()                     # one collective more, on rank 0 only
    prog.train_step(args, opt)


def _step_end(rank, mesh):
    if rank == 0:
        transport.all_reduce(torch.ones(3), _group(mesh, "tp"))
    else:
        ledger.step_end(groups_for(mesh))


def _p2p_order(rank, mesh):
    from fxtron.runtime.pp.p2p import P2P, Slot
    p2p = P2P(groups_for(mesh), match_by_tag=False)
    slot = [Slot(torch.float32, 2, (2, 3), False)]
    got = []
    if rank == 0:
        for mb in (0, 1):
            p2p.send_forward([torch.full((2, 3), float(mb))], slot, mb, to_stage=1)
    else:
        p2p.exchange([], [("act", 1, 1, slot), ("act", 0, 1, slot)])     # posted in the other order
        got = [float(p2p.wait("act", mb, 1)[0][0, 0]) for mb in (1, 0)]
    p2p.finish()
    ledger.step_end(groups_for(mesh))
    return got


_opt = adamw(eps=1e-8, weight_decay=0.01)         # torch's defaults


def _correct(rank, mesh):
    model = make("gpt")
    args = batch("gpt", 4, 8, 0)[0]
    prog = fxtron.parallelize(model, mesh, example_inputs=args, sequence_parallel=True).program(rank)
    opt = _opt(prog.parameters())
    before = ledger.stats()["checked"]
    losses = [prog.train_step(batch("gpt", 4, 8, s)[0], opt) for s in range(2)]
    return {"losses": losses, "checked": ledger.stats()["checked"] - before}


CASES = {"widths": _widths, "ops": _ops, "extra": _extra, "step-end": _step_end, "correct": _correct,
         "p2p-order": _p2p_order}
TP = fxtron.Mesh(2, tp=2)
PP = fxtron.Mesh(2, pp=2)


# the cases that raise leave both ranks at the same collective number, but "step-end"
# (one rank's collective against the other's step end) does not: it runs last on its mesh
checked = cases_fixture({2: [(TP, ["correct", "widths", "ops", "extra", "step-end"]), (PP, ["p2p-order"])]}, _case,
                        timeout_s=300, check_collectives=True, shm_transport=False)


def _errors(res, mesh, case):
    out = ranks_of(res, mesh, case)
    errors = [r["error"] for r in out]
    assert all(errors), f"{case}: a rank went on without an error: {errors}"
    return errors


def test_a_model_of_another_width_on_one_rank_is_named_before_the_collective(checked):
    for e in _errors(checked, TP, "widths"):
        assert re.search(r"diverged at collective #\d+ on group tp \(ranks 0, 1\): rank 0 all_reduce \(4, 8, 16\) "
                         r"float32, rank 1 all_reduce \(4, 8, 8\) float32", e), e


def test_another_collective_of_the_same_size_is_named(checked):
    for e in _errors(checked, TP, "ops"):
        assert "rank 0 all_reduce (4, 8) float32, rank 1 all_gather (4, 8) float32" in e, e
        assert "NCCL matches them by order" in e


def test_one_collective_more_on_one_rank_is_named_where_the_others_go_on(checked):
    for e in _errors(checked, TP, "extra"):
        # rank 0's norm (a scalar all-reduce) against rank 1's first collective of the next step
        assert re.search(r"rank 0 all_reduce \(\) float32, rank 1 \w+", e), e
        assert "last operations of rank" in e


def test_a_step_that_ends_on_one_rank_only_is_named(checked):
    for e in _errors(checked, TP, "step-end"):
        assert "rank 0 all_reduce (3,) float32, rank 1 the end of step" in e, e


def test_transfers_received_in_another_order_are_named_at_the_step_end(checked):
    errors = _errors(checked, PP, "p2p-order")
    for e in errors:
        assert ("transfer #1 from rank 0 to rank 1: rank 0 sends send (2, 3) float32 to rank 1 "
                "[act of microbatch 0 for stage 1, tensor 0], rank 1 receives recv (2, 3) float32 from rank 0 "
                "[act of microbatch 1 for stage 1, tensor 0]") in e, e


def test_a_correct_program_is_checked_and_trains_unchanged(checked):
    out = [r["out"] for r in ranks_of(checked, TP, "correct")]
    assert all(o["checked"] > 20 for o in out), out        # every collective and both step ends
    ref = fxtron.tools.testing.reference_training(make("gpt"), [batch("gpt", 4, 8, s) for s in range(2)],
                                            _opt)
    for o in out:
        assert max(abs(a - b) for a, b in zip(o["losses"], ref["losses"])) < 2e-6, (o["losses"], ref["losses"])


# ------------------------------------------------------------------------------ a hung job
def _all_here(folder, rank, world):
    """Wait until every rank has reached this point (a file each, polled): not a collective,
    so that no collective timeout runs while a rank still compiles."""
    open(os.path.join(folder, str(rank)), "w").close()
    while not all(os.path.exists(os.path.join(folder, str(r))) for r in range(world)):
        time.sleep(0.01)


def _hang(rank, mesh, folder):
    model = make("gpt", layers=2)
    args = batch("gpt", 4, 8, 0)[0]
    prog = fxtron.parallelize(model, mesh, example_inputs=args, microbatches=2).program(rank)
    opt = torch.optim.SGD(prog.parameters(), lr=0.1)
    # both programs built first: rank 1's 3 s timeout then starts when rank 0 is about to wait
    # too (under load, one rank's compilation can lag the other's by more than 3 s)
    _all_here(folder, rank, mesh.world_size)
    if rank == 0:
        prog.train_step(args, opt)           # sends its activations, then waits for their gradients
    else:
        check_same_batch(prog.groups, (args, None))    # (the step's first collective, train_step's check)
        prog.grad_norm()                     # a program that diverged: a norm over pp first
    time.sleep(60)


def test_a_hung_collective_ends_the_job_with_what_every_rank_waits_in(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_on_ranks(_hang, PP, PP, str(tmp_path), timeout_s=120, collective_timeout_s=3, shm_transport=False)
    # from the hang on (both ranks' programs built: _all_here's files), not from the processes'
    # start, which on a loaded machine alone takes more than a minute
    start = max(os.path.getmtime(tmp_path / str(r)) for r in range(PP.world_size))
    took = time.time() - start
    msg = str(info.value)
    assert took < scaled(60), f"the job took {took:.0f} s to end"
    assert "what every rank was doing (flight recorder)" in msg, msg
    # rank 0 waits for the gradient of its first microbatch: its shapes first (on pp's control twin)
    assert re.search(r"rank 0: (waiting|failed) in transfer #1 on group pp control \(ranks 0, 1\): recv \(3,\) "
                     r"int64 from rank 1 \[grad of microbatch 0 for stage 0, shapes\]", msg), msg
    assert re.search(r"rank 1: (waiting|failed) in collective #2 on group pp \(ranks 0, 1\): all_reduce \(\) float32",
                     msg), msg
    assert "failed after" in msg            # the rank that timed out says which operation it was
