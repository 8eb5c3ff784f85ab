"""The monitor as one of the loop's components.

``monitor/monitor.py``'s ``Monitor`` is where every record goes (``loop.metrics.write``,
from the loop and from every component); as a component it follows the loop's events:

- ``on_checkpoint``: every sink is flushed before the checkpoint is written, so the
  records of the steps a checkpoint holds are on disk (metrics.jsonl) and in the
  TensorBoard event file when it becomes resumable;
- ``on_fit_end``: the seconds this process spent monitoring go into the run's summary.

It has no checkpoint state (an empty ``state_dict`` writes nothing): its counters are per
process by definition (``optimizer_skipped_steps``, ``monitor_s``: docs/metrics.md), and
everything a resumed run must continue lives in the records themselves."""

from __future__ import annotations

from typing import Any

from trainforge.train.component import Component


class MonitorComponent(Component):
    name = "monitor"

    def __init__(self, monitor: Any):
        self.monitor = monitor

    def on_checkpoint(self, loop: Any) -> None:
        self.monitor.flush()

    def on_fit_end(self, loop: Any, summary: dict[str, Any]) -> None:
        summary["monitor_s"] = round(self.monitor.self_seconds(), 4)
