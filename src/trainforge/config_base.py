"""What every config section shares: field helpers for the sections that live beside
their component (``train/section.py``, ``data/section.py``...), and the TOML form of a
resolved config. It sits below every package, so a component can write the config it
was given (the trainer's ``config.toml`` and checkpoint ``meta.json``) without importing
``trainforge.config``, which composes the sections and so sits above them."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

import tomli_w

from trainforge.errors import ConfigError

_TOML_HEADER = "# resolved trainforge config: `trainforge train --config` accepts this file\n\n"


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A config key: its default, its ``--help`` text, and optional metadata: ``example`` (a
    valid value, quoted in type errors) and ``from_text`` (a parser of a shorter command-line
    form, e.g. model.hourglass's "2@1 4@2 2@1", tried where the text is not TOML)."""
    return field(default=default, metadata={"help": help, **meta})


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is not allowed: {allowed}")


def config_to_dict(cfg: Any) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` of a config dataclass (sub-tables as nested dicts)."""
    return dataclasses.asdict(cfg)


def _drop_none(table: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def config_to_toml(cfg: Any) -> str:
    """TOML text of a resolved config that ``load_config`` reads back to an equal one
    (unset optional keys are omitted: TOML has no null)."""
    return _TOML_HEADER + tomli_w.dumps(_drop_none(config_to_dict(cfg)))
