"""Runtime: torch.distributed process groups built from a Mesh, and process-group set-up.

`init_distributed(mesh)` is the one place that reads the launcher's environment (RANK,
WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them). It returns a `ProcessGroups` value that
the rest of fxtron takes as an argument; nothing below it looks up a default group.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import hashlib
import itertools
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxtron.config import DebugConfig
from fxtron.errors import ParallelizeError, ParallelizeWarning
from fxtron.mesh import GROUP_KINDS, Mesh
from fxtron.ops import ledger, shm

DEFAULT_TIMEOUT_S = 300.0
# The groups whose collectives sit on the critical path of every layer (tp) or of every step
# (data parallel's gradient buckets): these get a shared-memory channel when all their ranks
# share a host (ops/shm.py). Kinds with identical ranks share one channel.
SHM_KINDS = ("tp", "dp", "dp-cp", "expert-dp")


@dataclass
class ProcessGroups:
    """This rank's process group for every kind of `Mesh.groups`.

    Identical rank lists share one ProcessGroup (tp and tp-pp coincide when pp == 1, say), so
    a mesh never costs more communicators than it has distinct groups.
    """

    mesh: Mesh
    rank: int
    backend: str
    device: torch.device
    # every group's collective timeout (init_distributed's timeout_s; new_group's own default
    # would be torch's 30 minutes, whatever the default group's)
    timeout: datetime.timedelta | None = None
    # shared-memory channels by group name (ops/shm.py), made by init_distributed
    channels: dict = field(default_factory=dict, repr=False)
    _by_kind: dict[str, tuple[tuple[int, ...], object]] = field(default_factory=dict, repr=False)
    _made: dict[tuple[int, ...], object] = field(default_factory=dict, repr=False)   # (Mesh.groups' derived kinds)
    # gloo twins (same ranks) of groups, by group name: small control messages on the CPU
    # (pipeline shapes, the ledger's order check), never ordered against the group's own traffic
    _twins: dict[str, object] = field(default_factory=dict, repr=False)

    def meta(self, kind: str):
        """A gloo group of the same ranks as `kind`'s group, for control messages: their order
        never interleaves with the data of the group itself (NCCL matches by order alone)."""
        pg = self.group(kind)
        if pg.group_name not in self._twins:
            raise ParallelizeError(f"group {kind!r} has no control twin (build_groups makes one for pp, "
                                   "and for every group when the collective order is checked)")
        return self._twins[pg.group_name]

    def group(self, kind: str):
        """The ProcessGroup of `kind` that holds this rank."""
        return self._entry(kind)[1]

    def ranks(self, kind: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of `kind`, in Megatron's order."""
        return self._entry(kind)[0]

    def size(self, kind: str) -> int:
        return len(self._entry(kind)[0])

    def index(self, kind: str) -> int:
        """This rank's position inside its group of `kind`."""
        return self._entry(kind)[0].index(self.rank)

    def distinct(self) -> list[tuple[str, tuple[int, ...], object]]:
        """(kind, ranks, group) of each distinct group holding this rank, in the mesh's order of
        kinds (the same on every rank), a group that several kinds share listed once."""
        out, seen = [], set()
        for kind, (ranks, pg) in self._by_kind.items():
            if pg.group_name not in seen:
                seen.add(pg.group_name)
                out.append((kind, ranks, pg))
        return out

    def add(self, kinds) -> None:
        """Create the groups of derived `kinds` (Mesh.groups' '<kind>/shard:<k>', HSDP) not made
        yet. Every rank of the job calls it with the same kinds, in the same order (each group
        is made by every rank, torch.distributed's rule)."""
        world = tuple(range(self.mesh.world_size))
        for kind in kinds:
            if kind in self._by_kind:
                continue
            mine = None
            for ranks in self.mesh.groups(kind):
                key = tuple(ranks)
                pg = self._made.get(key)
                if pg is None:
                    pg = self._made[key] = dist.group.WORLD if key == world else \
                        dist.new_group(list(key), timeout=self.timeout)
                if self.rank in key:
                    mine = (key, pg)
            self._by_kind[kind] = mine

    def forget(self) -> None:
        """Drop this value's references to its groups (runtime/groups.py destroy: after
        dist.destroy_process_group, so that the groups themselves go now)."""
        self.channels, self._by_kind, self._made, self._twins = {}, {}, {}, {}

    def _entry(self, kind: str):
        if kind not in self._by_kind:
            raise ParallelizeError(f"unknown group kind {kind!r}; known kinds: {', '.join(GROUP_KINDS)}")
        return self._by_kind[kind]


# kinds whose groups always get a gloo twin (pipeline shape messages travel on it)
TWIN_KINDS = ("pp",)


def build_groups(mesh: Mesh, rank: int, backend: str, device: torch.device, *,
                 twins_for_all: bool = False, timeout: datetime.timedelta | None = None) -> ProcessGroups:
    """Create every group of the mesh (and the gloo twins of those of TWIN_KINDS, or of every
    group with `twins_for_all`), each with `timeout` on its collectives; all ranks must call this
    in the same order (they do: the iteration below depends only on the mesh)."""
    made: dict[tuple[int, ...], object] = {}
    twins: dict[tuple[int, ...], object] = {}
    world = tuple(range(mesh.world_size))
    pgs = ProcessGroups(mesh=mesh, rank=rank, backend=backend, device=device, timeout=timeout)
    for kind in GROUP_KINDS:
        mine = None
        for ranks in mesh.groups(kind):
            key = tuple(ranks)
            if key not in made:
                # every rank takes part in creating every group (torch.distributed's rule)
                made[key] = dist.group.WORLD if key == world else dist.new_group(list(key), timeout=timeout)
            if (twins_for_all or kind in TWIN_KINDS) and len(key) > 1 and key not in twins:
                twins[key] = dist.new_group(list(key), backend="gloo", timeout=timeout)
            if rank in key:
                mine = key
        if mine is not None:
            pgs._by_kind[kind] = (mine, made[mine])
            if mine in twins:
                pgs._twins[made[mine].group_name] = twins[mine]
    return pgs


def _install_ledger(groups: ProcessGroups, check: bool) -> None:
    books = []
    for kind, ranks, pg in groups.distinct():
        twin = groups._twins.get(pg.group_name)
        books.append((pg.group_name, kind, ranks, twin if check else None))
        if twin is not None:
            books.append((twin.group_name, f"{kind} control", ranks, None))
    ledger.install(groups.rank, books, check=check, flight_dir=DebugConfig().flight_dir)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def shm_default() -> bool:
    """config.DebugConfig.shm (FXTRON_SHM=0 turns the shared-memory transport off by default)."""
    return DebugConfig().shm


#: set in a rank fxtron.launch started, to the launcher's port: the rendezvous store
#: (MASTER_ADDR:MASTER_PORT) is the launching process's, which every rank joins as a client (a
#: job started from the rank -- torchrun, with a port of its own -- inherits it, but not its port)
LAUNCHED_STORE = "FXTRON_LAUNCHED_STORE"
_inits = itertools.count()     # this process's rendezvous so far: each one's keys under their own prefix


def _held_store(rank: int, world: int, timeout_s: float):
    """The rendezvous store where a process outside this job holds it, with a prefix per
    rendezvous of this process (a second init_distributed after destroy() would read the first
    one's keys -- gloo's addresses, its barrier's counts -- and fail): in a rank fxtron.launch
    started, the launcher's; under torchrun (TORCHELASTIC_RESTART_COUNT set), its agent's, or
    rank 0's multi-tenant one, with a prefix per restart as well (the agent keeps its store across
    a restart, and a restarted group reading the killed group's keys fails in connectFullMesh,
    "Connection refused"). None elsewhere (init_process_group's env:// rendezvous, rank 0 hosting
    it while the group lives)."""
    host, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    launched = port is not None and os.environ.get(LAUNCHED_STORE) == str(port)
    if host is None or port is None or (attempt is None and not launched):
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    if launched or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        base = dist.TCPStore(host, port, None if launched else world, is_master=False, timeout=timeout)
    else:
        base = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    prefix = "fxtron" if launched else f"fxtron/attempt_{attempt}"
    return dist.PrefixStore(f"{prefix}/init_{next(_inits)}", base)


class _SayOnce:
    """Each ParallelizeWarning shown once for the job, not once per rank: what fxtron warns of on
    one rank (a model it traced, an option it took) it mostly warns of on every rank, and a job of
    8 or 64 processes printed it 8 or 64 times. The first rank to show a warning's words claims
    them in the job's rendezvous store (an atomic add; under fxtron.launch the launcher's store,
    under torchrun its agent's, one per restart); ranks that warn the same words later show
    nothing. Words that differ by rank (a stage named) show on each. Other warnings are Python's
    as they were. Installed by init_distributed where it holds the store, removed by destroy()."""

    def __init__(self):
        self.store = None
        self._shown = None              # the warnings.showwarning this one wraps

    def start(self, store) -> None:
        if self._shown is None:
            self._shown = warnings.showwarning
            warnings.showwarning = self.showwarning
        self.store = store

    def stop(self) -> None:
        if self._shown is not None and warnings.showwarning == self.showwarning:
            warnings.showwarning = self._shown
        self._shown, self.store = None, None

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.store is not None and isinstance(category, type) and issubclass(category, ParallelizeWarning):
            key = hashlib.sha1(f"{category.__name__}: {message}".encode()).hexdigest()[:20]
            try:
                if self.store.add(f"warned/{key}", 1) > 1:
                    return
            except Exception:  # noqa: BLE001 - a store gone (a peer's exit): show it rather than lose it
                pass
        (self._shown or _python_showwarning)(message, category, filename, lineno, file, line)


def _python_showwarning(message, category, filename, lineno, file=None, line=None):
    """Python's own way of showing a warning (where the hook was removed under a caller holding it)."""
    import sys
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


_said_once = _SayOnce()


def _say_once(store) -> None:
    _said_once.start(store)


def init_distributed(mesh: Mesh, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     shm_transport: bool | None = None, check_collectives: bool | None = None,
                     store=None) -> ProcessGroups:
    """Initialize torch.distributed for this process (torchrun or fxtron.launch set the
    environment) and create the mesh's groups. Returns this rank's ProcessGroups.
    `store`: the rendezvous store, when the caller holds one; else the environment's
    (MASTER_ADDR, MASTER_PORT: in a rank fxtron.launch started, a client of the store the
    launcher holds). A process may init_distributed again after destroy().

    Every collective issued through these groups times out after `timeout_s`, so a rank whose
    peer died raises instead of hanging. With gloo, a tp group whose ranks all run on this
    host also gets a shared-memory channel for fxtron's tensor-parallel collectives
    (ops/shm.py) unless `shm_transport` is False (default: on, unless FXTRON_SHM=0).

    `check_collectives` (default: FXTRON_CHECK_COLLECTIVES=1 in the environment) compares every
    collective across its group before it runs, and the steps' point-to-point transfers at step
    ends, over gloo twins of the groups (ops/ledger.py): a rank whose program diverged raises,
    naming the first differing operation on each rank, instead of hanging NCCL. Every rank
    records its last operations (the flight recorder) whatever the setting; with
    FXTRON_FLIGHT_DIR set (fxtron.launch sets it), to a file per rank there.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None:
        raise ParallelizeError(
            "init_distributed needs RANK and WORLD_SIZE in the environment (run the script under "
            "torchrun, or use fxtron.launch for local processes)")
    if world != mesh.world_size:
        raise ParallelizeError(
            f"the job has WORLD_SIZE={world} processes but the mesh is for {mesh.world_size}; "
            f"start {mesh.world_size} processes or build Mesh(world_size={world}, ...)")
    backend = backend or default_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        local = _env_int("LOCAL_RANK") or 0
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = store if store is not None else _held_store(rank, world, timeout_s)
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), store=store)
        if store is not None:
            _say_once(store)
    if check_collectives is None:
        check_collectives = ledger.check_default()
    groups = build_groups(mesh, rank, backend, device, twins_for_all=check_collectives,
                          timeout=datetime.timedelta(seconds=timeout_s))
    _install_ledger(groups, check_collectives)
    if shm_transport is None:
        shm_transport = shm_default()
    if shm_transport and backend == "gloo":
        wanted = {}
        for kind in SHM_KINDS:
            if groups.size(kind) > 1:
                pg = groups.group(kind)
                wanted.setdefault(pg.group_name, pg)
        groups.channels = shm.open_channels(wanted, timeout_s)
    if not _REGISTRY:
        # a script that returns without tearing the process group down would abort in gloo's
        # thread destructors at exit; tear it down for it
        atexit.register(destroy)
    _REGISTRY[mesh] = groups
    return groups


# The groups that init_distributed made in this process, by mesh. torch.distributed is itself
# per-process state; this only lets `pm.program(rank)` find the groups of its own mesh without
# the caller threading them through. Everything inside fxtron takes ProcessGroups explicitly.
_REGISTRY: dict[Mesh, ProcessGroups] = {}


def groups_for(mesh: Mesh) -> ProcessGroups | None:
    """The ProcessGroups that init_distributed created in this process for `mesh`, if any."""
    return _REGISTRY.get(mesh)


def destroy() -> None:
    """Tear down what init_distributed made in this process: the shared-memory channels, the
    flight recorder, then every process group -- destroyed for real, their threads joined,
    while the interpreter is whole. dist.destroy_process_group only unregisters a gloo group;
    its worker threads live on until the last reference to it goes, which (a ProcessGroups
    value, a program, a graph module holding it) was at interpreter exit: a worker that then
    releases a work's tensors needs the GIL of an interpreter being finalized, and the process
    aborts ('terminate called without an active exception', SIGABRT) after its job is done.
    So every ProcessGroups made here forgets its groups, and what cycles hold is collected."""
    for groups in _REGISTRY.values():
        shm.close_channels(groups.channels)
        groups.channels = {}
    _said_once.stop()
    ledger.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    for groups in _REGISTRY.values():
        groups.forget()
    _REGISTRY.clear()
    gc.collect()
