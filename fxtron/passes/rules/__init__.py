"""Passes: sharding rules per op (how a placement on one mesh axis flows through it) and the
lowerings of ops that change on sharded inputs. Importing this package registers every rule;
`register_rule` adds one (see registry.py for what a rule is)."""
from fxtron.passes.rules import layers, order, pointwise, reductions, scans, views  # noqa: F401 - register the rules
from fxtron.passes.rules.pointwise import PARTIAL_THROUGH
from fxtron.passes.rules.registry import (CASTS, Ctx, is_tensor, lowerings_for, no_rule, reduced_dims, register_lowering,
                                          register_rule, rule_for, tensor_inputs)

__all__ = ["CASTS", "Ctx", "PARTIAL_THROUGH", "is_tensor", "lowerings_for", "no_rule", "reduced_dims", "register_lowering",
           "register_rule", "rule_for", "tensor_inputs"]
