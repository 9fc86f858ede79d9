"""Runtime: run a function on every rank of a mesh as local processes (one machine).

`launch(fn, mesh, args)` spawns mesh.world_size processes, initializes torch.distributed in each
(gloo on CPU, NCCL when every rank can have its own GPU) with the mesh's groups, runs
`fn(rank, *args)` and returns the results in rank order. The processes are forked from a
forkserver that has imported torch, fxtron and (where installed) transformers once
(multiprocessing's "forkserver", CUDA-safe like "spawn": importing torch initializes no device),
so a rank starts in a fraction of a second instead of the ~3 s those imports cost afresh; each
rank gets the launching process's environment and standard output and error as they are at
the launch (a forkserver's children would otherwise inherit the server's, fixed when it started; what a module reads from the
environment as it is imported -- TRITON_INTERPRET for codegen/wgrad.py -- is as it was when the
first launch started the server). A rank's result (or traceback) reaches the launcher as a file
in a directory of the launch's own and a notice of a few bytes on a queue, so a rank killed while
reporting cannot leave the launcher blocked on half a message. The first rank to fail ends the job:
the others are killed and its traceback is raised here as LaunchError. A ParallelizeWarning that
every rank gives shows once for the job (runtime/groups.py). For many machines run
the same per-rank code under torchrun with `fxtron.init_distributed(mesh)` instead
(`torchrun_world` tells a process started by torchrun).
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxtron.errors import LaunchError, ParallelizeError, PeerError, RefusalError
from fxtron.mesh import Mesh
from fxtron.ops import ledger


def _rendezvous(timeout_s: float):
    """The job's rendezvous store, held by the launching process on a port the system picks
    as it binds: no other job on the machine (a second test suite, say) can take it between
    the pick and the bind, as it could a port found free, closed and handed to rank 0."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _report_path(reports: str, rank: int, ok: bool) -> str:
    return os.path.join(reports, f"rank{rank}.{'result' if ok else 'error'}")


def _report(results, reports: str, rank: int, ok: bool, payload: bytes) -> None:
    """A rank's result (torch.save's bytes: tensors travel as bytes, not as shared-memory
    handles that die with the process) or traceback, written whole to a file and renamed into
    place; then a notice of a few bytes on the queue. A pipe write that small is atomic, so a
    rank killed while reporting (the OOM killer, as a large result doubles its memory) leaves
    no half message for the launcher's read to block on forever."""
    path = _report_path(reports, rank, ok)
    with open(path + ".part", "wb") as fh:
        fh.write(payload)
    os.replace(path + ".part", path)
    results.put((rank, ok))
    results.close()
    results.join_thread()           # the queue's feeder thread must flush before the rank exits


def _read_report(reports: str, rank: int, ok: bool) -> bytes:
    path = _report_path(reports, rank, ok)
    with open(path, "rb") as fh:
        payload = fh.read()
    os.remove(path)
    return payload


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


#: what the forkserver the ranks are forked from imports once (module docstring)
_PRELOAD = ["torch", "fxtron", "transformers"]


class _Stdio:
    """The launcher's standard output and error (fds 1 and 2 as they are at the launch), handed
    to a rank as it starts: a forkserver's child inherits the server's, which were the
    launcher's when the server started (a redirect or a test's capture since then would lose
    the rank's output). Pickled as the process starts, the fds travel with it (multiprocessing's
    DupFd); `attach()` puts them in place in the rank."""

    def __init__(self, fds: list | None = None):
        self.fds = fds

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return (_Stdio, ([DupFd(1), DupFd(2)],))

    def attach(self) -> None:
        for target, fd in zip((1, 2), self.fds or ()):
            got = fd.detach()
            if got != target:
                os.dup2(got, target)
                os.close(got)


def _worker(fn, mesh: Mesh, rank: int, args: tuple, port: int, backend: str | None,
            timeout_s: float, threads: int, shm_transport: bool | None, check_collectives: bool | None,
            flight_dir: str, results, reports: str, env: dict[str, str], stdio: _Stdio) -> None:
    from fxtron.runtime import groups as G
    stdio.attach()
    os.environ.clear()
    os.environ.update(env)          # the launcher's environment at the launch, not the forkserver's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(mesh.world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(mesh.world_size), FXTRON_FLIGHT_DIR=flight_dir,
                      **{G.LAUNCHED_STORE: str(port)})
    torch.set_num_threads(threads)
    try:
        # (the rendezvous: a client of the store the launching process holds, _rendezvous)
        G.init_distributed(mesh, backend=backend, timeout_s=timeout_s, shm_transport=shm_transport,
                           check_collectives=check_collectives)
        out = fn(rank, *args)
        payload = _dumps(out)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        _report(results, reports, rank, False, _failure(rank, e))
        os._exit(1)  # skip destructors that could block on dead peers
    _report(results, reports, rank, True, payload)
    G.destroy()


#: around the head of a rank's failure report where it raised a ParallelizeError: its message
#: (for a PeerError, empty: a peer's death it followed from)
_REFUSED, _PEER = "\x00refused\x00", "\x00peer\x00"


def _failure(rank: int, e: BaseException) -> bytes:
    """A failed rank's report: its traceback, headed by the message of a ParallelizeError it
    raised (a mistake of the user's; not a collective's failure), or marked where it followed
    from a peer's death (a PeerError, or a collective whose backend says the peer is gone)."""
    text = f"rank {rank} failed:\n{traceback.format_exc()}"
    if isinstance(e, PeerError) or any(sign in str(e) for sign in ledger.PEER_GONE):
        text = f"{_PEER}{_PEER}{text}"           # (a torch collective's own: gloo's 'Connection closed by peer')
    elif isinstance(e, ParallelizeError) and not isinstance(e, (LaunchError, ledger.CollectiveFailure)):
        text = f"{_REFUSED}{e}{_REFUSED}{text}"
    return text.encode()


def _head(report: str) -> tuple[str | None, str | None, str]:
    """(kind: "refused", "peer" or None, a refusal's message, the traceback) of a report."""
    for kind, mark in (("refused", _REFUSED), ("peer", _PEER)):
        if report.startswith(mark):
            _, said, text = report.split(mark, 2)
            return kind, said, text
    return None, None, report


def _refusal(heads: list[tuple], world: int) -> RefusalError | None:
    """A RefusalError where the failed ranks raised one ParallelizeError, the same message
    (and any other failed in a collective with them, a PeerError): its message once, the ranks
    that raised it, the first one's traceback."""
    refused = [(said, text) for kind, said, text in heads if kind == "refused"]
    if not refused or len({said for said, _ in refused}) > 1 or any(kind is None for kind, _, _ in heads):
        return None
    ranks = [text.split(" ", 2)[1] for _, text in refused]
    where = f"every rank ({world})" if len(ranks) == world else f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}"
    return RefusalError(f"{refused[0][0]}\n\n(raised on {where} once the processes had started; rank {ranks[0]}'s "
                        f"traceback follows)\n{refused[0][1]}")


def _exit(code: int | None) -> str:
    """A process's exit as words: its code, or the signal that ended it."""
    if code is not None and code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"with exit code {code}"


def _failures(procs, results, done: dict, first: str | None, flight_dir: str, reports: str,
              grace_s: float = 1.0) -> LaunchError:
    """Every failure seen within a short grace period: the first traceback, then any other
    rank's traceback and every rank that died without one (a peer's death often makes the
    others fail too, so the whole picture helps find the cause), then what every rank was
    doing, from the flight recorder (ops/ledger.py). A rank that died without a report is
    the cause the others' failures follow from: a PeerError that names it first."""
    raw = [first] if first else []
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            rank, ok = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            raw.append(_read_report(reports, rank, False).decode())
    heads = [_head(m) for m in raw]
    messages = [text for _, _, text in heads]
    reported = {m.split(" ", 2)[1] for m in messages if m.startswith("rank ")}
    dead = [f"rank {r} died {_exit(p.exitcode)} without a traceback" for r, p in enumerate(procs)
            if r not in done and str(r) not in reported and p.exitcode not in (None, 0)]
    if dead:
        others = (["the other ranks' failures follow from it:"] + messages) if messages else []
        return PeerError("\n\n".join(dead + others + [ledger.flight_report(flight_dir, len(procs))]))
    refused = _refusal(heads, len(procs))
    if refused is not None:
        return refused
    messages = messages or ["a rank failed without a report"]
    return LaunchError("\n\n".join(messages + [ledger.flight_report(flight_dir, len(procs))]))


def torchrun_world() -> int | None:
    """WORLD_SIZE when this process is one rank of a torchrun job (RANK, WORLD_SIZE and
    LOCAL_RANK in the environment): it then runs its own rank, with init_distributed, rather
    than launching the mesh's processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _importing_main() -> bool:
    """Whether this call runs while a new process of multiprocessing imports the parent's main
    script (its bootstrap: spawn's _fixup_main_from_path), not from a function a child runs."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.startswith("_fixup_main_from") and \
                frame.f_globals.get("__name__") == "multiprocessing.spawn":
            return True
        frame = frame.f_back
    return False


def launch(fn: Callable[..., Any], mesh: Mesh, args: tuple = (), *, backend: str | None = None,
           timeout_s: float = 600.0, collective_timeout_s: float = 120.0,
           threads_per_rank: int | None = None, shm_transport: bool | None = None,
           check_collectives: bool | None = None, flight_dir: str | None = None) -> list[Any]:
    """Run `fn(rank, *args)` on mesh.world_size local processes; return results in rank order.

    fn and args must be picklable (a module-level function). `timeout_s` bounds the whole job,
    `collective_timeout_s` every collective. `shm_transport`: see init_distributed (tp
    collectives through shared memory with gloo; default on unless FXTRON_SHM=0).
    `check_collectives`: compare every collective across its group before it runs (default:
    FXTRON_CHECK_COLLECTIVES=1; see init_distributed). `flight_dir`: where every rank's flight
    recorder writes its last operations (default: a temporary directory, removed after the job;
    a directory given is kept). Raises LaunchError with the failing
    rank's traceback and, for every rank, the operation it was in (the flight recorder); a
    PeerError (a LaunchError) naming the rank and its exit where one died without a report.
    """
    if _importing_main():
        # a rank's process imports the script that launched it (to find fn): unguarded, the
        # import launches again, and multiprocessing's own error talks of freeze_support
        raise ParallelizeError("fxtron.launch was called again while a rank's process imported the script that "
                               "launches (each rank imports it to find the function it runs): call fxtron.launch "
                               "under `if __name__ == \"__main__\":`")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= mesh.world_size else "gloo"
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // mesh.world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)      # (read when the server starts: the first launch)
    results = ctx.Queue()
    store = _rendezvous(collective_timeout_s)
    port = store.port
    own_flight_dir = flight_dir is None
    if own_flight_dir:
        flight_dir = tempfile.mkdtemp(prefix="fxtron-flight-")
    else:
        os.makedirs(flight_dir, exist_ok=True)
    reports = tempfile.mkdtemp(prefix="fxtron-reports-")      # this launch's alone (a flight_dir may be shared)
    procs = [ctx.Process(target=_worker, name=f"fxtron-rank{r}",
                         args=(fn, mesh, r, tuple(args), port, backend, collective_timeout_s,
                               threads_per_rank, shm_transport, check_collectives, flight_dir, results, reports,
                               dict(os.environ), _Stdio()), daemon=True)
             for r in range(mesh.world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < mesh.world_size:
            try:
                rank, ok = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise LaunchError(f"job timed out after {timeout_s:.0f} s; ranks still running: "
                                      f"{[r for r in range(mesh.world_size) if r not in done]}\n\n"
                                      + ledger.flight_report(flight_dir, mesh.world_size)) from None
                if any(r not in done and p.exitcode not in (None, 0) for r, p in enumerate(procs)):
                    raise _failures(procs, results, done, None, flight_dir, reports) from None
                continue
            payload = _read_report(reports, rank, ok)
            if not ok:
                raise _failures(procs, results, done, payload.decode(), flight_dir, reports)
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        del store
        shutil.rmtree(reports, ignore_errors=True)
        if own_flight_dir:
            shutil.rmtree(flight_dir, ignore_errors=True)
    return [done[r] for r in range(mesh.world_size)]
