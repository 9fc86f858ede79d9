"""Runtime: data-parallel gradient buffers and buckets (Megatron's _ParamAndGradBuffer and
DistributedDataParallel).

Every gradient of a rank lives in one contiguous buffer: parameter i's `main_grad` is a view
of it, parameters laid out in reverse order of use (the order backward produces their
gradients), grouped into buckets of about `bucket_size` elements. During the backward of the
last microbatch of a step, each parameter reports when its gradient is complete (a
post-accumulate-grad hook for gradients autograd computes; the fused linear's weight-gradient
job itself for gradients accumulated straight into main_grad, so a deferred GEMM counts only
once it has run); when the last parameter of a bucket reports, that bucket's all-reduce (or
reduce-scatter, for the distributed optimizer) starts asynchronously over the data-parallel
group, already scaled by 1/dp, while backward goes on. `finish()` starts what never started
and waits for everything.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fxtron.core.records import FRESH, FRESH_GRADS
from fxtron.ops import ledger, shm
from fxtron.ops import transport as T


def default_bucket_size(dp: int) -> int:
    """Megatron's default: max(40M, 1M x dp) elements."""
    return max(40_000_000, 1_000_000 * dp)


@dataclass
class Bucket:
    """A contiguous slice [start, end) of the buffer holding `params` (names), with how many
    gradient reports it still waits for in this step."""

    index: int
    params: list[str]
    start: int
    end: int
    expected: int = 0
    pending: int = 0
    work: object = None
    started: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class GradBuffer:
    """The flat gradient buffer of one rank and its buckets.

    params: (name, parameter, reports expected per step) in order of first use in forward.
    group: the process group that reduces the buckets, of `dp` ranks (this one `dp_rank`);
    `average`: the divisor applied before the sum (default dp: the average over dp; under
    context parallel the group is dp-cp and the divisor dp, summing over cp). Each bucket is
    padded to a multiple of dp for an even reduce-scatter.
    """

    params: list[tuple[str, torch.nn.Parameter, int]]
    dtype: torch.dtype
    bucket_size: int
    group: object = None
    dp: int = 1
    reduce_scatter: bool = False
    dp_rank: int = 0
    alone: frozenset = frozenset()      # parameters that get a bucket of their own (tied weights)
    average: int | None = None          # the divisor (None: dp)
    data: torch.Tensor = field(init=False)
    buckets: list[Bucket] = field(init=False, default_factory=list)
    offsets: dict[str, tuple[int, int]] = field(init=False, default_factory=dict)
    bytes_sent: int = field(init=False, default=0)      # by this rank in the last step (ring algorithms)
    started_early: int = field(init=False, default=0)   # buckets of the last step started during backward

    def __post_init__(self):
        pad = self.dp if self.reduce_scatter else 1
        at, current, start = 0, [], 0
        layout: list[tuple[str, int, int]] = []
        for name, p, _ in reversed(self.params):        # backward produces the last-used first
            if name in self.alone and current:
                at = _round_up(at, pad)
                self.buckets.append(Bucket(len(self.buckets), current, start, at))
                current, start = [], at
            layout.append((name, at, p.numel()))
            at += p.numel()
            current.append(name)
            if at - start >= self.bucket_size or name in self.alone:
                at = _round_up(at, pad)
                self.buckets.append(Bucket(len(self.buckets), current, start, at))
                current, start = [], at
        if current:
            at = _round_up(at, pad)
            self.buckets.append(Bucket(len(self.buckets), current, start, at))
        device = self.params[0][1].device if self.params else torch.device("cpu")
        self.data = torch.zeros(at, dtype=self.dtype, device=device)
        expected = {name: n for name, _, n in self.params}
        self._bucket_of: dict[str, Bucket] = {}
        for b in self.buckets:
            b.expected = sum(expected[n] for n in b.params)
            for n in b.params:
                self._bucket_of[n] = b
        for name, off, n in layout:
            self.offsets[name] = (off, n)
        self._reporting = False
        self._suspended = False
        self._fresh: dict = {}          # name -> its view, not yet written this step (reset)

    # ------------------------------------------------------------------ views
    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        off, n = self.offsets[name]
        return self.data[off:off + n].view(like.shape)

    # ------------------------------------------------------------------ one step
    def reset(self, views: dict | None = None) -> None:
        """Forget the last step's gradients and collectives. The buffer is not zero-filled: each
        parameter's view (`views`, name -> its main_grad) is marked fresh (core/records.py FRESH_GRADS), so the
        step's first contribution is written, not added (a fused linear's first weight-gradient
        GEMM writes its output, as autograd's does; ops/linear.py), and a view still fresh when
        its bucket is reduced is zeroed then (a parameter without a gradient this step). Without
        `views` (direct accumulation, runtime/grads.py: autograd adds into the views itself), or
        after `release`, the buffer is zeroed."""
        for b in self.buckets:
            if b.work is not None:
                # started by a step that failed before waiting for it (an error the caller caught):
                # completed first, so the peers' collectives stay in step, and without writing into
                # the buffer after it is reset (a shared-memory channel would otherwise complete it
                # at its next collective, into this step's gradients)
                ledger.discard(b.work)
                b.work = None
        storage = self.data.untyped_storage()
        if storage.nbytes() == 0 and self.data.numel():
            storage.resize_(self.data.numel() * self.data.element_size())
            self.data.zero_()           # (the padding between buckets too)
        if views is None:
            self.data.zero_()
            self._fresh = {}
        else:
            self._fresh = {n: views[n] for n in self.offsets if n in views}
            for v in self._fresh.values():
                FRESH_GRADS.set(v, FRESH)
        self.started_early = 0
        self.bytes_sent = 0
        for b in self.buckets:
            b.pending, b.work, b.started = b.expected, None, False
        self._reporting = False

    def release(self) -> None:
        """Give the buffer's memory back until the next `reset` (zero=2 between steps); the
        parameters' views of it stay valid and see it again then."""
        self.data.untyped_storage().resize_(0)

    def start_reporting(self, names=None) -> None:
        """The next backward is the step's last for these parameters (None: all): count
        their reports and start each bucket's collective as soon as it is complete."""
        if names is None:
            self._reporting = True
        elif self._reporting is not True:
            self._reporting = set(self._reporting or ()) | set(names)

    @contextlib.contextmanager
    def suspended(self):
        """Reports inside do not count: gradients of an earlier microbatch finishing after
        the last one's backward began (ZB-H1's deferred weight-gradient passes)."""
        saved, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = saved

    def report(self, name: str) -> None:
        """One gradient contribution of `name` is complete in the buffer."""
        if self._suspended:
            return
        if self._reporting is not True and (not self._reporting or name not in self._reporting):
            return
        b = self._bucket_of[name]
        b.pending -= 1
        if b.pending == 0:
            self.started_early += 1
            self._start(b)

    def _start(self, b: Bucket) -> None:
        b.started = True
        for n in b.params:             # no gradient this step: zero, not last step's
            v = self._fresh.pop(n, None)
            if v is not None and FRESH_GRADS.take(v):
                v.zero_()
        chunk = self.data[b.start:b.end]
        if (self.average or self.dp) != 1:
            chunk.div_(self.average or self.dp)     # scale once: the average over dp
        if self.dp == 1 or self.group is None:      # (an expert weight's replicas may be one rank: ep = dp)
            return
        # through the group's shared-memory channel where it has one (ranks of one host, gloo:
        # ops/shm.py), else the backend's own async collective
        if self.reduce_scatter:
            out = chunk.view(self.dp, -1)[self.dp_rank]
            if shm.channel(self.group.group_name) is not None:
                b.work = _Into(T.start_reduce_scatter(chunk.view(self.dp, -1), 0, self.group), out)
            else:
                e = ledger.issue(self.group, "reduce_scatter", chunk)
                b.work = ledger.started(e, dist.reduce_scatter_tensor(out, chunk.clone(), group=self.group,
                                                                      async_op=True))
            self.bytes_sent += chunk.numel() * chunk.element_size() * (self.dp - 1) // self.dp
        else:
            b.work = T.start_all_reduce(chunk, self.group)
            self.bytes_sent += 2 * chunk.numel() * chunk.element_size() * (self.dp - 1) // self.dp

    def finish(self) -> None:
        """Start every bucket that has not started (parameters without a gradient this step,
        or a step whose reports were never counted) and wait for all of them."""
        for b in self.buckets:
            if not b.started:
                self._start(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._reporting = False

    def shard(self, b: Bucket, rank: int) -> tuple[int, int]:
        """[start, end) of dp rank `rank`'s shard of bucket b in the buffer."""
        n = b.numel // self.dp
        return b.start + rank * n, b.start + (rank + 1) * n


class _Into:
    """A started reduce-scatter whose wait() copies this rank's slice where the bucket keeps it."""

    def __init__(self, work, out: Tensor):
        self.work, self.out = work, out

    def wait(self) -> None:
        self.out.copy_(self.work.wait().view_as(self.out))

    def discard(self) -> None:
        ledger.discard(self.work)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k

