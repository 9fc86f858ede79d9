"""Core, configuration fields: how a section of the typed configuration is declared and checks
itself -- `option` (a field's help, shorthand, flag, environment variable and bounds), the value
checks that name the field, the value and the choices (with the closest one: did-you-mean for a
misspelt value or key), `Section` (checked when made), the dtype names and the FXTRON_*
environment switches.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import field
from typing import Any, Literal, get_args, get_origin

from fxtron.errors import ParallelizeError

# ----------------------------------------------------------------------------- dtype names
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def torch_dtype(name: str | None):
    """The torch dtype of a configuration's dtype name ("bf16" -> torch.bfloat16); None stays None."""
    import torch
    return None if name is None else getattr(torch, _DTYPE_NAMES[name])


# ----------------------------------------------------------------------------- the environment
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An FXTRON_* switch: unset or empty gives `default`; 0/false/no/off is False, anything else True."""
    value = os.environ.get(name, "").strip().lower()
    return default if value == "" else value not in _FALSE


def env_str(name: str) -> str | None:
    """An FXTRON_* setting that names something (a directory); None when unset or empty."""
    return os.environ.get(name) or None


def option(default: Any = dataclasses.MISSING, *, help: str, shorthand: str | None = None, flag: str | None = None,
           env: str | None = None, cli: bool = True, minimum: float | None = None, positive: bool = False,
           factory: Any = dataclasses.MISSING) -> Any:
    """A field of a section: `help` for the flag and the docs; `shorthand` the keyword of
    parallelize and (with dashes) the flag, default the field's own name; `env` the variable that
    sets the default; `cli=False` for a field only Python or TOML can give (a plan);
    `minimum` / `positive` bound a number."""
    meta = dict(help=help, shorthand=shorthand, flag=flag, env=env, cli=cli, minimum=minimum, positive=positive)
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------- checking one value
def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


def _closest(value: Any, candidates) -> str:
    same = [c for c in candidates if str(c) == str(value)]
    if same:            # zero="1" (a TOML string): the choice is 1, written without quotes
        return f" (give {same[0]!r}, without quotes)"
    near = difflib.get_close_matches(str(value), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _where(section: str, f: dataclasses.Field) -> str:
    flag = _flag(f) if f.metadata.get("cli", True) else None
    return f"{section}.{f.name} in the configuration" + (f", {flag} on the command line" if flag else "")


def _shorthand(f: dataclasses.Field) -> str:
    return f.metadata.get("shorthand") or f.name


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + _shorthand(f).replace("_", "-")


def _optional(tp) -> tuple[Any, bool]:
    """(the type inside Optional, whether None is allowed)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _check_value(section: str, f: dataclasses.Field, tp, value: Any) -> Any:
    """`value` made canonical for field `f` of type `tp`, or a ParallelizeError naming the field,
    the value and what it takes."""
    inner, nullable = _optional(tp)
    name = _shorthand(f)

    def bad(what: str, hint: str = "") -> ParallelizeError:
        return ParallelizeError(f"{name} must be {what}{' or None' if nullable else ''}, not {value!r}{hint} "
                                f"({_where(section, f)})")

    if value is None:
        if nullable:
            return None
        raise bad(_describe(inner))
    if get_origin(inner) is Literal and set(get_args(inner)) == set(_DTYPE_NAMES):
        value = _dtype_name(value)
    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if isinstance(value, bool) or value not in choices:
            raise bad(f"one of {_choices(choices)}", _closest(value, choices))
        return value
    if inner is bool:
        if not isinstance(value, bool):
            raise bad("True or False")
        return value
    if inner is int or inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (inner is int and not isinstance(value, int)):
            raise bad(_describe(inner, f))
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(_describe(inner, f))
        lo, positive = f.metadata.get("minimum"), f.metadata.get("positive")
        if (lo is not None and value < lo) or (positive and not value > 0):
            raise bad(_describe(inner, f))
        return float(value) if inner is float else value
    if inner is str:
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if get_origin(inner) is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return tuple(value)
    if get_origin(inner) is dict or inner is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad("a dict keyed by strings")
        return dict(value)
    return value


def _dtype_name(value: Any) -> Any:
    """A torch dtype or one of its names as the configuration's name ("bf16"); anything else as is."""
    try:
        import torch
        if isinstance(value, torch.dtype):
            return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(value, str(value))
    except ImportError:       # pragma: no cover
        pass
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value, value)
    return value


def _describe(tp, f: dataclasses.Field | None = None) -> str:
    if tp is int or tp is float:
        kind = "an int" if tp is int else "a number"
        if f is not None and f.metadata.get("positive"):
            return f"a positive {'int' if tp is int else 'number'}"
        if f is not None and f.metadata.get("minimum") is not None:
            return f"{kind} of at least {f.metadata['minimum']}"
        return kind
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


# ----------------------------------------------------------------------------- a section
class Section:
    """A frozen dataclass whose fields check themselves when it is made (`__post_init__`), then
    `_rules()` checks the fields together, and `check(mesh)` what needs the mesh."""

    _name = "section"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check_value(self._name, f, hints[f.name], getattr(self, f.name)))
        self._rules()

    def _rules(self) -> None:
        pass

    def check(self, mesh) -> None:
        pass
