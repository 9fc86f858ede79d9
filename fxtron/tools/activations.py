"""What autograd keeps for backward, estimated without processes: each of a rank's graphs is run
forward on fake tensors (torch's FakeTensorMode: shapes, dtypes and storages, no data, no
communication; expert parallel's dispatch under uniform routing) at the batch and sequence
asked, under the same saved-tensor hooks the runtime's memory tracker uses (runtime/memory.py),
and the storages saved for backward are added up, each once, parameters and buffers excluded
(their 16-bit compute copies included, as the tracker counts them).

The figure is therefore the tracker's own measure, not a formula: it sees what each op's
autograd formula saves (a linear its input, a softmax its output, the vocab-parallel cross
entropy its fp32 softmax), views sharing a storage, sequence parallel's gathered inputs and the
inputs a recomputed region keeps in place of its insides. It is a forward's: the memory a
backward briefly needs on top (the region being recomputed, the gradients) is not in it.

`saved_bytes(pm, rank, batch, seq)` gives one microbatch's bytes per model chunk;
`peak_saved_bytes` follows the rank's schedule (each forward adds its chunk's bytes, each
backward frees them; under the zero-bubble schedules at the weight-gradient pass) and gives the
most alive at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxtron.core import meta
from fxtron.core.meta import BATCH, SEQ
from fxtron.core.records import SEQUENCE_GATHERED, SequenceGathered
from fxtron.errors import ParallelizeError
from fxtron.ops import ep as ep_ops
from fxtron.ops.linear import Regather
from fxtron.ops.recompute import Recomputed, outline
from fxtron.passes.pp import find_layer_list
from fxtron.runtime.pp import schedules
from fxtron.runtime.bind import on_device
from fxtron.runtime.precision import compute_copy


def _concrete(shape, sub: dict) -> tuple[int, ...]:
    return tuple(int(sympy.sympify(d).subs(sub)) for d in shape)


def _deferred(node: fx.Node | None) -> bool:
    """Is `node` a fused linear whose weight-gradient GEMM a split backward defers to its W pass
    (its weight a parameter, accumulating into main_grad: ops/linear.py)?"""
    return (node is not None and node.op == "call_function" and node.target == torch.ops.fxtron.linear.default
            and meta.is_param(node.args[1]))


def _gather_from_sequence(x, dim, world, group):
    """gather_from_sequence as the runtime's form marks its output (ops/sp.py): the linears it
    feeds save the shard, not the gathered whole."""
    out = torch.ops.fxtron.gather_from_sequence(x, dim, world, group)
    SEQUENCE_GATHERED.set(out, SequenceGathered(x.detach(), Regather(lambda shard: None)))
    return out


def _placed(gm: fx.GraphModule) -> fx.GraphModule:
    """gm as the runtime runs it (bind): tensors it creates on the CPU, recomputed regions as
    checkpointed calls, sequence parallel's gathers marked for the linears after them; its
    communicating ops keep their compiled forms, whose fake kernels give shapes without a
    process group."""
    out = meta.copy_graph(gm)
    cpu = torch.device("cpu")
    for node in out.graph.nodes:
        if node.op == "call_function":
            on_device(node, cpu)
            if node.target == torch.ops.fxtron.gather_from_sequence.default:
                node.target = _gather_from_sequence
    out.recompile()
    return outline(out)


class _Where(fx.Interpreter):
    """Runs gm node by node, knowing whether the node now running is inside the model's
    repeated layers ("layer"), before them ("pre") or after them ("post")."""

    def __init__(self, gm: fx.GraphModule, prefix: str | None, measure):
        super().__init__(gm)
        self.part = "pre"
        self.recomputed = 0
        self.node: fx.Node | None = None
        self.linear_outputs = 0
        self._measure = measure
        self.layers: set[str] = set()
        self._prefix = prefix

    def _module(self, node: fx.Node) -> str:
        if node.op == "call_module":      # a recomputed region: its nodes' module
            inner = self.module.get_submodule(node.target)
            inner = getattr(inner, "region", inner)
            return next((meta.get(n, meta.MODULE) or "" for n in inner.graph.nodes if n.op == "call_function"), "")
        return meta.get(node, meta.MODULE) or ""

    def run_node(self, node: fx.Node):
        self.node = node
        if node.op == "call_module" and isinstance(self.module.get_submodule(node.target), Recomputed):
            # what the region saves while backward runs it again: measured by running it once more
            args, _ = self.fetch_args_kwargs_from_env(node)
            self.recomputed = max(self.recomputed, self._measure(self.module.get_submodule(node.target).region, args))
        if node.op in ("call_function", "call_module") and self._prefix is not None:
            path = self._module(node)
            if path.startswith(self._prefix + "."):
                self.part = "layer"
                self.layers.add(".".join(path[len(self._prefix) + 1:].split(".", 1)[:1]))
            elif self.part == "layer":
                self.part = "post"
        out = super().run_node(node)
        if _deferred(node):
            self.linear_outputs += out.numel() * out.element_size()
        return out


@dataclass(frozen=True)
class Saved:
    """One microbatch's bytes saved for backward by one graph: `pre` by what runs before the
    model's repeated layers (the embedding), `layers` by the `count` layers together, `post`
    by what runs after them (the final norm, the head, the loss); `copies` the 16-bit compute
    copies of parameters the ops save under mixed precision (the tracker counts them; inspect's
    memory table has them among the parameters); `recomputed` what the largest recomputed region
    saves while backward runs it again (held for a moment on top of the rest: not in `total`)."""

    pre: int
    layers: int
    post: int
    count: int
    copies: int = 0
    recomputed: int = 0     # the largest recomputed region's bytes, saved while backward runs it again
    deferred: int = 0       # what a deferred weight-gradient pass keeps from B to W (zero-bubble schedules)

    @property
    def activations(self) -> int:
        """Bytes of activations proper: not the parameters' compute copies."""
        return self.pre + self.layers + self.post

    @property
    def total(self) -> int:
        """The tracker's measure: the activations and the compute copies saved."""
        return self.activations + self.copies

    @property
    def per_layer(self) -> float:
        return self.layers / self.count if self.count else 0.0


def _run_forward(gm: fx.GraphModule, dtype: torch.dtype | None, sub: dict, prefix: str | None) -> Saved:
    """One forward of `gm` on fake tensors; the bytes of the storages saved for backward."""
    saved: dict[int, tuple[str, int]] = {}
    held: list[torch.Tensor] = []          # keep every saved tensor alive: no storage is reused
    excluded: set[int] = set()
    copies: set[int] = set()               # the parameters' 16-bit compute copies
    wgrad: set[int] = set()                # what the linears save: a deferred W pass keeps it after B

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in excluded and key not in saved:
            saved[key] = ("copies" if key in copies else runner.part, storage.nbytes())
            held.append(t)
        if key not in excluded and _deferred(runner.node):
            wgrad.add(key)
        return t

    def measure(region: fx.GraphModule, args) -> int:
        inside: dict[int, int] = {}

        def count(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in excluded and storage._cdata not in copies and storage._cdata not in saved:
                inside[storage._cdata] = storage.nbytes()
                held.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            region(*args)
        return sum(inside.values())

    runner = _Where(gm, prefix, measure)

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta["val"]
            spec = meta.get(node, meta.INPUT)
            shape = _concrete(meta.get(node, meta.LOCAL_SHAPE) or tuple(val.shape), sub)
            if spec is not None and spec.kind in ("parameter", "buffer"):
                # the program holds fp32 tensors and computes with their 16-bit copies
                held_dtype = torch.float32 if val.is_floating_point() and dtype is not None else val.dtype
                t = torch.zeros(shape, dtype=held_dtype, requires_grad=spec.kind == "parameter"
                                and val.is_floating_point())
                excluded.add(t.untyped_storage()._cdata)
                held.append(t)                              # alive, as the program's are
                # (a weight fxtron::master_linear takes is passed as it is: ops/linear.py)
                raw = any(u.target == torch.ops.fxtron.master_linear.default and u.args[1] is node for u in node.users)
                args.append(t if raw else compute_copy(t, dtype))
                if args[-1] is not t:
                    copies.add(args[-1].untyped_storage()._cdata)
            elif spec is not None:                          # a user input: zeros (token 0, no ignored label)
                args.append(torch.zeros(shape, dtype=val.dtype))
            else:                                           # a received activation
                t = torch.zeros(shape, dtype=val.dtype)
                args.append(t.requires_grad_() if t.is_floating_point() else t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ep_ops.uniform_routing():
            runner.run(*args)
    parts = {"pre": 0, "layer": 0, "post": 0, "copies": 0}
    for part, nbytes in saved.values():
        parts[part] += nbytes
    # a deferred W pass keeps the linears' saved inputs and their output gradients (of the outputs' size)
    deferred = sum(saved[k][1] for k in wgrad if k in saved) + runner.linear_outputs
    return Saved(parts["pre"], parts["layer"], parts["post"], len(runner.layers), parts["copies"], runner.recomputed,
                 deferred)


def saved_bytes(pm, rank: int, batch: int, seq: int) -> list[Saved]:
    """What one microbatch of `batch` sequences of `seq` tokens (the rank's own, after the
    data-parallel split) leaves saved for backward, per model chunk of `rank` (one entry
    without pipeline parallel)."""
    rg = pm.compiled(rank)
    dtype = pm.config.precision.torch_dtype
    dtype = None if dtype in (None, torch.float32) else dtype
    sub = {BATCH: batch, SEQ: seq}
    try:
        prefix = find_layer_list(pm.traced)[0]
    except ParallelizeError:
        prefix = None                       # no repeated layers: all of it counts as "pre"
    out = []
    for gm in rg.graphs:
        try:
            out.append(_run_forward(_placed(gm), dtype, sub, prefix))
        except Exception as e:      # an op whose fake kernel needs data (a data-dependent shape)
            raise ParallelizeError(f"rank {rank}: the forward could not run on fake tensors to count what autograd "
                                   f"saves ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    return out


def peak_saved_bytes(pm, rank: int, per_chunk: list[Saved], *, copies: bool = True) -> int:
    """The most bytes saved for backward alive at once on `rank` over its schedule's step, from
    each chunk's per-microbatch figure (`saved_bytes`); without the parameters' compute copies
    when not `copies`."""
    kept = [min(s.deferred, s.total) for s in per_chunk]
    per_chunk = [s.total if copies else s.activations for s in per_chunk]
    o = pm.config.pipeline
    if pm.stage_assignment is None and o.microbatches == 1:
        return per_chunk[0]
    pp_rank = pm.mesh.coords(rank)["pp"]
    actions = schedules.actions(o.schedule, pm.mesh.pp, o.microbatches, pp_rank, o.chunks)
    split = any(a.kind == "W" for a in actions)
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += per_chunk[a.chunk]
        elif a.kind == "B":      # a split backward keeps what its W pass needs
            live -= per_chunk[a.chunk] - (kept[a.chunk] if split else 0)
        elif a.kind == "W":
            live -= kept[a.chunk]
        peak = max(peak, live)
    return peak


__all__ = ["Saved", "peak_saved_bytes", "saved_bytes"]
