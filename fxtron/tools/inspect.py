"""Tools, inspection: compile one rank of any mesh without processes and say everything
about it — where the rank sits in the mesh, its graph, what it communicates and how much
memory it needs — as text (`fxtron inspect`) or data (`--json`).

Models come from every spec `fxtron train --model` takes (one resolver, trainer/models.py): a
shipped preset (`gpt-tiny` ... `llama-7b`), a transformers architecture (`hf:llama`,
`hf:gpt2`, ...: the library's default config, built on the meta device: no weights, no
downloads), a transformers directory (its config.json, on the meta device), or
`package.module:factory` for your own (the factory, called on the meta device, returns the
model, or (model, args) or (model, args, kwargs) with example inputs; a bare model gets token
ids and targets of the shipped models' form, with its `vocab_size` or `config.vocab_size`).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import sympy
import torch

from fxtron.core import meta
from fxtron.errors import ParallelizeError


def load_model(spec: str, *, batch: int = 2, seq: int = 16, overrides: dict | None = None):
    """(model on the meta device, example args, example kwargs) for `spec`, resolved as
    `fxtron train --model` resolves it (trainer/models.py: a preset, hf:<architecture>, a
    transformers directory or package.module:factory). `overrides` set fields of an
    hf:<architecture>'s transformers config (num_hidden_layers=4)."""
    from fxtron import models
    from fxtron.trainer.models import build_model
    tm = build_model(spec, overrides=overrides)
    if spec in models.PRESETS:
        return tm.model, models.example_inputs(spec, batch, seq, device="meta"), {}
    if tm.transformers:
        ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        return tm.model, (), {"input_ids": ids, "labels": ids}
    if tm.example is not None:
        return (tm.model, *tm.example)
    if tm.vocab_size is None:
        raise ParallelizeError(f"{spec} returned a model without vocab_size; return (model, example_args) instead")
    ids = torch.randint(0, tm.vocab_size, (batch, seq + 1))
    return tm.model, (ids[:, :-1].clone(), ids[:, 1:].clone()), {}


# ----------------------------------------------------------------------------- dumps
class PassDump:
    """Writes the graph after every pass of one rank's compilation as readable Python:
    DIR/rank<r>/<nn>_<pass>.py, each headed by the pass, what it did and how long it took."""

    def __init__(self, root: str, rank: int):
        self.dir = os.path.join(root, f"rank{rank}")
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise ParallelizeError(f"dump={root!r} (FXTRON_DUMP, --dump): the pass dump cannot write there "
                                   f"({e.strerror or e}); give a directory it can write") from None
        self.count = 0
        self.files: list[str] = []

    def __call__(self, pass_name: str, gm, seconds: float, doc: str = "") -> None:
        from fxtron.compiler.show import format_graph
        path = os.path.join(self.dir, f"{self.count:02d}_{pass_name}.py")
        self.count += 1
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        table = format_graph(gm, title="")
        with open(path, "w") as f:
            f.write(f"# fxtron: graph after pass `{pass_name}` ({seconds * 1e3:.1f} ms)\n")
            if doc:
                f.write("".join(f"# {line}\n" for line in doc.strip().splitlines()))
            f.write("#\n# every node with its local shape, placement and source module:\n")
            f.write("".join(f"#   {line}\n" for line in table.strip().splitlines()))
            f.write("\n" + code)
        self.files.append(path)


# ----------------------------------------------------------------------------- the report
@dataclass
class Report:
    """Everything `fxtron inspect` says about one rank (`as_dict()` is the --json form)."""

    model: str
    mesh: str
    rank: int
    coords: dict
    groups: dict
    graph: str
    collectives: list[dict]
    memory: dict
    pipeline: dict | None
    batch: int
    seq: int
    compile_s: float
    notes: list[str] = field(default_factory=list)
    microbatches: int = 1
    step_bytes: int = 0      # what the rank sends per step: the list's wire bytes, per-microbatch ones m times

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def text(self, *, graph: bool = True) -> str:
        from tabulate import tabulate
        out = [f"{self.model} on {self.mesh}", f"rank {self.rank}: " + ", ".join(f"{k} {v}" for k, v in self.coords.items()),
               "groups of this rank: " + "; ".join(f"{k} {v}" for k, v in self.groups.items())]
        if self.pipeline:
            out += ["", self.pipeline["table"], f"schedule {self.pipeline['schedule']}, microbatches "
                    f"{self.pipeline['microbatches']}: bubble over ideal time {self.pipeline['bubble']} "
                    f"(its order simulated at unit pass times; the closed form {self.pipeline['bubble_formula']} "
                    "holds with enough microbatches)"]
        if graph:
            out += ["", self.graph]
        rows = [[c["node"] or c["what"], c["collective"], c["phase"], c["group"], c["shape"], c["per"], c["wire_bytes"],
                 _fmt(c["wire_at"])] for c in self.collectives]
        out += ["", tabulate(rows, headers=["node / what", "collective", "phase", "group", "local shape", "per",
                                            "wire bytes / rank", f"at B={self.batch}, S={self.seq}"]),
                f"{len(rows)} collectives and transfers; {_fmt(self.step_bytes)} sent per rank and step "
                f"({self.microbatches} microbatch(es) of B={self.batch})"]
        m = self.memory
        out += ["", tabulate([[k, _fmt(v) if isinstance(v, (int, float)) else v] for k, v in m.items()],
                             headers=["memory per rank", f"B={self.batch}, S={self.seq}"])]
        out += [f"note: {n}" for n in self.notes]
        out.append(f"compiled in {self.compile_s:.2f} s")
        return "\n".join(out)


def _fmt(n: float) -> str:
    from fxtron.compiler.report import fmt_bytes
    return fmt_bytes(n, digits=2)


def inspect(pm, rank: int, *, model_name: str = "", batch: int = 1, seq: int = 2048, zero: int | None = None) -> Report:
    """Compile `rank` of the ParallelModel `pm` and describe it; sizes evaluated at `batch`
    sequences (per rank and microbatch) of `seq` tokens."""
    from fxtron.core.meta import BATCH, SEQ
    from fxtron.mesh import GROUP_KINDS
    from fxtron.runtime.pp import schedules
    t0 = time.perf_counter()
    rg = pm.compiled(rank)
    compile_s = time.perf_counter() - t0
    mesh = pm.mesh
    coords = {k: f"{v}/{getattr(mesh, k)}" for k, v in mesh.coords(rank).items()}
    groups = {}
    for kind in GROUP_KINDS:
        try:
            ranks = mesh.group_of(kind, rank)
        except Exception:   # kinds this rank is in no group of (embedding on a middle stage)
            continue
        if len(ranks) > 1:
            groups[kind] = list(ranks)
    sub = {BATCH: batch, SEQ: seq}
    colls = []
    for r in pm.collectives(rank):
        colls.append({"node": r.node, "what": r.module, "collective": f"{r.kind} x{r.count}" if r.count > 1 else r.kind,
                      "phase": r.phase, "group": f"{r.group} {list(r.ranks)}", "per": r.per,
                      "shape": "(" + ", ".join(str(s) for s in r.shape) + ")",
                      "payload_bytes": str(r.payload_bytes), "wire_bytes": str(r.wire_bytes),
                      "wire_at": int(r.evaluate(batch, seq)[1])})
    params = rg.param_count
    activation, held_acts, activation_note = _saved_for_backward(pm, rank, rg, batch, seq, sub)
    o = pm.config.pipeline
    zero = pm.config.data_parallel.zero if zero is None else zero
    in_flight = 1
    pipeline = None
    if pm.stage_assignment is not None:
        pp_rank = mesh.coords(rank)["pp"]
        in_flight = schedules.in_flight_bound(o.schedule, mesh.pp, o.microbatches, pp_rank, o.chunks)
        bubble = schedules.bubble_fraction(o.schedule, mesh.pp, o.microbatches, o.chunks)
        formula = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v m)",
                   "zb-h1": "(p-1)(F+B-W)/(m(F+B+W)) at F=B=W", "zb-v": "(p-1)(F/2)/(m(F+B+W)) at F=B=W"}[o.schedule]
        pipeline = {"table": str(pm.stage_assignment), "schedule": o.schedule, "microbatches": o.microbatches,
                    "virtual_stages": o.chunks, "bubble": str(bubble), "bubble_formula": formula,
                    "stages": [s.index for s in rg.stages], "in_flight": in_flight}
    held = sum(math.prod(p.held_shape) * p.dtype.itemsize for p in rg.local.values())
    pieces = sum(math.prod(p.held_shape) for p in rg.local.values())     # zero=3 (HSDP: 1/dp_shard)
    sixteen = any(p.dtype.itemsize == 2 for p in rg.local.values())

    def sharded(p) -> float:
        """Elements of p's share under zero=1/2: 1/size of its gradient group (dp, dp-cp, or
        expert-dp for experts: expert parallel's own data-parallel group)."""
        try:
            size = len(mesh.group_of(p.grad_group, rank))
        except Exception:  # noqa: BLE001 - a kind this rank is in no group of
            size = 1
        return math.prod(p.local_shape) / size
    shares = int(sum(sharded(p) for p in rg.local.values()))
    memory = {
        "parameters" + (" (zero=3: the rank's 1/d pieces)" if zero >= 3 else "")
        + (" (16-bit compute copies, during the step)" if sixteen else ""):
            held if zero >= 3 else rg.param_bytes,
        "gradients (fp32 main_grad)" + (" (zero=2: whole during backward, the rank's 1/dp kept after it)"
                                        if zero == 2 else ""):
            pieces * 4 if zero >= 3 else params * 4,
        "optimizer (Adam, fp32 moments)" + (" / dp (experts: / expert-dp)" if zero else ""):
            pieces * 8 if zero >= 3 else (shares if zero else params) * 8,
        # fxtron's zero=1/2 keep the fp32 parameters whole on every rank (the optimizer steps views
        # of its shard of them, then all-gathers), where Megatron keeps 16-bit ones whole and fp32
        # shards: runtime/zero.py
        **({("main parameters (fp32: zero=3's 1/d pieces)" if zero >= 3 else "main parameters (fp32, whole on every rank)"):
            pieces * 4 if zero >= 3 else params * 4} if sixteen else {}),
        "activations per microbatch" + (" (upper bound)" if held_acts is None else ""): activation,
        f"activations held ({in_flight} microbatch{'es' if in_flight > 1 else ''} in flight)":
            held_acts if held_acts is not None else activation * in_flight,
    }
    notes = [activation_note]
    if zero >= 3 and held < rg.param_bytes:
        units = _unit_bytes(rg)
        if pm.config.data_parallel.gather_per_step:
            memory["gathered parameters (gather_per_step: every layer held during the step)"] = rg.param_bytes
        else:
            memory["gathered parameters (two layers at once)"] = sum(sorted(units.values())[-2:])
        notes.append(f"zero=3: {len(units)} layers gathered before use, the next one prefetched, each gathered again "
                     "in backward and its gradients reduce-scattered as backward completes them")
    memory["total"] = sum(v for v in memory.values() if isinstance(v, int)) - activation
    return Report(model=model_name or type(pm.model).__name__, mesh=str(mesh), rank=rank, coords=coords, groups=groups,
                  graph=pm.graph(rank), collectives=colls, memory=memory, pipeline=pipeline, batch=batch, seq=seq,
                  compile_s=compile_s, notes=notes, microbatches=o.microbatches,
                  step_bytes=sum(c["wire_at"] * (o.microbatches if c["per"] == "microbatch" else 1) for c in colls))


def _unit_bytes(rg) -> dict[str, int]:
    """zero=3: each unit's (layer's) whole local parameter bytes."""
    out: dict[str, int] = {}
    for p in rg.local.values():
        if p.flat is not None:
            out[p.flat.unit] = out.get(p.flat.unit, 0) + math.prod(p.local_shape) * p.dtype.itemsize
    return out


_VIEWS = {"view", "reshape", "_unsafe_view", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
          "squeeze", "t", "alias", "detach", "split", "chunk", "unbind", "getitem", "sym_size"}


def _saved_for_backward(pm, rank, rg, batch, seq, sub) -> tuple[int, int | None, str]:
    """(one microbatch's activations, the most held at once over the schedule, what they are):
    what autograd saves, counted by running the rank's graphs on fake tensors (tools/activations.py);
    where that cannot run, every tensor the forward makes (an upper bound) and None."""
    from fxtron.tools import activations
    try:
        per_chunk = activations.saved_bytes(pm, rank, batch, seq)
    except ParallelizeError as e:
        return (_activation_bytes(rg, sub), None,
                f"activations: every tensor the forward makes, an upper bound of what autograd keeps ({e})")
    recomputed = max(s.recomputed for s in per_chunk)
    return (sum(s.activations for s in per_chunk),
            activations.peak_saved_bytes(pm, rank, per_chunk, copies=False) + recomputed,
            "activations: what autograd saves for backward, counted by running the rank's graphs on fake tensors "
            "(the memory tracker's measure, without the 16-bit parameter copies listed above); the peak follows the "
            "schedule's forwards and backwards" + (f", plus {recomputed:,} bytes the largest recomputed region saves "
                                                   "while backward runs it again" if recomputed else ""))


def _activation_bytes(rg, sub) -> int:
    from fxtron.compiler.report import assume_uniform, uniform_routing
    total = 0
    for g in rg.graphs:
        uniform = uniform_routing(g)         # rows an expert-parallel dispatch received: as many as sent
        for node in g.graph.nodes:
            if node.op != "call_function":
                continue
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            val = node.meta.get("val")
            if name in _VIEWS or not isinstance(val, torch.Tensor):
                continue
            region = meta.get(node, meta.RECOMPUTE)
            if region is not None and all(meta.get(u, meta.RECOMPUTE) == region for u in node.users):
                continue     # made again in backward, not kept: only a region's outputs stay
            shape = meta.get(node, meta.LOCAL_SHAPE)
            if shape is None:
                continue
            n = sympy.Integer(1)
            for d in shape:
                n *= sympy.sympify(d)
            total += int(assume_uniform(n, uniform).subs(sub)) * val.dtype.itemsize
    return total
