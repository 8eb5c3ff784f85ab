"""Field helpers shared by every config section (``trainforge.config`` and the
sections that live beside their feature, e.g. ``compression/section.py``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from trainforge.errors import ConfigError


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} is not allowed: {allowed}")
