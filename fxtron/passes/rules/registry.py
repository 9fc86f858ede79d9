"""Passes: the registry of sharding rules -- for each op, how a placement on one mesh axis flows
through it -- and of lowerings, ops that become another op on sharded inputs (the vocab-parallel
embedding and cross entropy).

A rule is a function `rule(ctx) -> (output placement, expects)` (or None where it has no way
for these placements: the op then runs replicated, as an op without a rule does): `ctx.node` is the FX node,
`ctx.inputs` its tensor inputs in flattened-args order and `ctx.p` their placements on the axis
being propagated (`ctx.axis`, of `ctx.size` ranks); it returns the node's placement on that axis
(a tuple of them for a multi-output op) and, per tensor input, the placement that input must
have (None: as it comes). `propagate` records both and `insert_redistributions` emits the
collectives where they differ. Rules never run tensors; shapes come from `node.meta["val"]`.
Rules are registered beside their definitions (passes/rules/*.py) and by users:

    from fxtron import REPLICATE, Shard, register_rule

    @register_rule(torch.ops.aten.cumsum.default)
    def cumsum(ctx):
        p, dim = ctx.p[0], ctx.node.args[1] % ctx.node.meta["val"].dim()
        if isinstance(p, Shard) and p.dim != dim:
            return p, [None]               # a scan along another dim: each shard on its own
        return REPLICATE, [REPLICATE]      # gather first
"""
from __future__ import annotations

from typing import Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxtron.core import meta, opsets
from fxtron.core.meta import TraceInfo
from fxtron.core.placement import Shard
from fxtron.errors import ParallelizeError

_aten = torch.ops.aten
Rule = Callable[["Ctx"], tuple]   # -> (out placement, expects: list[Placement | None])
Lowering = Callable[..., "fx.Node | None"]

#: ops that only copy or cast a value (its layout and meaning unchanged), which passes look through
CASTS = opsets.LOOK_THROUGH

_RULES: dict = {}
_LOWERINGS: dict = {}


def register_rule(*targets, replace: bool = False):
    """Register the decorated function as the sharding rule of each op in `targets`:
    OpOverloads such as torch.ops.aten.cumsum.default, or an op's qualified name
    ("transformers::grouped_mm_fallback", its default overload) for a library's custom op that
    may not be loaded yet. A target that already has a rule raises ValueError unless
    `replace=True`."""
    def deco(fn: Rule) -> Rule:
        for t in targets:
            if t in _RULES and not replace and _RULES[t] is not fn:
                raise ValueError(f"{t} already has a sharding rule ({_RULES[t].__qualname__}); "
                                 "pass replace=True to register_rule to replace it")
            _RULES[t] = fn
        return fn
    if not targets:
        raise TypeError("register_rule needs at least one op: register_rule(torch.ops.aten.cumsum.default)")
    return deco


def rule_for(target) -> Rule | None:
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        name = target.name()                          # "ns::op" for the default overload
        rule = _RULES.get(name if target._overloadname == "default" else f"{name}.{target._overloadname}")
    return rule


def register_lowering(*targets):
    """Register `fn(node, lower) -> fx.Node | None` to rewrite each op in `targets` when its
    inputs arrive sharded (see passes/redistribute.py `Lower`); None keeps the op as it is."""
    def deco(fn: Lowering) -> Lowering:
        for t in targets:
            _LOWERINGS.setdefault(t, []).append(fn)
        return fn
    return deco


def lowerings_for(target) -> list[Lowering]:
    return _LOWERINGS.get(target, [])


# ----------------------------------------------------------------------------- helpers
def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued fx.Node leaves of node.args/kwargs, in pytree order (the order of
    what a rule expects)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and is_tensor(a)]


def is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and bool(val)
                                             and all(isinstance(v, torch.Tensor) for v in val))


def shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def ndim(node: fx.Node) -> int:
    return node.meta["val"].dim()


def norm(dim: int, n: int) -> int:
    return dim + n if dim < 0 else dim


def expr(s) -> sympy.Expr:
    return sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def is_zero(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 0


def is_one(s) -> bool:
    return not isinstance(s, torch.SymInt) and int(s) == 1


def reduced_dims(node: fx.Node) -> list[int]:
    """The dims a reduction (sum, mean, amax, var, softmax, cumsum, norm, ...) reduces its first
    input over, non-negative: args[1] (args[2] for norm / linalg_vector_norm), every dim when
    absent or empty (and always for sum.default / mean.default)."""
    nd = node.args[0].meta["val"].dim()
    at = 2 if node.target in (_aten.norm.ScalarOpt_dim, _aten.linalg_vector_norm.default) else 1
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
    if dims is None or dims == [] or node.target in (_aten.sum.default, _aten.mean.default):
        return list(range(nd))
    return [norm(d, nd) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]


class Ctx:
    """What a rule may ask: the node, its tensor inputs and their placements `p` on the axis
    being propagated, the axis (`axis`) and its number of ranks (`size`), whether its shards
    are load-balanced chunks (`balanced`: cp), the axis's options (`options`) and whether a
    value takes a gradient (`carries_grad`)."""

    def __init__(self, node: fx.Node, placements: dict, *, axis: str, size: int, trace: TraceInfo,
                 partials_to_sequence: bool = False, balanced: bool = False, options=None, grad=None):
        self.node, self.axis, self.size = node, axis, size
        self.balanced, self.options = balanced, dict(options or {})
        self._grad = grad
        self._trace, self._partials_to_sequence = trace, partials_to_sequence
        self.inputs = tensor_inputs(node)
        self.p = [placements[a] for a in self.inputs]
        self._placements = placements

    def placement_of(self, node: fx.Node):
        """The placement on this axis of any node before this one (None if it has none)."""
        return self._placements.get(node)

    @property
    def placements(self) -> list:
        return self.p

    def seq_shard(self, node: fx.Node | None = None) -> Shard | None:
        """Where a partial sum feeding a token-wise op goes under sequence parallel: Shard on
        the sequence dim of `node` (default: this node); None without sequence parallel or
        when the value has no sequence dim."""
        if not self._partials_to_sequence:
            return None
        d = meta.seq_dim(node or self.node, self._trace)
        return None if d is None else Shard(d)

    def index(self, arg) -> int:
        return next(i for i, a in enumerate(self.inputs) if a is arg)

    def sym(self, s) -> sympy.Expr:
        """A dim of a `val` as a sympy expression in the batch and sequence symbols B and S."""
        return self._trace.expr(s) if self._trace is not None else expr(s)

    def carries_grad(self, node: fx.Node) -> bool:
        """Does a gradient flow back through `node` (meta.carries_grad)? False where unknown."""
        return self._grad is not None and node in self._grad

    def fail(self, why: str) -> ParallelizeError:
        return no_rule(self.node, self.p, why, axis=self.axis)


def no_rule(node: fx.Node, placements, why: str = "", *, axis: str = "tp") -> ParallelizeError:
    ins = tensor_inputs(node)
    desc = ", ".join(f"%{a.name} {tuple(str(expr(s)) for s in a.meta['val'].shape)} placed {axis}:{p}"
                     for a, p in zip(ins, placements) if isinstance(a.meta.get("val"), torch.Tensor))
    module = meta.get(node, meta.MODULE) or "(top level)"
    sources = split_sources(node, axis)
    keep = ("make the layers that split these inputs replicated (parallelize(..., plan={"
            + ", ".join(f"{s!r}: 'replicate'" for s in sources) + "})), or " if sources else "")
    return ParallelizeError(
        f"node %{node.name} ({node.target}) in module {module}: {why or 'no sharding rule for this op with these input placements'}. "
        f"Inputs: {desc}. Either {keep}register a sharding rule for "
        f"{node.target}: fxtron.register_rule({_qualified(node.target)})(rule), where rule(ctx) returns "
        "(output placement, per-input placements); see fxtron.passes.rules.registry.")


def split_sources(node: fx.Node, axis: str) -> list[str]:
    """The module paths owning the split parameters that `node`'s non-replicated inputs on
    `axis` come from (the layers a plan would have to replicate for the node to see whole
    values), nearest first."""
    out: list[str] = []
    stack = [a for a in reversed(tensor_inputs(node)) if _split(a, axis)]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if meta.is_param(n):
            owner = meta.param_name(n).rpartition(".")[0]
            if owner not in out:
                out.append(owner)
            continue
        # inputs n takes as they come (not those made whole before it: the embedding's partial
        # sum is all-reduced before the linear that follows it)
        wants = meta.expects(n, axis)
        ins = tensor_inputs(n)
        stack.extend(a for i, a in reversed(list(enumerate(ins)))
                     if _split(a, axis) and not (i < len(wants) and wants[i] is not None and wants[i].is_replicate()))
    return out


def _split(node: fx.Node, axis: str) -> bool:
    p = meta.placement(node, axis)
    return any(q is not None and not q.is_replicate() for q in (p if isinstance(p, tuple) else (p,)))


def _qualified(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


__all__ = ["Ctx", "Rule", "is_tensor", "lowerings_for", "no_rule", "register_lowering", "register_rule", "rule_for",
           "reduced_dims", "split_sources", "tensor_inputs"]
