"""The config-key reference (docs/reference/config.md), generated from the typed sections that
``config.py`` composes into ``Config``: every key of every table with its type, allowed values,
default and meaning. The meaning is each field's ``help`` metadata, the same text
``trainforge train --help`` prints, so the page, the help and the parser cannot disagree.

``python -m trainforge.config_reference > docs/reference/config.md`` regenerates it;
tests/test_config_reference.py fails when the checked-in copy is stale. It reads the dataclasses
directly (not the argparse options built from them) so the page depends only on ``Config``."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from trainforge.config import Config
from trainforge.config_args import _plain

_HEADER = [
    "# Config keys",
    "",
    "Generated from the typed config sections by "
    "`python -m trainforge.config_reference > docs/reference/config.md`; do not edit by hand.",
    "",
    "Every key below can be set in a TOML file (`trainforge train --config run.toml`, under its "
    "`[table]`) or on the command line as `--table.key VALUE`. A boolean is also `--table.key` "
    "(true) or `--no-table.key` (false); an optional key takes `none` to unset it. "
    "`trainforge train --print_config` prints the resolved config.",
    "",
]


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str       # dotted: data.cache.dir
    type: str      # int, float, str, bool, choice, list of tables (+ " or none")
    allowed: str   # the choices of a Literal, else ""
    default: str   # as written in TOML / on the command line
    meaning: str


def _shown(value: Any) -> str:
    if value is None:
        return "none (unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return repr(value) if value else "[]"
    return str(value)


def _key_doc(key: str, tp: Any, default: Any, meaning: str) -> KeyDoc:
    tp, optional = _plain(tp)
    allowed = ""
    if typing.get_origin(tp) is Literal:
        name, allowed = "choice", ", ".join(f"`{c}`" for c in typing.get_args(tp))
    elif tp is list or typing.get_origin(tp) is list:
        name = "list of tables"
    else:
        name = getattr(tp, "__name__", str(tp))
    return KeyDoc(key, name + (" or none" if optional else ""), allowed, _shown(default), meaning)


def tables(cls: type = Config, prefix: str = "") -> list[tuple[str, list[KeyDoc]]]:
    """[(table, its keys)], in ``Config``'s order, each nested table ([data.cache]) after its parent."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, list[KeyDoc]]] = []
    keys: list[KeyDoc] = []
    obj = cls()
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out += tables(hints[f.name], name)
            continue
        keys.append(_key_doc(name, hints[f.name], getattr(obj, f.name), f.metadata.get("help", "")))
    return ([(prefix, keys)] if prefix else []) + out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The whole page: a table of contents, then one table per config table."""
    all_tables = tables()
    lines = list(_HEADER)
    lines.append("Tables: " + ", ".join(f"[`[{t}]`](#{t.replace('.', '')})" for t, _ in all_tables) + ".")
    lines.append("")
    for table, keys in all_tables:
        lines += [f"## [{table}] {{#{table.replace('.', '')}}}", "",
                  "| key | type | allowed values | default | meaning |", "|---|---|---|---|---|"]
        for k in keys:
            cells = [f"`{k.key}`", k.type, k.allowed or "-", f"`{k.default}`", _cell(k.meaning) or "-"]
            lines.append("| " + " | ".join(_cell(c) if i != 2 else c for i, c in enumerate(cells)) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
