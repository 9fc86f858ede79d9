"""Core, configuration on the command line: the argparse flags generated from a tree's fields
(one group per section; names, types, choices and help from the fields) and the tree a command
line gives. The tree is an argument (`Config` by default; `fxtron train` passes the trainer's
TrainConfig), so nothing here knows the trainer's sections.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, get_args, get_origin

from fxtron.config.fields import _default, _flag, _optional, _shorthand
from fxtron.config.sections import Config

_DEST = "cfg."


def add_arguments(parser: argparse.ArgumentParser, cls: type = Config, *, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every command-line field of `cls`'s sections (but the sections in `skip`),
    one argument group per section: names, types, choices and help from the fields. A flag not
    given leaves the field as the file or the defaults have it (see `from_arguments`)."""
    hints_cls = typing.get_type_hints(cls)
    for sf in dataclasses.fields(cls):
        if sf.name in skip:
            continue
        sec_cls = hints_cls[sf.name]
        group = parser.add_argument_group(sf.name, (sec_cls.__doc__ or "").strip().splitlines()[0])
        hints = typing.get_type_hints(sec_cls)
        for f in dataclasses.fields(sec_cls):
            if not f.metadata.get("cli", True):
                continue
            inner, nullable = _optional(hints[f.name])
            default = _default(f)
            env = f" (env {f.metadata['env']})" if f.metadata.get("env") else ""
            kw: dict[str, Any] = dict(dest=f"{_DEST}{sf.name}.{f.name}", default=argparse.SUPPRESS,
                                      help=f"{f.metadata['help']} [default: {_show(default)}]{env}")
            if inner is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif get_origin(inner) is Literal:
                choices = list(get_args(inner))
                kind = type(choices[0])
                kw.update(type=_parser(kind, nullable), choices=choices + ([None] if nullable else []),
                          metavar="{" + ",".join(map(str, choices)) + ("," + "none" if nullable else "") + "}")
            elif get_origin(inner) is tuple:
                kw.update(nargs="+", metavar="NAME")
            else:
                kw.update(type=_parser(inner, nullable), metavar=_shorthand(f).upper())
            group.add_argument(_flag(f), **kw)


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def _parser(kind: type, nullable: bool):
    def parse(text: str):
        if nullable and text.lower() == "none":
            return None
        return kind(text)
    parse.__name__ = kind.__name__
    return parse


def given(namespace: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the configuration flags given on the command line."""
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(namespace).items():
        if dest.startswith(_DEST):
            section, name = dest[len(_DEST):].split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def from_arguments(namespace: argparse.Namespace, cls: type = Config, *, base: Config | None = None) -> Config:
    """The configuration of a command line: `base` (the defaults, or the file --config names),
    then the flags given."""
    if base is None:
        path = getattr(namespace, "config", None)
        base = cls.from_toml(path) if path else cls()
    return base.replace_sections(given(namespace))
