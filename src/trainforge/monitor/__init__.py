"""Training monitor: a registry of typed metrics fed by the trainer's records, hooks
that measure inside a step, and sinks (JSONL, Prometheus, TensorBoard, W&B, MLflow); plus the run
report (``report.py``) and the Grafana dashboard generator (``dashboard.py``).

``catalog.py`` is the table of metrics; ``docs/metrics.md`` is generated from it.
Imports are lazy: ``config.py`` loads ``MonitorSection`` without torch hooks or sinks.
"""

from __future__ import annotations

import importlib

_LAZY = {"Monitor": "monitor", "MonitorSection": "section"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"trainforge.monitor.{_LAZY[name]}"), name)
    raise AttributeError(name)
