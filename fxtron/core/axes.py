"""Core: a mesh as one rank's passes see it -- the size of every axis and the rank's coordinate
on it. Passes take a MeshView, never a bare `tp` and `tp_rank`, so a pass written for one axis
reads the same for any other (`mesh.size("cp")`, `mesh.coord("cp")`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

#: Every axis of a mesh (Megatron's dense layout), in the order they are listed.
MESH_AXES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class MeshView:
    """Axis sizes and this rank's coordinates. `sizes` / `coords` map every axis of MESH_AXES
    (a missing axis has size 1 and coordinate 0)."""

    rank: int
    sizes: Mapping[str, int] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for axis, n in self.sizes.items():
            c = self.coords.get(axis, 0)
            if not 0 <= c < n:
                raise ValueError(f"coordinate {c} on axis {axis} is outside its size {n}")

    def size(self, axis: str) -> int:
        return int(self.sizes.get(axis, 1))

    def coord(self, axis: str) -> int:
        return int(self.coords.get(axis, 0))

    def parallel(self, axis: str) -> bool:
        """Does this axis split the work over more than one rank?"""
        return self.size(axis) > 1

    def __str__(self) -> str:
        return f"rank {self.rank}: " + ", ".join(f"{a} {self.coord(a)}/{self.size(a)}" for a in MESH_AXES
                                                 if a in self.sizes)


__all__ = ["MESH_AXES", "MeshView"]
