"""The command-line form of typed config sections: one argparse option per key, generated from the
dataclasses (``trainforge train --help`` groups them by table with type, allowed values, default and
meaning), and the raw ``--section.key VALUE`` text they collect.

argparse only matches the option and keeps its raw text; ``config.py`` then checks it against the
field's type exactly as a value from a TOML file (the same checks, the same one-line error). Every
option's default is SUPPRESS: an option not given leaves the lower layers (defaults, the saved run
config, a --config file) alone, which keeps the precedence. Built on stdlib argparse, not tyro:
tyro's booleans take no value (``--parallel.compile false``, which configs and scripts use, is
refused) and its errors are multi-line panels with its own wording (README "Command line")."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from trainforge.errors import ConfigError

_OVERRIDES = "config_overrides"  # the namespace attribute: [(dotted key, raw text)] in command-line order


class OverrideParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (ConfigError), not argparse's usage + SystemExit
        raise ConfigError(message)


def _record(ns: argparse.Namespace, key: str, raw: str) -> None:
    setattr(ns, _OVERRIDES, [*getattr(ns, _OVERRIDES, []), (key, raw)])


class _ValueOption(argparse.Action):
    """``--section.key VALUE`` or ``--section.key=VALUE``."""

    def __call__(self, parser, ns, value, option_string=None):
        _record(ns, self.dest, value)


class _BoolOption(argparse.Action):
    """``--section.key`` (true), ``--no-section.key`` (false), or ``--section.key true|false`` as before."""

    def __call__(self, parser, ns, value, option_string=None):
        if option_string.startswith("--no-"):
            if value is not None:
                raise ConfigError(f"{option_string} takes no value: write {option_string} alone, or "
                                  f"--{self.dest} {value}")
            value = "false"
        _record(ns, self.dest, "true" if value is None else value)


def _plain(tp: Any) -> tuple[Any, bool]:
    """(the type without ``| None``, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _shown(value: Any) -> str:
    """A default as it is written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return repr(value) if value else "[]"
    return str(value)


@dataclass(frozen=True)
class ConfigKey:
    key: str        # dotted: data.cache.dir
    tp: Any         # without | None
    optional: bool
    default: Any
    help: str


def section_keys(prefix: str, cls: type, obj: Any) -> list[tuple[str, list[ConfigKey]]]:
    """[(table, its keys)] for a section and, after it, each nested table ([data], [data.cache], ...)."""
    hints = typing.get_type_hints(cls)
    keys: list[ConfigKey] = []
    tables: list[tuple[str, list[ConfigKey]]] = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            tables += section_keys(f"{prefix}.{f.name}", hints[f.name], value)
            continue
        tp, optional = _plain(hints[f.name])
        keys.append(ConfigKey(f"{prefix}.{f.name}", tp, optional, value, f.metadata.get("help", "")))
    return [(prefix, keys), *tables]


def _describe(k: ConfigKey) -> tuple[str | None, str]:
    """(metavar, the help text after the field's own): type, allowed values and default."""
    if typing.get_origin(k.tp) is Literal:
        choices = ", ".join(map(str, typing.get_args(k.tp)))
        return "CHOICE", f"one of: {choices}{', none' if k.optional else ''}; default: {_shown(k.default)}"
    if k.tp is bool:
        return None, f"bool{' or none' if k.optional else ''}; default: {_shown(k.default)}"
    if k.tp is list or typing.get_origin(k.tp) is list:
        return "TOML", f"a TOML list of tables; default: {_shown(k.default)}"
    name = getattr(k.tp, "__name__", str(k.tp))
    return name.upper(), f"{name}{' or none' if k.optional else ''}; default: {_shown(k.default)}"


def add_key_arguments(parser: argparse.ArgumentParser,
                      tables: typing.Iterable[tuple[str, typing.Iterable[ConfigKey]]]) -> None:
    """One argument group per table ([model], [data], [data.cache]...) and one option per key:
    ``--section.key VALUE``, and for a boolean ``--section.key`` / ``--no-section.key`` too."""
    for table, keys in tables:
        group = parser.add_argument_group(f"[{table}]")
        for k in keys:
            metavar, extra = _describe(k)
            text = f"{k.help} ({extra})" if k.help else f"({extra})"
            text = text.replace("%", "%%")  # argparse %-formats help
            if metavar is None:
                group.add_argument(f"--{k.key}", f"--no-{k.key}", dest=k.key, action=_BoolOption, nargs="?",
                                   metavar="BOOL", default=argparse.SUPPRESS, help=text)
            else:
                group.add_argument(f"--{k.key}", dest=k.key, action=_ValueOption, metavar=metavar,
                                   default=argparse.SUPPRESS, help=text)


def join_values(args: list[str], kinds: dict[str, bool]) -> list[str]:
    """``--key VALUE`` -> ``--key=VALUE`` for the config keys (``kinds``: ``--section.key`` -> whether it
    is a boolean). argparse takes a value that starts with '-' for an option unless it looks like -1 or
    -.5; joined, -1e-3 and -x stay values as before. Nothing that starts with ``--`` is taken as a
    value: ``--parallel.compile --model.flavor debug`` sets compile (bare: true) and flavor."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if kinds.get(arg) is False and (nxt is None or nxt.startswith("--")):
            raise ConfigError(f"override {arg} has no value: write {arg} VALUE (or {arg}=VALUE for a value "
                              "that starts with --)")
        if arg in kinds and nxt is not None and not nxt.startswith("--"):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def overrides_from(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """The (dotted key, raw text) pairs a parser with ``add_config_arguments`` collected, in order."""
    return list(getattr(ns, _OVERRIDES, []))


