"""Compiler: trace a model's repeated layers once.

torch.export pays ~0.4 s per transformer layer for symbolic shapes (fake-tensor propagation
with SymInt arithmetic on every op): 15 s for a 32-layer model, although its layers are one
program over different weights. So `trace` exports a *twin* of the model whose layer list
keeps its first two layers (`twin`), and `expand` repeats the twin's second layer over the
other layers' parameters. The result is the graph a full export gives, op for op.

The shortcut is taken only where it is sound; anywhere else the whole model is exported:
1. `find_layers`: the model's longest ModuleList (>= 3 entries) holds layers of one structure:
   the same submodule classes, parameter and buffer names, shapes, dtypes and requires_grad,
   and no tensor shared with another layer or the rest of the model;
2. `check_same_program`: run on fake tensors of the example's sizes (no symbols, so cheap), every layer
   after the first dispatches the same aten ops, with the same non-tensor arguments, shapes,
   dtypes and data flow (relative to itself and the layer before), as the second; and the
   twin's run is the model's with layers 2.. left out. So nothing depends on which layer runs
   or how many there are: a forward that reads len(layers), a per-layer flag, a layer that
   skips its attention, a residual from two layers back all send the model to a full export;
3. `expand`: in the twin's graph, layer 1 is layer 0 node for node, nothing else runs between
   them, and nothing after the layers reads an intermediate layer's values.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from fxtron.core import meta
from fxtron.core.meta import info

_LIFTED = re.compile(r"lifted_tensor_[0-9x]+(?=$|#)")   # export's name for a tensor constant
MIN_LAYERS = 3   # with two layers the twin is the model
KEEP = 2         # layers the twin keeps: layer 1 is the template, layer 0 shows how it links


class NotRepeatable(Exception):
    """Why the model's layers cannot be traced once (the caller exports the whole model)."""


# ----------------------------------------------------------------------------- 1. structure
def find_layers(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    """The dotted path of the model's longest ModuleList and its entries, if they are layers of
    one structure that share no tensor with each other or the rest of the model."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name]
    if not lists:
        raise NotRepeatable("no ModuleList")
    path, layers = max(lists, key=lambda nm: (len(nm[1]), -len(nm[0])))
    layers = list(layers)
    if len(layers) < MIN_LAYERS:
        raise NotRepeatable(f"{path} has {len(layers)} entries")
    ref = _structure(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        if _structure(layer) != ref:
            raise NotRepeatable(f"{path}.{i} differs in structure from {path}.0")
    counts: dict[int, int] = {}
    for t in _tensors(model):
        counts[id(t)] = counts.get(id(t), 0) + 1
    for i, layer in enumerate(layers):
        for name, t in _named_tensors(layer):
            if counts[id(t)] > 1:
                raise NotRepeatable(f"{path}.{i}.{name} is shared")
    return path, layers


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _tensors(model: torch.nn.Module):
    return [t for _, t in _named_tensors(model)]


def _structure(layer: torch.nn.Module) -> tuple:
    modules = tuple((name, type(m)) for name, m in layer.named_modules(remove_duplicate=False))
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in layer.named_parameters(remove_duplicate=False))
    buffers = []
    for mod_name, m in layer.named_modules(remove_duplicate=False):
        for n, b in m._buffers.items():
            if b is not None:
                buffers.append((f"{mod_name}.{n}" if mod_name else n, tuple(b.shape), b.dtype,
                                n not in m._non_persistent_buffers_set))
    return modules, params, tuple(buffers)


def twin(model: torch.nn.Module, path: str, keep: int = KEEP) -> torch.nn.Module:
    """A shallow copy of `model` whose ModuleList at `path` holds only its first `keep` layers.
    Only the modules on the path are copied (their child dicts, not their tensors); every
    layer and every other module is the model's own."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    new, old = root, model
    *parents, last = path.split(".")
    for name in parents:
        child = copy.copy(old._modules[name])
        child._modules = dict(old._modules[name]._modules)
        new._modules[name] = child
        new, old = child, old._modules[name]
    short = copy.copy(old._modules[last])
    short._modules = dict(list(old._modules[last]._modules.items())[:keep])
    new._modules[last] = short
    return root


# ----------------------------------------------------------------------------- 2. behaviour
@dataclass
class _Record:
    """Per segment of one concrete run ('pre', layer i, 'post'), each dispatched op as a
    hashable signature: the op, the argument structure, and per leaf either a constant or the
    tensor's shape, dtype and origin (an input, a parameter or an earlier op's output, named
    relative to the segment that reads it)."""

    n_layers: int
    pre: list = field(default_factory=list)
    layers: list = field(default_factory=list)
    post: list = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, record: _Record, names: dict[int, str], inputs: dict[int, int], prefix: str):
        super().__init__()
        self.record = record
        self.names = names          # id(tensor) -> parameter / buffer name
        self.inputs = inputs        # id(tensor) -> user input index
        self.made: dict[int, tuple] = {}   # id(tensor) -> (segment, op index, output index)
        self.keep: list = []        # outputs stay alive so their ids stay theirs
        self.where: object = "pre"  # 'pre', layer index, 'between', 'post'
        self.error: str | None = None
        self.next = 0               # the layer that must start next
        self.layer_param = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$")

    def _ops(self) -> list:
        if self.where == "pre":
            return self.record.pre
        if self.where == "post":
            return self.record.post
        return self.record.layers[self.where]

    def _relative(self, seg) -> object:
        if seg == self.where or seg in ("pre", "post"):
            return "self" if seg == self.where else seg
        if isinstance(self.where, int):
            return ("back", self.where - seg)
        return ("last", self.record.n_layers - 1 - seg)

    def _leaf(self, x) -> object:
        if not isinstance(x, torch.Tensor):
            return ("const", type(x).__name__, repr(x))
        desc = (tuple(x.shape), x.dtype)
        value = x.constant if isinstance(x, FakeTensor) else (None if x.device.type == "meta" else x)
        if value is not None and value.numel() <= 64:   # a constant made in the forward: its values
            with unset_fake_temporarily():   # read as the real tensor it is, not through the fake mode
                desc += (tuple(value.detach().flatten().tolist()),)
        if id(x) in self.names:
            name = self.names[id(x)]
            m = self.layer_param.match(name)
            if m:
                return ("param", self._relative(int(m.group(1))), m.group(2), *desc)
            return ("param", name, *desc)
        if id(x) in self.made:
            seg, i, o = self.made[id(x)]
            return ("value", self._relative(seg), i, o, *desc)
        if id(x) in self.inputs:
            return ("input", self.inputs[id(x)], *desc)
        return ("other", *desc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.where == "between":
            self.error = self.error or f"{func} runs between two layers"
            return out
        leaves, spec = pytree.tree_flatten((args, kwargs))
        ops = self._ops()
        ops.append((str(func), str(spec), tuple(self._leaf(x) for x in leaves)))
        for o, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = (self.where, len(ops) - 1, o)
                self.keep.append(t)
        return out

    # layer hooks: layer i starts, layer i ends
    def enter(self, i: int):
        if self.error:
            return
        if i != self.next or self.where not in ("pre", "between"):
            self.error, self.where = f"layer {i} runs out of order, twice or inside another", "between"
            return
        self.where, self.next = i, i + 1
        self.record.layers.append([])

    def leave(self, i: int):
        if not self.error:
            self.where = "post" if i == self.record.n_layers - 1 else "between"


def fake_on_cpu(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of `mode` like `t`; a meta tensor's on the CPU (a model built on meta is
    traced as the CPU-built one: code that asks a tensor's device -- transformers' MoE picks
    histc's dtype by it -- takes a path every device runs). The devices this writes into the
    graph become the program's in passes/devices.py."""
    if t.device.type != "meta":
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def fake_twin(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """A shallow copy of `module`'s whole tree whose meta parameters and buffers are fake CPU
    tensors of `mode` (tied ones stay one tensor; the model itself is not touched)."""
    made: dict[int, torch.Tensor] = {}
    modules: dict[int, torch.nn.Module] = {}

    def tensor(t, parameter: bool):
        if t is None or t.device.type != "meta":
            return t
        if id(t) not in made:
            f = fake_on_cpu(mode, t.detach())
            made[id(t)] = torch.nn.Parameter(f, t.requires_grad) if parameter else f
        return made[id(t)]

    def twin_of(m):
        if id(m) not in modules:
            s = modules[id(m)] = copy.copy(m)
            s._parameters = {n: tensor(p, True) for n, p in m._parameters.items()}
            s._buffers = {n: tensor(b, False) for n, b in m._buffers.items()}
            s._modules = {n: None if c is None else twin_of(c) for n, c in m._modules.items()}
        return modules[id(m)]
    return twin_of(module)


def _record(wrapped: torch.nn.Module, layers: list[torch.nn.Module], prefix: str, tensors: list) -> _Record:
    """Run `wrapped(*tensors)` on fake tensors of the example's sizes (static: no symbols, so
    cheap; fake, as under export, so models that ask "am I being traced?" take the traced
    path), recording what each layer dispatches."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    state, names = {}, {}
    for name, t in _named_tensors(wrapped):
        if id(t) not in memo:
            memo[id(t)] = fake_on_cpu(fake, t.detach())
            names[id(memo[id(t)])] = name
        state[name] = memo[id(t)]
    args = [fake.from_tensor(t) for t in tensors]
    record = _Record(n_layers=len(layers))
    recorder = _Recorder(record, names, {id(a): i for i, a in enumerate(args)}, prefix)
    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: recorder.enter(i)))
            handles.append(layer.register_forward_hook(lambda m, a, o, i=i: recorder.leave(i)))
        with torch.no_grad(), fake, recorder:
            torch.func.functional_call(wrapped, state, tuple(args))
    finally:
        for h in handles:
            h.remove()
    if recorder.error:
        raise NotRepeatable(recorder.error)
    if recorder.where != "post" or len(record.layers) != len(layers):
        raise NotRepeatable("the layers do not all run, once each, in order")
    return record


def check_same_program(wrapped: torch.nn.Module, wrapped_twin: torch.nn.Module, layers: list[torch.nn.Module],
                       path: str, tensors: list, inside: str = "") -> None:
    """Raise NotRepeatable unless every layer after the first does what the second does, and the
    twin (first KEEP layers) does what the model does with the others left out (see the module
    docstring). `path` is the layer list's path in the model, which is `inside` `wrapped`
    (the wrapper's attribute holding the model, or '')."""
    prefix = f"{inside}.{path}" if inside else path
    full = _record(wrapped, layers, prefix, tensors)
    for i in range(2, len(layers)):
        if full.layers[i] != full.layers[1]:
            raise NotRepeatable(f"{path}.{i} runs a different program from {path}.1")
    short = _record(wrapped_twin, layers[:KEEP], prefix, tensors)
    if (short.pre, short.layers, short.post) != (full.pre, full.layers[:KEEP], full.post):
        raise NotRepeatable("the model's forward outside its layers depends on how many layers it has")


# ----------------------------------------------------------------------------- 3. the graph
def expand(gm: fx.GraphModule, path: str, n_layers: int, buffers: dict[str, torch.Tensor]) -> None:
    """Edit the twin's traced graph in place into the model's: layer 1's nodes are repeated for
    layers 2 .. n_layers-1, each with its own parameter and buffer placeholders (in the model's
    order), fed by the layer before, and what came after layer 1 reads the last layer.
    `buffers`: the model's non-persistent buffers by name (the copies' constants). Raises
    NotRepeatable, before changing anything, where layer 1 is not layer 0 node for node."""

    ti = info(gm)
    graph = gm.graph
    if any(re.match(rf"{re.escape(path)}\.\d+\.", b) for b in ti.buffer_mutations.values()):
        raise NotRepeatable("the layers write buffers")
    layer_re = re.compile(rf"^{re.escape(path)}\.(\d+)(?:\.|$)")
    tensor_re = re.compile(rf"^{re.escape(path)}\.(\d+)\.(.+)$")

    # placeholders of layers 0 and 1, by relative name (export numbers lifted constants
    # through the whole model: layer 0's lifted_tensor_0 is layer 1's lifted_tensor_2)
    own: list[dict[str, fx.Node]] = [{}, {}]
    for node in graph.find_nodes(op="placeholder"):
        spec = meta.get(node, meta.INPUT)
        m = tensor_re.match(spec.target) if spec.kind != "user" else None
        if m:
            mine = own[int(m.group(1))]
            rel = _LIFTED.sub(lambda _: f"lifted_tensor_#{sum('#' in k for k in mine)}", m.group(2))
            mine[rel] = node
    owner = {node: (i, rel) for i in (0, 1) for rel, node in own[i].items()}
    if list(own[0]) != list(own[1]):
        raise NotRepeatable("layers 0 and 1 have different placeholders")

    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    seg: list[list[fx.Node]] = [[], []]
    span = []
    for pos, node in enumerate(nodes):
        m = layer_re.match(meta.get(node, meta.MODULE) or "")
        if m:
            seg[int(m.group(1))].append(node)
            span.append(pos)
    if not seg[0] or len(seg[0]) != len(seg[1]) or len(span) != span[-1] - span[0] + 1 \
            or nodes.index(seg[0][-1]) > nodes.index(seg[1][0]):
        raise NotRepeatable("layers 0 and 1 are not two runs of the same nodes, one after the other")
    idx = [{node: k for k, node in enumerate(s)} for s in seg]

    # layer 1 node for node against layer 0; what each layer-0 value it reads is to it
    role: dict[fx.Node, str] = {}   # layer-0 node -> 'chain' (the previous layer's) or 'shared'
    partner: dict[fx.Node, fx.Node] = {}   # layer-0 node <-> what layer 0 reads in its place
    for a, b in zip(*seg):
        la, sa = pytree.tree_flatten((a.args, a.kwargs))
        lb, sb = pytree.tree_flatten((b.args, b.kwargs))
        if a.op != b.op or a.target != b.target or sa != sb:
            raise NotRepeatable(f"{b.name} ({b.target}) differs from {a.name} ({a.target})")
        for x, y in zip(la, lb):
            if not isinstance(y, fx.Node):
                ok = _same_constant(x, y)
            elif y in idx[1]:
                ok = x is seg[0][idx[1][y]]
            elif y in idx[0]:
                r = "shared" if x is y else "chain"
                ok = (x is y or (x not in idx[0] and x not in owner)) and role.setdefault(y, r) == r \
                    and partner.setdefault(y, x) is x and partner.setdefault(x, y) is y
            elif y in owner:
                ok = owner[y][0] == 1 and own[0].get(owner[y][1]) is x
            else:
                ok = x is y
            if not ok:
                raise NotRepeatable(f"{b.name} reads {y} where {a.name} reads {x}")
    tail = nodes[nodes.index(seg[1][-1]) + 1:] + list(graph.find_nodes(op="output"))
    for node in tail:
        for x in node.all_input_nodes:
            if x in idx[0] and role.get(x) != "shared":
                raise NotRepeatable(f"{node.name} reads {x.name}, an intermediate layer's value")

    # new placeholders: each run of layer 1's (parameters, buffers, constants) is followed by
    # the same run for layers 2.., as export orders them
    placeholders = list(graph.find_nodes(op="placeholder"))
    runs: list[list[fx.Node]] = []
    for k, node in enumerate(placeholders):
        if owner.get(node, (0,))[0] == 1:
            if runs and placeholders[k - 1] is runs[-1][-1]:
                runs[-1].append(node)
            else:
                runs.append([node])
    made: dict[tuple[int, str], fx.Node] = {}
    for run in runs:
        anchor = run[-1]
        for j in range(KEEP, n_layers):
            one, mine = f"{path}.1.", f"{path}.{j}."
            for node in run:
                spec = meta.get(node, meta.INPUT)
                name = spec.target.replace(one, mine, 1)
                if _LIFTED.search(name):    # numbered below, once all are in place
                    name = _LIFTED.sub(f"lifted_tensor_{j}x{len(made)}", name)
                with graph.inserting_after(anchor):   # export's target: p_model_blocks_1_... for layer j
                    ph = graph.placeholder(node.target.replace(_flat(one), _flat(mine), 1))
                ph.meta.update({key: v for key, v in node.meta.items() if key != meta.INPUT})
                meta.set(ph, meta.INPUT, meta.InputSpec(spec.kind, name))
                if spec.target in ti.constants:
                    ti.constants[name] = buffers[name] if name in buffers else ti.constants[spec.target].clone()
                made[(j, owner[node][1])] = anchor = ph

    # the copies, in order, after layer 1
    copies = {0: seg[0], 1: seg[1]}
    anchor = seg[1][-1]
    for j in range(KEEP, n_layers):
        mine: list[fx.Node] = []

        def arg(y: fx.Node, j=j, mine=mine) -> fx.Node:
            if y in idx[1]:
                return mine[idx[1][y]]
            if y in idx[0]:
                return y if role[y] == "shared" else copies[j - 1][idx[0][y]]
            if y in owner:
                return made[(j, owner[y][1])]
            return y

        for b in seg[1]:
            with graph.inserting_after(anchor):
                c = graph.node_copy(b, arg)   # meta copied (shallow): the same vals and source
            _relabel(c, path, j)
            mine.append(c)
            anchor = c
        copies[j] = mine
    last = {b: copies[n_layers - 1][k] for k, b in enumerate(seg[1])}
    for node in tail:
        node.args, node.kwargs = fx.map_arg((node.args, node.kwargs), lambda x: last.get(x, x))

    _name_inputs(gm)
    graph.lint()
    gm.recompile()


def _name_inputs(gm: fx.GraphModule) -> None:
    """TraceInfo's parameter and buffer lists in placeholder order; lifted constants numbered
    in that order, and every placeholder named, as a whole export names them."""

    ti = info(gm)
    specs = [(node, meta.get(node, meta.INPUT)) for node in gm.graph.find_nodes(op="placeholder")]
    lifted = [(node, spec) for node, spec in specs if _LIFTED.search(spec.target)]
    for k, (node, spec) in enumerate(lifted):     # to temporary names first: no clashes
        name = _LIFTED.sub(f"lifted_tensor_{k}", spec.target)
        if spec.target in ti.constants:
            ti.constants[name + "#"] = ti.constants.pop(spec.target)
        node.target = _LIFTED.sub(f"lifted_tensor_{k}#", node.target)
        meta.set(node, meta.INPUT, dataclasses.replace(spec, target=name + "#"))
    for node, spec in specs:
        spec = meta.get(node, meta.INPUT)
        if spec.target.endswith("#"):
            if spec.target in ti.constants:
                ti.constants[spec.target[:-1]] = ti.constants.pop(spec.target)
            node.target = node.target[:-1]
            spec = dataclasses.replace(spec, target=spec.target[:-1])
            meta.set(node, meta.INPUT, spec)
        if spec.kind != "user":
            node._rename(("" if spec.kind == "parameter" else "buf_") + _flat(spec.target))
    final = [meta.get(node, meta.INPUT) for node, _ in specs]
    ti.params[:] = [spec.target for spec in final if spec.kind == "parameter"]
    ti.buffers[:] = [spec.target for spec in final if spec.kind == "buffer"]


def _flat(name: str) -> str:
    return name.replace(".", "_")


def _relabel(node: fx.Node, path: str, j: int) -> None:
    """A copy of a layer-1 node, relabelled as layer j's (its module path and nn_module_stack)."""
    one = re.compile(rf"(?<!\w){re.escape(path)}\.1(?=\.|$)")
    sub = f"{path}.{j}"
    meta.set(node, meta.MODULE, one.sub(sub, meta.get(node, meta.MODULE)))
    meta.set(node, meta.PROVENANCE, meta.Provenance("trace", f"{path}.1 repeated"))
    stack = node.meta.get("nn_module_stack")
    if stack:
        node.meta["nn_module_stack"] = {one.sub(sub, k): (one.sub(sub, q), cls) for k, (q, cls) in stack.items()}


def _same_constant(x, y) -> bool:
    if isinstance(x, fx.Node) or type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return x is y
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an argument that cannot be compared is not the same
        return False
