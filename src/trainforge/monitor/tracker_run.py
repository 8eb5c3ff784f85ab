"""What the experiment-tracker sinks (``wandb_sink.py``, ``mlflow_sink.py``) and the
TensorBoard hparams share: a record as flat numbers, the run's config as flat
``section.key`` parameters, and the tracker's run id kept in the run directory so a
resumed run continues the same tracker run.

Trackers get the trainer's records (the keys of metrics.jsonl), not the registry's
Prometheus names: a user compares the W&B chart ``loss`` with the ``loss`` column of
``metrics.jsonl`` and the run report.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Iterator

from trainforge.storage.atomic import atomic_write_text

# The trainer writes the resolved config here before the monitor opens (train/trainer.py's
# CONFIG_FILE; the monitor cannot import train/).
CONFIG_FILE = "config.toml"
IDS_FILE = "trackers.json"
# step: the x axis, not a series; time_unix_s: every tracker stamps its own wall clock.
SKIPPED_KEYS = frozenset({"step", "time_unix_s"})


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def record_metrics(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's numeric values as ``(name, value)``: a nested dict or list becomes
    ``key/sub`` (``grad_norm_group/layers.0``, ``parallel_degree/tp``); strings, None and
    non-finite values are left out (metrics.jsonl holds a non-finite value as null)."""
    for key, value in record.items():
        if key in SKIPPED_KEYS:
            continue
        yield from _flat(key, value)


def _flat(key: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(f"{key}/{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flat(f"{key}/{i}", v)
    elif (n := _number(value)) is not None:
        yield key, n


def config_params(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (``RUN_DIR/config.toml``) as ``{"section.key": value}``;
    sub-tables go one level deeper (``data.augment.transforms`` stays one value, as TOML
    text of a list). Empty when the file is missing (a Monitor built outside the trainer)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    out: dict[str, Any] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for k, v in table.items():
            name = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(name, v)
            elif isinstance(v, (list, tuple)):
                out[name] = json.dumps(v)
            else:
                out[name] = v

    walk("", tomllib.loads(path.read_text()))
    return out


def run_name(configured: str, run_dir: Path) -> str:
    return configured or run_dir.resolve().name


def stored_id(run_dir: Path, tracker: str) -> str | None:
    """The tracker run id a previous attempt of this run stored (None when none)."""
    try:
        return json.loads((run_dir / IDS_FILE).read_text()).get(tracker)
    except (OSError, ValueError):
        return None


def store_id(run_dir: Path, tracker: str, run_id: str) -> None:
    path = run_dir / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    ids[tracker] = run_id
    atomic_write_text(path, json.dumps(ids, indent=1) + "\n")
