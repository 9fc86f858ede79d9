"""Runtime: sharded data parallel (zero=3, FSDP) -- what a program does at the graph's
fsdp_gather and fsdp_free nodes (passes/fsdp.py, ops/fsdp.py).

Each unit (a layer's parameters of one gradient group) is held as the rank's flat pieces: the
program's parameters, 1/d of each local parameter, zero-padded. Per unit and step:

- forward: `gather` all-gathers the pieces (in the compute dtype: 16 bits under bf16) in one
  collective, lays the parameters out whole in one flat tensor and returns views of it; it then
  starts the next unit's gather (prefetch), which the next gather waits for. `free` drops the
  flat tensor after the unit's last use in forward. What autograd keeps of a gathered
  parameter for backward is not the tensor but where it lies in its unit (saved-tensor hooks;
  a fused linear keeps the handle, ops/linear.py), so nothing holds the gathered copy between
  forward and backward.
- backward: the first use of a unit gathers it again (and starts gathering the unit before it,
  the next backward needs); its gradients accumulate into one fp32 flat tensor of the unit
  (fused linears' weight-gradient GEMMs write there, autograd's gradients are added by the
  gather's backward), and when every gradient of the unit has reported (RankSpec.grad_reports,
  per microbatch) the unit is reduce-scattered over its group -- averaged over dp, fp32 or
  grad_reduce_dtype -- asynchronously; the regathered parameters and the flat gradient are
  dropped, and the reduced piece is added to the rank's gradient of its pieces when the
  collective completes. `finish()` reduces what never reported and waits for everything.

Under hybrid sharding (HSDP, dp_shard=k) the pieces are over consecutive groups of k ranks of
the gradient group, and each reduce-scattered piece is then all-reduced over its replicas.

With `gather_per_step` the units gathered in a step stay gathered until it ends (no gather
again in backward or for later microbatches): the whole local parameters are held during the
step, as without zero=3, for one gather per unit and step.

Bytes per step and unit of P parameter bytes over d ranks: all-gather in forward and again in
backward, reduce-scatter of the gradients: 3 (d-1)/d P on the wire, 1.5x the all-reduce's
2 (d-1)/d P (Rajbhandari et al.).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx

from fxtron.core import layout, meta
from fxtron.core.records import FRESH_GRADS, FSDP_GATHERED, FsdpGathered
from fxtron.ops import fsdp as ops
from fxtron.ops import ledger
from fxtron.ops.linear import active_queue
from fxtron.ops.recompute import recomputing


class _Unit:
    """One unit on this rank: its parameters (names, local shapes, pieces of `chunks`
    elements), its group and the state of the step."""

    def __init__(self, label: str, kind: str, names: list[str], shapes: list[tuple[int, ...]], chunks: list[int],
                 group, world: int, index: int):
        self.label, self.kind, self.names, self.shapes = label, kind, names, shapes
        self.chunks, self.group, self.world, self.index = chunks, group, world, index
        self.numels = [layout.numel(s) for s in shapes]
        self.piece = sum(chunks)                          # elements of the rank's pieces, together
        self.cols = _offsets(chunks)                      # where each parameter's piece lies in them
        self.offsets = _offsets(self.numels)              # where each parameter lies in the gathered flat
        self.goffsets = _offsets([world * c for c in chunks])   # ... in the gradient flat (padded)
        self.flat: torch.Tensor | None = None             # the gathered parameters, while held
        self.pending = None                               # (work, received) of a started gather
        self.grad: torch.Tensor | None = None             # the gradient flat of this microbatch
        self.reports = 0
        self.expected = 0
        self.other = False                                # autograd computes some of its gradient
        self.backward_reads = True                        # its backward reads its parameters
        self.replicate = None                             # HSDP: the group of the pieces' replicas
        self.next: _Unit | None = None                    # forward order within its graph
        self.prev: _Unit | None = None

    def index_of(self, x: "_Packed") -> int | None:
        """Which parameter a packed tensor is, if it is one whole (not a view of part of it)."""
        for i, (off, shape) in enumerate(zip(self.offsets, self.shapes)):
            if x.offset == off and tuple(x.size) == tuple(shape) and tuple(x.stride) == _contiguous(shape):
                return i
        return None

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])


def _needing(u: _Unit | None) -> _Unit | None:
    """u, if its backward reads its parameters (a fused linear's weight, a norm's multiply;
    not an embedding lookup's table alone): the unit worth gathering ahead in backward."""
    return u if u is not None and u.backward_reads else None


def _reports(gather: fx.Node) -> tuple[int, bool]:
    """How many reports complete a unit's gradient in one backward: one per fused linear
    reading one of its parameters (its weight-gradient GEMM), and one for the gather's own
    backward if autograd computes any other part."""
    fused, other = 0, False
    linear = torch.ops.fxtron.linear.default
    for item in gather.users:
        for u in item.users:
            if u.target == torch.ops.fxtron.fsdp_free.default:
                continue
            if u.target == linear and u.args[1] is item:
                fused += 1
            else:
                other = True
    return fused + int(other), other


def _contiguous(shape) -> tuple[int, ...]:
    out, at = [], 1
    for s in reversed(shape):
        out.append(at)
        at *= int(s)
    return tuple(reversed(out))


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


class _Packed:
    """A gathered parameter autograd saved for backward, as where it lies in its unit."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: _Unit, t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class FsdpUnits:
    """A program's units (from the fsdp_gather nodes of its compiled graphs), over its parameters
    (`params`: the pieces, by name; `local`: their descriptions), computing in `dtype` (None: the parameters' own), the
    gradients reduced into `grads` (name -> the fp32 gradient of the piece) averaged over
    `average` ranks (the dense dp), each scaled by `share` (name -> factor) first."""

    def __init__(self, graphs: list[fx.GraphModule], params: dict, local: dict, groups, *, dtype, grad_dtype,
                 average: int, share: dict[str, float], gather_per_step: bool = False):
        self.params, self.groups, self.dtype, self.grad_dtype = params, groups, dtype, grad_dtype
        self.average, self.share, self.gather_per_step = average, share, gather_per_step
        self.units: dict[str, _Unit] = {}
        for gm in graphs:
            prev = None
            for node in gm.graph.nodes:
                if node.op != "call_function" or node.target != torch.ops.fxtron.fsdp_gather.default:
                    continue
                _, label, shards, shapes, dims = node.args
                names = [meta.param_name(s) for s in shards]
                flat = local[names[0]].flat
                kind = flat.group or local[names[0]].grad_group
                world, index = groups.size(kind), groups.index(kind)
                unit = _Unit(label, kind, names, ops.shapes_of(shapes, dims), [params[n].numel() for n in names],
                             groups.group(kind), world, index)
                if flat.replicate and groups.size(flat.replicate) > 1:   # HSDP: the replicas' sum
                    unit.replicate = groups.group(flat.replicate)
                unit.expected, unit.other = _reports(node)
                unit.backward_reads = ops.read_in_backward(node)
                unit.prev, self.units[label] = prev, unit
                if prev is not None:
                    prev.next = unit
                prev = unit
        self._storage: dict[int, _Unit] = {}     # data_ptr of a held flat -> its unit
        self._reducing: list = []                 # (unit names, chunks, cols, work, out) in flight
        self.grads: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0                       # by this rank in the last step (ring algorithms)
        self.gathers = 0                          # all-gathers issued in the last step
        self.peak_held = 0                        # most gathered parameter bytes held at once, last step
        self._held = 0
        self._last: _Unit | None = None           # the unit backward last entered
        self._queued = False                      # the end-of-backward callback is queued
        self.memory = None                        # the step's runtime.memory.MemoryTracker, when tracked

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def running(self):
        """While the program's graph runs: what autograd saves of a gathered parameter is
        packed as its place in the unit."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def begin(self, grads: dict[str, torch.Tensor]) -> None:
        """A step starts: reduced gradients go into `grads` (name -> the piece's gradient)."""
        # reductions a failed step started (an error the caller caught): finished and dropped,
        # so the peers stay in step and none lands in this step's gradients
        for _, work, _ in self._reducing:
            work.wait()
        self._reducing = []
        self.grads = grads
        self._last = None
        self.bytes_sent = self.gathers = self.peak_held = self._held = 0
        for u in self.units.values():
            u.reports, u.grad = 0, None

    def finish(self) -> None:
        """Reduce every unit's gradient that has not been (a report that never came), wait for
        every collective, drop every gathered unit; the step is over."""
        for u in self.units.values():
            if u.grad is not None:
                self._reduce(u)
        self._drain(0)
        for u in self.units.values():
            if u.pending is not None:
                self._receive(u)
            self._drop(u)
        self.grads = {}

    def settle(self) -> None:
        """Outside a step: wait for every collective still in flight (a prefetched gather that
        no step will use, a reduction) and drop every gathered unit -- nothing of the units
        is pending when the run ends and its process groups go."""
        self._drain(0)
        for u in self.units.values():
            if u.pending is not None:
                self._receive(u)
            self._drop(u)

    # ------------------------------------------------------------------ gathers
    def _start(self, u: _Unit, pieces: list[torch.Tensor] | None = None) -> None:
        if pieces is None:
            pieces = [self._compute(self.params[n].detach()) for n in u.names]
        send = torch.cat([p.reshape(-1) for p in pieces]) if len(pieces) > 1 else pieces[0].reshape(-1).contiguous()
        received = send.new_empty(u.world * u.piece)
        e = ledger.issue(u.group, "all_gather", send)
        work = ledger.started(e, dist.all_gather_into_tensor(received, send, group=u.group, async_op=True))
        u.pending = (work, received)
        self._hold(received)
        self.gathers += 1
        self.bytes_sent += send.numel() * send.element_size() * (u.world - 1)

    def _receive(self, u: _Unit) -> torch.Tensor:
        work, received = u.pending
        u.pending = None
        work.wait()
        received = received.view(u.world, u.piece)
        if len(u.names) == 1:
            flat = received.view(-1)[:u.numels[0]]
        else:
            flat = torch.cat([received[:, c:c + k].reshape(-1)[:n] for c, k, n in zip(u.cols, u.chunks, u.numels)])
        u.flat = flat
        self._storage[flat.untyped_storage().data_ptr()] = u
        if flat.untyped_storage().data_ptr() != received.untyped_storage().data_ptr():
            self._hold(flat)
            self._hold(received, -1)
        return flat

    def _hold(self, t: torch.Tensor, sign: int = 1) -> None:
        """Count gathered bytes held (received buffers, gathered flats) and their peak."""
        self._held += sign * t.untyped_storage().nbytes()
        self.peak_held = max(self.peak_held, self._held)

    def _held_flat(self, u: _Unit, pieces=None, prefetch: _Unit | None = None) -> torch.Tensor:
        """u's gathered flat, gathered now unless held or started; then `prefetch` is started
        (after u's copy-out, so that at most two units' received buffers exist at once)."""
        if u.flat is None:
            if u.pending is None:
                self._start(u, pieces)
            self._receive(u)
        if prefetch is not None and prefetch.flat is None and prefetch.pending is None:
            self._start(prefetch)                # its bytes move while this unit computes
        return u.flat

    def _drop(self, u: _Unit) -> None:
        if u.flat is not None:
            self._storage.pop(u.flat.untyped_storage().data_ptr(), None)
            self._hold(u.flat, -1)
            u.flat = None

    def gather(self, label: str, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """fsdp_gather: the unit's whole parameters (views of its gathered flat)."""
        u = self.units[label]
        ahead = None if recomputing() else u.next
        flat = self._held_flat(u, [self._compute(p.detach()) for p in pieces], ahead)
        return [u.view(flat, i) for i in range(len(u.names))]

    def free(self, label: str) -> None:
        """fsdp_free: forward is done with the unit (a recomputation keeps it for its backward)."""
        if not self.gather_per_step and not recomputing():
            self._drop(self.units[label])

    def weight(self, label: str, i: int) -> torch.Tensor:
        """Parameter i of the unit in backward, gathered again if it is not held."""
        u = self.units[label]
        self._entering(u)
        return u.view(self._held_flat(u, prefetch=_needing(u.prev)), i)

    def _entering(self, u: _Unit) -> None:
        """Backward reaches unit u: the weight-gradient GEMMs queued so far (the later units',
        ops/linear.py WgradQueue) run now, while u's gather is in flight, so those units
        complete, reduce and drop their parameters instead of waiting for backward's end."""
        self._in_backward()
        if self._last is u:
            return
        self._last = u
        if u.flat is None and u.pending is None:
            self._start(u)
        queue = active_queue()
        if queue is not None and not queue.deferred and queue.jobs:
            queue.run()

    def _pack(self, t: torch.Tensor):
        # this hook hides any outer one: what it does not pack, the step's memory tracker sees
        seen = self.memory._pack if self.memory is not None else (lambda x: x)
        if not t.is_floating_point() or t.device.type == "meta":
            return seen(t)
        u = self._storage.get(t.untyped_storage().data_ptr())
        return seen(t) if u is None else _Packed(u, t)

    def _unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        self._entering(x.unit)
        u = x.unit
        flat = self._held_flat(u, prefetch=_needing(u.prev))
        out = flat.as_strided(x.size, x.stride, x.offset)
        i = u.index_of(x)
        if i is not None:     # a whole parameter (a recomputed region's input): a fused linear's handle again
            FSDP_GATHERED.set(out, FsdpGathered(self, u.label, i))
        return out

    def _compute(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)

    # ------------------------------------------------------------------ gradients
    def _grad(self, u: _Unit) -> torch.Tensor:
        if u.grad is None:
            u.grad = torch.zeros(u.world * u.piece, dtype=self.grad_dtype, device=self.params[u.names[0]].device)
        return u.grad

    def main_grad(self, label: str, i: int) -> torch.Tensor:
        """Where parameter i's gradient accumulates this microbatch (a fused linear's main_grad)."""
        u = self.units[label]
        g = self._grad(u)
        return g[u.goffsets[i]:u.goffsets[i] + u.numels[i]].view(u.shapes[i])

    def reporter(self, label: str):
        u = self.units[label]
        return lambda: self._report(u)

    def autograd_grads(self, label: str, grads: list) -> None:
        """The gather's backward: the gradients autograd computed for the unit's parameters."""
        u = self.units[label]
        self._in_backward()
        for i, g in enumerate(grads):
            if g is not None:
                self.main_grad(label, i).add_(g)
        if u.other:       # (called also when only fused linears read the unit: nothing to report then)
            self._report(u)

    def _in_backward(self) -> None:
        """Once per backward: when it ends, wait for the reductions still in flight (so a
        backward run outside train_step leaves complete gradients)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued = False
        if not self.grads:          # outside a step: nothing else will wait for them
            for u in self.units.values():
                if u.grad is not None:
                    self._reduce(u)
            self._drain(0)

    def _report(self, u: _Unit) -> None:
        u.reports += 1
        if u.reports >= u.expected:
            self._reduce(u)

    def _reduce(self, u: _Unit) -> None:
        """Start reduce-scattering the unit's gradient flat (this microbatch's) over its group."""
        u.reports = 0
        g, u.grad = u.grad, None
        if not self.gather_per_step:
            self._drop(u)                        # backward is done with the unit's parameters
        if g is None:
            return
        send = g.new_empty((u.world, u.piece))
        for i, n in enumerate(u.names):
            part = g[u.goffsets[i]:u.goffsets[i] + u.world * u.chunks[i]].view(u.world, u.chunks[i])
            scale = self.share.get(n, 1.0) / self.average
            send[:, u.cols[i]:u.cols[i] + u.chunks[i]].copy_(part)
            if scale != 1.0:
                send[:, u.cols[i]:u.cols[i] + u.chunks[i]].mul_(scale)
        out = send.new_empty(u.piece)
        e = ledger.issue(u.group, "reduce_scatter", send)
        work = ledger.started(e, dist.reduce_scatter_tensor(out, send.view(-1), group=u.group, async_op=True))
        self.bytes_sent += out.numel() * out.element_size() * (u.world - 1)
        self._reducing.append((u, work, out))
        self._drain(2)

    def _drain(self, keep: int) -> None:
        """Wait for the oldest reductions until `keep` are in flight; add them to the pieces' gradients."""
        while len(self._reducing) > keep:
            u, work, out = self._reducing.pop(0)
            work.wait()
            if u.replicate is not None:    # HSDP: summed over the shard group, now over its replicas
                with ledger.collective(u.replicate, "all_reduce", out):
                    dist.all_reduce(out, group=u.replicate)
                r = dist.get_world_size(u.replicate)
                self.bytes_sent += 2 * out.numel() * out.element_size() * (r - 1) // r
            for i, n in enumerate(u.names):
                part = out[u.cols[i]:u.cols[i] + u.chunks[i]]
                g = self.grads.get(n)
                if g is None:           # outside train_step (prog(...).backward()): into the piece's .grad
                    p = self.params[n]
                    p.grad = part.to(p.dtype).clone() if p.grad is None else p.grad.add_(part.to(p.dtype))
                elif FRESH_GRADS.take(g):      # the step's first (runtime/dp.py, core/records.py)
                    g.copy_(part)
                else:
                    g.add_(part.to(g.dtype))


# ---------------------------------------------------------------------- whole and held tensors
def whole_local(held: torch.Tensor, spec, groups) -> torch.Tensor:
    """The rank's local tensor of a parameter (or a gradient, or optimizer state shaped like
    it) from every rank's flat piece under zero=3 (an all-gather over its group); `held`
    itself otherwise."""
    f = spec.flat
    if f is None:
        return held
    group = groups.group(f.group or spec.grad_group)
    out = held.new_empty(f.world * f.chunk)
    with ledger.collective(group, "all_gather", held):
        dist.all_gather_into_tensor(out, held.contiguous(), group=group)
    return out[:layout.numel(spec.local_shape)].view(spec.local_shape)


__all__ = ["FsdpUnits", "whole_local"]
