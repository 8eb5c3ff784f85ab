"""The config part of ``trainforge report``: each run's RUN/config.toml (the resolved
config the trainer writes), flattened to ``section.key`` rows; with several runs the
keys whose values differ, with one run all of them."""

from __future__ import annotations

import html
import json
import tomllib
from pathlib import Path
from typing import Any

from trainforge.errors import TrainforgeError


def flatten_config(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"training": {"lr": 0.001}}`` -> ``{"training.lr": "0.001"}``; nested tables
    (``[data.cache]``) give ``data.cache.memory_mb``; lists and inline tables stay one
    value. Values are written as JSON, so a string ``"1"`` and a number ``1`` differ."""
    out: dict[str, str] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = json.dumps(value, default=str)
    return out


def read_config(path: Path) -> dict[str, str] | None:
    """The flattened file, or None when it does not exist (a run from before the trainer
    wrote one, or a copied metrics.jsonl); invalid TOML is a TrainforgeError naming it."""
    if not path.is_file():
        return None
    try:
        return flatten_config(tomllib.loads(path.read_text()))
    except tomllib.TOMLDecodeError as e:
        raise TrainforgeError(f"{path} is not valid TOML: {e}") from None


def config_diff(configs: list[dict[str, str] | None]) -> list[tuple[str, list[str | None]]]:
    """(key, value per run, None where that run lacks the key) for every key whose values
    are not all equal, in config-file order. A run without a config adds no rows."""
    present = [c for c in configs if c is not None]
    keys = list(dict.fromkeys(k for c in present for k in c))
    rows = [(k, [c.get(k) for c in present]) for k in keys]
    return [(k, [c.get(k) if c is not None else None for c in configs]) for k, vals in rows if len(set(vals)) > 1]


def table(head: list[str], rows: list[tuple[str, list[str | None]]], cls: str = "") -> str:
    """An HTML table, everything escaped: a header row of ``head``, then per row its key
    and one cell per column (None: "(unset)")."""
    e = html.escape
    out = [f"<table class='{cls}'><tr><th></th>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for key, vals in rows:
        cells = "".join(f"<td>{e(v)}</td>" if v is not None else "<td class='unset'>(unset)</td>" for v in vals)
        out.append(f"<tr><th>{e(key)}</th>{cells}</tr>")
    return "".join(out) + "</table>"


def config_html(names: list[str], configs: list[dict[str, str] | None]) -> str:
    """The page's config section: the differing keys (several runs) and, folded, every key."""
    missing = [n for n, c in zip(names, configs) if c is None]
    note = f"<p>no config.toml in: {html.escape(', '.join(missing))}</p>" if missing else ""
    keys = list(dict.fromkeys(k for c in configs if c is not None for k in c))
    every = table(names, [(k, [c.get(k) if c is not None else None for c in configs]) for k in keys], "config")
    if len(configs) == 1:
        return f"<h2>Config</h2>{note}<details><summary>config.toml ({len(keys)} keys)</summary>{every}</details>"
    diff = config_diff(configs)
    shown = table(names, diff, "config diff") if diff else f"<p>the configs are identical ({len(keys)} keys)</p>"
    return (f"<h2>Config: {len(diff)} {'key differs' if len(diff) == 1 else 'keys differ'}</h2>{note}{shown}"
            f"<details><summary>all {len(keys)} keys</summary>{every}</details>")
