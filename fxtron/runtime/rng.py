"""Runtime: random number streams for tensor parallel, as Megatron's model-parallel RNG tracker.

A random op (dropout, attention dropout) on a value that is replicated over the tp ranks must
draw the same numbers on every tp rank, or the replicas silently drift apart; on a value that is
sharded it must draw independent numbers per rank, or every shard gets the same mask. Each
program owns two generators: `replicated` (seeded alike on every rank) and `sharded` (seed +
2718 + tp rank, Megatron's offset). The compiler wraps every random op in `rng_call(region, op,
...)`; while a program runs its graph, `rng_call` swaps the chosen stream in as the default
generator for that one op and saves where the stream got to.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

_ACTIVE: contextvars.ContextVar["RNGStreams | None"] = contextvars.ContextVar("fxtron_rng", default=None)
SHARDED_OFFSET = 2718   # Megatron's model_parallel_cuda_manual_seed offset


@dataclass
class RNGStreams:
    """The two random streams of one rank's program."""

    seed: int
    tp_rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        self.states = {"replicated": self._state(self.seed),
                       "sharded": self._state(self.seed + SHARDED_OFFSET + self.tp_rank)}

    def _state(self, seed: int) -> torch.Tensor:
        g = torch.Generator(device=self.device) if self.device.type != "cuda" else torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g.get_state()

    @contextlib.contextmanager
    def active(self):
        """Make these streams the ones `rng_call` uses while the graph runs."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def run(self, region: str, fn, *args, **kwargs):
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


def rng_call(region: str, op, *args, **kwargs):
    """Run the random `op` on the `region` stream ("replicated" or "sharded") of the program
    whose graph is running; outside a program, run it as it is."""
    streams = _ACTIVE.get()
    if streams is None:
        return op(*args, **kwargs)
    return streams.run(region, op, *args, **kwargs)


RANDOM_OPS = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
              torch.ops.aten.bernoulli.default, torch.ops.aten.bernoulli.p,
              torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default,
              torch.ops.aten.scaled_dot_product_attention.default}


def is_random(node) -> bool:
    """Does this graph node draw random numbers? (SDPA only with dropout_p > 0)"""
    if node.op != "call_function" or node.target not in RANDOM_OPS:
        return False
    if node.target == torch.ops.aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(p)
    if node.target == torch.ops.aten.dropout.default:
        return bool(node.args[1]) and bool(node.args[2])
    return True
