"""The launcher and process groups: results in rank order, groups equal to the mesh's, a
failing rank ends the job promptly with its traceback, and the same code under torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import fxtron
from fxtron.runtime.groups import groups_for
from fxtron.tools.testing import run_on_ranks, scaled

pytestmark = pytest.mark.slow      # gloo jobs and torchrun


def _groups_job(rank: int, mesh: fxtron.Mesh):
    g = groups_for(mesh)
    out = {}
    for kind in ("tp", "dp", "pp", "cp", "dp-cp", "tp-pp", "embedding"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g.group(kind))          # sum of the ranks in my group
        # the collective timeout of every group, not only the default one's (torch's own for a
        # new group is 30 minutes): read through gloo's backend options
        timeout = g.group(kind)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        out[kind] = (g.ranks(kind), float(t), timeout)
    return rank, out


def test_groups_match_mesh_and_communicate():
    mesh = fxtron.Mesh(8, tp=2, pp=2)
    results = run_on_ranks(_groups_job, mesh, mesh, collective_timeout_s=77.0)
    assert [r for r, _ in results] == list(range(8))
    for rank, out in results:
        for kind, (ranks, total, timeout) in out.items():
            assert list(ranks) == mesh.group_of(kind, rank), (kind, rank)
            assert total == sum(ranks), (kind, rank)
            assert timeout == 77.0, (kind, rank, timeout)


def _again_job(rank: int, mesh: fxtron.Mesh):
    """Tear the job's groups down and make them again, twice (a launched function that runs the
    trainer twice does so): each rendezvous on the launcher's store, under its own keys."""
    from fxtron.runtime import groups as G
    sums = []
    for _ in range(2):
        G.destroy()
        g = G.init_distributed(mesh)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g.group("tp"))
        sums.append(float(t))
    return sums


def test_a_launched_rank_may_init_again_after_destroy():
    """Before: rank 0's second rendezvous tried to host a store on the port the launcher holds
    (EADDRINUSE) and the job failed."""
    mesh = fxtron.Mesh(2, tp=2)
    assert run_on_ranks(_again_job, mesh, mesh) == [[3.0, 3.0], [3.0, 3.0]]


def _fail_job(rank: int):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)      # rank 0 waits here for rank 1, which never comes
    return rank


def test_failing_rank_ends_job_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(fxtron.LaunchError) as err:
        run_on_ranks(_fail_job, 2, timeout_s=120)
    msg = str(err.value)
    assert "rank 1 failed" in msg and "boom on purpose" in msg and "_fail_job" in msg
    assert time.monotonic() - start < scaled(60)  # the waiting rank is killed, not waited for


def _refuse_job(rank: int, mode: str):
    dist.barrier()
    if mode == "every":
        raise fxtron.ParallelizeError("a mistake of the user's, on purpose")
    if rank == 0:
        raise fxtron.ParallelizeError("rank 0's mistake, on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)      # rank 1 waits here for rank 0, which never comes
    return rank


def test_the_same_parallelize_error_of_the_ranks_is_said_once():
    """A user's mistake found once the processes started (the trace shows the model cannot be
    split as asked) is one message, the ranks that raised it and one traceback -- not every
    rank's traceback and the flight recorder's 'no communication recorded' for each."""
    with pytest.raises(fxtron.RefusalError) as err:
        run_on_ranks(_refuse_job, 2, "every", timeout_s=120)
    msg = str(err.value)
    assert isinstance(err.value, fxtron.LaunchError) and isinstance(err.value, fxtron.ParallelizeError)
    assert msg.startswith("a mistake of the user's, on purpose\n\n(raised on every rank (2) once the processes had "
                          "started; rank "), msg
    assert msg.count("Traceback") == 1 and "_refuse_job" in msg and "flight recorder" not in msg, msg
    # one rank's, the other waiting for it in a collective: a peer's failure, which follows from it
    with pytest.raises(fxtron.RefusalError, match=r"^rank 0's mistake, on purpose\n\n\(raised on rank 0 once"):
        run_on_ranks(_refuse_job, 2, "one", timeout_s=120)


def test_a_refusal_is_one_only_where_every_failure_is_it_or_follows_from_it():
    from fxtron.runtime.launch import _PEER, _REFUSED, _head, _refusal
    said = [_head(f"{_REFUSED}no{_REFUSED}rank {r} failed:\nTraceback ...") for r in (0, 1)]
    peer = _head(f"{_PEER}{_PEER}rank 1 failed:\nTraceback ... PeerError")
    other = _head("rank 1 failed:\nTraceback ... RuntimeError: boom")
    assert str(_refusal(said, 2)).startswith("no\n\n(raised on every rank (2) once the processes had started; rank 0's")
    assert str(_refusal([said[0], peer], 2)).startswith("no\n\n(raised on rank 0 once")
    assert _refusal([said[0], other], 2) is None                    # another failure beside it
    assert _refusal([said[0], _head(f"{_REFUSED}yes{_REFUSED}rank 1 failed:")], 2) is None   # two mistakes
    assert _refusal([peer], 2) is None and _refusal([], 2) is None


def _warn_job(rank: int):
    import warnings
    for _ in range(2):
        warnings.warn("fxtron does this differently from one process, on purpose", fxtron.ParallelizeWarning)
    warnings.warn(f"stage {rank} does this, on purpose", fxtron.ParallelizeWarning)
    warnings.warn("a plain warning of the user's, on purpose", UserWarning)
    return rank


def test_a_parallelize_warning_of_every_rank_shows_once(capfd):
    """What every rank warns of (the same words) is shown once for the job, not once per rank;
    a warning whose words name the rank shows on each, and other warnings are Python's."""
    assert run_on_ranks(_warn_job, 2, timeout_s=120) == [0, 1]
    err = capfd.readouterr().err
    shown = lambda words: err.count(f"Warning: {words}")     # noqa: E731 - (not the source line below it)
    assert shown("fxtron does this differently from one process, on purpose") == 1, err
    assert shown("stage 0 does this") == 1 and shown("stage 1 does this") == 1, err
    assert shown("a plain warning of the user's, on purpose") == 2, err


def _exit_job(rank: int):
    dist.barrier()  # every group is up: the death below is the only failure
    if rank == 0:
        os._exit(3)
    return rank


def test_rank_that_dies_silently_is_reported():
    with pytest.raises(fxtron.LaunchError, match="rank 0 died with exit code 3"):
        run_on_ranks(_exit_job, 2, timeout_s=120)


def test_a_dead_peer_is_a_peer_error_naming_its_rank_and_exit():
    with pytest.raises(fxtron.PeerError) as err:
        run_on_ranks(_exit_job, 2, timeout_s=120)
    assert isinstance(err.value, fxtron.LaunchError) and isinstance(err.value, fxtron.ParallelizeError)
    assert str(err.value).startswith("rank 0 died with exit code 3 without a traceback"), str(err.value)


def test_a_script_that_launches_without_a_main_guard_is_told_to_add_one(tmp_path):
    """Each rank's process imports the launching script to find its function: unguarded, the
    import launched again, and multiprocessing's bootstrapping error spoke of freeze_support."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import fxtron

        def work(rank):
            return rank

        fxtron.launch(work, fxtron.Mesh(2))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert 'call fxtron.launch under `if __name__ == "__main__":`' in done.stderr, done.stderr[-2000:]
    # a guarded script whose launch runs in a child process it spawned (a sweep isolating its runs)
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import fxtron

        def work(rank):
            return rank

        def run(q):
            q.put(fxtron.launch(work, fxtron.Mesh(2)))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=run, args=(q,))
            p.start()
            print(q.get(timeout=240))
            p.join()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "[0, 1]" in done.stdout, done.stderr[-2000:]


class _KilledWhileSaved:
    """A result whose saving kills its rank (the OOM killer's moment: saving a large result
    doubles the rank's memory)."""

    def __reduce__(self):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_while_reporting_job(rank: int):
    return {"big": torch.zeros(1 << 20), "then": _KilledWhileSaved()} if rank == 1 else rank


def test_a_rank_killed_while_reporting_its_result_ends_the_job():
    """A rank's result reaches the launcher as a file and a notice of a few bytes: a rank killed
    at any moment of its report leaves no half-read message to block the launcher forever."""
    t0 = time.monotonic()
    with pytest.raises(fxtron.PeerError, match="rank 1 died killed by SIGKILL"):
        fxtron.launch(_killed_while_reporting_job, fxtron.Mesh(2), timeout_s=scaled(120))
    assert time.monotonic() - t0 < scaled(60)


def test_a_collective_whose_peer_closed_is_a_peer_error():
    from fxtron.ops import ledger
    e = ledger.Entry(n=1, group="tp", seq=4, op="send", shape=(2, 8), dtype=0, peer=1, issued=time.time())
    err = ledger.failure(e, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))
    assert isinstance(err, fxtron.PeerError) and isinstance(err, fxtron.ParallelizeError)
    assert "rank 1 died (its connection closed) during transfer #4 on group tp" in str(err), str(err)
    other = ledger.failure(e, RuntimeError("Timed out waiting 1000ms"))
    assert type(other) is ledger.CollectiveFailure and isinstance(other, fxtron.ParallelizeError)


def _sleep_job(rank: int):
    time.sleep(3600)      # longer than any job timeout (run_on_ranks stretches them under load)


def test_job_timeout():
    with pytest.raises(fxtron.LaunchError, match="timed out"):
        run_on_ranks(_sleep_job, 2, timeout_s=8)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, sys, torch, fxtron
    from fxtron.models import build, example_inputs
    mesh = fxtron.Mesh(2, tp=2)          # tensor parallel: the collectives run over torchrun's group
    groups = fxtron.init_distributed(mesh)
    model = build("gpt-tiny", seed=0)
    pm = fxtron.parallelize(model, mesh, example_inputs=example_inputs("gpt-tiny", batch=4, seq=8))
    prog = pm.program(groups.rank, groups)
    opt = torch.optim.SGD(prog.parameters(), lr=0.1)
    losses = [prog.train_step(example_inputs("gpt-tiny", batch=4, seq=8, seed=s), opt) for s in range(2)]
    import warnings
    warnings.warn("every rank's words, on purpose", fxtron.ParallelizeWarning)
    if groups.rank == 0:
        print("LOSSES", json.dumps(losses))
""")


def test_same_tp_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True,
                          timeout=scaled(240), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("ParallelizeWarning: every rank's words, on purpose") == 1, proc.stderr[-4000:]
    import json
    from fxtron.models import build, example_inputs
    got = json.loads(proc.stdout.split("LOSSES", 1)[1].strip().splitlines()[0])
    model = build("gpt-tiny", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for s in range(2):
        opt.zero_grad()
        loss = model(*example_inputs("gpt-tiny", batch=4, seq=8, seed=s))
        loss.backward()
        opt.step()
        ref.append(float(loss.detach()))
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5, (got, ref)
