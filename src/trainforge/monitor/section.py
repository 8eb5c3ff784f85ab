"""``[monitor]``: what the training monitor measures and where it sends it."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require
from trainforge.errors import ConfigError


@dataclass
class MonitorSection:
    enabled: bool = _f(True, "measure system, framework and model metrics (hooks, system counters); false = "
                             "only the trainer's own records, written to metrics.jsonl")
    prometheus_port: int = _f(0, "serve Prometheus metrics over HTTP on this port; each process serves "
                                 "prometheus_port + its LOCAL_RANK (one port per rank); 0 = off")
    prometheus_host: str = _f("127.0.0.1", "address the metrics endpoint binds; the default keeps it on this "
                                           "machine; 0.0.0.0 exposes it on every interface")
    interval_steps: int = _f(10, "sample model statistics (per-group gradient and parameter norms, update/weight "
                                 "ratio, activation stats) on one step every this many steps; 0 = never")
    activation_stats: bool = _f(False, "on sampled steps, record mean/std/max |value| of every transformer "
                                       "block's output (forward hooks)")
    profile_every: int = _f(0, "run torch.profiler on one step every this many steps and export the top "
                               "operators by self time; 0 = off")
    top_ops: int = _f(10, "operators exported from a profiled step")
    tensorboard: bool = _f(False, "also write TensorBoard event files to RUN_DIR/tensorboard (pip install "
                                  "'trainforge[tensorboard]')")
    pushgateway_url: str = _f("", "push this rank's final metrics to a Prometheus Pushgateway at this URL when "
                                  "the job ends, e.g. http://127.0.0.1:9091; empty = off")
    pushgateway_job: str = _f("trainforge", "job label of the Pushgateway push")
    linger_s: float = _f(0.0, "keep the metrics endpoint up this many seconds after training ends, so a "
                              "scraper sees the final values")
    wandb: bool = _f(False, "also log every record and the config to Weights & Biases, rank 0 only (pip install "
                            "'trainforge[wandb]')")
    wandb_project: str = _f("trainforge", "W&B project of the run")
    wandb_entity: str = _f("", "W&B entity (user or team); empty = W&B's default (WANDB_ENTITY, your login)")
    wandb_mode: Literal["", "online", "offline", "disabled"] = _f(
        "", "W&B mode: online, offline (local files only, `wandb sync` later) or disabled; empty = W&B's "
            "own default (WANDB_MODE, else online)")
    mlflow: bool = _f(False, "also log every record and the config to MLflow, rank 0 only (pip install "
                             "'trainforge[mlflow]')")
    mlflow_tracking_uri: str = _f("", "MLflow tracking URI, e.g. http://host:5000 or sqlite:///mlflow.db; empty = "
                                      "MLflow's default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the "
                                      "working directory)")
    mlflow_experiment: str = _f("trainforge", "MLflow experiment of the run (created when missing)")
    run_name: str = _f("", "name of the run in W&B and MLflow; empty = the run directory's name")

    def validate(self) -> None:
        _require(0 <= self.prometheus_port <= 65535, "monitor.prometheus_port", self.prometheus_port,
                 "a TCP port in [1, 65535], or 0 for off")
        _require(self.prometheus_host.strip() != "", "monitor.prometheus_host", self.prometheus_host,
                 "an address to bind, e.g. 127.0.0.1")
        for name in ("interval_steps", "profile_every"):
            v = getattr(self, name)
            _require(v >= 0, f"monitor.{name}", v, "an integer >= 0 (0 = off)")
        _require(self.top_ops >= 1, "monitor.top_ops", self.top_ops, "an integer >= 1")
        _require(self.pushgateway_url == "" or self.pushgateway_url.startswith(("http://", "https://")),
                 "monitor.pushgateway_url", self.pushgateway_url, "an http:// or https:// URL, or empty for off")
        _require(self.pushgateway_job.strip() != "", "monitor.pushgateway_job", self.pushgateway_job,
                 "a non-empty job name")
        _require(math.isfinite(self.linger_s) and self.linger_s >= 0, "monitor.linger_s", self.linger_s,
                 "a number of seconds >= 0")
        _require(not self.wandb or self.wandb_project.strip() != "", "monitor.wandb_project", self.wandb_project,
                 "a non-empty W&B project name")
        _require(not self.mlflow or self.mlflow_experiment.strip() != "", "monitor.mlflow_experiment",
                 self.mlflow_experiment, "a non-empty MLflow experiment name")
        # Checked here, not when the sink opens: a missing tracker fails before data and model load.
        for key, module, extra in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")):
            if getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"config key 'monitor.{key}' = true needs the {module} package: pip install "
                                  f"'trainforge[{extra}]', or set it to false")
