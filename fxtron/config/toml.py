"""Core, configuration as TOML: a tree (`Config`, or a subclass such as the trainer's
TrainConfig, given as the argument) written as {section: {field: value}} and read back, an
unknown section or field named with the closest known one. `Config.to_toml` / `from_toml` call
these.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from fxtron.config.fields import _closest, _default, _optional
from fxtron.errors import ParallelizeError


def to_dict(cfg) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} with the values TOML can hold: a None whose default is not
    None is written "none"; other Nones are left out (the default)."""
    out: dict[str, dict[str, Any]] = {}
    for sf in dataclasses.fields(cfg):
        sec = getattr(cfg, sf.name)
        body: dict[str, Any] = {}
        for f in dataclasses.fields(sec):
            v = getattr(sec, f.name)
            if v is None:
                if _default(f) is not None:
                    body[f.name] = "none"
                continue
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, dict):
                odd = {k: x for k, x in v.items() if not isinstance(x, str)}
                if odd:
                    k = next(iter(odd))
                    raise ParallelizeError(f"{sf.name}.{f.name} holds {k!r}: {odd[k]!r}, which TOML cannot write; "
                                           f"give its style as a string ('colwise', 'rowwise', 'vocab', 'replicate')")
            body[f.name] = v
        out[sf.name] = body
    return out


def to_toml(cfg) -> str:
    """The tree as TOML text (`fxtron train --print-config`)."""
    import tomli_w
    return tomli_w.dumps(cfg.to_dict())


def from_dict(cls, data: dict[str, Any], *, base=None, source: str = "the configuration"):
    """The tree from {section: {field: value}} over `base` (default: the defaults): unknown
    sections and fields are ParallelizeErrors naming them and the closest known ones."""
    base = base if base is not None else cls()
    names = [f.name for f in dataclasses.fields(cls)]
    changes: dict[str, dict[str, Any]] = {}
    for section, body in data.items():
        if section not in names and not isinstance(body, dict):   # a field written above every section
            owners = [n for n in names if any(f.name == section for f in dataclasses.fields(getattr(base, n)))]
            if owners:
                raise ParallelizeError(f"{source} sets {section} = {body!r} outside any section; it is a field of "
                                       f"[{owners[0]}]: write it under that table")
        if section not in names:
            raise ParallelizeError(f"{source} has a section [{section}]{_closest(section, names)}; the sections "
                                   f"are {', '.join(names)}")
        if not isinstance(body, dict):
            raise ParallelizeError(f"{source}: {section} must be a table ([{section}]), not {body!r}")
        fields_ = {f.name: f for f in dataclasses.fields(getattr(base, section))}
        hints = typing.get_type_hints(type(getattr(base, section)))
        for key, value in body.items():
            if key not in fields_:
                raise ParallelizeError(f"{source}: [{section}] has no field {key!r}{_closest(key, fields_)}; its "
                                       f"fields are {', '.join(fields_)}")
            changes.setdefault(section, {})[key] = _from_text(hints[key], value)
    return base.replace_sections(changes)


def from_toml(cls, path: str, *, base=None):
    """The tree of class `cls` from the TOML file at `path` over `base`; a missing file, bad TOML
    or a bad value is a ParallelizeError naming the file."""
    import tomllib
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ParallelizeError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ParallelizeError(f"configuration file {path} is not valid TOML: {e}") from None
    try:
        return cls.from_dict(data, base=base, source=path)
    except ParallelizeError as e:
        if str(e).startswith(path):
            raise
        raise ParallelizeError(f"{path}: {e}") from None


def _from_text(tp, value: Any) -> Any:
    """A value read from TOML or a flag: "none" is None where the field takes None."""
    inner, nullable = _optional(tp)
    if nullable and inner is not str and isinstance(value, str) and value.lower() == "none":
        return None
    return value

