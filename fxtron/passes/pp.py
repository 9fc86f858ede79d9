"""Passes: cut a graph into pipeline stages.

`assign_stages(gm, ...)` decides (data, no rewriting): the model's transformer layers are found
as the children of its repeated module list (`blocks.0`, `model.layers.3`, `transformer.h.5`),
each layer a unit that is never cut; what runs before the first layer (embeddings) joins the
first stage, what runs after the last (final norm, LM head, loss) joins the last. Units are
balanced over pp x v stages by a cost of FLOPs and parameters, or cut where the user names.

`split_stages(gm, assignment, stages)` applies it (mechanism): each stage becomes its own
GraphModule whose inputs are the parameters, buffers and user inputs it uses plus the
activations that cross into it ("boundary inputs"), and whose outputs are the activations
later stages need (the last stage returns the loss too). Nodes that depend on no parameter
(position ids, masks, rotary tables, sizes) are recomputed on every stage that uses them
instead of being sent; so are nodes that depend only on parameters (a transposed weight). A
weight used on two stages (a tied embedding and LM head) is an input of both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from tabulate import tabulate

from fxtron.core import meta
from fxtron.core.meta import info
from fxtron.core.stage import MAX_BOUNDARY_TENSORS, Stage
from fxtron.errors import ParallelizeError

aten = torch.ops.aten
_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class StageAssignment:
    """Which layers each pipeline stage runs. Stage j of the pp*v-stage chain runs on
    pipeline rank j % pp as its model chunk j // pp, or, with `v_shape` (schedule zb-v, two
    chunks), in a V: rank r runs stages r and 2pp-1-r. `layers[j]` are the module paths of
    stage j's layers; `flops[j]` (at the traced example's batch and sequence sizes, forward)
    and `params[j]` what the balancing saw."""

    pp: int
    virtual: int
    layer_list: str
    units: tuple[str, ...]
    unit_stage: tuple[int, ...]
    flops: tuple[int, ...]
    params: tuple[int, ...]
    split_points: tuple[str, ...] = ()
    v_shape: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        if self.v_shape:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        return stage // self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs, chunk 0 first."""
        if self.v_shape:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [c * self.pp + pp_rank for c in range(self.virtual)]

    def layers(self, stage: int) -> list[str]:
        return [u for u, s in zip(self.units, self.unit_stage) if s == stage]

    def rows(self) -> list[list]:
        out = []
        for s in range(self.num_stages):
            ls = self.layers(s)
            span = ls[0] if len(ls) == 1 else f"{ls[0]} .. {ls[-1].rsplit('.', 1)[-1]}"
            extra = (["embeddings"] if s == 0 else []) + (["head, loss"] if s == self.num_stages - 1 else [])
            out.append([s, self.rank_of(s), self.chunk_of(s), f"{span} ({len(ls)})" + (" + " + ", ".join(extra) if extra else ""),
                        f"{self.params[s]:,}", f"{self.flops[s]:.3g}"])
        return out

    def __str__(self) -> str:
        how = f"cut before {', '.join(self.split_points)}" if self.split_points else "balanced by FLOPs and parameters"
        return (f"{self.num_stages} stages (pp={self.pp} x {'2 in a V' if self.v_shape else f'virtual={self.virtual}'}) "
                f"over {len(self.units)} layers of "
                f"{self.layer_list}, {how}\n"
                + tabulate(self.rows(), headers=["stage", "pp rank", "chunk", "layers", "params", "forward FLOPs"]))


# ----------------------------------------------------------------------------- planning
def find_layer_list(gm: fx.GraphModule) -> tuple[str, list[str]]:
    """The model's repeated layers: the module-path prefix with the most numbered children
    among the graph's nodes (`blocks` of blocks.0 .. blocks.11), and those children in order."""
    children: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        m = _LAYER.match(meta.get(node, meta.MODULE) or "")
        if m:
            children.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not children:
        raise ParallelizeError("pipeline parallel cuts between the model's repeated layers (a ModuleList such as "
                               "blocks.0, blocks.1, ...), and this model's graph has none; use mesh.pp=1")
    prefix = max(children, key=lambda p: (len(children[p]), -len(p)))
    return prefix, [f"{prefix}.{i}" for i in sorted(children[prefix])]


def _unit_of_path(path: str, prefix: str, index: dict[str, int]) -> int | None:
    if path.startswith(prefix + "."):
        head = path[len(prefix) + 1:].split(".", 1)[0]
        return index.get(f"{prefix}.{head}")
    return None


def classify(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each node's kind: 'param' (a parameter, or computed from parameters alone), 'free'
    (computed from no parameter: user inputs, buffers, sizes, constants) or 'act' (an
    activation: mixes parameters with data, or is computed from an activation)."""
    kind: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind[node] = "param" if meta.is_param(node) else "free"
        elif node.op == "output":
            continue
        else:
            ins = {kind[a] for a in node.all_input_nodes}
            if "act" in ins or ("param" in ins and "free" in ins and not _is_size_op(node)):
                kind[node] = "act"
            elif "param" in ins:
                kind[node] = "param"
            else:
                kind[node] = "free"
    return kind


def _is_size_op(node: fx.Node) -> bool:
    return not isinstance(node.meta.get("val"), torch.Tensor)


def assign_units(gm: fx.GraphModule, prefix: str, units: list[str]) -> dict[fx.Node, int]:
    """The layer unit of every activation node: from its module path inside the layer list;
    before the first layer -> the first unit, after the last -> the last; elsewhere (nodes a
    pass inserted without a module) -> the earliest unit that uses it. And the unit of every
    in-place write into a buffer that no activation feeds (see below)."""
    index = {u: i for i, u in enumerate(units)}
    kind = classify(gm)
    order = [n for n in gm.graph.nodes if kind.get(n) == "act"]
    direct = {n: _unit_of_path(meta.get(n, meta.MODULE) or "", prefix, index) for n in order}
    positions = [i for i, n in enumerate(order) if direct[n] is not None]
    first, last = (positions[0], positions[-1]) if positions else (len(order), -1)
    unit: dict[fx.Node, int] = {}
    for i in range(len(order) - 1, -1, -1):
        n = order[i]
        if direct[n] is not None:
            unit[n] = direct[n]
        elif i < first:
            unit[n] = 0
        elif i > last:
            unit[n] = len(units) - 1
        else:
            used = [unit[u] for u in n.users if u in unit]
            unit[n] = min(used) if used else len(units) - 1
    # a write into a buffer computed from no activation and read by nothing after it
    # (BatchNorm's num_batches_tracked.add_(1)) is no value a stage recomputes but a side effect:
    # it runs once, on the stage of its module (the stage holding the buffer's other writes and
    # reads); outside the layers, with the layer before it (the first layer, before every layer).
    # One whose result is read runs where it is read, recomputed by each stage that reads it on
    # its own copy of the buffer.
    latest = 0          # the unit of the last layer's activation so far
    for n in list(gm.graph.nodes):
        if direct.get(n) is not None:
            latest = direct[n]
        elif kind.get(n) == "free" and _buffers_written(n) and not n.users and not meta.read_after(n):
            u = _unit_of_path(meta.get(n, meta.MODULE) or "", prefix, index)
            unit[n] = latest if u is None else u
            order.append(n)
    for n in order:   # data must flow forward through the layers
        for a in n.all_input_nodes:
            if a in unit and unit[a] > unit[n]:
                raise ParallelizeError(
                    f"node %{n.name} (module {meta.get(n, meta.MODULE)!r}, layer {units[unit[n]]}) uses %{a.name} "
                    f"computed in a later layer {units[unit[a]]}; fxtron cuts pipeline stages between layers that "
                    "run in order, and this model's layers do not: use mesh.pp=1")
    return unit


def _buffers_written(node: fx.Node) -> list[str]:
    """The buffers whose memory (the buffer or a view of it) `node` writes in place, by name;
    none for an op that changes no values (detach_)."""
    if not meta.writes_first(node) or node.target is aten.detach_.default:
        return []
    return [meta.get(a, meta.INPUT).target for a in meta.written(node, own=True)
            if a.op == "placeholder" and getattr(meta.get(a, meta.INPUT), "kind", None) == "buffer"]


def _hint(size) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
            aten.baddbmm.default}


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of a node at the traced example's sizes: 2 x the multiply-adds of matrix
    products and attention; elementwise work is ignored (it is memory-bound, not FLOPs)."""
    if node.op != "call_function":
        return 0
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    t = node.target
    out = 1
    for s in val.shape:
        out *= _hint(s)
    if t in _MATMULS:
        a = node.args[1] if t == aten.addmm.default else node.args[0]
        return 2 * out * _hint(a.meta["val"].shape[-1])
    if str(t) == "fxtron.linear.default":
        return 2 * out * _hint(node.args[0].meta["val"].shape[-1])
    if t in (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        k = node.args[1].meta["val"]
        return 4 * out * _hint(k.shape[-2])   # QK^T and PV
    if t == aten.embedding.default:
        return out   # a gather, counted as one op per output element
    return 0


def assign_stages(gm: fx.GraphModule, *, pp: int, virtual: int = 1, split_points: list[str] | None = None,
                  v_shape: bool = False) -> StageAssignment:
    """Assign the model's layers to pp * virtual stages: at `split_points` (module paths of
    the layers that begin stages 1, 2, ...), or balanced so the costliest stage is as cheap as
    possible, the cost of a layer being its share of the model's forward FLOPs plus its share
    of the parameters (embeddings count with the first layer, head and loss with the last).
    `v_shape`: two stages per rank placed in a V (virtual must be 2)."""
    if v_shape and virtual != 2:
        raise ValueError("a V places two stages per pipeline rank")
    prefix, units = find_layer_list(gm)
    k = pp * virtual
    if k > len(units):
        raise ParallelizeError(
            f"{k} pipeline stages (pp={pp} x virtual_stages={virtual}) but the model has {len(units)} layers "
            f"({units[0]} .. {units[-1]}); every stage needs at least one whole layer: lower pp or virtual_stages")
    unit = assign_units(gm, prefix, units)
    flops = [0] * len(units)
    params = [0] * len(units)
    # a parameter counts in every layer that reads it: a tied embedding is held by the first stage
    # and the last (each row of the stage table, and the balance, carries it)
    seen_params: set[tuple[int, fx.Node]] = set()
    for node, u in unit.items():
        flops[u] += node_flops(node)
        for a in node.all_input_nodes:
            if meta.is_param(a) and (u, a) not in seen_params:
                seen_params.add((u, a))
                params[u] += a.meta["val"].numel()
    if split_points:
        cuts = []
        for p in split_points:
            if p not in units:
                raise ParallelizeError(f"split point {p!r} is not one of the model's layers "
                                       f"({units[0]}, {units[1] if len(units) > 1 else ''} .. {units[-1]})")
            cuts.append(units.index(p))
        if len(cuts) != k - 1 or cuts != sorted(set(cuts)) or cuts[0] == 0:
            what = "one layer" if k == 2 else f"{k - 1} distinct layers in order"
            raise ParallelizeError(
                f"split_points={list(split_points)} must name {what} after {units[0]} (each the first layer of a "
                f"stage), one per stage boundary for pp={pp} x virtual_stages={virtual}")
        bounds = [0] + cuts + [len(units)]
    else:
        tf, tpar = max(sum(flops), 1), max(sum(params), 1)
        cost = [f / tf + p / tpar for f, p in zip(flops, params)]
        bounds = _balanced(cost, k)
    unit_stage = []
    for s in range(k):
        unit_stage += [s] * (bounds[s + 1] - bounds[s])
    st_flops = [sum(f for f, s in zip(flops, unit_stage) if s == j) for j in range(k)]
    st_params = [sum(p for p, s in zip(params, unit_stage) if s == j) for j in range(k)]
    return StageAssignment(pp, virtual, prefix, tuple(units), tuple(unit_stage), tuple(st_flops), tuple(st_params),
                           tuple(split_points or ()), v_shape)


def _balanced(cost: list[float], k: int) -> list[int]:
    """Boundaries of k contiguous non-empty groups of `cost` minimizing the largest group sum
    (the linear partition problem, by dynamic programming); ties go to the earliest cut."""
    n = len(cost)
    pre = [0.0]
    for c in cost:
        pre.append(pre[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], pre[i] - pre[c])
                if v < best[j][i] - 1e-12:
                    best[j][i], cut[j][i] = v, c
    bounds, i = [n], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    return bounds[::-1]


# ----------------------------------------------------------------------------- splitting
def split_stages(gm: fx.GraphModule, assignment: StageAssignment, stages: list[int]) -> list[Stage]:
    """The GraphModules of `stages` (each a subgraph of gm, see the module docstring)."""
    ti = info(gm)
    if ti.buffer_mutations:
        raise ParallelizeError(f"the model writes buffers in forward ({sorted(ti.buffer_mutations.values())}); "
                               "fxtron's pipeline stages do not carry buffer updates: use mesh.pp=1")
    prefix, units = assignment.layer_list, list(assignment.units)
    unit = assign_units(gm, prefix, units)
    stage_of = {n: assignment.unit_stage[u] for n, u in unit.items()}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out_node.args[0]
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    last = assignment.num_stages - 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # boundary values: activations made on an earlier stage and used on stage s or later
    crossing: dict[int, list[fx.Node]] = {}
    for n, s in stage_of.items():
        used = [stage_of[u] for u in n.users if u in stage_of] + ([last] if n is loss else [])
        far = max(used, default=s)
        if far > s:
            for t in range(s + 1, far + 1):
                crossing.setdefault(t, []).append(n)
    _check_buffers_written(gm, stage_of, crossing)
    for stage, nodes in crossing.items():
        nodes.sort(key=order.get)
        if len(nodes) > MAX_BOUNDARY_TENSORS:
            raise ParallelizeError(
                f"{len(nodes)} activations cross into pipeline stage {stage} ({', '.join('%' + n.name for n in nodes[:6])}, "
                f"...); fxtron sends at most {MAX_BOUNDARY_TENSORS} per boundary: choose other split_points")
        for n in nodes:
            if not isinstance(n.meta.get("val"), torch.Tensor):
                raise ParallelizeError(f"%{n.name} ({meta.get(n, meta.MODULE)!r}) is a {type(n.meta.get('val')).__name__} "
                                       "computed from activations and needed on a later pipeline stage; only tensors "
                                       "cross stages: use mesh.pp=1 or compute it from the inputs")
    return [_stage_graph(gm, ti, s, stage_of, crossing, loss if s == last else None, order) for s in stages]


def _check_buffers_written(gm: fx.GraphModule, stage_of: dict, crossing: dict) -> None:
    """A buffer written in place in forward (export keeps the write in the graph) is one memory
    every microbatch writes, held by each stage's rank on its own: an error where that memory
    leaves its stage (a boundary value: microbatch 1's forward overwrites what microbatch 0 sent,
    and its backward runs through microbatch 1's graph) or is read on another stage (that
    stage's copy never sees the write)."""
    sent = {n for nodes in crossing.values() for n in nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for w in gm.graph.nodes:
        here = stage_of.get(w)
        buffers = _buffers_written(w) if here is not None else []
        if not buffers:
            continue
        memory = meta.written(w, own=True)
        out = sorted((n for n in memory if n in sent), key=lambda n: n.name)
        if out:
            raise ParallelizeError(
                f"buffer {buffers[0]} is written in place in forward (%{w.name}, {w.target}, in "
                f"{meta.get(w, meta.MODULE) or 'the top level'}) and its memory (%{out[0].name}) is a pipeline stage's "
                f"output: every microbatch writes the same buffer, so a later microbatch would overwrite what an "
                f"earlier one sent; return a copy (buf.clone()) from the layer, or use mesh.pp=1")
        before = [u for a in meta.written(w) for u in a.users if u is not w and order[u] < order[w]]
        for readers, when in ((meta.read_after(w), "afterwards"),
                              (before, "before it (the value the previous step wrote)")):
            stages = _stages_reading(readers, stage_of) - {here}
            if stages:
                raise ParallelizeError(
                    f"buffer {buffers[0]} is written in place in forward on pipeline stage {here} (%{w.name}, "
                    f"{w.target}) and read {when} on stage {min(stages)}, whose rank holds its own copy of the "
                    f"buffer (it would read the old values): keep the buffer's writes and reads in one stage "
                    f"(split_points), or use mesh.pp=1")


def _stages_reading(readers, stage_of: dict) -> set[int]:
    """The stages that run `readers`: a reader computed from no activation runs on the stages of
    its users."""
    stages, stack, seen = set(), list(readers), set()
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        if r in stage_of:
            stages.add(stage_of[r])
        else:
            stack.extend(r.users)
    return stages


def _stage_graph(gm, ti, s, stage_of, crossing, loss, order) -> Stage:
    receives = crossing.get(s, [])
    sends = crossing.get(s + 1, [])
    mine = [n for n in gm.graph.nodes if stage_of.get(n) == s]
    # everything not an activation that this stage's nodes need, recomputed here
    need: set[fx.Node] = set()
    stack = [a for n in mine for a in n.all_input_nodes]
    recv = set(receives)
    while stack:
        a = stack.pop()
        if a in need or a in recv or a in stage_of:
            continue
        need.add(a)
        stack.extend(a.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and n in need]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    params, buffers, users = [], [], []
    for kind in ("parameter", "buffer", "user"):
        for p in placeholders:
            spec = meta.get(p, meta.INPUT)
            if spec.kind != kind:
                continue
            env[p] = g.node_copy(p, lambda x: env[x])
            (params if kind == "parameter" else buffers if kind == "buffer" else users).append(
                spec.target if kind != "user" else spec.index)
    for r in receives:
        ph = g.placeholder(r.name)
        ph.meta.update({k: v for k, v in r.meta.items() if k != meta.INPUT})
        env[r] = ph
    body = sorted(need.difference(placeholders) | set(mine), key=order.get)
    for n in body:
        env[n] = g.node_copy(n, lambda x: env[x])
    outs = [env[n] for n in sends] + ([env[loss]] if loss is not None else [])
    g.output(tuple(outs))
    g.lint()
    sub = fx.GraphModule(gm, g)
    sub.meta.update(gm.meta)
    for n in sub.graph.nodes:
        if n.op != "placeholder" and n.op != "output":
            meta.set(n, meta.STAGE, s)
    return Stage(index=s, gm=sub, params=params, buffers=buffers, user_inputs=users,
                 inputs=[r.name for r in receives], outputs=[n.name for n in sends], has_loss=loss is not None,
                 values={n.name: n for n in receives + sends})


def param_stages(gm: fx.GraphModule, assignment: StageAssignment) -> dict[str, set[int]]:
    """For every parameter, the stages that use it (directly, or through nodes computed from
    parameters alone, which every using stage recomputes)."""
    prefix, units = assignment.layer_list, list(assignment.units)
    unit = assign_units(gm, prefix, units)
    kind = classify(gm)
    out: dict[str, set[int]] = {}
    for n, u in unit.items():
        stack = [a for a in n.all_input_nodes if kind.get(a) == "param"]
        seen: set[fx.Node] = set()
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a.op == "placeholder":
                out.setdefault(meta.get(a, meta.INPUT).target, set()).add(assignment.unit_stage[u])
            else:
                stack.extend(x for x in a.all_input_nodes if kind.get(x) == "param")
    return out
