"""Ops: random number streams for distributed values, as Megatron's model-parallel RNG tracker.

A random op (dropout, attention dropout) on a value that is replicated over the ranks of an
axis must draw the same numbers on every one of them, or the replicas silently drift apart; on
a value that is sharded over an axis it must draw independent numbers per rank, or every shard
gets the same mask. The compiler wraps every random op in `rng_call(region, op, ...)`, with
region "replicated" or "sharded:<axes>" (the axes its output is sharded over, "sharded:tp");
a program's `RNGStreams` holds one generator state per region -- the replicated one seeded
alike on every rank, a sharded one at seed + 2718 + the rank's index over those axes
(Megatron's model_parallel_cuda_manual_seed offset) -- and while the program runs its graph
`rng_call` swaps the region's stream in as the default generator for that one op and saves
where the stream got to.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Mapping

import torch

_ACTIVE: contextvars.ContextVar["RNGStreams | None"] = contextvars.ContextVar("fxtron_rng", default=None)
SHARDED_OFFSET = 2718   # Megatron's model_parallel_cuda_manual_seed offset
REPLICATED = "replicated"


def sharded_region(axes: tuple[str, ...]) -> str:
    """The region name of a value sharded over `axes`: "sharded:tp"."""
    return "sharded:" + "-".join(axes)


@dataclass
class RNGStreams:
    """The random streams of one rank's program. `coords`: the rank's coordinate on every mesh
    axis, `sizes` the axis sizes (the index over several axes is mixed-radix, first axis
    fastest); a region's stream is made on first use."""

    seed: int
    coords: Mapping[str, int] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sizes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.states = {REPLICATED: self._state(self.seed)}

    def _state(self, seed: int) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g.get_state()

    def _offset(self, region: str) -> int:
        if not region.startswith("sharded:"):
            raise ValueError(f"unknown random region {region!r}: 'replicated' or 'sharded:<axes>'")
        index, stride = 0, 1
        for axis in region.split(":", 1)[1].split("-"):
            index += self.coords.get(axis, 0) * stride
            stride *= self.sizes.get(axis, 1)
        return SHARDED_OFFSET + index

    @contextlib.contextmanager
    def active(self):
        """Make these streams the ones `rng_call` uses while the graph runs."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Where every stream is now (a recomputed region's start, ops/recompute.py)."""
        return dict(self.states)

    @contextlib.contextmanager
    def replaying(self, start: dict[str, torch.Tensor]):
        """Run with every stream back at `start` (a stream made since starts where it was made),
        these streams the active ones; afterwards every stream is where it was before."""
        saved = self.states
        self.states = dict(start)
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            self.states = saved

    def run(self, region: str, fn, *args, **kwargs):
        if region not in self.states:
            self.states[region] = self._state(self.seed + self._offset(region))
        cuda = self.device.type == "cuda"
        get = (lambda: torch.cuda.get_rng_state(self.device)) if cuda else torch.get_rng_state
        put = (lambda s: torch.cuda.set_rng_state(s, self.device)) if cuda else torch.set_rng_state
        saved = get()
        put(self.states[region])
        try:
            out = fn(*args, **kwargs)
            self.states[region] = get()
        finally:
            put(saved)
        return out


def active_streams() -> "RNGStreams | None":
    """The streams of the program whose graph is running, if any."""
    return _ACTIVE.get()


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """aten.dropout keeping a 1-byte mask for backward on every device, as CUDA's fused dropout
    does (CPU's dropout keeps a mask of the input's dtype, 2-4x the bytes); the same draws and
    values."""
    return torch.native_dropout(x, p, train)[0] if train and p > 0 else x


_BOOL_MASKED = {torch.ops.aten.dropout.default: _dropout}


def rng_call(region: str, op, *args, **kwargs):
    """Run the random `op` on the `region` stream of the program whose graph is running;
    outside a program, run it as it is. Dropout keeps a 1-byte mask (`_dropout`)."""
    op = _BOOL_MASKED.get(op, op)
    streams = _ACTIVE.get()
    if streams is None:
        return op(*args, **kwargs)
    return streams.run(region, op, *args, **kwargs)


RANDOM_OPS = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
              torch.ops.aten.bernoulli.default, torch.ops.aten.bernoulli.p,
              torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default,
              torch.ops.aten.scaled_dot_product_attention.default}


def takes_region(node) -> bool:
    """Is this a graph op that draws its random numbers inside, from the stream named by its
    `rng_region` keyword (context parallel's attention), rather than one `rng_call` wraps? Such
    an op is marked `draws_at(i)`: its argument i is its dropout probability."""
    return node.op == "call_function" and hasattr(node.target, "fxtron_dropout_arg")


def draws_at(arg: int):
    """Mark a function a graph calls as drawing random numbers inside when its argument `arg`
    (a dropout probability) is non-zero, from the stream its `rng_region` keyword names."""
    def mark(fn):
        fn.fxtron_dropout_arg = arg
        return fn
    return mark


def is_random(node) -> bool:
    """Does this graph node draw random numbers? (SDPA and context parallel's attention only
    with dropout_p > 0)"""
    if takes_region(node):
        return bool(node.args[node.target.fxtron_dropout_arg])
    if node.op != "call_function" or node.target not in RANDOM_OPS:
        return False
    if node.target == torch.ops.aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(p)
    if node.target == torch.ops.aten.dropout.default:
        return bool(node.args[1]) and bool(node.args[2])
    return True


__all__ = ["REPLICATED", "RNGStreams", "active_streams", "draws_at", "is_random", "rng_call", "sharded_region", "takes_region"]
