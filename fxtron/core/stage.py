"""Core: one pipeline stage of a rank -- its graph and its interface. The compiler's stage split
makes them; the runtime's schedule runs them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

#: The most activations one pipeline boundary may carry (the p2p tags leave room for them and
#: their shape messages).
MAX_BOUNDARY_TENSORS = 62


@dataclass
class Stage:
    """One stage's graph and its interface. The GraphModule is called as
    gm(*params, *buffers, *user_inputs, *boundary_inputs) and returns the tuple
    (*boundary_outputs) -- plus the loss last on the final stage. `gm` None stands for the
    whole per-rank graph run as one stage (no pipeline parallel)."""

    index: int
    gm: fx.GraphModule | None
    params: list[str]
    buffers: list[str]
    user_inputs: list[int]                   # indices into the flat user inputs
    inputs: list[str] = field(default_factory=list)    # boundary values received
    outputs: list[str] = field(default_factory=list)   # boundary values sent on
    has_loss: bool = False
    values: dict[str, fx.Node] = field(default_factory=dict)   # boundary name -> node (val, placement, shape)


__all__ = ["MAX_BOUNDARY_TENSORS", "Stage"]
