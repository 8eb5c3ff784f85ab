"""``WandbSink``: the trainer's records and the run's config to Weights & Biases.

Rank 0 only (the monitor builds it where it writes metrics.jsonl). Each record is one
``run.log(metrics, step=record's step)``: the validation record of a step merges into
the training record's row. ``wandb.init`` runs when the monitor is built, before the
first step; a run resumed from a checkpoint continues the W&B run whose id the first
attempt stored in ``RUN_DIR/trackers.json`` (``resume="allow"``). W&B's local files go
to ``RUN_DIR/wandb`` unless ``WANDB_DIR`` says otherwise, so ``wandb sync RUN_DIR/wandb/
offline-run-*`` uploads an offline run later.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainforge.errors import ConfigError
from trainforge.log import get_logger
from trainforge.monitor.section import MonitorSection
from trainforge.monitor.tracker_run import record_metrics, run_name, store_id, stored_id

TRACKER = "wandb"


class WandbSink:
    def __init__(self, section: MonitorSection, run_dir: Path, params: dict[str, Any], resumed: bool):
        import wandb

        previous = stored_id(run_dir, TRACKER) if resumed else None
        try:
            self.run = wandb.init(
                project=section.wandb_project, entity=section.wandb_entity or None,
                name=run_name(section.run_name, run_dir), config=params,
                id=previous, resume="allow" if previous else None,
                mode=section.wandb_mode or None,  # None: WANDB_MODE, else W&B's default (online)
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir))
        except wandb.errors.Error as e:  # no login, no network, an unknown entity: before any step
            raise ConfigError(f"config key 'monitor.wandb' = true: W&B could not start a run ({e}); run "
                              "`wandb login`, or set monitor.wandb_mode = \"offline\" and `wandb sync` "
                              "later") from None
        store_id(run_dir, TRACKER, self.run.id)
        get_logger().info(f"W&B run {self.run.id}: {self.run.url or self.run.dir}")  # url is None offline

    def log(self, step: int, record: dict[str, Any]) -> None:
        metrics = dict(record_metrics(record))
        if metrics:
            self.run.log(metrics, step=step)

    def flush(self) -> None:
        pass  # the W&B service process writes as it receives

    def close(self, failed: bool = False) -> None:
        # Waits for the service process: nothing logged is lost, no process left. A non-zero
        # exit code marks the run failed in W&B.
        self.run.finish(exit_code=1 if failed else 0)
