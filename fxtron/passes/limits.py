"""Passes: what inputs the model itself can take, read from its graph -- how long a sequence (a
learned position table looked up by positions the model makes, `wpe(arange(S))`, or a table
sliced to the sequence, `rope_cos[:S]`), and which token ids (an input looked up in an
embedding table of V rows, or the targets of a cross entropy over V classes). The step refuses
a longer sequence or an id out of range before it runs: in one process these are index errors;
split over tp, a vocab-parallel lookup would silently read zeros for an id past the table."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxtron.core import meta, opsets

aten = torch.ops.aten


@dataclass(frozen=True)
class SeqLimit:
    """The longest sequence the model takes, and what sets it (for the message)."""

    tokens: int
    why: str


def _is_seq_size(node, gm: fx.GraphModule) -> bool:
    """Is `node` the run-time size of a user input's sequence dim?"""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.sym_size.int):
        return False
    spec = meta.get(node.args[0], meta.INPUT)
    return spec is not None and spec.kind == "user" and node.args[1] < len(spec.dims) and spec.dims[node.args[1]] == "seq"


def _from_positions(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Does `node` derive from an arange over the sequence length (positions the model makes)?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in (aten.arange.default, aten.arange.start, aten.arange.start_step) \
                and any(_is_seq_size(a, gm) for a in n.args):
            return True
        stack.extend(n.all_input_nodes)
    return False


def seq_limit(gm: fx.GraphModule) -> SeqLimit | None:
    """The tightest limit the graph sets on the sequence length, or None (rotary angles computed
    from positions, say, take any length)."""
    best: SeqLimit | None = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = None
        if node.target == aten.embedding.default and meta.is_param(node.args[0]) and _from_positions(node.args[1], gm):
            found = SeqLimit(int(node.args[0].meta["val"].shape[0]),
                             f"the position table {meta.param_name(node.args[0])} has "
                             f"{int(node.args[0].meta['val'].shape[0])} rows")
        elif node.target == aten.slice.Tensor and len(node.args) > 3 and _is_seq_size(node.args[3], gm) \
                and node.args[0].op == "placeholder":
            src = node.args[0]
            spec = meta.get(src, meta.INPUT)
            if spec is not None and spec.kind in ("buffer", "parameter"):
                size = int(src.meta["val"].shape[node.args[1]])
                found = SeqLimit(size, f"{spec.kind} {spec.target} is cut to the sequence from {size} positions")
        if found is not None and (best is None or found.tokens < best.tokens):
            best = found
    return best


@dataclass(frozen=True)
class TokenRange:
    """User input `index` holds ids in [0, classes) -- or `ignore` (a loss's ignore_index)."""

    index: int
    classes: int
    ignore: int | None
    why: str


# ops that move ids without changing them (a cast, a view, a slice, a pad with the ignore value)
_IDENTITY = opsets.VIEWS | opsets.SLICES | opsets.COPIES | opsets.CASTS | {aten.constant_pad_nd.default, aten.pad.default}


def _source_input(node) -> int | None:
    """The user input `node` is (a view, slice or copy of), by index; None if computed."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            spec = meta.get(node, meta.INPUT)
            return spec.index if spec is not None and spec.kind == "user" else None
        if node.op != "call_function" or node.target not in _IDENTITY:
            return None
        node = node.args[0]
    return None


def token_ranges(gm: fx.GraphModule) -> list[TokenRange]:
    """Every user input the graph uses as ids into a table or as classification targets, with
    the number of rows or classes (the tightest where several)."""
    found: dict[int, TokenRange] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rng = None
        if node.target == aten.embedding.default and meta.is_param(node.args[0]):
            idx = _source_input(node.args[1])
            if idx is not None:
                rows = int(node.args[0].meta["val"].shape[0])
                rng = TokenRange(idx, rows, None, f"the embedding table {meta.param_name(node.args[0])} has {rows} rows")
        elif node.target in (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default):
            idx = _source_input(node.args[1])
            logits = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            size = logits.shape[1 if logits.dim() >= 2 else 0] if logits is not None else None
            if idx is not None and isinstance(size, int):
                classes = size
                ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
                rng = TokenRange(idx, classes, int(ignore), f"the loss's targets index {classes} classes (logits)")
        if rng is not None and (rng.index not in found or rng.classes < found[rng.index].classes):
            found[rng.index] = rng
    return [found[i] for i in sorted(found)]


__all__ = ["SeqLimit", "TokenRange", "seq_limit", "token_ranges"]
