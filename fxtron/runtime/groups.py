"""Runtime: torch.distributed process groups built from a Mesh, and process-group set-up.

`init_distributed(mesh)` is the one place that reads the launcher's environment (RANK,
WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them). It returns a `ProcessGroups` value that
the rest of fxtron takes as an argument; nothing below it looks up a default group.
"""
from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxtron.errors import ParallelizeError
from fxtron.mesh import GROUP_KINDS, Mesh
from fxtron.ops import shm

DEFAULT_TIMEOUT_S = 300.0
# The groups whose collectives sit on the critical path of every layer: these get a
# shared-memory channel when all their ranks share a host (ops/shm.py).
SHM_KINDS = ("tp",)


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
    # shared-memory channels by group name (ops/shm.py), made by init_distributed
    channels: dict = field(default_factory=dict, repr=False)
    _by_kind: dict[str, tuple[tuple[int, ...], object]] = field(default_factory=dict, repr=False)

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

    def _entry(self, kind: str):
        if kind not in self._by_kind:
            raise ParallelizeError(f"unknown group kind {kind!r}; known kinds: {', '.join(GROUP_KINDS)}")
        return self._by_kind[kind]


def build_groups(mesh: Mesh, rank: int, backend: str, device: torch.device) -> ProcessGroups:
    """Create every group of the mesh; all ranks must call this in the same order (they do:
    the iteration below depends only on the mesh)."""
    made: dict[tuple[int, ...], object] = {}
    world = tuple(range(mesh.world_size))
    pgs = ProcessGroups(mesh=mesh, rank=rank, backend=backend, device=device)
    for kind in GROUP_KINDS:
        mine = None
        for ranks in mesh.groups(kind):
            key = tuple(ranks)
            if key not in made:
                # every rank takes part in creating every group (torch.distributed's rule)
                made[key] = dist.group.WORLD if key == world else dist.new_group(list(key))
            if rank in key:
                mine = key
        if mine is not None:
            pgs._by_kind[kind] = (mine, made[mine])
    return pgs


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def shm_default() -> bool:
    """FXTRON_SHM=0 in the environment turns the shared-memory transport off by default."""
    return os.environ.get("FXTRON_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def init_distributed(mesh: Mesh, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     shm_transport: bool | None = None) -> ProcessGroups:
    """Initialize torch.distributed for this process (torchrun or fxtron.launch set the
    environment) and create the mesh's groups. Returns this rank's ProcessGroups.

    Every collective issued through these groups times out after `timeout_s`, so a rank whose
    peer died raises instead of hanging. With gloo, a tp group whose ranks all run on this
    host also gets a shared-memory channel for fxtron's tensor-parallel collectives
    (ops/shm.py) unless `shm_transport` is False (default: on, unless FXTRON_SHM=0).
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
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    groups = build_groups(mesh, rank, backend, device)
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
    for groups in _REGISTRY.values():
        shm.close_channels(groups.channels)
    _REGISTRY.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
