"""``MlflowSink``: the trainer's records and the run's config to MLflow.

Rank 0 only (the monitor builds it where it writes metrics.jsonl). Through an
``MlflowClient`` bound to ``monitor.mlflow_tracking_uri`` (empty: MLflow's default, the
``MLFLOW_TRACKING_URI`` environment variable, else ``sqlite:///mlflow.db`` in the working
directory), not the fluent ``mlflow.log_*`` API, whose active run is process-wide state.

Each record is one ``log_batch`` of metrics at the record's step, queued
(``synchronous=False``: a batch costs about 50 ms on the default sqlite store, which the
training loop would wait for at every record) and waited for at ``flush`` (every
checkpoint) and ``close``; a batch that failed is a warning there, not a failed run,
since metrics.jsonl holds every record. The config goes in
as params (``section.key``); a value longer than MLflow's limit is cut there, so the
whole ``config.toml`` is logged as an artifact too. A run resumed from a checkpoint
continues the MLflow run whose id the first attempt stored in ``RUN_DIR/trackers.json``
(params are immutable in MLflow: the resumed run's config is the new artifact).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from trainforge.errors import ConfigError
from trainforge.log import get_logger
from trainforge.monitor.section import MonitorSection
from trainforge.monitor.tracker_run import CONFIG_FILE, record_metrics, run_name, store_id, stored_id

TRACKER = "mlflow"
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limits
MAX_BATCH_PARAMS = 100
MAX_PENDING = 256  # queued batches before log() waits for them


def metric_key(name: str) -> str:
    """MLflow accepts letters, digits, ``_ - . : /`` and spaces in a metric name."""
    return re.sub(r"[^\w\-.:/ ]", "_", name)


class MlflowSink:
    def __init__(self, section: MonitorSection, run_dir: Path, params: dict[str, Any], resumed: bool):
        from mlflow.exceptions import MlflowException

        try:
            self._open(section, run_dir, params, resumed)
        except MlflowException as e:  # a bad URI, an unreachable server: before any step
            uri = section.mlflow_tracking_uri or "MLflow's default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"config key 'monitor.mlflow_tracking_uri' = {uri}: MLflow could not start a run "
                              f"({first}); give a reachable server (http://host:5000) or a local store "
                              "(sqlite:///mlflow.db)") from None

    def _open(self, section: MonitorSection, run_dir: Path, params: dict[str, Any], resumed: bool) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(section.mlflow_tracking_uri or None)
        self._pending: list = []  # mlflow RunOperations of queued log_batch calls
        previous = stored_id(run_dir, TRACKER) if resumed else None
        self.run_id = None
        if previous is not None:
            try:
                self.run_id = self.client.get_run(previous).info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
            except MlflowException:
                get_logger().warning(f"MLflow run {previous} (from {run_dir / 'trackers.json'}) is not in "
                                     f"{self.client.tracking_uri}; the resumed run starts a new one")
                self.run_id = None
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(section.mlflow_experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(section.mlflow_experiment)
            run = self.client.create_run(exp_id, run_name=run_name(section.run_name, run_dir),
                                         tags={"trainforge.run_dir": str(run_dir.resolve())})
            self.run_id = run.info.run_id
            self._log_params(params)
        if (run_dir / CONFIG_FILE).is_file():
            self.client.log_artifact(self.run_id, str(run_dir / CONFIG_FILE))
        store_id(run_dir, TRACKER, self.run_id)
        get_logger().info(f"MLflow run {self.run_id} at {self.client.tracking_uri}")

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:
            limit = 500  # the oldest MLflow's limit
        items = [Param(k, str(v)[:limit]) for k, v in params.items()]
        for i in range(0, len(items), MAX_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_BATCH_PARAMS])

    def log(self, step: int, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        values = {metric_key(k): v for k, v in record_metrics(record)}
        items = [Metric(k, v, now_ms, step) for k, v in values.items()]
        for i in range(0, len(items), MAX_BATCH_METRICS):
            self._pending.append(self.client.log_batch(self.run_id, metrics=items[i:i + MAX_BATCH_METRICS],
                                                       synchronous=False))
        if len(self._pending) > MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        from mlflow.exceptions import MlflowException

        pending, self._pending = self._pending, []
        for op in pending:
            try:
                op.wait()
            except MlflowException as e:
                get_logger().warning(f"MLflow run {self.run_id}: a metrics batch was not logged ({e}); "
                                     "metrics.jsonl has every record")

    def close(self, failed: bool = False) -> None:
        """``failed``: the run ended by an error (MLflow shows it FAILED, not FINISHED)."""
        self.flush()
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
