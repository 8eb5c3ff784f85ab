"""A small JSON file of measured machine facts (matmul peaks, dtype probes) kept in the
cache directory, so each is measured once per machine. Reads never fail (a missing or
damaged file is an empty cache); writes are atomic and a read-only cache only costs a
re-measurement next time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainforge.storage.atomic import atomic_write_json


def read_json_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_cache(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError:
        pass
