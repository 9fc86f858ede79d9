"""Passes, tensor parallel: the split plan -- which linears split by columns, which by rows,
which embeddings by vocabulary -- found on the traced graph (Megatron's pattern) or given by
the user keyed by module path. The plan is data, computed once per model (not per rank) and
immutable: `{module path: style}`, each layer's graph node by name, and the tp placement of
every parameter; the tensor-parallel passes (passes/tp.py) apply it.

How the pattern is found, with no knowledge of the model's code:
- a linear whose output reaches a residual add (an add whose other operand was computed before
  the linear, or is such a value scaled by a number or a weight: MiniMax's and Doge's scaled
  residuals) through shape ops only is an output projection: rowwise (attn.proj, mlp.fc2,
  o_proj, down_proj);
- a linear whose output reaches a rowwise linear without crossing another residual is a first
  projection: colwise (q/k/v or fused qkv, fc1, gate and up); a fused output later split into k
  equal parts (or viewed as (k, heads, ...)) is sharded with interleave k, one cut into unequal
  parts by slices or split_with_sizes (Phi-3's qkv under grouped-query attention; Ergo's viewed
  per head and cut into query, key and value heads) with their proportions;
- a linear whose output reaches cross_entropy is the LM head: colwise, feeding the
  vocab-parallel cross entropy;
- an embedding looked up with the user's token ids is vocab-parallel; other embeddings
  (positions) are replicated, as are tables read by position and added to the token embeddings
  without an embedding op (position_tables). Everything else is replicated.
Experts are linears of a 3-D weight (experts, in, out) or (experts, out, in) -- a grouped GEMM,
a bmm over (experts, tokens, in) (Llama 4), or F.linear on one expert's matrix per group of rows
(JetMoE's ParallelExperts) -- planned by the same pattern: gate/up colwise, down rowwise, each
expert split over tp (Megatron's expert tensor parallelism, when ep does not take them).
"""
from __future__ import annotations

import fnmatch
import math
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

import torch
import torch.fx as fx

from fxtron.core import meta, opsets
from fxtron.core.layout import Interleave, block_sizes, normalize
from fxtron.core.placement import REPLICATE, Placement, Shard
from fxtron.errors import ParallelizeError
from fxtron.passes.rules.layers import einsum_subscripts, grouped_mm
from fxtron.passes.rules.registry import rule_for

aten = torch.ops.aten


@dataclass(frozen=True)
class Colwise:
    """Megatron's ColumnParallelLinear: weight split along its output features."""

    gather_output: bool = False

    def __str__(self):
        return "colwise" + (" (gather_output)" if self.gather_output else "")


@dataclass(frozen=True)
class Rowwise:
    """Megatron's RowParallelLinear: weight split along its input features; the partial
    outputs are summed by an all-reduce before the bias is added."""

    input_is_parallel: bool = True

    def __str__(self):
        return "rowwise" + ("" if self.input_is_parallel else " (scatter input)")


@dataclass(frozen=True)
class VocabParallel:
    """Megatron's VocabParallelEmbedding: embedding rows split by vocabulary range."""

    def __str__(self):
        return "vocab-parallel"


@dataclass(frozen=True)
class Replicated:
    def __str__(self):
        return "replicate"


Style = Colwise | Rowwise | VocabParallel | Replicated
_BY_NAME = {"colwise": Colwise(), "rowwise": Rowwise(), "vocab": VocabParallel(),
            "vocab_parallel": VocabParallel(), "replicate": Replicated()}


@dataclass(frozen=True)
class Layer:
    """A linear or embedding found in the graph: its node's name, module path, weight and bias
    parameter names, and the weight layout ('out_in' as nn.Linear, 'in_out' as Conv1D/mm, 'left'
    for weight @ x: nn.Linear's weight, the features on the output's dim -2; for
    the 3-D weights of a mixture of experts, one matrix per expert, 'e_out_in' / 'e_in_out')."""

    node: str
    kind: str                      # "linear" | "embedding"
    path: str
    weight: str
    bias: str | None
    layout: str                    # "out_in" | "in_out" | "left" | "e_out_in" | "e_in_out"
    in_features: int
    out_features: int


@dataclass(frozen=True)
class _Found:
    """A Layer while planning: the same facts with the fx.Node itself."""

    node: fx.Node
    kind: str
    path: str
    weight: str
    bias: str | None
    layout: str
    in_features: int
    out_features: int

    def record(self) -> Layer:
        return Layer(self.node.name, self.kind, self.path, self.weight, self.bias, self.layout,
                     self.in_features, self.out_features)


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class TPPlan:
    """The plan, for one model and one tp size: a style per layer (by module path), each
    layer's node (by name: the same in every rank's copy of the graph), the tp placement of
    every parameter, and `notes` on why a layer the pattern would split stays replicated."""

    tp: int
    styles: Mapping[str, Style] = field(default_factory=lambda: _frozen({}))
    params: Mapping[str, Placement] = field(default_factory=lambda: _frozen({}))
    interleave: Mapping[str, Interleave] = field(default_factory=lambda: _frozen({}))
    layers: Mapping[str, Layer] = field(default_factory=lambda: _frozen({}))
    notes: tuple[str, ...] = ()
    replicated: Mapping[str, "Unsplit"] = field(default_factory=lambda: _frozen({}))
    #: parameters of no linear or embedding that the user's plan replicates on purpose ("table": "replicate")
    kept: frozenset = frozenset()
    #: position tables read without an embedding op (position_tables): whole by design
    positions: frozenset = frozenset()

    def unsplit(self) -> dict[str, str]:
        """The linears left replicated that Megatron would split: path -> why (not those the
        user's plan replicates, nor routers, which Megatron keeps whole too)."""
        return {p: u.why for p, u in self.replicated.items() if u.loud}

    def style(self, path: str) -> Style:
        return self.styles.get(path, Replicated())

    def table(self) -> list[tuple[str, str, str]]:
        """(module path, style, weight placement) per layer, in graph order."""
        return [(p, str(self.style(p)), str(self.params.get(l.weight, REPLICATE)))
                for p, l in self.layers.items()]

    def nodes(self, kind: type, **where) -> frozenset[str]:
        """Names of the nodes of the layers planned with a style of `kind` (and attributes)."""
        return frozenset(self.layers[p].node for p, s in self.styles.items()
                         if isinstance(s, kind) and all(getattr(s, k) == v for k, v in where.items()))


@dataclass(frozen=True)
class Unsplit:
    """Why a linear stays replicated at tp > 1; `loud`: fxtron could not do what the mesh asks
    (warned, and an error under strict), as opposed to a choice (the user's plan, a router)."""

    why: str
    loud: bool


_DOWN_PROJECTION = ("a low-rank down-projection whose output only feeds column-split linears (MLA's q_a_proj, "
                    "kv_a_proj): replicated, as Megatron's duplicated linear_q_down_proj / linear_kv_down_proj")
_NO_GRAD = ("computed under torch.no_grad (no gradient reaches it: DeepSeek-V3.2's sparse-attention indexer): "
            "replicated, as DeepSeek's reference keeps the indexer whole")
_HEAD_TRANSFORM = ("the LM head's transform (dense -> activation -> norm -> the head, BERT's and RoBERTa's): "
                   "replicated, as in Megatron's BERT LM head")
_GATE = ("a gate of one output per token (sigmoid(x W^T) scaling another branch: Qwen2-MoE's shared_expert_gate): "
         "replicated, as Megatron's shared-expert gate weight")
_ROW_GATE = ("a gate of the hidden width multiplying a row-parallel output (RWKV's receptance: "
             "sigmoid(r(x)) * value(k(x))): the product needs that output whole, so a column split would trade "
             "the all-reduce for a reduce-scatter and a forward all-gather; replicated (Megatron has no split for it)")
_NORM_GATE = ("a gate MLP of a norm (AXK2's gated RMSNorm: y * sigmoid(fc2(act(fc1(y))))), a low-rank "
              "bottleneck on the norm's output: replicated, as the norm it belongs to (splitting it adds an "
              "all-reduce per norm)")
_DEAD = "its output reaches nothing the forward returns (a pooler a causal LM drops): replicated, unused"
_NO_PATTERN = ("no Megatron pattern found: its output neither reaches a residual add through shape ops "
               "(rowwise) nor feeds a rowwise linear or the loss (colwise); name its style in plan=")


@dataclass
class _Draft:
    """The plan while it is being made (mutable); `freeze` makes the TPPlan."""

    tp: int
    layers: dict[str, _Found]
    styles: dict[str, Style] = field(default_factory=dict)
    params: dict[str, Placement] = field(default_factory=dict)
    interleave: dict[str, Interleave] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)     # path -> why the plan dropped its style
    kept: set[str] = field(default_factory=set)           # parameters of no layer the user's plan replicates

    def freeze(self, user_styles: Mapping[str, Style], mode: str, gm: fx.GraphModule | None = None) -> TPPlan:
        replicated = {}
        if self.tp > 1:
            down = _down_projections(self, gm) if gm is not None else set()
            live = _live(gm) if gm is not None else set()
            rows = {self.layers[p].node for p, s in self.styles.items() if isinstance(s, Rowwise)}
            gates = _norm_gates(self.layers)
            heads = {l.node for p, l in self.layers.items()
                     if isinstance(self.styles.get(p), Colwise) and l.kind == "linear" and _reaches_loss(l)}
            for path, l in self.layers.items():
                if l.kind != "linear" or not isinstance(self.styles.get(path, Replicated()), Replicated):
                    continue
                if path in self.why:
                    replicated[path] = Unsplit(self.why[path], True)
                elif isinstance(user_styles.get(path), Replicated):
                    replicated[path] = Unsplit("replicated by the plan", False)
                elif mode == "replace":
                    replicated[path] = Unsplit("plan_mode='replace' and the plan does not name it", False)
                elif meta.get(l.node, meta.NO_GRAD):
                    replicated[path] = Unsplit(_NO_GRAD, False)
                elif l.node in gates:
                    replicated[path] = Unsplit(_NORM_GATE, True)
                elif _is_router(l):
                    replicated[path] = Unsplit(ROUTER, False)
                elif path in down:
                    replicated[path] = Unsplit(_DOWN_PROJECTION, False)
                elif _is_scalar_gate(l):
                    replicated[path] = Unsplit(_GATE, False)
                elif _gates_row_output(l, rows):
                    replicated[path] = Unsplit(_ROW_GATE, True)
                elif _feeds_head(l, heads):
                    replicated[path] = Unsplit(_HEAD_TRANSFORM, False)
                elif gm is not None and l.node not in live:
                    replicated[path] = Unsplit(_DEAD, False)
                else:
                    replicated[path] = Unsplit(_NO_PATTERN, True)
        return TPPlan(self.tp, _frozen(self.styles), _frozen(self.params), _frozen(self.interleave),
                      _frozen({p: l.record() for p, l in self.layers.items()}), tuple(self.notes),
                      _frozen(replicated), frozenset(self.kept),
                      frozenset(position_tables(gm)) if gm is not None and self.tp > 1 else frozenset())


# ----------------------------------------------------------------------------- graph helpers
# ops that keep a value's layout (copies, casts, dropout), and those that only reshape it
_SAME_LAYOUT = opsets.COPIES | (opsets.CASTS - {aten.type_as.default}) | {aten.dropout.default}   # type_as: two inputs
_SHAPE_OPS = _SAME_LAYOUT | opsets.RESHAPES | opsets.FOLDS | {aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
                                                           aten.t.default}


_param_name = meta.param_name
ROUTER = "a router (its output picks experts): replicated, as in Megatron"


def _owner(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def find_layers(gm: fx.GraphModule) -> dict[str, _Found]:
    """Every linear (linear, addmm, mm/matmul with a parameter weight) and embedding in the
    graph, keyed by the module path that owns its weight, in graph order."""
    layers: dict[str, _Found] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t, a = node.target, node.args
        layer = None
        if t == aten.linear.default and _expert_matrix(a[1]) is not None:
            layer = _expert_linear(node, a[1])   # F.linear(x, weight[i]): one expert of a 3-D weight (JetMoE)
        elif t == aten.linear.default and _cast_param(a[1]):
            w = _cast_param(a[1])
            b = _cast_param(a[2]) if len(a) > 2 else None
            shape = a[1].meta["val"].shape
            layer = _Found(node, "linear", _owner(w), w, b, "out_in", int(shape[1]), int(shape[0]))
        elif t == aten.addmm.default and _param_name(a[2]):
            w = _param_name(a[2])
            shape = a[2].meta["val"].shape
            layer = _Found(node, "linear", _owner(w), w, _param_name(a[0]), "in_out", int(shape[0]), int(shape[1]))
        elif t in (aten.mm.default, aten.matmul.default) and _param_name(a[1]) and a[1].meta["val"].dim() == 2:
            w = _param_name(a[1])
            shape = a[1].meta["val"].shape
            layer = _Found(node, "linear", _owner(w), w, None, "in_out", int(shape[0]), int(shape[1]))
        elif (t in (aten.mm.default, aten.matmul.default) and _param_name(a[0]) and a[0].meta["val"].dim() == 2
              and not _param_name(a[1])):
            w = _param_name(a[0])                            # weight @ x (Mamba's dt_proj.weight @ dt^T)
            shape = a[0].meta["val"].shape
            layer = _Found(node, "linear", _owner(w), w, None, "left", int(shape[1]), int(shape[0]))
        elif t in (aten.mm.default, aten.matmul.default) and meta.transposed_param(a[1]):
            w = _param_name(a[1].args[0])                    # x @ weight.T (Falcon): nn.Linear's layout
            shape = a[1].args[0].meta["val"].shape
            layer = _Found(node, "linear", _owner(w), w, None, "out_in", int(shape[1]), int(shape[0]))
        elif t == aten.einsum.default and len(a[1]) == 2:
            layer = _einsum_linear(node)
        elif ((_is_grouped_mm(t) or t == aten.bmm.default) and len(a) > 1 and isinstance(a[1], fx.Node)
              and a[1].meta["val"].dim() == 3):
            layer = _experts(node, a[1])       # a grouped GEMM, or a bmm over (experts, tokens, in) (Llama 4)
        elif t == aten.embedding.default and _param_name(a[0]):
            w = _param_name(a[0])
            shape = a[0].meta["val"].shape
            layer = _Found(node, "embedding", _owner(w), w, None, "out_in", int(shape[0]), int(shape[1]))
        if layer is not None:
            key = layer.path
            if key in layers:  # a weight used twice (tied LM head): name it by the calling module
                key = meta.get(node, meta.MODULE) or key
                while key in layers:
                    key += "'"
                layer = _Found(node, layer.kind, key, layer.weight, layer.bias, layer.layout,
                              layer.in_features, layer.out_features)
            layers[key] = layer
    return layers


def _cast_param(w, hops: int = 3) -> str | None:
    """The parameter `w` is, or a cast or copy of (Ergo's LM head: F.linear(x.float(),
    weight.float()), the logits in float32)."""
    while isinstance(w, fx.Node) and hops >= 0:
        if _param_name(w):
            return _param_name(w)
        if w.op != "call_function" or w.target not in _SAME_LAYOUT:
            return None
        w, hops = w.args[0], hops - 1
    return None


#: (out features dim, in features dim) of a weight, by layout
WEIGHT_DIMS = {"out_in": (0, 1), "left": (0, 1), "in_out": (1, 0), "e_out_in": (1, 2), "e_in_out": (2, 1)}


def _is_grouped_mm(target) -> bool:
    """A grouped GEMM of tokens sorted by expert with one weight matrix per expert: an op whose
    sharding rule is the grouped GEMM's (aten._grouped_mm, transformers' grouped_mm_fallback,
    or a user's op registered with it)."""
    return rule_for(target) is grouped_mm


def _path_of(param: str) -> str:
    """A layer's path: its module's for a `weight`, the parameter's own name for a bare one
    (experts.gate_up_proj, a w_o contracted by einsum)."""
    return _owner(param) if param.rsplit(".", 1)[-1] == "weight" else param


def _einsum_linear(node: fx.Node) -> _Found | None:
    """einsum(eq, [x, W]) (either order) with W a 2-D parameter contracting one of its dims with
    x and keeping the other ("bsd,od->bso": nn.Linear's layout; "bsd,do->bso": Conv1D's)."""
    ops = list(node.args[1])
    ws = [i for i, o in enumerate(ops) if _param_name(o) and o.meta["val"].dim() == 2]
    if len(ws) != 1:
        return None
    subs, out = einsum_subscripts(node.args[0], [o.meta["val"].dim() for o in ops])
    w = ops[ws[0]]
    ws_, xs = subs[ws[0]], subs[1 - ws[0]]
    kept = [ch in out and ch not in xs for ch in ws_]
    summed = [ch in xs and ch not in out for ch in ws_]
    if kept == [True, False] and summed == [False, True]:
        layout = "out_in"
    elif kept == [False, True] and summed == [True, False]:
        layout = "in_out"
    else:
        return None
    name, shape = _param_name(w), w.meta["val"].shape
    o, i = WEIGHT_DIMS[layout]
    return _Found(node, "linear", _path_of(name), name, None, layout, int(shape[i]), int(shape[o]))


def _experts(node: fx.Node, w: fx.Node) -> _Found | None:
    """The experts' fused 3-D weight of a grouped GEMM x (tokens, in) @ w (experts, in, out):
    the parameter itself ('e_in_out'), or transposed from (experts, out, in) ('e_out_in')."""
    if _param_name(w):
        name, layout = _param_name(w), "e_in_out"
        shape = w.meta["val"].shape
        return _Found(node, "linear", _path_of(name), name, _expert_bias(node, shape[0], shape[2]), layout,
                      int(shape[1]), int(shape[2]))
    if (w.op == "call_function" and w.target == aten.transpose.int and _param_name(w.args[0])
            and {w.args[1] % 3, w.args[2] % 3} == {1, 2}):
        name = _param_name(w.args[0])
        shape = w.args[0].meta["val"].shape
        return _Found(node, "linear", _path_of(name), name, _expert_bias(node, shape[0], shape[1]), "e_out_in",
                      int(shape[2]), int(shape[1]))
    return None


def _expert_bias(gemm: fx.Node, experts: int, out: int) -> str | None:
    """The experts' bias (experts, out) added to the grouped GEMM's output row by row at each
    row's expert (gpt-oss: `out + bias[expert_of_row]`), or None."""
    for user in gemm.users:
        if user.op == "call_function" and user.target in _ADDS and len(user.args) == 2:
            other = user.args[1] if user.args[0] is gemm else user.args[0]
            if (isinstance(other, fx.Node) and other.target == aten.index.Tensor and len(other.args[1]) == 1
                    and _param_name(other.args[0])
                    and tuple(other.args[0].meta["val"].shape) == (int(experts), int(out))):
                return _param_name(other.args[0])
    return None


def _expert_matrix(w) -> str | None:
    """The 3-D parameter (experts, out, in) whose one expert `w` is (weight[i]: a select on dim 0)."""
    if (isinstance(w, fx.Node) and w.op == "call_function" and w.target == aten.select.int
            and w.args[1] == 0 and _param_name(w.args[0]) and w.args[0].meta["val"].dim() == 3):
        return _param_name(w.args[0])
    return None


def _expert_linear(node: fx.Node, w: fx.Node) -> _Found:
    """F.linear(x, weight[i]) over one expert's token group (ParallelExperts: JetMoE's experts
    loop over the groups of rows split by the experts' counts, then concatenate them): the
    3-D weight as an experts' layer, 'e_out_in'; each expert's use is a layer of the same weight
    (keyed path, path', ...), which the plan splits alike."""
    name = _expert_matrix(w)
    shape = w.args[0].meta["val"].shape
    return _Found(node, "linear", _path_of(name), name, None, "e_out_in", int(shape[2]), int(shape[1]))


def _rows_joined(node: fx.Node) -> fx.Node:
    """An expert's output joined with the other experts' rows by one cat on dim 0 (the
    features untouched): the cat, whose users the plan reads; else the node itself."""
    users = list(node.users)
    if len(users) == 1 and _row_cat(users[0]):
        return users[0]
    return node


def _row_cat(node: fx.Node) -> bool:
    """A cat of rows (dim 0) of 2-D values: tokens grouped by expert put back together."""
    return (node.op == "call_function" and node.target == aten.cat.default
            and (node.args[1] if len(node.args) > 1 else 0) == 0 and node.meta["val"].dim() == 2)


def _through_shape_ops(node: fx.Node, limit: int = 12):
    """Users of `node`, looking through shape-only ops (and getitem), as (user, arg position)."""
    out, frontier, seen = [], [node], set()
    while frontier and limit:
        limit -= 1
        cur = frontier.pop()
        for user in cur.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in _SHAPE_OPS:
                frontier.append(user)
            else:
                out.append((user, cur))
    return out


# what may stand between a row-parallel output and its residual add, or between the LM head and
# the loss, token by token: a norm after the sublayer (OLMo2, Gemma2/3: its ops decomposed, or
# one layer_norm / rms_norm), scaling by constants or weights (residual multipliers, logit
# scaling) and softcapping (tanh); never another linear, matmul, attention or routing op
_TOKENWISE = _SHAPE_OPS | {
    aten.add.Tensor, aten.add_.Tensor, aten.add.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
    aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default, aten.sqrt.default, aten.tanh.default,
    aten.sub.Tensor, aten.layer_norm.default, aten.rms_norm.default, aten.type_as.default,
    aten.var_mean.correction, aten.var.correction,
    # a mixture of experts' combine: rows put back in token order, the top-k outputs summed
    aten.index.Tensor, aten.index_add.default, aten.index_add_.default, aten.sum.dim_IntList}


_ADDS = {aten.add.Tensor, aten.add_.Tensor}      # `mlp_output += attention_output` (Falcon) is in place


def _tokenwise_users(node: fx.Node, limit: int = 48, also: tuple = ()):
    """Users reached from `node` through token-wise ops (see _TOKENWISE) and the ops `also`,
    as (user, via): the adds on the way are yielded too (they may be the residual)."""
    frontier, seen = [node], {node}
    while frontier and limit:
        limit -= 1
        cur = frontier.pop(0)
        for user in cur.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            yield user, cur
            if user.target in _TOKENWISE or user.target in also or _row_cat(user):
                frontier.append(user)


def _reaches_residual(layer: _Found, order: dict[fx.Node, int]) -> bool:
    """Does the output reach a residual add (one whose other operand was computed before the
    linear) through token-wise ops: shape ops, other adds (GPT-NeoX's parallel attention + MLP
    sum), a post-sublayer norm, scaling? The add after a norm of the output is the residual
    only if the output passed the norm whole: the norm's statistic needs the full row, which
    an all-reduce before it gives (Megatron's row-parallel output, then the norm)."""
    return any(user.target in _ADDS and _is_residual(user, via, layer.node, order)
               for user, via in _tokenwise_users(layer.node))


def _is_residual(add: fx.Node, via: fx.Node, linear: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Is `add` (reached from `linear` through `via`) a residual: its other operand computed
    before the linear -- or a sum one of whose terms was (Cohere's parallel block, `residual +
    attention + mlp`: the MLP's output joins a sum the attention's output made after it) --, of
    the add's own shape (a mask added to attention scores broadcasts)?"""
    other = add.args[1] if add.args[0] is via else add.args[0]
    b = add.meta.get("val")
    return (isinstance(b, torch.Tensor) and _earlier_term(other, tuple(b.shape), linear, order)
            and _bias_of(other) is None)


def _bias_of(node) -> str | None:
    """The parameter `node` reads, through shape ops and a gather of its rows (gpt-oss' experts'
    `bias[expert_of_row]`, one row per copy): a bias, never the residual stream -- unless the
    rows are the user's token ids (`weight[input_ids]`: an embedding written as indexing)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target in _SHAPE_OPS | opsets.EXPANDS or node.target == aten.index.Tensor):
        if node.target == aten.index.Tensor and _from_user_input(node.args[1]):
            return None
        node = node.args[0]
    return _param_name(node) if isinstance(node, fx.Node) else None


def _from_user_input(indices) -> bool:
    """Is one of the index tensors a user's input, through shape ops?"""
    for ids in indices if isinstance(indices, (list, tuple)) else [indices]:
        for _ in range(8):
            if not isinstance(ids, fx.Node):
                break
            spec = meta.get(ids, meta.INPUT)
            if spec is not None:
                if spec.kind == "user":
                    return True
                break
            if ids.op != "call_function" or ids.target not in _SHAPE_OPS | opsets.EXPANDS:
                break
            ids = ids.args[0]
    return False


_SCALINGS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}


def _earlier_term(node, shape: tuple, linear: fx.Node, order: dict[fx.Node, int], depth: int = 4) -> bool:
    """`node`, of `shape`, was computed before `linear`, or is a sum with such a term, or such a
    value scaled by a number or a weight, or cast (MiniMax's `residual * alpha + attention * beta`:
    the residual's scaling is computed after the sublayer)."""
    if not isinstance(node, fx.Node):
        return False
    a = node.meta.get("val")
    if not (isinstance(a, torch.Tensor) and tuple(a.shape) == shape):
        return False
    if order[node] < order[linear]:
        return True
    if depth <= 0 or node.op != "call_function":
        return False
    if node.target in _ADDS:
        return any(_earlier_term(t, shape, linear, order, depth - 1) for t in node.args[:2])
    if node.target in _SAME_LAYOUT:
        return _earlier_term(node.args[0], shape, linear, order, depth - 1)
    if node.target in _SCALINGS and _is_scale(node.args[1]):
        return _earlier_term(node.args[0], shape, linear, order, depth - 1)
    if node.target in (aten.mul.Tensor, aten.mul.Scalar) and _is_scale(node.args[0]):
        return _earlier_term(node.args[1], shape, linear, order, depth - 1)
    return False


def _is_scale(x, limit: int = 16) -> bool:
    """A number, or a value of parameters, buffers and constants only (a learned per-feature
    scale: Doge's `post_attention_residual * residual + attention`; Ergo's residual gate, a
    function of its weight), within `limit` ops."""
    if isinstance(x, (int, float)):
        return True
    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        spec = meta.get(n, meta.INPUT)
        if n.op == "get_attr" or (spec is not None and spec.kind != "user"):
            continue
        if n.op != "call_function" or len(seen) > limit:
            return False
        stack.extend(n.all_input_nodes)
    return True


_ELEMENTWISE = {aten.gelu.default, aten.relu.default, aten.tanh.default, aten.silu.default, aten.sigmoid.default,
                aten.erf.default, aten.add.Tensor, aten.add.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                aten.div.Scalar, aten.pow.Tensor_Scalar, aten.layer_norm.default, aten.rms_norm.default,
                aten.native_layer_norm.default, operator.getitem}


def _live(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes the graph's outputs and its in-place writes depend on: what the compiler
    keeps when it drops dead values (localize.drop_dead_values: fx's dead-code elimination
    keeps impure ops), so a layer outside it is not in any rank's graph."""
    live, stack = set(), [n for n in gm.graph.nodes if n.op == "output" or n.is_impure()]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


_NORMS = {aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default}


def _feeds_head(layer: _Found, heads: set[fx.Node], hops: int = 24) -> bool:
    """Is the linear the LM head's transform: its output reaches the input of a column-split
    linear that reaches the loss (`heads`) through a norm, and elementwise ops and activations,
    whose other operands are parameters, buffers or constants -- no residual, nothing else
    joins?"""
    reached, frontier = {layer.node: False}, [layer.node]        # node -> a norm on the way
    while frontier and hops:
        hops -= 1
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in heads and user.args[0] is node:
                    if reached[node]:
                        return True
                    continue
                if user.op != "call_function" or user.target not in (_ELEMENTWISE | _SHAPE_OPS) or user in reached:
                    continue
                others = [a for a in user.all_input_nodes if a not in reached]
                if all(a.op == "get_attr" or (meta.get(a, meta.INPUT) is not None
                                              and meta.get(a, meta.INPUT).kind != "user") for a in others):
                    reached[user] = user.target in _NORMS or any(reached.get(a, False) for a in user.all_input_nodes)
                    nxt.append(user)
        frontier = nxt
    return False


def _reaches_loss(layer: _Found) -> bool:
    """Does the output reach cross_entropy through token-wise ops (logit scaling, softcapping),
    or through a stack of several heads' logits on a new leading dim (MusicGen's one head per
    audio codebook, each codebook's slice to its own cross_entropy)?"""
    return _logits_reach_loss(layer.node, stacked=True)


def _logits_reach_loss(node: fx.Node, stacked: bool) -> bool:
    for u, via in _tokenwise_users(node, also=() if stacked else (aten.select.int,)):
        if u.target == aten.cross_entropy_loss.default and u.args[0] is via:
            return True
        if stacked and u.target == aten.stack.default and _stacks_before_last(u) and \
                _logits_reach_loss(u, stacked=False):    # a head's logits picked back by select
            return True
    return False


def _stacks_before_last(stack: fx.Node) -> bool:
    """A stack whose new dim is not the last: each input's last (vocabulary) dim stays last."""
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    rank = len(stack.args[0][0].meta["val"].shape) + 1 if "val" in stack.args[0][0].meta else None
    return rank is not None and dim % rank != rank - 1


def _is_router(layer: _Found, hops: int = 6) -> bool:
    """Does the output pick experts: reach a topk within a few ops (softmax/sigmoid, casts) --
    or, for a linear of fewer outputs than inputs (never an LM head), an argmax whose index is
    read (PhiMoE's sparsemixer picks each expert by max(dim).indices, masking the first)?"""
    frontier, seen = [layer.node], set()
    narrow = 1 < layer.out_features < layer.in_features
    for _ in range(hops):
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                if user.target == aten.topk.default or (narrow and _picks_index(user)):
                    return True
                nxt.append(user)
        frontier = nxt
    return False


def _picks_index(node: fx.Node) -> bool:
    """An argmax, or a max over a dim whose indices are read."""
    if node.target == aten.argmax.default:
        return True
    return node.target == aten.max.dim and any(u.target is operator.getitem and u.args[1] == 1 and u.users
                                               for u in node.users)


def _norm_gates(layers: Mapping[str, _Found]) -> set[fx.Node]:
    """The linears of gate MLPs on a value: fc1 -> activation -> fc2 whose sigmoid (through
    casts) multiplies fc1's own input (AXK2's gated RMSNorm, y * sigmoid(mlp(y)))."""
    linears = {l.node for l in layers.values() if l.kind == "linear" and l.layout == "out_in"}

    def strip(n, ops):
        while isinstance(n, fx.Node) and n.op == "call_function" and n.target in ops:
            n = n.args[0]
        return n

    out = set()
    for fc2 in linears:
        fc1 = strip(fc2.args[0], _SAME_LAYOUT | _GATE_ACTIVATIONS)
        if fc1 not in linears or fc1 is fc2:
            continue
        y = strip(fc1.args[0], _SAME_LAYOUT)
        frontier = [fc2]
        for _ in range(4):
            nxt = []
            for node in frontier:
                for user in node.users:
                    if user.op != "call_function":
                        continue
                    if user.target in _SAME_LAYOUT or (user.target == aten.sigmoid.default and node is not user):
                        nxt.append(user)
                    elif user.target == aten.mul.Tensor and any(
                            a is not node and strip(a, _SAME_LAYOUT) is y for a in user.args[:2]) and \
                            any(n.target == aten.sigmoid.default for n in frontier if n.op == "call_function"):
                        out.update((fc1, fc2))
            frontier = nxt
    return out


_GATE_ACTIVATIONS = {aten.sigmoid.default, aten.silu.default, aten.tanh.default, aten.gelu.default, aten.relu.default}


def _users_through(start: fx.Node, through, hops: int = 4):
    """(value, user) for the call users of `start` and of what it reaches through ops in
    `through`, up to `hops` steps, breadth first."""
    frontier = [start]
    for _ in range(hops):
        nxt = []
        for node in frontier:
            for user in node.users:
                if user.op != "call_function":
                    continue
                yield node, user
                if user.target in through:
                    nxt.append(user)
        frontier = nxt


def _gates_row_output(layer: _Found, rows: set[fx.Node], hops: int = 4) -> bool:
    """Does the linear's output, through an activation and casts, multiply a row-parallel
    linear's output (through shape ops) of its own width: a gate on the all-reduced sum?"""
    for node, user in _users_through(layer.node, _SAME_LAYOUT | _GATE_ACTIVATIONS, hops):
        if user.target == aten.mul.Tensor:
            other = user.args[1] if user.args[0] is node else user.args[0]
            while isinstance(other, fx.Node) and other.op == "call_function" and other.target in _SHAPE_OPS:
                other = other.args[0]
            if other in rows and other.meta["val"].shape[-1] == layer.out_features:
                return True
    return False


def _is_scalar_gate(layer: _Found, hops: int = 4) -> bool:
    """A linear of one output feature (nothing to split) whose sigmoid, through casts and
    shape ops, multiplies another value: a gate, whole on every rank as Megatron's is."""
    if layer.out_features != 1:
        return False
    for _, user in _users_through(layer.node, _SHAPE_OPS, hops):
        if user.target == aten.sigmoid.default:
            return any(u.op == "call_function" and u.target == aten.mul.Tensor
                       for u, _ in _through_shape_ops(user))
    return False


def router_weights(gm: fx.GraphModule) -> set[str]:
    """The parameters whose product picks experts (reaches a topk within a few ops), whatever
    casts stand between the parameter and its matmul: routers, whole as in Megatron, also where
    the plan does not find them as linears (DeepSeek's gate runs F.linear on float32 copies)."""
    out = set()
    for node in gm.graph.nodes:
        name = _param_name(node)
        if name is None:
            continue
        reached, frontier = [node], [node]
        while frontier:                  # the parameter and every cast or copy of it
            frontier = [u for n in frontier for u in n.users if u.target in opsets.LOOK_THROUGH]
            reached += frontier
        for cast in reached:
            for user in cast.users:
                if user.op == "call_function" and user.target in _ROUTER_PRODUCTS and \
                        _is_router(_Found(user, "linear", "", name, None, "out_in", 0, 0)):
                    out.add(name)
    return out


def unused_weights(gm: fx.GraphModule) -> set[str]:
    """The parameters the traced forward never reads (an encoder-decoder's cross-attention
    without encoder states, a multimodal wrapper's vision tower without images): nothing
    computes with them, so no rule has anything to split."""
    return {name for node in gm.graph.nodes if (name := _param_name(node)) is not None and not node.users}


_ROUTER_PRODUCTS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default, aten.t.default,
                    aten.permute.default}


def _feeds_row(layer: _Found, rows: set[fx.Node], linears: set[fx.Node], order, limit: int = 400) -> bool:
    """Does the output flow into a rowwise linear's input before crossing a residual add or
    another linear?"""
    frontier, seen = [layer.node], {layer.node}
    while frontier and limit:
        limit -= 1
        cur = frontier.pop()
        for user in cur.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user in rows:
                return True
            if user in linears:
                continue
            if user.target in _ADDS and _is_residual(user, cur, layer.node, order) and not _on_heads(user, layer):
                continue  # a residual: the layer's region ends here
            frontier.append(user)
    return False


def _on_heads(add: fx.Node, layer: _Found) -> bool:
    """Is `add` on attention's scores, not the hidden state: more dims than the linear's output
    (its features viewed as heads, (B, heads, S, S)), for a linear of one weight (an expert's
    output has fewer dims than the hidden state it joins). CPM-Ant adds a position bias of the
    scores' own shape, computed before its projections: no residual."""
    val, out = add.meta.get("val"), layer.node.meta.get("val")
    return (not layer.layout.startswith("e_") and isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)
            and val.dim() > out.dim())


def _sliced_blocks(layer: _Found) -> Interleave | None:
    """The blocks a fused output is cut into by slicing its features ([q|k|v] of unequal sizes
    under grouped-query attention, Phi-3's qkv_proj: qkv[..., :q], qkv[..., q:q+k], ...): their
    proportions (a count when equal), or None unless slices cut it into >= 2 whole blocks."""
    feat, cuts = layer.out_features, []
    frontier, seen = [layer.node], set()
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in _SAME_LAYOUT:
                frontier.append(user)
            elif user.target == aten.slice.Tensor:
                nd = cur.meta["val"].dim()
                dim = user.args[1] if len(user.args) > 1 else 0
                start = user.args[2] if len(user.args) > 2 else 0
                end = user.args[3] if len(user.args) > 3 else feat
                step = user.args[4] if len(user.args) > 4 else 1
                if dim not in (-1, nd - 1) or step != 1 or not isinstance(start, int) or not isinstance(end, int):
                    return None
                cuts.append((start or 0, min(end, feat)))
    cuts = sorted(set(cuts))
    if len(cuts) < 2 or cuts[0][0] != 0 or cuts[-1][1] != feat or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
        return None
    return normalize(tuple(e - s for s, e in cuts))


def _first_views(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """The views of `node` (through copies and casts), as (view, its input): a fused output
    viewed as (..., 3, heads, d) and then unbound or indexed, which _through_shape_ops looks
    through."""
    out, frontier = [], [node]
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user.op != "call_function":
                continue
            if user.target in _SAME_LAYOUT:
                frontier.append(user)
            elif user.target in opsets.RESHAPES:
                out.append((user, cur))
    return out


def _unbound_blocks(view: fx.Node, feat: int, tp: int = 1) -> Interleave | None:
    """A fused output viewed (..., k, heads, d) -- the trailing sizes multiply to the feature
    dim -- and then unbound, selected or split along the first of them (qkv viewed as
    (B, S, 3, heads, d) and unbound on the 3): its k blocks. None if no such cut follows the
    view (a cut after the heads, Falcon's (B, S, heads, 3, d), leaves whole heads contiguous)."""
    out = view.meta["val"].shape
    dims, prod = [], 1
    for j in range(len(out) - 1, -1, -1):
        if prod == feat or isinstance(out[j], torch.SymInt):   # never int() a symbolic size
            break
        prod *= int(out[j])
        dims.insert(0, j)
    if prod != feat or len(dims) < 2:
        return None
    for user in view.users:
        if user.op != "call_function" or user.target not in (aten.unbind.int, aten.select.int, aten.split.Tensor,
                                                              aten.chunk.default, aten.split_with_sizes.default):
            continue
        at = 1 if user.target in (aten.unbind.int, aten.select.int) else 2
        d = user.args[at] if len(user.args) > at else 0
        d = d + len(out) if d < 0 else d
        if d != dims[0]:
            continue
        if user.target == aten.chunk.default:
            return int(user.args[1])
        if user.target == aten.split.Tensor and isinstance(user.args[1], int) and int(out[d]) % user.args[1] == 0:
            return int(out[d]) // user.args[1]
        if user.target == aten.split_with_sizes.default:
            sizes = list(user.args[1])
            # equal parts are k blocks; unequal ones whose heads each divide over tp (Ergo's 4
            # query, 2 key and 2 value heads: (B, S, 8, d).split([4, 2, 2], -2)) are blocks in
            # those proportions; others (Falcon-7B's 8 query heads, one key, one value) are no
            # blocks of whole heads
            if len(sizes) > 1 and len(set(sizes)) == 1:
                return len(sizes)
            if len(sizes) > 1 and all(isinstance(x, int) and x > 0 and x % tp == 0 for x in sizes) and tp > 1:
                return normalize(tuple(sizes))
            return None
        if user.target in (aten.unbind.int, aten.select.int):
            return int(out[d])
    return None


def _model_parallel_blocks(view: fx.Node, feat: int) -> int | None:
    """m where `view` holds a fused output as (..., m, feat/m) -- m blocks, each cut into its
    parts along the last dim (CodeGen's qkv in model-parallel-blocked order: mp_num blocks of
    [q | v | k] for their own heads): a contiguous split over tp then gives each rank whole
    blocks, its heads' q, k and v, with no gather."""
    val = view.meta.get("val")
    if val is None or val.dim() < 2 or isinstance(val.shape[-1], torch.SymInt) or isinstance(val.shape[-2], torch.SymInt):
        return None
    m, per = int(val.shape[-2]), int(val.shape[-1])
    return m if m > 1 and m * per == feat else None


#: ops between a fused projection and the split of its parts that the split into per-part
#: linears replays on each part (passes/tp.py split_fused_parts): none changes the
#: last dim
_PART_CHAIN = {aten.unsqueeze.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
               aten.to.dtype, aten._to_copy.default}


def fused_split(linear: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """The ops from a linear to the split_with_sizes that cuts its output's last dim into its
    parts (GPTBigCode's `c_attn(x).unsqueeze(1).split((h, d, d), dim=3)`), and that split;
    None unless the chain is one user each of _PART_CHAIN ops."""
    chain, cur = [], linear
    while len(cur.users) == 1:
        (user,) = cur.users
        if user.op != "call_function":
            return None
        if user.target in _PART_CHAIN:
            chain.append(user)
            cur = user
            continue
        if user.target == aten.split_with_sizes.default:
            nd = cur.meta["val"].dim()
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            return (chain, user) if dim in (-1, nd - 1) else None
        return None
    return None


def whole_parts(linear: fx.Node, out_features: int, k: Interleave, tp: int) -> tuple[int, ...]:
    """The parts of a fused projection too few heads to split over tp -- GPTBigCode's one key
    and one value head under multi-query attention beside its query heads --, which every rank
    keeps whole while the others split (Megatron cannot split this layer). The head size is the
    last dim the first part is viewed with ((..., heads, d)); a part whose heads do not divide
    over tp is whole. Only for a linear whose parts are cut by one split_with_sizes, which
    split_fused_parts turns into one linear per part."""
    if tp == 1 or isinstance(k, int) or linear.target != aten.linear.default:
        return ()
    found = fused_split(linear)
    if found is None:
        return ()
    _, split = found
    first = [u for u in split.users if u.target is operator.getitem and u.args[1] == 0]
    head = None
    for view, _ in (_first_views(first[0]) if first else []):
        out = view.meta["val"].shape
        if len(out) >= 2 and not isinstance(out[-1], torch.SymInt) and int(out[-1]) > 1:
            head = int(out[-1])
            break
    if head is None:
        return ()
    sizes = block_sizes(out_features, k)
    whole = tuple(i for i, s in enumerate(sizes) if s % head or (s // head) % tp)
    return whole if len(whole) < len(sizes) else ()


def _interleave(layer: _Found, tp: int) -> Interleave:
    """k for a fused projection split later into k equal parts (or viewed as (k, heads, d)), or
    the proportions of unequal parts cut from it by slicing or split_with_sizes."""
    if layer.layout == "left":
        return 1          # weight @ x: its features on dim -2, not cut into fused parts
    feat = layer.out_features
    sliced = _sliced_blocks(layer)
    if sliced is not None:
        return sliced
    for view, _ in _first_views(layer.node):
        k = _unbound_blocks(view, feat, tp)
        if k is not None:
            return k
    joined = _rows_joined(layer.node)
    for user, via, last in [*((u, v, None) for u, v in _through_shape_ops(joined)), *_channels_first(layer)]:
        if user.op != "call_function":
            continue
        val = via.meta.get("val")
        if val is None:
            continue
        last = val.dim() - 1 if last is None else last     # (a negative dim counts from the end: -2 of channels first)
        whole = not isinstance(val.shape[last], torch.SymInt) and int(val.shape[last]) == feat   # the features, not a head's
        if user.target in (aten.split.Tensor, aten.chunk.default, aten.split_with_sizes.default):
            dim = user.args[2] if len(user.args) > 2 else 0
            blocks = _model_parallel_blocks(via, feat)
            if dim % val.dim() == last and blocks is not None and blocks % tp == 0:
                return 1
        if user.target == aten.split.Tensor:
            size, dim = user.args[1], (user.args[2] if len(user.args) > 2 else 0)
            if dim % val.dim() == last and whole and isinstance(size, int) and feat % size == 0:
                return feat // size
        if user.target in (aten.chunk.default, aten.tensor_split.sections):
            chunks, dim = user.args[1], (user.args[2] if len(user.args) > 2 else 0)
            if dim % val.dim() == last and whole and isinstance(chunks, int) and feat % chunks == 0:
                return chunks
        if user.target == aten.split_with_sizes.default:
            sizes, dim = user.args[1], (user.args[2] if len(user.args) > 2 else 0)
            if dim % val.dim() == last and all(isinstance(x, int) and x > 0 for x in sizes) and sum(sizes) == feat:
                return normalize(tuple(x for i, size in enumerate(sizes) for x in _cut_again(user, i, size, last)))
    return 1


#: ops that act on each channel alone (activations, casts, copies), which keep the features apart
_CHANNELWISE = _SAME_LAYOUT | {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default,
                               aten.tanh.default, aten.softplus.default, aten.elu.default}
_CONVS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default}


# ops a fused part passes on its way to a second cut with its channels kept in place (Mamba-2's
# xBC: transposed, cast, the depthwise conv, sliced to the sequence, silu, transposed back)
_CHANNELS_KEPT = _CHANNELWISE | {aten.slice.Tensor}


def _cut_again(split: fx.Node, i: int, size: int, dim: int, limit: int = 32) -> list[int]:
    """The sizes part i of a fused output is cut into again after ops that keep its channels
    in place (Mamba-2's in_proj -> [z | xBC | dt], then conv(xBC) -> [x | B | C]): Megatron
    lays the projection out by those finer parts, so each rank's slice of every one. [size]
    when there is no second cut."""
    start = next((u for u in split.users if u.target is operator.getitem and u.args[1] == i), None)
    stack, seen = ([(start, dim)] if start is not None else []), set()
    while stack and limit:
        cur, dim = stack.pop()
        limit -= 1
        nd = cur.meta["val"].dim() if isinstance(cur.meta.get("val"), torch.Tensor) else 0
        for user in cur.users:
            if user.op != "call_function" or user in seen or not nd:
                continue
            seen.add(user)
            t, a = user.target, user.args
            if t == aten.split_with_sizes.default and (a[2] if len(a) > 2 else 0) % nd == dim \
                    and all(isinstance(x, int) and x > 0 for x in a[1]) and sum(a[1]) == size:
                return list(a[1])
            if t == aten.transpose.int and dim in (a[1] % nd, a[2] % nd):
                stack.append((user, a[2] % nd if dim == a[1] % nd else a[1] % nd))
            elif t in _CHANNELS_KEPT and not (t == aten.slice.Tensor and (a[1] if len(a) > 1 else 0) % nd == dim):
                stack.append((user, dim))
            elif t in _CONVS and a[0] is cur and dim == 1 and _depthwise(user):
                stack.append((user, dim))
    return [size]


def _channels_first(layer: _Found, limit: int = 16) -> list[tuple[fx.Node, fx.Node, int]]:
    """(user, via, the features' dim) where a linear's output is transposed to channels first
    before it is cut (Mamba's in_proj(x).transpose(1, 2).chunk(2, dim=1)), also after ops that
    keep each channel to itself -- a depthwise convolution, an activation, a slice of the
    sequence, a transpose back (Qwen3.5's in_proj_qkv(x).transpose(1, 2), its causal conv and
    silu, transposed back and split into q, k, v)."""
    out, frontier, seen = [], [], set()
    for t in layer.node.users:
        if t.op == "call_function" and t.target == aten.transpose.int:
            nd = t.meta["val"].dim()
            d0, d1 = t.args[1] % nd, t.args[2] % nd
            if nd - 1 in (d0, d1):
                frontier.append((t, d0 if d1 == nd - 1 else d1))
    while frontier and limit:
        limit -= 1
        cur, dim = frontier.pop()
        for u in cur.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            val = u.meta.get("val")
            nd = val.dim() if isinstance(val, torch.Tensor) else 0
            if u.target in _CHANNELWISE and u.args[0] is cur:
                frontier.append((u, dim))
            elif u.target == aten.transpose.int and nd:
                d0, d1 = u.args[1] % nd, u.args[2] % nd
                frontier.append((u, d1 if dim == d0 else d0 if dim == d1 else dim))
            elif u.target == aten.slice.Tensor and nd and (u.args[1] if len(u.args) > 1 else 0) % nd != dim:
                frontier.append((u, dim))
            elif u.target in _CONVS and u.args[0] is cur and dim == 1 and _depthwise(u):
                frontier.append((u, dim))
            else:
                out.append((u, cur, dim))
    return out


def _depthwise(conv: fx.Node) -> bool:
    """A convolution of groups = input channels = output channels: each channel on its own."""
    a = conv.args
    at = 8 if conv.target == aten.convolution.default else 6
    groups = a[at] if len(a) > at else conv.kwargs.get("groups", 1)
    x, w = a[0].meta["val"], a[1].meta["val"]
    ch = x.shape[1]
    return (isinstance(groups, int) and not isinstance(ch, torch.SymInt) and int(ch) == groups
            and int(w.shape[0]) == groups)


# ----------------------------------------------------------------------------- planning
def auto_plan(gm: fx.GraphModule, tp: int) -> dict[str, Style]:
    """Megatron's pattern found on the graph: {module path: style}."""
    layers = find_layers(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = {l.node for l in layers.values() if l.kind == "linear"}
    styles: dict[str, Style] = {}
    rows = set()
    gates = _norm_gates(layers)
    for path, l in layers.items():
        if l.node in gates:
            continue        # a norm's gate MLP: whole, as its norm
        if l.kind == "linear" and _reaches_residual(l, order):
            styles[path] = Rowwise()
            rows.add(l.node)
    for path, l in layers.items():
        if path in styles or l.node in gates:
            continue
        if l.kind == "linear" and _is_router(l):
            continue        # its scores pick experts on every rank: whole, as in Megatron
        if l.kind == "linear" and meta.get(l.node, meta.NO_GRAD):
            continue        # under torch.no_grad (a sparse-attention indexer): whole
        if l.kind == "linear" and (_reaches_loss(l) or _feeds_row(l, rows, linears, order)):
            styles[path] = Colwise()
        elif l.kind == "embedding" and _looks_up_user_ids(l):
            styles[path] = VocabParallel()
    cols = {l.node: p for p, l in layers.items() if isinstance(styles.get(p), Colwise)}
    for path, l in sorted(layers.items(), key=lambda item: order[item[1].node]):
        if l.node in cols and _takes_split_input(l, cols, linears):
            styles[path] = Rowwise()       # its input comes split: Megatron's row-parallel, a partial sum
            del cols[l.node]
    return styles


def _takes_split_input(layer: _Found, cols: dict, linears: set[fx.Node], limit: int = 64) -> bool:
    """Does the linear's input come from a column-split linear of the same module through ops
    that keep its features apart (Mamba's x_proj, fed by in_proj through the channel-wise
    conv): then it is the row-parallel one, its input already split, its output a partial sum."""
    parent = layer.path.rpartition(".")[0]
    if not parent:
        return False
    stack, seen = [layer.node.args[0]], set()
    while stack and limit:
        n = stack.pop()
        limit -= 1
        if not isinstance(n, fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n in cols:
            return cols[n].rpartition(".")[0] == parent
        if n in linears or not (meta.get(n, meta.MODULE) or "").startswith(parent):
            continue                 # another layer, or outside the module: not this module's input
        stack.extend(n.all_input_nodes)
    return False


# ops that replace some token ids by a constant id (a multimodal wrapper's image tokens by the
# pad id before the text embedding: Gemma 4's where(mask, 0, ids)): the operand that carries the ids
_IDS_KEPT = {aten.where.ScalarSelf: 2, aten.where.ScalarOther: 1, aten.masked_fill.Scalar: 0}


def _looks_up_user_ids(layer: _Found) -> bool:
    return _user_ids(layer.node) is not None


def _user_ids(embedding: fx.Node) -> fx.Node | None:
    """The user's input an embedding looks up (its token ids); None when it reads other
    indices (positions)."""
    return _ids_input(embedding.args[1], 8)


def _ids_input(ids, hops: int) -> fx.Node | None:
    """The user's input `ids` are, through shape ops, casts, a replacement of some ids
    (_IDS_KEPT), or a concatenation with other ids (CPM-Ant's prompt ids put before the text's:
    the table holds both, split by rows as one vocabulary); else None."""
    while isinstance(ids, fx.Node) and hops > 0:
        spec = meta.get(ids, meta.INPUT)
        if spec is not None:
            return ids if spec.kind == "user" else None
        if ids.op == "call_function" and ids.target == aten.cat.default:
            return next((found for part in ids.args[0] if (found := _ids_input(part, hops - 1)) is not None), None)
        if ids.op != "call_function" or ids.target not in _SHAPE_OPS | _IDS_KEPT.keys():
            return None
        ids, hops = ids.args[_IDS_KEPT.get(ids.target, 0)], hops - 1
    return None


# what a position table passes through on its way to the token embeddings: reshapes, broadcasts,
# copies and casts, slices, cats (an axial table's parts side by side: Reformer) and reads at
# positions (Whisper's weight[positions])
_TABLE_OPS = _SHAPE_OPS | opsets.VIEWS | opsets.SLICES | {aten.cat.default}
_TABLE_READS = {aten.index.Tensor, aten.index_select.default}
# what may stand between a token embedding's lookup and the add of the positions: shape ops,
# dropout, scaling by a constant (Whisper's embed_scale: _SCALINGS), an earlier add of other positions


def position_tables(gm: fx.GraphModule) -> set[str]:
    """The parameters read by position and added to the token embeddings, multiplied by nothing:
    every use reaches, through reshapes, broadcasts, slices, cats and reads at indices that are
    not the user's token ids, an add whose other operand is a token embedding's lookup (the
    residual stream's start). Learned absolute positions written without an embedding op
    (Whisper's sliced table, Reformer's axial parts): whole on every rank, as Megatron's
    position embeddings (a plain replicated nn.Embedding beside the vocab-parallel one). A
    layer's weight is never one: a linear, matmul or product consumes it."""
    tokens = {n: ids for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.embedding.default
              and _param_name(n.args[0]) and (ids := _user_ids(n)) is not None}
    if not tokens:
        return set()
    token_ids = set(tokens.values())
    out = set()
    for node in gm.graph.nodes:
        name = _param_name(node)
        val = node.meta.get("val")
        if name is None or not isinstance(val, torch.Tensor) or sum(d > 1 for d in val.shape) < 2:
            continue
        if node.users and _added_to_tokens(node, set(tokens), token_ids):
            out.add(name)
    return out


def _added_to_tokens(table: fx.Node, tokens: set[fx.Node], token_ids: set[fx.Node], limit: int = 64) -> bool:
    """Does every use of `table` reach, through table ops only, an add to the token embeddings?"""
    frontier, seen, reached = [table], {table}, False
    while frontier:
        cur = frontier.pop()
        for user in cur.users:
            if user in seen or user.target == aten._assert_tensor_metadata.default:
                continue
            seen.add(user)
            limit -= 1
            if limit < 0 or user.op != "call_function":
                return False
            if user.target in _ADDS:
                other = user.args[1] if user.args[0] is cur else user.args[0]
                if not _from_tokens(other, tokens):
                    return False
                reached = True
            elif user.target in _TABLE_READS:
                index = user.args[1] if user.target == aten.index.Tensor else user.args[2]
                if user.args[0] is not cur or _reads(index, token_ids):
                    return False
                frontier.append(user)
            elif user.target in _TABLE_OPS or user.target is operator.getitem:
                frontier.append(user)
            else:
                return False            # multiplied, matmul'd, normed: a layer's weight, not positions
    return reached


def _from_tokens(node, tokens: set[fx.Node], depth: int = 8) -> bool:
    """Is `node` a token embedding's lookup, through shape ops, dropout, scaling by a
    constant, or a sum with such a term (positions added before)?"""
    if not isinstance(node, fx.Node) or depth < 0 or node.op != "call_function":
        return False
    if node in tokens:
        return True
    if node.target in _SHAPE_OPS:
        return _from_tokens(node.args[0], tokens, depth - 1)
    if node.target in _SCALINGS:
        scale = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else node.args[1]
        constant = not isinstance(scale, torch.Tensor) or scale.numel() == 1
        return constant and _from_tokens(node.args[0], tokens, depth - 1)
    if node.target in _ADDS:
        return any(_from_tokens(a, tokens, depth - 1) for a in node.args[:2])
    return False


def _reads(index, inputs: set[fx.Node], limit: int = 64) -> bool:
    """Do the values of `index` (a node or a list of them) depend on one of `inputs` (sizes
    read from them do not count)?"""
    stack = [i for i in (index if isinstance(index, (list, tuple)) else [index]) if isinstance(i, fx.Node)]
    seen = set()
    while stack and limit:
        limit -= 1
        n = stack.pop()
        if n in seen or not isinstance(n.meta.get("val"), torch.Tensor):
            continue                        # a size (SymInt) carries no values
        seen.add(n)
        if n in inputs:
            return True
        stack.extend(n.all_input_nodes)
    return bool(stack)                      # too far to tell: treated as read


def _parse_style(value, key: str) -> Style:
    if isinstance(value, (Colwise, Rowwise, VocabParallel, Replicated)):
        return value
    if isinstance(value, str) and value.lower() in _BY_NAME:
        return _BY_NAME[value.lower()]
    raise ParallelizeError(f"plan[{key!r}] = {value!r}: use 'colwise', 'rowwise', 'vocab', 'replicate' "
                           "or fxtron.passes.tp_plan.Colwise(gather_output=...)/Rowwise(input_is_parallel=...)")


def make_tp_plan(gm: fx.GraphModule, *, tp: int, user_plan: dict | None = None, mode: str = "override") -> TPPlan:
    """The split plan for tp ranks. `user_plan` maps module path patterns (fnmatch, e.g.
    "blocks.*.attn.qkv"; a module's path names every linear and embedding under it) to styles
    ('replicate' may also name parameters of no layer, kept whole on purpose); with mode "override" it refines the automatic plan, with
    "replace" it is the whole plan (everything it does not name is replicated)."""
    if mode not in ("override", "replace"):
        raise ParallelizeError(f"plan_mode must be 'override' or 'replace', not {mode!r}")
    layers = find_layers(gm)
    result = _Draft(tp=tp, layers=layers)
    styles = auto_plan(gm, tp) if (mode == "override" and tp > 1) else {}
    user_styles: dict[str, Style] = {}
    params = [n for n in (meta.param_name(node) for node in gm.graph.nodes) if n is not None]
    live = None
    for pattern, value in (user_plan or {}).items():
        style = _parse_style(value, pattern)
        hits = plan_matches(pattern, layers)
        kept = plan_matches(pattern, params)
        if not hits and isinstance(style, Replicated) and kept:   # parameters of no layer, whole on purpose
            result.kept.update(kept)
            continue
        if not hits:
            raise ParallelizeError(f"plan entry {pattern!r} matches no linear or embedding, nor a module holding "
                                   f"one; the model's are: {', '.join(p for p in layers)}")
        live = live if live is not None else _live(gm)
        dead = [p for p in hits if layers[p].node not in live]
        if len(dead) == len(hits) and not isinstance(style, Replicated):   # no rank's graph has it to split
            raise ParallelizeError(
                f"plan entry {pattern!r} names {', '.join(dead)}, which computes nothing that reaches the model's "
                f"outputs: fxtron drops it as dead code (its parameters take no gradient, as in the model) and has "
                f"nothing of it to split; remove the entry, or return what it computes")
        hits = [p for p in hits if p not in dead]
        for p in hits:
            styles[p] = user_styles[p] = style
    user_keys = set(user_styles)
    if tp == 1:
        styles = {}
    _replicate_auto_conflicts(styles, layers, user_keys, tp, result)
    setter: dict[str, str] = {}      # parameter -> the layer whose style placed it first
    for path, style in styles.items():
        l = layers[path]
        bad = _indivisible(l, style, tp, result, path)
        if bad:
            if path in user_keys:
                raise ParallelizeError(bad)
            result.notes.append(bad + " -> replicated")
            result.why[path] = bad
            continue
        placements = _param_placements(l, style, tp)
        result.styles[path] = style
        for name, pl in placements.items():
            prev = result.params.get(name)
            if prev is not None and prev != pl:
                other = setter[name]
                kinds = {layers[other].kind, l.kind}
                hint = ("a tied embedding and LM head: 'vocab' and 'colwise'" if kinds == {"embedding", "linear"}
                        else "pieces of one parameter used as different layers (weight[i] of an experts' matrix): "
                             "give them one style, or 'replicate' both")
                raise ParallelizeError(
                    f"parameter {name} is used by two layers that split it differently: {other} "
                    f"({styles.get(other)!r}: {prev}) and {path} ({style!r}: {pl}); fxtron splits a parameter one "
                    f"way: give both the same style in the plan ({hint})")
            result.params[name] = pl
            setter.setdefault(name, path)
    _resolve_tied(result, layers, user_keys)
    return result.freeze(user_styles, mode, gm)


def _replicate_auto_conflicts(styles: dict, layers: dict, user_keys: set, tp: int, result: "_Draft") -> None:
    """Layers the automatic plan split that share a parameter it would split two ways (pieces of
    one matrix used as a column- and a row-parallel layer: weight[0] as q, weight[1] as o) are
    replicated, with a note; where the user's plan chose one of the styles, the conflict is
    theirs to resolve (the error below names both layers)."""
    users: dict[str, dict[str, Placement]] = {}
    for path, style in styles.items():
        try:
            placements = _param_placements(layers[path], style, tp)
        except ParallelizeError:
            continue                     # (raised where the plan is applied)
        for name, pl in placements.items():
            users.setdefault(name, {})[path] = pl
    for name, by_path in users.items():
        if len(set(by_path.values())) < 2 or user_keys & set(by_path):
            continue
        why = (f"{name} is used by {', '.join(sorted(by_path))}, which the automatic plan would split "
               "differently")
        for path in by_path:
            styles.pop(path, None)
            result.why[path] = why
        result.notes.append(why + " -> replicated")


def _down_projections(draft: "_Draft", gm: fx.GraphModule) -> set[str]:
    """Unplanned linears whose output reaches a colwise linear of a layer (not the LM head)
    before any residual or other linear, and a rowwise linear never: a low-rank bottleneck in
    front of column-split projections (MLA), which Megatron keeps whole."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = {l.node for l in draft.layers.values() if l.kind == "linear"}
    cols = {draft.layers[p].node for p, s in draft.styles.items()
            if isinstance(s, Colwise) and not _reaches_loss(draft.layers[p])}
    rows = {draft.layers[p].node for p, s in draft.styles.items() if isinstance(s, Rowwise)}
    return {p for p, l in draft.layers.items()
            if l.kind == "linear" and p not in draft.styles and p not in draft.why
            and _feeds_row(l, cols, linears, order) and not _feeds_row(l, rows, linears, order)}


def plan_matches(pattern: str, names: Iterable[str]) -> list[str]:
    """The layers (or parameters) a plan key names: its path matches the pattern (fnmatch), or
    the pattern names a module holding it ("model.layers.0.self_attn" names its q/k/v/o
    projections)."""
    return [p for p in names if fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, pattern + ".*")]


def _param_placements(l: _Found, style: Style, tp: int) -> dict[str, Placement]:
    if isinstance(style, Replicated):
        return {}
    if isinstance(style, VocabParallel):
        if l.kind != "embedding":
            raise ParallelizeError(f"{l.path} is a linear; 'vocab' applies to embeddings")
        return {l.weight: Shard(0)}
    if l.kind == "embedding":
        if isinstance(style, Colwise):   # split the embedding dim
            return {l.weight: Shard(1)}
        raise ParallelizeError(f"{l.path} is an embedding: use 'vocab', 'colwise' or 'replicate'")
    k = 1
    out_dim, in_dim = WEIGHT_DIMS[l.layout]
    if isinstance(style, Colwise):
        k = _interleave(l, tp)
        whole = whole_parts(l.node, l.out_features, k, tp) if l.layout == "out_in" else ()
        out = {l.weight: Shard(out_dim, k, whole)}
        if l.bias:     # (experts, out) for the experts' bias
            out[l.bias] = Shard(1 if l.layout.startswith("e_") else 0, k, whole)
        return out
    out = {l.weight: Shard(in_dim)}
    if l.bias:
        out[l.bias] = REPLICATE
    return out


def _indivisible(l: _Found, style: Style, tp: int, result: _Draft, path: str) -> str | None:
    if isinstance(style, Replicated):
        return None
    if isinstance(style, Colwise) and l.kind == "linear":
        k = _interleave(l, tp)
        result.interleave[path] = k
        blocks = block_sizes(l.out_features, k)
        whole = whole_parts(l.node, l.out_features, k, tp) if l.layout == "out_in" else ()
        if any(b % tp for i, b in enumerate(blocks) if i not in whole):
            parts = "" if k == 1 else f" in {len(blocks)} fused parts of {', '.join(map(str, blocks))}"
            return (f"{path} ({l.weight}, {l.out_features} output features{parts}) cannot be split colwise over "
                    f"tp={tp}: " + (f"{l.out_features} is not divisible by {tp * k}; choose a tp that divides it"
                                    if isinstance(k, int) else
                                    f"not every part is divisible by {tp}; choose a tp that divides {math.gcd(*blocks)} "
                                    "(for attention: the number of kv heads)"))
    if isinstance(style, Rowwise) and l.in_features % tp:
        return (f"{path} ({l.weight}, {l.in_features} input features) cannot be split rowwise over tp={tp}; "
                "choose a tp that divides it")
    if isinstance(style, VocabParallel) and l.in_features % tp:
        return (f"{path} ({l.weight}, vocabulary {l.in_features}) cannot be split over tp={tp}: pad the "
                f"vocabulary to a multiple of {tp} (Megatron pads to a multiple of 128*tp)")
    return None


def _resolve_tied(result: _Draft, layers: dict[str, _Found], user_keys: set[str]) -> None:
    """A weight shared by two layers (tied embedding and LM head) must be split the same way in
    both; the automatic plan replicates both rather than fail."""
    uses: dict[str, list[str]] = {}
    for path, l in layers.items():
        uses.setdefault(l.weight, []).append(path)
    for weight, paths in uses.items():
        if len(paths) < 2 or weight not in result.params:
            continue
        planned = [p for p in paths if p in result.styles]
        if len(planned) == len(paths):
            continue
        missing = [p for p in paths if p not in result.styles]
        if any(p in user_keys for p in paths):
            raise ParallelizeError(f"{weight} is shared by {', '.join(paths)}; the plan splits it in "
                                   f"{', '.join(planned)} but not in {', '.join(missing)}: plan them together")
        for p in planned:
            del result.styles[p]
        for p in paths:
            result.why[p] = f"{weight} is shared by {', '.join(paths)}, which cannot all be split"
        for name in [layers[p].weight for p in paths] + [layers[p].bias for p in paths if layers[p].bias]:
            result.params.pop(name, None)
        result.notes.append(f"{weight} is shared by {', '.join(paths)} which cannot all be split -> replicated")
