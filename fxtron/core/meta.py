"""Core: the node.meta contract -- every key fxtron writes, its type, meaning and writer -- and
the graph-level facts of a traced model (TraceInfo, the batch and sequence symbols B and S).

torch's own keys are reused, never redefined: `val` (a FakeTensor or SymInt from export),
`nn_module_stack` (module path -> (qualified name, class)), `stack_trace`. fxtron's keys all
start with "fxtron_" and hold the frozen values below. `get`/`set` check the key is known and
the value has its type, so a typo or a wrong value fails where it is written. Placements are
per mesh axis (`placement(node, "tp")`); `is_param` / `param_name` answer "is this
placeholder a parameter" in one place.

The compiler writes this metadata and the runtime reads it (a pipeline stage's boundary
shapes, a program's inputs): both import this module, neither imports the other.
"""
from __future__ import annotations

import builtins
import operator
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import sympy

import torch
import torch.fx as fx

from fxtron.core.placement import PerAxis

_aten = torch.ops.aten
from fxtron.errors import ParallelizeError


@dataclass(frozen=True)
class InputSpec:
    """What a placeholder stands for. kind: a lifted parameter or buffer (target: its name in
    the original model's state_dict), or the index-th user input, with `dims` naming each
    dimension's role ('batch', 'seq' or None for a static dim)."""

    kind: Literal["parameter", "buffer", "user"]
    target: str
    index: int = -1
    dims: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class Provenance:
    """The pass that created this node (nodes that came from export carry 'trace')."""

    pass_name: str
    reason: str = ""


@dataclass(frozen=True)
class MetaKey:
    name: str
    type: type | tuple[type, ...]
    meaning: str
    written_by: str


_KEYS: dict[str, MetaKey] = {}


def _key(name: str, typ, meaning: str, written_by: str) -> str:
    _KEYS[name] = MetaKey(name, typ, meaning, written_by)
    return name


INPUT = _key("fxtron_input", InputSpec,
             "what a placeholder stands for: parameter, buffer or user input", "compiler.trace")
MODULE = _key("fxtron_module", str,
              "dotted path of the innermost source module ('' for the model's own forward)",
              "compiler.trace")
PROVENANCE = _key("fxtron_provenance", Provenance,
                  "which pass created the node, and why", "every pass that creates nodes")
PLACEMENT = _key("fxtron_placement", PerAxis,
                 "the value's placement on each mesh axis the graph is distributed over "
                 "(core.placement; a tuple per axis for multi-output nodes)", "passes.propagate")
EXPECTS = _key("fxtron_expects", PerAxis,
               "per axis: the placement each tensor input must have (None: as it comes), in "
               "flattened-args order", "passes.propagate")
REDISTRIBUTE_OUT = _key("fxtron_redistribute_out", PerAxis,
                        "per axis: the placement every consumer sees (a colwise linear with gather_output)",
                        "passes.propagate")
LOCAL_SHAPE = _key("fxtron_local_shape", tuple,
                   "this rank's shape, sympy expressions in the batch and sequence symbols",
                   "passes.shapes")
KERNEL = _key("fxtron_kernel", str, "the GEMM kernel fuse_linears chose for a linear", "passes.fuse")
GRAD_REDUCE = _key("fxtron_grad_reduce", tuple,
                   "on a parameter placeholder: the mesh axes over which its gradient is partial on "
                   "each rank (a replicated norm weight used on sequence shards: ('tp',)); summed there "
                   "once per step, in the step's finalize (Gradients.finalize), as Megatron all-reduces sequence-parallel norm weights",
                   "passes.redistribute")
FALLBACK = _key("fxtron_fallback", str,
                "on a node with no sharding rule for its inputs' placements: the axis on which its "
                "inputs were made whole and it ran replicated (a correct fallback the summary reports)",
                "passes.propagate")
GATHERED = _key("fxtron_gathered", str,
                "on an all-gather inserted so that an op whose rule needs the value whole gets it (not a "
                "colwise gather_output, nor sequence parallel's gather into a region): why -- forward "
                "communication Megatron's layer would not issue, which the summary reports",
                "passes.redistribute")
NO_GRAD = _key("fxtron_no_grad", bool,
                "on a node of a torch.no_grad region that trace inlined (export's wrap_with_set_grad_enabled): no "
                "gradient flows back through it; the tp plan leaves the linears there whole", "compiler.trace")
STAGE = _key("fxtron_stage", int, "pipeline stage that runs the node", "passes.stages")
OWN_SIZE = _key("fxtron_own_size", bool,
                "on a sym_size of a split value: the graph means this rank's own size (a tp rank's share of a "
                "mixture-of-experts layer's copies, uneven by routing), which localize leaves as it is",
                "passes.expert_parallel")
NEGATIVES = _key("fxtron_negatives", str,
                 "on an op reading across the batch made the global batch's by gathering its other operand over "
                 "dp (in-batch negatives), or on the loss over those: how", "passes.statistics")
STATISTIC = _key("fxtron_statistic", str,
                 "on a batch statistic the loss depends on (a reduction over the batch dim): how it was made the "
                 "global batch's -- 'scaled', 'global count', 'summed over dp', 'as is' (a mean, or a token mean's "
                 "numerator, reaching the loss linearly), 'local' (moe_aux_loss='local')", "passes.statistics")
RECOMPUTE = _key("fxtron_recompute", str,
                 "the activation-recomputation region the node belongs to ('blocks.3', 'blocks.2.attn core'): "
                 "its activations are computed again in backward instead of kept", "passes.recompute")


def keys() -> dict[str, MetaKey]:
    """All fxtron node.meta keys, by name."""
    return dict(_KEYS)


def set(node: fx.Node, key: str, value: Any) -> None:  # noqa: A001 - mirrors dict API
    spec = _KEYS.get(key)
    if spec is None:
        raise KeyError(f"{key!r} is not an fxtron meta key; known: {sorted(_KEYS)}")
    if not isinstance(value, spec.type):
        raise TypeError(f"node.meta[{key!r}] must be {spec.type}, got {type(value).__name__}")
    node.meta[key] = value


def get(node: fx.Node, key: str, default: Any = None) -> Any:
    if key not in _KEYS:
        raise KeyError(f"{key!r} is not an fxtron meta key; known: {sorted(_KEYS)}")
    return node.meta.get(key, default)


def source(node: fx.Node) -> str:
    """Where in the model's Python the node was made (the last frame of export's stack_trace):
    'modeling_mixtral.py:102 in load_balancing_loss_func: `expert_mask = ...`', or ''."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, func, code = frames[-1]
    code = code.strip()
    return f"{os.path.basename(path)}:{line} in {func}" + (f": `{code[:100]}`" if code else "")


# ----------------------------------------------------------------------------- per-axis keys
def placement(node: fx.Node, axis: str, default: Any = None) -> Any:
    """The node's placement on `axis` (a Placement, or a tuple for a multi-output node)."""
    return get(node, PLACEMENT, PerAxis()).get(axis, default)


def set_placement(node: fx.Node, axis: str, value: Any) -> None:
    set(node, PLACEMENT, get(node, PLACEMENT, PerAxis()).with_axis(axis, value))


def expects(node: fx.Node, axis: str) -> tuple:
    """What the node's rule on `axis` expects of each tensor input (None: as it comes)."""
    return get(node, EXPECTS, PerAxis()).get(axis, ())


def set_expects(node: fx.Node, axis: str, value: tuple) -> None:
    set(node, EXPECTS, get(node, EXPECTS, PerAxis()).with_axis(axis, tuple(value)))


def redistribute_out(node: fx.Node, axis: str) -> Any:
    return get(node, REDISTRIBUTE_OUT, PerAxis()).get(axis)


def set_redistribute_out(node: fx.Node, axis: str, value: Any) -> None:
    set(node, REDISTRIBUTE_OUT, get(node, REDISTRIBUTE_OUT, PerAxis()).with_axis(axis, value))


# ----------------------------------------------------------------------------- placeholders
def is_param(node: Any) -> bool:
    """Is `node` a placeholder standing for one of the model's parameters?"""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return False
    spec = get(node, INPUT)
    return spec is not None and spec.kind == "parameter"


def transposed_param(node) -> bool:
    """Is `node` a 2-D parameter transposed (w.T, w.t(), w.transpose(0, 1), w.permute(1, 0))?"""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
        return False
    w = node.args[0]
    if not (is_param(w) and w.meta["val"].dim() == 2):
        return False
    t, a = node.target, node.args
    return (t in (_aten.t.default, _aten.numpy_T.default)
            or (t == _aten.transpose.int and {a[1] % 2, a[2] % 2} == {0, 1})
            or (t == _aten.permute.default and [d % 2 for d in a[1]] == [1, 0]))


def param_name(node: Any) -> str | None:
    """The parameter's name in the model's state_dict when `node` is a parameter placeholder."""
    return get(node, INPUT).target if is_param(node) else None


def unread(gm: fx.GraphModule, kind: str) -> tuple[str, ...]:
    """The model's parameters (kind "parameter") or buffers ("buffer") its traced forward never
    reads: placeholders without users."""
    return tuple(spec.target for n in gm.graph.nodes if n.op == "placeholder" and not n.users
                 and (spec := get(n, INPUT)) is not None and spec.kind == kind)


#: ops whose value takes no gradient from their tensor inputs (they lend only shape, dtype, device)
_NO_GRAD = {_aten.new_empty.default, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
            _aten.new_empty_strided.default, _aten.zeros_like.default, _aten.ones_like.default,
            _aten.empty_like.default, _aten.full_like.default, _aten.rand_like.default, _aten.randn_like.default,
            _aten.detach.default}


#: ops whose output shares its input's memory: a write into it writes into the input (and autograd
#: carries that write's gradient to the input's readers). Not view.dtype: a view autograd does
#: not differentiate (a write through it gives the base no gradient), nor detach
_ALIASING = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten._reshape_alias.default,
             _aten.select.int, _aten.slice.Tensor, _aten.narrow.default, _aten.unsqueeze.default, _aten.squeeze.dim,
             _aten.squeeze.dims, _aten.squeeze.default, _aten.transpose.int, _aten.permute.default, _aten.t.default,
             _aten.movedim.int, _aten.movedim.intlist, _aten.swapaxes.default, _aten.swapdims.default,
             _aten.expand.default, _aten.expand_as.default, _aten.view_as.default, _aten.alias.default,
             _aten.diagonal.default, _aten.unflatten.int, _aten.flatten.using_ints, _aten.as_strided.default,
             _aten.unfold.default, _aten.view_as_real.default, _aten.view_as_complex.default, _aten.real.default,
             _aten.imag.default}

#: ops whose outputs (a list, each read through a getitem) are views of their input's memory.
#: torch forbids writing in place into split's, chunk's and unbind's pieces while grad is on;
#: tensor_split's (and hsplit's...) are single views that it allows
_ALIASING_PIECES = {_aten.split.Tensor, _aten.split.sizes, _aten.split_with_sizes.default, _aten.unbind.int,
                    _aten.chunk.default, _aten.tensor_split.sections, _aten.tensor_split.indices,
                    _aten.tensor_split.tensor_indices_or_sections, _aten.hsplit.int, _aten.hsplit.array,
                    _aten.vsplit.int, _aten.vsplit.array, _aten.dsplit.int, _aten.dsplit.array}


def writes_first(node: fx.Node) -> bool:
    """Does the op write into its first argument (copy_, add_, index_put_, masked_fill_...)?"""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and isinstance(node.args[0] if node.args else None, fx.Node)


def _alias_of(node: fx.Node) -> "fx.Node | None":
    """The value whose memory `node` shares: a view's input, a piece's (getitem of a split)
    list, a list of pieces' input, an in-place op's destination (`add_` returns it); None
    for a value of its own."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if node.target in _ALIASING or node.target in _ALIASING_PIECES or writes_first(node):
        return src
    if node.target is operator.getitem and src.op == "call_function" and src.target in _ALIASING_PIECES:
        return src
    return None


def written(node: fx.Node, own: bool = False) -> "list[fx.Node]":
    """For an op that writes into its first argument, every value that shares that memory: the
    views from the written one back to their base (a slice of zeros_like that `x[:, i] = y`
    fills: the chunked delta rule's output, Qwen3-Next's), and the base's other views (and
    pieces, and in-place ops' results). A gradient written there flows on from whatever reads
    them afterwards. With `own`, the op's result and its views too."""
    dst = node.args[0]
    chain = [dst]
    while (base := _alias_of(dst)) is not None:
        dst = base
        chain.append(dst)
    seen, stack = builtins.set(chain), list(chain)      # every view on the way has other views too
    while stack:
        for user in stack.pop().users:
            if user not in seen and (own or user is not node) and _alias_of(user) in seen:
                seen.add(user)
                stack.append(user)
    return list(seen)


def read_after(node: fx.Node) -> "list[fx.Node]":
    """For an op that writes into its first argument, the nodes after it that read that memory
    under another name than the op's own result (the base a slice of it was written through, a
    view made before): a pass that hands the op a copy of its destination (a redistribution)
    leaves them the old values."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return [u for a in written(node) for u in a.users if u is not node and order[u] > order[node]]


def carries_grad(gm: fx.GraphModule) -> "set[fx.Node]":
    """The nodes a gradient flows back through: floating values computed from a parameter or
    from a pipeline stage's received activation (a placeholder that stands for no parameter,
    buffer or user input), except through factories like new_zeros / zeros_like -- unless a
    value that carries one is written into them in place (`out[:, i] = y`: autograd's
    CopySlices), which makes the written memory carry it from then on."""
    out: "set[fx.Node]" = builtins.set()        # this module's `set` writes meta
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        floating = differentiable(val) or isinstance(val, (list, tuple))
        if node.op == "placeholder":
            spec = get(node, INPUT)
            if (spec is not None and spec.kind == "parameter") or (spec is None and floating):
                out.add(node)
        elif floating and node.target not in _NO_GRAD and any(a in out for a in node.all_input_nodes):
            out.add(node)
            if writes_first(node):
                out.update(written(node))
    return out


def differentiable(val) -> bool:
    """Can autograd carry a gradient through a value: a floating or complex tensor (a rotary
    embedding's view_as_complex)."""
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def reaches_loss(gm: fx.GraphModule) -> "set[fx.Node]":
    """The nodes a gradient of the loss reaches (`carries_grad` ones with a path of such to
    the graph's outputs, not counting the buffers written back): a parameter outside it
    (used only under torch.no_grad, or not at all) gets no gradient in the model, its .grad
    None."""
    seeds = carries_grad(gm)
    grad: "set[fx.Node]" = builtins.set()
    for node in gm.graph.nodes:     # carries_grad's, where a value of unknown kind (no `val`) may carry one
        if node.op == "placeholder":
            if node in seeds:
                grad.add(node)
        elif node.op == "call_function" and node.target not in _NO_GRAD and any(a in grad for a in node.all_input_nodes):
            val = node.meta.get("val")
            if val is None or differentiable(val) or isinstance(val, (list, tuple)):
                grad.add(node)
                if writes_first(node):
                    grad.update(written(node))
    out: "set[fx.Node]" = builtins.set()
    ti = gm.meta.get(TRACE_INFO)
    mutations = ti.buffer_mutations if ti is not None else {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            flat = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            out |= {a for i, a in enumerate(flat) if isinstance(a, fx.Node) and i not in mutations and a in grad}
        elif node in grad and any(u in out and u in grad and u.target not in _NO_GRAD for u in node.users):
            out.add(node)            # not through zeros_like(p): its memory, written later, takes the gradient, not p
        elif node in grad and writes_first(node) and any(
                u in out for a in written(node) for u in a.users if order[u] > order[node]):
            out.add(node)            # an in-place write that something reaching the loss reads later
    return out


# ----------------------------------------------------------------------------- graph-level
TRACE_INFO = "fxtron_trace"
BATCH, SEQ = sympy.Symbol("B", positive=True, integer=True), sympy.Symbol("S", positive=True, integer=True)


@dataclass
class TraceInfo:
    """What a traced graph's inputs and outputs are (`gm.meta["fxtron_trace"]`, carried by
    every pass's output).

    params / buffers: names in placeholder order (each placeholder's node.meta fxtron_input
    says the same). aliases: tied names -> the canonical name they share storage with.
    user_dims: per tensor user input, the role of each dim ('batch', 'seq' or None).
    symbols: export's shape symbols -> fxtron's readable ones (B, S).
    in_spec: pytree spec of (args, kwargs); statics: its leaves, None where a tensor goes
    (non-tensor leaves were baked into the graph).
    buffer_mutations: output index -> buffer name written back after forward.
    layers: whether the layers were traced once and repeated, or why the model was traced whole.
    signature, token_ranges: what the step checks every batch against (runtime/batch.py).
    statistics, statistics_report: the batch statistics made global (passes/statistics.py).
    documents: the input of document ids whose order the cp split follows (passes/cp_documents.py).
    loss_dtype: the dtype of the loss the graph returns, as traced (a 16-bit program is traced in
    16 bits), or float16 where an fp16 value it sums, casts or scales receives its gradient (an
    fp16 cross entropy plus an fp32 auxiliary loss): fp16 caps fp16's loss scale
    (runtime/precision.py LossScaler).
    ranges: B's and S's sizes the program holds, where the model's code narrowed them (below).
    """

    params: list[str]
    buffers: list[str]
    user_dims: list[tuple[str | None, ...]]
    symbols: dict[sympy.Symbol, sympy.Symbol]
    in_spec: Any
    statics: list = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    buffer_mutations: dict[int, str] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: str = ""   # how the layers were traced: repeated from two, or why the model was traced whole
    # per user input: (dtype, shape in B, S and integers) as traced, or None for a non-tensor
    signature: list = field(default_factory=list)
    # the user inputs that are token ids or class targets, and their range (passes/limits.TokenRange)
    token_ranges: list = field(default_factory=list)
    # input statistics the runtime computes over the global batch before each step, by key
    # (passes/statistics.Statistic), and what that pass did (its StatisticsReport, or None)
    statistics: dict = field(default_factory=dict)
    statistics_report: Any = None
    # cp_documents: the user input of each token's document id, by which the runtime reorders
    # every row before the cp split (passes/cp_documents.py); None: the plain load-balanced split
    documents: int | None = None
    loss_dtype: torch.dtype | None = None
    # B and S -> (lowest, highest or None) where the model's code narrowed export's range of them
    # (a Python branch on the size: export guards it); the step refuses sizes outside
    ranges: dict = field(default_factory=dict)

    @property
    def n_user_inputs(self) -> int:
        return len(self.user_dims)

    def expr(self, size) -> sympy.Expr:
        """A dim of a `val` (int or SymInt) as a sympy expression in B and S."""
        if isinstance(size, torch.SymInt):
            return sympy.sympify(size.node.expr).xreplace(self.symbols)
        return sympy.Integer(int(size))

    def shape(self, val) -> tuple[sympy.Expr, ...]:
        return tuple(self.expr(s) for s in val.shape)


GRAPH_AXES = "fxtron_axes"


def graph_axes(gm: fx.GraphModule) -> tuple[str, ...]:
    """The mesh axes the graph's values have placements on (`propagate` adds each)."""
    return tuple(gm.meta.get(GRAPH_AXES, ()))


def add_graph_axis(gm: fx.GraphModule, axis: str) -> None:
    if axis not in graph_axes(gm):
        gm.meta[GRAPH_AXES] = graph_axes(gm) + (axis,)


BALANCED_AXES = "fxtron_balanced_axes"


def balanced_axes(gm: fx.GraphModule) -> tuple[str, ...]:
    """The mesh axes whose shards are load-balanced (cp: a rank holds chunks r and 2n-1-r of
    2n, ops/cp/layout.py) rather than contiguous; their collectives reorder around the transfer."""
    return tuple(gm.meta.get(BALANCED_AXES, ()))


def add_balanced_axis(gm: fx.GraphModule, axis: str) -> None:
    if axis not in balanced_axes(gm):
        gm.meta[BALANCED_AXES] = balanced_axes(gm) + (axis,)


AXIS_OPTIONS = "fxtron_axis_options"


def axis_options(gm: fx.GraphModule, axis: str) -> dict:
    """The choices `propagate` was given for `axis` (cp: its cp_comm_type), which its
    lowerings read too."""
    return dict(gm.meta.get(AXIS_OPTIONS, {}).get(axis, {}))


def set_axis_options(gm: fx.GraphModule, axis: str, options) -> None:
    gm.meta[AXIS_OPTIONS] = {**gm.meta.get(AXIS_OPTIONS, {}), axis: dict(options)}


def info(gm: fx.GraphModule) -> TraceInfo:
    """The TraceInfo that `trace` attached to a graph module (and passes carry along)."""
    try:
        return gm.meta[TRACE_INFO]
    except KeyError:
        raise ParallelizeError("this GraphModule was not made by fxtron.compiler.trace") from None


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of gm's graph, node names kept, gm.meta carried (node.meta
    copied shallowly: the fake tensors in `val` are shared, never mutated)."""
    graph = fx.Graph()
    out_val = graph.graph_copy(gm.graph, {})
    graph.output(out_val)
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def seq_dim(node: fx.Node, ti: TraceInfo) -> int | None:
    """The dim of node's value whose size is exactly the sequence symbol S, if any."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and ti.symbols.get(sympy.sympify(size.node.expr)) == SEQ:
            return d
    return None
