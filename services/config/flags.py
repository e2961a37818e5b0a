"""Flags declared on the config dataclasses, and the generic code that reads them.

Each field of a config slice is declared once, with :func:`flag`: its default,
its flag name(s), help and choices live in the field's metadata (a
:class:`FlagSpec`). :func:`add_slice_args` turns a slice class into an argparse
group; :func:`build_slice` turns a parsed namespace back into the slice. The
argparse type follows the field's annotation (``bool``: a bare ``store_true``
flag; ``int``/``float``: converted; ``tuple[str, ...]``: repeatable).

Fields that need more than that say so in their metadata, never here: ``build``
computes the value (keys gathered from flags, files and the environment),
``extra`` registers helper flags only ``build`` reads, ``sglang`` adds SGLang's
flag for the same setting with its own value syntax (an :class:`Alias`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

META_KEY = "nibble.flag"
Text = str | Callable[[], str]


class Choices(tuple):
    """What argparse offers (iteration: ``--help``, error messages) plus ``hidden`` names it
    still accepts (``in``); :func:`~.validate.validate` decides whether they may be used
    (the experimental KV formats, behind ``--enable-experimental-kv-formats``)."""

    hidden: tuple[str, ...]

    def __new__(cls, offered: Iterable[str], hidden: Iterable[str] = ()) -> Choices:
        self = super().__new__(cls, offered)
        self.hidden = tuple(hidden)
        return self

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or value in self.hidden


@dataclass(frozen=True)
class Alias:
    """SGLang's flag for a setting, with its own values: ``convert`` maps one to the field's
    value (or raises :class:`ConfigError` for a value Nibble cannot honour)."""

    name: str
    convert: Callable[[str], Any]
    help: str
    metavar: str | None = None


@dataclass(frozen=True)
class FlagSpec:
    """How one config field appears on the command line (``names[0]`` is its flag)."""

    names: tuple[str, ...] = ()            # the flag; () = derived from the field name
    aliases: tuple[str, ...] = ()          # more names, same values (SGLang's)
    help: Text | None = None
    choices: Iterable[str] | Callable[[], Iterable[str]] | None = None
    metavar: str | None = None
    bare: Any = None                       # not None: the flag may come without a value
    secret: bool = False                   # kept out of repr (logs)
    env: str | None = None                 # an environment variable ``build`` reads
    # build(parsed value, spec, namespace, environment) -> the field's value
    build: Callable[[Any, FlagSpec, argparse.Namespace, Mapping[str, str]], Any] | None = None
    extra: tuple[tuple[str, dict], ...] = ()   # (flag, argparse kwargs) read only by ``build``
    sglang: Alias | None = None

    @property
    def flag(self) -> str:
        return self.names[0]

    @property
    def option_strings(self) -> tuple[str, ...]:
        return self.names + self.aliases


def flag(default: Any = dataclasses.MISSING, name: str | None = None, *,
         help: Text | None = None, choices=None, metavar: str | None = None,
         aliases: tuple[str, ...] = (), bare: Any = None, secret: bool = False,
         env: str | None = None, build=None, extra: tuple[tuple[str, dict], ...] = (),
         sglang: Alias | None = None):
    """A dataclass field declared as a flag. ``name``: the flag (default ``--field-name``);
    ``aliases``: more names for the same flag (shown in ``--help``); ``choices``: the values,
    or a callable reading a registry when the parser is built; the rest: see FlagSpec."""
    spec = FlagSpec((name,) if name else (), tuple(aliases), help, choices, metavar, bare,
                    secret, env, build, tuple(extra), sglang)
    return dataclasses.field(default=default, repr=not secret, metadata={META_KEY: spec})


def specs(cls) -> list[tuple[dataclasses.Field, FlagSpec, Any]]:
    """``(field, spec, resolved type)`` for every field of the slice class ``cls``; a field's
    default flag name is ``--`` plus its name with dashes."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(META_KEY)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with flag()")
        if not spec.names:
            spec = dataclasses.replace(spec, names=(_flag_name(f.name),))
        out.append((f, spec, hints[f.name]))
    return out


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> Any:
    """``int | None`` -> int; ``tuple[str, ...]`` -> tuple; ``bool`` -> bool."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else str
    return typing.get_origin(hint) or hint


def _text(value: Text | None) -> str | None:
    return value() if callable(value) else value


def _choices(spec: FlagSpec):
    c = spec.choices() if callable(spec.choices) else spec.choices
    return None if c is None else (c if isinstance(c, Choices) else tuple(c))


def argparse_kwargs(f: dataclasses.Field, spec: FlagSpec, hint) -> dict:
    """The ``add_argument`` keyword arguments of one field (its default is the field's)."""
    kind = _base_type(hint)
    kw: dict[str, Any] = {"dest": f.name, "help": _text(spec.help)}
    if spec.metavar is not None:
        kw["metavar"] = spec.metavar
    elif spec.flag != _flag_name(f.name) and kind not in (bool, tuple):
        kw["metavar"] = spec.flag[2:].replace("-", "_").upper()    # not the field's name
    if kind is bool:
        kw.update(action="store_true", default=f.default)
        return kw
    if kind is tuple:
        kw.update(action="append", default=None)     # an empty tuple when never given
        return kw
    kw["default"] = f.default
    if kind in (int, float):
        kw["type"] = kind
    if spec.bare is not None:
        kw.update(nargs="?", const=spec.bare)
    choices = _choices(spec)
    if choices is not None:
        kw["choices"] = choices
    return kw


def add_slice_args(parser: argparse.ArgumentParser, cls, title: str) -> None:
    """One argument group holding every flag of the slice class ``cls``."""
    g = parser.add_argument_group(title)
    for f, spec, hint in specs(cls):
        g.add_argument(*spec.option_strings, **argparse_kwargs(f, spec, hint))
        for name, kw in spec.extra:
            g.add_argument(name, **kw)
        if spec.sglang is not None:
            a = spec.sglang
            g.add_argument(a.name, dest=alias_dest(a), default=argparse.SUPPRESS,
                           metavar=a.metavar, help=a.help)


def alias_dest(alias: Alias) -> str:
    return alias.name[2:].replace("-", "_")


def _value(f: dataclasses.Field, spec: FlagSpec, hint, ns: argparse.Namespace,
           env: Mapping[str, str]) -> Any:
    value = getattr(ns, f.name, f.default)
    if spec.build is not None:
        return spec.build(value, spec, ns, env)
    if value is None and _base_type(hint) is tuple:
        return ()
    if isinstance(value, list):
        return tuple(value)
    if spec.sglang is not None:
        value = _sglang_value(f, spec, ns, value)
    return value


def _sglang_value(f: dataclasses.Field, spec: FlagSpec, ns: argparse.Namespace, value: Any):
    """The field's value when SGLang's flag was given (it must agree with Nibble's own)."""
    a = spec.sglang
    raw = getattr(ns, alias_dest(a), None)
    if raw is None:
        return value
    mapped = a.convert(raw)
    if value != f.default and value != mapped:
        raise ConfigError(f"{a.name} {raw} contradicts {spec.flag} "
                          f"{'' if isinstance(value, bool) else value}".rstrip())
    return mapped


def build_slice(cls, ns: argparse.Namespace, env: Mapping[str, str]):
    """The slice ``cls`` from parsed flags; a flag the parser lacks keeps its default."""
    return cls(**{f.name: _value(f, spec, hint, ns, env) for f, spec, hint in specs(cls)})


def alias_flags(classes: Iterable[type]) -> dict[str, str]:
    """Every other name a flag answers to -> the flag's own name (SGLang's names)."""
    out = {}
    for cls in classes:
        for _, spec, _ in specs(cls):
            out.update({name: spec.flag for name in spec.aliases})
            if spec.sglang is not None:
                out[spec.sglang.name] = spec.flag
    return out
