"""Core, run-time records: what the runtime and the ops tell each other about particular tensors
-- a parameter's data-parallel owner, a gathered weight's handle, a gradient view's state --
as explicit records in tables keyed by the tensor, instead of attributes set on it.

Each table is a `TensorRecords`: a weak-keyed map (by the tensor object's identity, as an
attribute on it would be) from a tensor to its record. An entry lives as long as its tensor and
no longer, so a record travels with a tensor where
the tensor goes -- into autograd's saved context, into a recomputation in backward that runs
outside the step's context (on a GPU in autograd's own thread) -- and needs no clearing when
the tensor dies. Producer and consumer both import the table from here, so the layering test
(tests/test_layers.py) sees every such connection as an import.

The tables, who writes each and who reads it:

  FSDP_PIECES       zero=3: a parameter's flat piece (and its compute copy) -> FsdpPiece(units),
                    the program's FsdpUnits (runtime/fsdp.py). Written by runtime/program.py
                    (Program.__init__) and runtime/precision.py (compute_copy keeps it on the
                    copy); read by ops/fsdp.py (the run-time fsdp_gather calls the units).
  FSDP_GATHERED     zero=3: a whole parameter that fsdp_gather gave -> FsdpGathered(units, unit,
                    index). Written by ops/fsdp.py (the run-time fsdp_gather) and
                    runtime/fsdp.py (a packed parameter unpacked in backward); read by
                    ops/fsdp.py (`handle`: the free) and ops/linear.py (a fused linear keeps the
                    handle, not the weight, for backward and gathers it again there).
  ZERO_WAITED       zero=1/2 with overlap_param_gather: a parameter the graph's param_wait
                    waits for -> ZeroWaited(zero, name), the distributed optimizer
                    (runtime/zero.py ZeroOne) and the parameter's name. Written by
                    runtime/program.py; read by ops/fsdp.py (param_wait's run-time form) and
                    runtime/zero.py (ZeroOne.ready: the buckets of those names).
  SEQUENCE_GATHERED sequence parallel: a tensor all-gathered from sequence shards ->
                    SequenceGathered(shard, regather), ops/linear.py's Regather. Written by
                    ops/sp.py (the run-time gather_from_sequence) and tools/activations.py (its
                    estimate); read by ops/linear.py (a linear saves the shard, gathers it again
                    in backward).
  GRAD_REPORTS      data parallel: a parameter (and its compute copy) -> GradReport(report),
                    the call that tells its gradient buffer one contribution is complete.
                    Written by runtime/grads.py (Gradients.accumulation's first step, kept) and
                    runtime/precision.py (compute_copy); read by ops/linear.py (a fused linear's
                    weight-gradient job reports, only while the weight has a main_grad: in a step).
  FRESH_GRADS       data parallel: a gradient view (a parameter's main_grad) not yet written
                    this step -> FreshGrad(). Written by runtime/dp.py (GradBuffer.reset marks
                    every view); taken (read and removed) by the step's first contribution:
                    ops/linear.py (its GEMM writes, not adds), runtime/grads.py (the
                    accumulate hook copies), runtime/fsdp.py (a reduced piece copies),
                    runtime/dp.py (a view still fresh when its bucket is reduced is zeroed).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch

R = TypeVar("R")


class TensorRecords(Generic[R]):
    """A table of records keyed weakly by tensor identity (see the module docstring).

    A dict from id(tensor) to (a weak reference to the tensor, the record); the reference's
    callback drops the entry when the tensor dies (CPython runs it as the tensor is freed,
    before its id can be reused). torch's WeakTensorKeyDictionary does the same through
    Python-level __hash__/__eq__ on a key object made per lookup: a fused linear reads three
    tables in forward and two in backward, every step, and that made the lookups a visible
    share of a small step's host time (a GPU waiting on its host pays it)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[int, tuple[weakref.ref, R]] = {}

    def set(self, t: torch.Tensor, record: R) -> None:
        key, table = id(t), self._table

        def gone(ref, key=key, table=table):
            entry = table.get(key)
            if entry is not None and entry[0] is ref:
                del table[key]
        self._table[key] = (weakref.ref(t, gone), record)

    def get(self, t: torch.Tensor) -> R | None:
        """`t`'s record, None without one."""
        entry = self._table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def pop(self, t: torch.Tensor) -> R | None:
        """Remove `t`'s record and return it (None without one)."""
        entry = self._table.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        del self._table[id(t)]
        return entry[1]

    def take(self, t: torch.Tensor) -> bool:
        """Did `t` have a record? Removes it (a flag read once: FRESH_GRADS)."""
        return self.pop(t) is not None

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"TensorRecords({self.kind!r}, {len(self._table)} entries)"


class _Owner:
    """A record naming the object that holds its tensor, weakly: the owner holds the tensor
    (the table's key), so a strong reference from the record would keep key, record and owner
    alive for as long as the process -- the program's units, its buffers and its process
    groups, whose gloo threads then outlived the run into interpreter exit (an abort, SIGABRT,
    after the job's work was done). The owner reads None once it is gone."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Any):
        object.__setattr__(self, "_owner", weakref.ref(owner))

    def _get(self) -> Any:
        return self._owner()

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")


class FsdpPiece(_Owner):
    """A zero=3 piece's owner: `units`, the program's runtime.fsdp.FsdpUnits (held weakly)."""

    __slots__ = ()

    @property
    def units(self) -> Any:
        return self._get()


@dataclass(frozen=True)
class FsdpGathered:
    """A whole parameter gathered under zero=3: `units` (runtime.fsdp.FsdpUnits) gathered it
    as parameter `index` of layer `unit` (the handle a fused linear keeps for backward)."""

    units: Any
    unit: str
    index: int


class ZeroWaited(_Owner):
    """A parameter the graph waits for (overlap_param_gather): `zero`, the distributed
    optimizer (runtime.zero.ZeroOne) whose all-gather brings it (held weakly: it holds the
    parameter), and its `name`."""

    __slots__ = ("name",)

    def __init__(self, zero: Any, name: str):
        super().__init__(zero)
        object.__setattr__(self, "name", name)

    @property
    def zero(self) -> Any:
        return self._get()


@dataclass(frozen=True)
class SequenceGathered:
    """A tensor all-gathered from sequence-parallel shards: `shard` (the rank's, detached) and
    `regather` (ops.linear.Regather: how backward gathers it again)."""

    shard: torch.Tensor
    regather: Any


@dataclass(frozen=True)
class GradReport:
    """A parameter's report during a step: `report()` says one contribution to its gradient
    is complete in the data-parallel buffer (runtime/dp.py GradBuffer.report)."""

    report: Callable[[], None]


@dataclass(frozen=True)
class FreshGrad:
    """A gradient view not yet written this step: the first contribution writes, not adds."""


FSDP_PIECES: TensorRecords[FsdpPiece] = TensorRecords("fsdp piece")
FSDP_GATHERED: TensorRecords[FsdpGathered] = TensorRecords("fsdp gathered")
ZERO_WAITED: TensorRecords[ZeroWaited] = TensorRecords("zero waited")
SEQUENCE_GATHERED: TensorRecords[SequenceGathered] = TensorRecords("sequence gathered")
GRAD_REPORTS: TensorRecords[GradReport] = TensorRecords("grad report")
FRESH_GRADS: TensorRecords[FreshGrad] = TensorRecords("fresh grad")
FRESH = FreshGrad()

__all__ = ["FRESH", "FRESH_GRADS", "FSDP_GATHERED", "FSDP_PIECES", "GRAD_REPORTS", "SEQUENCE_GATHERED",
           "ZERO_WAITED", "FreshGrad", "FsdpGathered", "FsdpPiece", "GradReport", "SequenceGathered",
           "TensorRecords", "ZeroWaited"]
