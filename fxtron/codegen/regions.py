"""Codegen, compiled programs: a rank's bound graph cut at fxtron's own ops into regions, each
region's forward and backward compiled by Inductor (`compile=True`, the codegen section).

What stays as it is (opaque): every fxtron op -- the collectives, the shared-memory channel, the
fused linear whose weight gradient accumulates into main_grad (codegen/wgrad.py's GEMM), the
cp attention blocks, the expert dispatch --, higher-order regions, the ops that draw random numbers (dropout, attention where it drops out:
ops/rng.py is_random), so that a compiled program draws exactly the uncompiled one's numbers
from fxtron's RNG streams, and the ops whose output's shape depends on the data (nonzero,
bincount). Where the fusion defers nothing a compiled step needs (compiler/passmanager.py
linears_in_regions says where), the linears belong to the regions: aten ops in fp32,
fxtron::master_linear under 16-bit compute (the fp32 weight cast inside the region, its weight
gradient accumulated in fp32, traced as the region's own math: ops/linear.py), and so do tensor
parallel's f and g between them (`Compiler(comm=True)`): fxtron::all_reduce (a custom op with a
fake kernel) a call inside the compiled forward or backward, copy_to_region a traced copy whose
backward calls it. A world-1 step is then one compiled region, forward and backward, and a tp
step one region between the vocab-parallel embedding and loss. Everything between the opaque
ops (norms, rotary, activations, residual adds, the loss, a cast) is a region of aten ops that
`torch.compile` turns into fused kernels, with AOTAutograd's backward. A recomputed region
(recompute=..., ops/recompute.py) stays one checkpointed call, and the graph inside it is cut and
compiled the same way: its compiled code runs in the forward and again in the recomputation
(the checkpoint keeps only the region's inputs either way). The opaque ops run in
graph order between the regions, and a region's collectives in its graph's order (each depends
on the last through the residual stream; the ranks of a group compile the same graph), so
every rank issues the same collectives in the same order as the uncompiled program.

Regions of the same code (a model's repeated layers) share one compiled module: Dynamo traces
and Inductor compiles each distinct region once per process. The ranks of one host compile a
region's code in turn (a lock file per code), so that Inductor's on-disk cache, which also
serves later runs, gives it to all but the first. A region of views alone is not compiled
(nothing to fuse). `plan(graphs)` counts the regions without compiling (pm.summary() reports it);
a `Compiler` compiles a rank's graphs and keeps their `CompileStats`: how many regions were
compiled and how long their first calls -- the compilations -- took. `host_bound` names what
in a graph a captured CUDA graph (cuda_graphs=True) cannot replay.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import operator
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from fxtron.core import opsets
from fxtron.ops import transport
from fxtron.ops.linear import linear_eager, master_linear_eager
from fxtron.ops.rng import RANDOM_OPS, is_random, rng_call
from fxtron.ops.sp import gather_from_sequence_eager, gather_from_sequence_traced
from fxtron.ops.tp import all_reduce_eager, copy_to_region_eager, copy_to_region_traced

aten = torch.ops.aten

#: fxtron's ops that are a compiled region's own (as the pass-level graph names them, and bound)
_REGION_OPS = {torch.ops.fxtron.master_linear.default, master_linear_eager}
#: tensor parallel's f and g (any form) -> the form a region traces: a region's own where it holds
#: the linears they stand between (`comm`: compiler/passmanager.py linears_in_regions), so that
#: the collectives are calls inside the compiled graphs instead of cuts between regions
_COMM_OPS = {torch.ops.fxtron.copy_to_region.default: copy_to_region_traced,
             copy_to_region_eager: copy_to_region_traced,
             torch.ops.fxtron.all_reduce.default: torch.ops.fxtron.all_reduce.default,
             all_reduce_eager: torch.ops.fxtron.all_reduce.default,
             # sequence parallel's f and g
             torch.ops.fxtron.gather_from_sequence.default: gather_from_sequence_traced,
             gather_from_sequence_eager: gather_from_sequence_traced,
             torch.ops.fxtron.reduce_scatter.default: torch.ops.fxtron.reduce_scatter.default}
#: ops that only look at a value (its shape, a view of it): a region of these alone is not compiled
_VIEWS = opsets.VIEWS | opsets.SLICES | {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                                         aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
                                         operator.getitem}


def opaque(node: fx.Node, comm: bool = False) -> bool:
    """Whether `node` runs as it is, outside every compiled region (see the module docstring);
    `comm`: tensor parallel's f and g are the regions' own."""
    if node.op in ("call_module", "call_method"):
        return True
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and opaque(src, comm)
    if t in _REGION_OPS or (comm and t in _COMM_OPS):    # fxtron's ops a region holds (traced)
        return False
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace not in ("aten", "prims"):
            return True
        # random draws (attention only where it drops out: is_random), outputs whose shape depends
        # on the data (fullgraph cannot trace them), and values no one reads (promote_types' dtype)
        tags = set(t.tags)
        if tags & _DATA_DEPENDENT_TAGS or not node.users:
            return True
        return torch.Tag.nondeterministic_seeded in tags and (t not in RANDOM_OPS or is_random(node))
    # Python's and torch's symbolic arithmetic on sizes is traced; any other function (an fxtron
    # op's run-time form, a higher-order op) is not
    module = getattr(t, "__module__", None) or ""
    return not (module in ("_operator", "operator", "math") or module.startswith("torch.fx.experimental.sym_node")
                or t in (torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not))


def _past_recompile_limit(e: BaseException) -> bool:
    """Whether `e` is Dynamo's refusal of a fullgraph region's shape past its recompile limit."""
    return type(e).__name__ in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") and \
        type(e).__module__.startswith("torch._dynamo")

#: tags of ops whose output's shape or value the host must read from the data (a captured CUDA
#: graph fixes both at capture)
_DATA_DEPENDENT_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
#: fxtron's ops that size their transfers from counts read on the host (the expert dispatch)
_COUNTED = ("ep_dispatch", "ep_combine")
#: indexing ops whose shape (or work) depends on the data only under a boolean mask (the
#: indices a mask picks are counted on the host); integer indices are a gather of fixed shape
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _masked_index(node: fx.Node) -> bool:
    """Whether an indexing node indexes by a boolean (or byte) mask."""
    indices = node.args[1] if len(node.args) > 1 else ()
    return any(isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
               for i in indices or ())


def host_bound(graphs: list[fx.GraphModule]) -> list[str]:
    """What in a rank's `graphs` a captured CUDA graph (cuda_graphs=True, runtime/graphs.py)
    cannot replay, a line per kind of op: outputs whose shape or value depends on the data
    (nonzero, bincount, .item(): the host reads them), the expert dispatch (its counts), random
    draws (fxtron's streams advance on the host, which a replay would not: every replay would
    draw the captured numbers)."""
    found: dict[str, str] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            t = node.target
            if t is rng_call or is_random(node):
                op = node.args[1] if t is rng_call and len(node.args) > 1 else t
                found.setdefault(f"random:{op}", f"{op} draws random numbers (dropout; fxtron's random streams "
                                                 "advance on the host): set the model's dropout to 0")
            elif isinstance(t, torch._ops.OpOverload):
                if t in _INDEXING:
                    if _masked_index(node):
                        found.setdefault(str(t), f"{t} indexes by a boolean mask (at {node.name}; the host counts "
                                                 "what it picks): use torch.where or a multiplication by the mask")
                elif _DATA_DEPENDENT_TAGS & set(t.tags):
                    found.setdefault(str(t), f"{t} has a data-dependent output (the host reads its "
                                             f"{'shape' if torch.Tag.dynamic_output_shape in t.tags else 'value'}, "
                                             f"at {node.name}): compute it with static shapes (masks instead of "
                                             "indices)")
                elif t.namespace == "fxtron" and t._opname in _COUNTED:
                    found.setdefault(str(t), f"{t} sizes its all-to-all from the tokens' counts per expert, read "
                                             "on the host")
    return list(found.values())


def _partitions(gm: fx.GraphModule, comm: bool = False) -> tuple[dict[fx.Node, int], dict[int, bool]]:
    """Each computing node's partition, in graph order: an opaque node alone in its own (with
    the getitems of its outputs), the nodes between two opaque ones together. Returns
    (node -> partition, partition -> whether it is a region to compile)."""
    part, ids, compiled = 0, {}, {}
    previous_opaque = True
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if opaque(node, comm):
            if node.target is operator.getitem:
                ids[node] = ids[node.args[0]]
                continue
            part += 1
            ids[node], compiled[part] = part, False
            previous_opaque = True
            continue
        if previous_opaque:
            part += 1
            compiled[part] = False
            previous_opaque = False
        ids[node] = part
        if node.op == "call_function" and node.target not in _VIEWS:
            compiled[part] = True
    return ids, compiled


@dataclass
class CompileStats:
    """What was compiled in a rank's graphs: `regions` compiled (of `distinct` codes), `opaque`
    ops run between them, `seconds` the first calls of the distinct regions took (their
    compilations, forward; the backward compiles on the first backward, unless the cache had
    it), `cached` the distinct regions found in the on-disk cache; `eval_regions` of `regions`
    those of the eval-mode graphs, compiled at the program's first evaluation."""

    regions: int = 0
    distinct: int = 0
    opaque: int = 0
    seconds: float = 0.0
    cached: int = 0          # distinct regions Inductor's (or AOTAutograd's) cache served
    recomputed: int = 0      # recomputed regions (checkpointed calls) whose insides were compiled
    inside: int = 0          # of `regions`, those inside them (run again in backward's recomputation)
    uncompiled_calls: int = 0  # region calls past Dynamo's recompile limit, run uncompiled
    eval_regions: int = 0    # of `regions`, the eval-mode graphs'
    _pending: set = field(default_factory=set, repr=False)

    def __add__(self, other: "CompileStats") -> "CompileStats":
        return CompileStats(self.regions + other.regions, self.distinct + other.distinct,
                            self.opaque + other.opaque, self.seconds + other.seconds, self.cached + other.cached,
                            self.recomputed + other.recomputed, self.inside + other.inside,
                            self.uncompiled_calls + other.uncompiled_calls, self.eval_regions + other.eval_regions)

    def line(self) -> str:
        """One line for the summary and the start-up log: what was compiled, in which graphs."""
        graphs = ("its training graph" if not self.eval_regions else
                  f"its training and eval-mode graphs ({self.eval_regions} of the regions the eval-mode graph's, "
                  "compiled at the first evaluation)")
        return (f"{_count(self.regions, 'region')} between {_count(self.opaque, 'fxtron op')} in {graphs}, compiled "
                f"by Inductor ({self.distinct} distinct" + (f", {self.cached} from the cache; their forwards compiled in "
                                                f"{self.seconds:.1f} s, the backwards on the first backward)"
                                                if self.seconds else ")")
                + (f"; {self.inside} of them inside {self.recomputed} recomputed regions' checkpointed calls, run "
                   "again in backward" if self.inside else "")
                + (f"; {self.uncompiled_calls} region calls past Dynamo's recompile limit ran uncompiled"
                   if self.uncompiled_calls else ""))


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _outlined(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as a program binds it: its recomputed regions outlined into checkpointed calls
    (ops/recompute.py outline), on a copy (the nodes' metadata shared)."""
    from fxtron.ops.recompute import outline, regions
    if not regions(gm):
        return gm
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return outline(fx.GraphModule(gm, g))


def _recomputed_of(node: fx.Node):
    """The recomputed region (ops/recompute.py Recomputed: a checkpointed call) `node` calls, or None."""
    from fxtron.ops.recompute import Recomputed
    if node.op != "call_module":
        return None
    mod = node.graph.owning_module.get_submodule(node.target)
    return mod if isinstance(mod, Recomputed) else None


def recomputed(gm: fx.GraphModule) -> list:
    """The recomputed regions `gm` runs."""
    return [m for n in gm.graph.nodes if (m := _recomputed_of(n)) is not None]


def _nodes(gm: fx.GraphModule):
    """gm's nodes and those of the recomputed regions it calls."""
    yield from gm.graph.nodes
    for mod in recomputed(gm):
        yield from _nodes(mod.region)


def plan(graphs: list[fx.GraphModule], comm: bool = False) -> CompileStats:
    """The regions a Compiler(comm) would compile in a rank's `graphs` (as the program binds
    them: a recomputed region a checkpointed call, its graph cut and counted as any other),
    counted without compiling."""
    stats, keys = CompileStats(), set()

    def count(gm: fx.GraphModule, holds: bool, inside: bool = False) -> int:
        for mod in recomputed(gm):
            stats.recomputed += count(mod.region, holds, True) > 0
        ids, compiled = _partitions(gm, holds)
        split = split_module(gm, gm, lambda n: ids[n], keep_original_order=True)
        keys.update(_code(getattr(split, f"submod_{p}")) for p, c in compiled.items() if c)
        stats.regions += sum(compiled.values())
        stats.inside += sum(compiled.values()) if inside else 0
        stats.opaque += sum(1 for p, c in compiled.items() if not c and _has_opaque(ids, p, holds))
        return sum(compiled.values())

    for gm in map(_outlined, graphs):
        count(gm, holds_comm(gm, comm))
    stats.distinct = len(keys)
    return stats


def _has_opaque(ids: dict[fx.Node, int], part: int, comm: bool = False) -> bool:
    """Whether partition `part` holds an fxtron op (a recomputed region's checkpointed call is
    not one: the regions inside it are counted)."""
    return any(p == part and n.target is not operator.getitem and opaque(n, comm) and _recomputed_of(n) is None
               for n, p in ids.items())


def holds_comm(gm: fx.GraphModule, comm: bool) -> bool:
    """Whether `gm`'s regions (the recomputed ones' too) hold tensor parallel's f and g under
    `comm`: not beside a fused linear (a model's own 16-bit weights), whose queued weight-gradient
    GEMMs run while f's backward all-reduce is in flight (ops/tp.py) -- inside a region they would
    wait for the end of backward, holding their inputs."""
    return comm and not any(n.target in (linear_eager, torch.ops.fxtron.linear.default) for n in _nodes(gm))


def _trace_comm(sub: fx.GraphModule) -> bool:
    """Put a region's f and g in the forms Dynamo traces (_COMM_OPS); whether any of them
    communicates (a group of more than one rank)."""
    found = talks = False
    for node in sub.graph.nodes:
        if node.op == "call_function" and node.target in _COMM_OPS:
            node.target = _COMM_OPS[node.target]
            found = True
            group = node.args[-1] if len(node.args) > 1 else node.kwargs.get("group", "")     # the last
            talks = talks or (isinstance(group, str) and transport.group_size(group) > 1)
    if found:
        sub.recompile()
    return talks


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _canonical(a, number: dict):
    """An argument as a key: values by their number in the region, plain constants as
    themselves (type and value), containers by their items; None for anything else."""
    if isinstance(a, fx.Node):
        return ("%", number[a])
    if isinstance(a, _PLAIN):
        return (type(a).__name__, a)
    if isinstance(a, (list, tuple)):
        items = [_canonical(x, number) for x in a]
        return None if any(x is None for x in items) else (type(a).__name__, tuple(items))
    if isinstance(a, slice):
        return _canonical((a.start, a.stop, a.step), number)
    if isinstance(a, dict):
        items = [(k, _canonical(v, number)) for k, v in sorted(a.items())]
        return None if any(v is None for _, v in items) else ("dict", tuple(items))
    return None


def _code(sub: fx.GraphModule):
    """A region's code with its values numbered in order: equal for two layers' same region.
    A region holding attributes of its own (constants), or an argument that is no plain
    constant, is never shared."""
    number: dict[fx.Node, int] = {}
    out = []
    for i, node in enumerate(sub.graph.nodes):
        number[node] = i
        args = _canonical((node.args, node.kwargs), number)
        if node.op == "get_attr" or args is None:
            return ("own", id(sub))
        target = "" if node.op == "placeholder" else node.target
        out.append((node.op, target if isinstance(target, str) else (getattr(target, "__module__", ""),
                                                                      getattr(target, "__qualname__", str(target)),
                                                                      str(target)), args))
    return tuple(out)


def _cache_hits() -> int:
    """The process's count of compilations served by AOTAutograd's and Inductor's caches."""
    from torch._dynamo.utils import counters
    return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]


def _lock_dir() -> str:
    """Where the host's compile locks live: beside Inductor's own cache (per user, where the
    compiled code goes), one directory instead of a file per region in the temporary directory."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        root = cache_dir()
    except Exception:                 # (a torch without it: the system's temporary directory)
        root = tempfile.gettempdir()
    path = os.path.join(root, "fxtron-compile-locks")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _host_lock(key):
    """Held by one process of the host at a time for a region's code: the ranks of a host that
    compile the same region take turns, and all but the first find it in Inductor's cache. Not
    taken where compiling itself communicates between ranks (Dynamo's compiler collectives,
    Inductor's distributed autotuning): a rank waiting for the lock would hold up its peer."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    if getattr(dynamo_config, "enable_compiler_collectives", False) or \
            getattr(inductor_config, "distributed_max_autotune_gemm", False):
        yield
        return
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:20]
    with open(os.path.join(_lock_dir(), f"{digest}.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _FirstCall(torch.nn.Module):
    """A compiled region that compiles on its first call, under the host's lock for its code,
    and times it into stats."""

    def __init__(self, compiled: torch.nn.Module, stats: CompileStats, key, communicates: bool = False):
        super().__init__()
        self.compiled = compiled
        self._stats = stats
        self._key = key
        self._communicates = communicates

    def forward(self, *args):
        try:
            if self not in self._stats._pending:
                return self.compiled(*args)
            t0, hits = time.perf_counter(), _cache_hits()
            # the first call runs the region too: one whose collectives wait for the peers compiles
            # without the lock (a peer waiting for it would never join them); the others take turns
            with _host_lock(self._key) if not self._communicates else contextlib.nullcontext():
                out = self.compiled(*args)
            self._stats.seconds += time.perf_counter() - t0
            self._stats.cached += _cache_hits() > hits
            self._stats._pending.discard(self)
            return out
        except Exception as e:                  # noqa: BLE001 - Dynamo's refusal alone is handled
            if not _past_recompile_limit(e):
                raise
            # (raised before the region ran: nothing of it computed, no collective issued)
            self._stats._pending.discard(self)
            return self._uncompiled(args)

    def _uncompiled(self, args):
        """The region as its graph runs it, for inputs of a shape past Dynamo's recompile limit
        (each shape, grad mode and size-1 dim a compiled entry of its own): the same ops, collectives
        included, in the same order -- said once, and counted in the stats."""
        if not self._stats.uncompiled_calls:
            import torch._dynamo.config as dynamo_config
            limit = getattr(dynamo_config, "recompile_limit", getattr(dynamo_config, "cache_size_limit", "?"))
            warnings.warn(f"compile=True: a region met more input shapes (or grad modes) than Dynamo's recompile_limit "
                          f"({limit}) keeps compiled; those calls run its graph uncompiled (the same numbers). Pad the "
                          "batches to a few lengths, or raise torch._dynamo.config.recompile_limit", stacklevel=3)
        # counted once per forward call: a recomputed region's second run, in backward, is not a call
        self._stats.uncompiled_calls += torch._C._current_graph_task_id() == -1
        return self.compiled._orig_mod(*args)


class Compiler:
    """Compiles a rank's graphs (the training graph or its stages, the eval-mode graphs) region
    by region, sharing one compiled module among the regions of the same code in all of them;
    `stats` counts over every graph compiled. `comm`: the regions hold tensor parallel's f and g
    (where they hold the linears: compiler/passmanager.py linears_in_regions), each collective a
    call inside the compiled graph, issued in graph order as uncompiled."""

    def __init__(self, comm: bool = False):
        self.stats = CompileStats()
        self.comm = comm
        self._shared: dict[object, torch.nn.Module] = {}

    def __call__(self, gm: fx.GraphModule, training: bool = True) -> fx.GraphModule:
        """`gm` (a bound rank graph; `training` False: an eval-mode one) with each region between
        opaque ops compiled by Inductor: the same values and gradients, the same collectives in
        the same order."""
        before = self.stats.regions
        out = self._compile(gm, holds_comm(gm, self.comm))
        if not training:
            self.stats.eval_regions += self.stats.regions - before
        return out

    def _compile(self, gm: fx.GraphModule, holds: bool, inside: bool = False) -> fx.GraphModule:
        for mod in recomputed(gm):           # the graph inside each checkpointed call, compiled alike
            if not mod.compiled and any(_partitions(mod.region, holds)[1].values()):
                mod.region, mod.compiled = self._compile(mod.region, holds, True), True
                self.stats.recomputed += 1
        ids, compiled = _partitions(gm, holds)
        split = split_module(gm, gm, lambda n: ids[n], keep_original_order=True)
        self.stats.opaque += sum(1 for p, c in compiled.items() if not c and _has_opaque(ids, p, holds))
        for part, compile_it in compiled.items():
            if not compile_it:
                continue
            name = f"submod_{part}"
            sub = getattr(split, name)
            key = _code(sub)
            if key not in self._shared:
                communicates = holds and _trace_comm(sub)
                # 16-bit values rounded where the graph casts them, as the uncompiled program's are:
                # a fused kernel keeps them in fp32 otherwise, and fp16's overflow checks (the step
                # a loss scale skips) would read other numbers than the uncompiled program's
                options = {"emulate_precision_casts": True} if _narrow(sub) else None
                self._shared[key] = _FirstCall(torch.compile(sub, fullgraph=True, options=options), self.stats, key,
                                               communicates)
                self.stats._pending.add(self._shared[key])
                self.stats.distinct += 1
            setattr(split, name, self._shared[key])
            self.stats.regions += 1
            self.stats.inside += inside
        return split


def _narrow(gm: fx.GraphModule) -> bool:
    """Whether a region computes with 16-bit floating values."""
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
               for n in gm.graph.nodes for v in [n.meta.get("val")])


__all__ = ["CompileStats", "Compiler", "holds_comm", "host_bound", "opaque", "plan"]
