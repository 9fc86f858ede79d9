"""Compiler: the node.meta contract — every key fxtron writes, its type, meaning and writer.

torch's own keys are reused, never redefined: `val` (a FakeTensor or SymInt from export),
`nn_module_stack` (module path -> (qualified name, class)), `stack_trace`. fxtron's keys all
start with "fxtron_" and hold the frozen values below. `get`/`set` check the key is known and
the value has its type, so a typo or a wrong value fails where it is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx


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
PLACEMENT = _key("fxtron_placement", object,
                 "the value's placement on the tp axis (passes.placement.Placement)", "passes.propagate")
EXPECTS = _key("fxtron_expects", tuple,
               "placement each tensor input must have (None: as it comes), in flattened-args order",
               "passes.propagate")
REDISTRIBUTE_OUT = _key("fxtron_redistribute_out", object,
                        "placement every consumer sees (a colwise linear with gather_output)",
                        "passes.propagate")
LOCAL_SHAPE = _key("fxtron_local_shape", tuple,
                   "this rank's shape, sympy expressions in the batch and sequence symbols",
                   "passes.propagate / compiler.annotate")
KERNEL = _key("fxtron_kernel", str, "the GEMM kernel codegen chose for a linear", "codegen")
GRAD_REDUCE = _key("fxtron_grad_reduce", str,
                    "on a parameter placeholder: its gradient is partial on each rank of this mesh axis "
                    "(a replicated norm weight used on sequence shards) and is summed there once per step, "
                    "in finalize_grads, as Megatron all-reduces sequence-parallel norm weights",
                    "passes.collectives")
STAGE = _key("fxtron_stage", int, "pipeline stage that runs the node", "passes.pipeline")


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
