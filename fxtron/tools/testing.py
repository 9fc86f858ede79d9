"""Tools, test support: run a function on N gloo ranks with bounded time and every failure surfaced,
many cases per set of processes (`run_cases`, `cases_fixture`), the single-process reference
that every equivalence test compares against (`reference_training`, from tools/reference.py),
the optimizer the tests train with (`adamw`) and the directory a test shares with its ranks
(`shared_dir`)."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Iterable

import torch

from fxtron.errors import LaunchError
from fxtron.mesh import Mesh
from fxtron.runtime.launch import launch
from fxtron.tools.reference import reference_training


# the most timeout_scale() stretches a bound: a job that hangs still ends within the hour
MAX_TIMEOUT_SCALE = 10.0


def timeout_scale() -> float:
    """How many times longer than on an idle machine the tests' time bounds are now:
    FXTRON_TEST_TIMEOUT_SCALE when set, else the machine's load (the 1-minute load average)
    per core, at least 1 and at most MAX_TIMEOUT_SCALE. Under a load of 16 on 2 cores every
    rank's compilation takes ~8x longer, and a rank that compiles slower than its peers
    reaches the first collective minutes after them: a fixed bound then fails a correct job."""
    value = os.environ.get("FXTRON_TEST_TIMEOUT_SCALE")
    if value not in (None, ""):
        return max(1.0, float(value))
    try:
        load = os.getloadavg()[0]
    except OSError:                 # (no load average on this platform)
        return 1.0
    return min(MAX_TIMEOUT_SCALE, max(1.0, load / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """An idle machine's time bound stretched by `timeout_scale()`: for the tests' subprocess
    timeouts and deadlines, as run_on_ranks does for its own."""
    return seconds * timeout_scale()


@contextlib.contextmanager
def shared_dir(name: str):
    """A directory the test process and the ranks it launches share (they import the test module
    again: the test process's id reaches them in the environment), removed when the block ends.
    `with shared_dir("fsdp") as path:` in the test process; `shared_dir_path("fsdp")` in a rank."""
    path = shared_dir_path(name)
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def shared_dir_path(name: str) -> str:
    """shared_dir's path, created by nothing (importable in the ranks without side effects)."""
    owner = os.environ.setdefault("FXTRON_TEST_DIR_OWNER", str(os.getpid()))
    return os.path.join(tempfile.gettempdir(), f"fxtron-{name}-{owner}")


def run_on_ranks(fn: Callable[..., Any], mesh: Mesh | int, *args, timeout_s: float = 300.0, **launch_options) -> list[Any]:
    """`fxtron.launch` for tests: gloo, one thread per rank, a job-wide timeout; a failing rank
    fails the test with that rank's traceback (pytest shows LaunchError's message whole).
    `launch_options` go to launch (check_collectives, shm_transport, collective_timeout_s).

    `timeout_s`, and the collective timeout when not given (timeout_s / 2), are an idle
    machine's: both are stretched by `timeout_scale()`, so a loaded machine does not fail a
    correct job. The collective bound is not shorter than half the job's: the load is read at
    the start, and a second suite that starts later slows the ranks' compilation, after which
    a rank waits in its first collective for a peer still compiling (a fixed 60 s bound could
    fail a whole module's cases so). A collective_timeout_s given is kept as it is (a test of the timeout itself;
    others scale theirs with `scaled`)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    scale = timeout_scale()
    launch_options.setdefault("collective_timeout_s", timeout_s / 2 * scale)
    return launch(fn, mesh, args=args, backend="gloo", timeout_s=timeout_s * scale, threads_per_rank=1,
                  **launch_options)


def case_key(case) -> Any:
    """A case's key in `run_cases`' results: its `.key` if it has one, else the case itself."""
    return getattr(case, "key", case)


def _run_plan(rank: int, plan: list, run_case: Callable, init: dict) -> dict:
    from fxtron.runtime.groups import init_distributed
    out = {}
    for mesh, cases in plan:
        if mesh.world_size > 1:
            init_distributed(mesh, **init)      # this mesh's groups, in the same processes
        for case in cases:
            out[(str(mesh), case_key(case))] = run_case(rank, mesh, case)
    return out


def run_cases(jobs: dict[int, list[tuple[Mesh, list]]], run_case: Callable[[int, Mesh, Any], Any], *,
              timeout_s: float = 900.0, **launch_options) -> dict:
    """Run every case of `jobs` (world size -> [(mesh, cases)], the meshes of one entry sharing
    its world size) with `run_case(rank, mesh, case)`, starting one set of gloo processes per
    world size (importing torch costs ~2 s a process) and making each mesh's groups in them.
    Returns {(str(mesh), case_key(case), rank): what run_case returned}; `ranks_of` reads it.
    `launch_options` go to launch; check_collectives and shm_transport also to every mesh's
    init_distributed."""
    out = {}
    for world, plan in jobs.items():
        meshes = {m.world_size for m, _ in plan}
        if meshes != {world}:
            raise ValueError(f"run_cases: the meshes of the {world}-process job have world sizes {sorted(meshes)}")
        init = {k: v for k, v in launch_options.items() if k in ("check_collectives", "shm_transport")}
        for rank, res in enumerate(run_on_ranks(_run_plan, plan[0][0], plan, run_case, init, timeout_s=timeout_s,
                                                **launch_options)):
            for key, value in res.items():
                out[key + (rank,)] = value
    return out


def cases_fixture(jobs: dict | Callable[[], dict], run_case: Callable[[int, Mesh, Any], Any], **options):
    """A module-scoped pytest fixture that runs `run_cases(jobs, run_case, **options)` once, when
    the module's first test asks for it: `results = cases_fixture(JOBS, _run_case)` in a test
    module (the fixture takes the name it is bound to). `jobs` may be a function of no arguments
    that builds them then."""
    import pytest

    def results():
        return run_cases(jobs() if callable(jobs) else jobs, run_case, **options)
    return pytest.fixture(scope="module")(results)


def ranks_of(results: dict, mesh: Mesh | str, case) -> list:
    """What every rank returned for `case` on `mesh` in `run_cases`' results, rank 0 first."""
    mesh_key, key = str(mesh), case_key(case)
    got = sorted(((k[2], v) for k, v in results.items() if k[0] == mesh_key and k[1] == key), key=lambda kv: kv[0])
    if not got:
        raise KeyError(f"no results for case {key!r} on {mesh_key}")
    return [v for _, v in got]


def adamw(lr: float = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
          weight_decay: float = 0.1) -> Callable[..., torch.optim.AdamW]:
    """The tests' optimizer: `adamw(...)(params)` is torch.optim.AdamW with these settings, a
    picklable factory for `reference_training` and for the ranks. The defaults are the
    equivalence tests': eps 1e-6 sits well above float32 gradient noise, so Adam does not turn
    round-off into full-size steps (a model whose gradients reach 1e-6, an embedding row of a
    rare token, needs eps=1e-4); torch's own defaults are eps=1e-8, weight_decay=0.01."""
    return functools.partial(torch.optim.AdamW, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest elementwise difference over matching keys, and where it is. Keys must match. A
    NaN or an inf on one side only is an infinite difference (a NaN's difference, compared,
    passed every tolerance); the same on both sides, none."""
    if set(a) != set(b):
        raise AssertionError(f"keys differ: only left {sorted(set(a) - set(b))}, only right {sorted(set(b) - set(a))}")
    worst, where = 0.0, ""
    for k in a:
        if a[k].shape != b[k].shape:
            raise AssertionError(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        x, y = a[k].double(), b[k].double()
        same = (torch.isnan(x) & torch.isnan(y)) | (torch.isinf(x) & (x == y))
        d = torch.nan_to_num((x - y).abs().masked_fill(same, 0.0), nan=math.inf).max().item() if x.numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


__all__ = ["adamw", "assert_trains_like", "case_key", "cases_fixture", "ranks_of", "run_cases", "run_on_ranks",
           "reference_training", "scaled", "timeout_scale", "train_program", "max_abs_diff", "LaunchError"]


def train_program(prog, batches: Iterable, opt) -> dict:
    """Train a rank's program on `batches` ((args, kwargs) global batches, or
    `fxtron.Microbatches` lists) with `opt`: its losses, the full gradients of the first step
    (before its optimizer step) and the full state at the end -- what `assert_trains_like`
    compares with `reference_training` -- and the global norms before clipping (with clip_grad)."""
    from fxtron.runtime.batch import Microbatches
    losses, grads, norms = [], None, []
    for step, item in enumerate(batches):
        if isinstance(item, Microbatches):
            losses.append(prog.train_step(item, opt))
        else:
            args, kwargs = item
            losses.append(prog.train_step(args, opt, kwargs=kwargs))
        norms.append(prog.last_grad_norm)
        if step == 0:
            grads = prog.full_grads()
    return {"losses": losses, "grads": grads, "state": prog.full_state_dict(), "norms": norms}


def assert_trains_like(got: dict, ref: dict, *, rank: int = 0, loss_tol: float = 2e-6, grad_tol: float = 1e-6,
                       weight_tol: float = 1e-5) -> None:
    """A rank's `train_program` result equals the single-process `reference_training` one:
    losses, first-step gradients and final weights within absolute tolerances (the weights of
    the rank's state; export's lifted constants may be absent)."""
    dl = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert dl < loss_tol, f"rank {rank}: losses {got['losses']} vs {ref['losses']}"
    dg, where = max_abs_diff(got["grads"], ref["grads"])
    assert dg < grad_tol, f"rank {rank}: gradient of {where} differs by {dg:.3g}"
    state = {k: v for k, v in ref["state"].items() if k in got["state"]}
    assert set(ref["state"]) - set(got["state"]) <= {k for k in ref["state"] if "lifted_tensor" in k}
    dw, where = max_abs_diff(got["state"], state)
    assert dw < weight_tol, f"rank {rank}: weight {where} differs by {dw:.3g} after {len(got['losses'])} steps"
