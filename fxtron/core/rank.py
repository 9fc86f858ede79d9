"""Core: one rank's compiled program as the runtime receives it -- its graph (or its pipeline
stages), its parameters' local descriptions and the facts the runtime needs to run and
synchronize it. The compiler makes it (compiler/passmanager.py RankGraph.spec); the runtime builds
a Program from it (runtime/build.py); neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.fx as fx

from fxtron.core.axes import MeshView
from fxtron.core.meta import TraceInfo
from fxtron.core.params import LocalParam
from fxtron.core.stage import Stage


@dataclass(frozen=True)
class RankSpec:
    """gm: the whole per-rank graph, or None when the rank runs `stages` (pipeline parallel,
    chunk 0 first). local: every parameter the rank holds. shared: parameters several pipeline
    ranks hold (a tied embedding and LM head) -> those pp ranks. param_order: the rank's
    parameters in order of first use in forward. grad_reports: how many times per step each
    parameter's gradient reports complete in the last backward. fused: parameters whose
    gradient fused linears accumulate into main_grad; autograd: parameters autograd computes
    (a part of) the gradient of, an AccumulateGrad's (any use but a fused linear's weight). seq_split: how many equal parts each
    rank's tokens of a sequence are cut into inside the graph (tp under sequence parallel), so
    the step can refuse a length that does not divide before it runs. max_seq: the longest
    sequence the model takes (a position table's rows; None: no limit found), max_seq_why:
    what sets it. host_bound: what in the graphs a captured CUDA graph cannot replay, a line
    each (codegen/regions.py host_bound; cuda_graphs=True refuses them at program build).
    unread_params, unread_buffers: under pipeline parallel, on the first stage's ranks, the
    parameters and buffers the model's forward never reads (in no stage's graph): held there so
    checkpoints keep them."""

    rank: int
    mesh: MeshView
    info: TraceInfo
    gm: fx.GraphModule | None
    stages: tuple[Stage, ...] | None
    local: Mapping[str, LocalParam]
    shared: Mapping[str, tuple[int, ...]]
    param_order: tuple[str, ...]
    grad_reports: Mapping[str, int]
    fused: tuple[str, ...]
    autograd: tuple[str, ...] = ()
    seq_split: int = 1
    max_seq: int | None = None
    max_seq_why: str = ""
    host_bound: tuple[str, ...] = ()
    unread_params: tuple[str, ...] = ()
    unread_buffers: tuple[str, ...] = ()

    @property
    def graphs(self) -> list[fx.GraphModule]:
        return [s.gm for s in self.stages] if self.stages is not None else [self.gm]


__all__ = ["RankSpec"]
