"""``Monitor``: the trainer's metrics destination.

The trainer writes every record (one per step at the logging interval, one per
validation, one per checkpoint, and whatever later features add) to ``Monitor.write``.
For a training-step record the monitor first adds what it measured itself (phase
times of that step, model statistics when the step was sampled, system counters once
per logging window, see ``probes.py`` and ``system.py``) without overwriting any key
the trainer set; then the one record goes to the JSONL file (rank 0), into the
registry, and from the registry to every other sink. So all destinations hold the
same values, and a record key a later branch adds is exported without touching this
package (as ``trainforge_record_value`` until ``catalog.py`` documents it).

Every rank has a monitor (records are built on every rank): rank 0 writes the run
directory's files (metrics.jsonl, tensorboard/) and alone logs to the experiment trackers
(W&B, MLflow: the records themselves, ``tracker_run.py``); each rank serves its own Prometheus
endpoint on ``prometheus_port + LOCAL_RANK``, with a ``rank`` label on every sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from trainforge.monitor.energy import EnergySampler
from trainforge.monitor.jsonl import JsonlSink
from trainforge.monitor.probes import StepProbe
from trainforge.monitor.registry import Registry
from trainforge.monitor.section import MonitorSection
from trainforge.monitor.sinks import PrometheusSink, TensorBoardSink
from trainforge.monitor.step_bytes import training_step_bytes
from trainforge.monitor.system import SystemSampler
from trainforge.monitor.tracker_run import config_params

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


class Monitor:
    """``jsonl_path``: where this rank writes records (None on ranks other than 0).
    ``dims``: the parallel layout (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``,
    ``world_size``); ``dist``: ``rank`` and ``local_rank``; ``step_fn()``: the trainer's
    completed-step count; ``opt_parts``: the modules whose parameters the optimizers
    step, when not ``model_parts`` (an fp32 master copy: same FQNs). Hooks are installed
    on ``model_parts`` and ``optimizers`` and removed by ``close``."""

    def __init__(self, section: MonitorSection, jsonl_path: Path | None, model_parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], device: torch.device, dims: Any, dist: Any,
                 step_fn: Callable[[], int], tensorboard_dir: Path | None = None,
                 opt_parts: list[nn.Module] | None = None):
        self.section, self.step_fn = section, step_fn
        self.world_size = dims.world_size
        self.pp = dims.pp
        self.axes = {a: getattr(dims, a) for a in AXES}
        self.jsonl = JsonlSink(jsonl_path) if jsonl_path is not None else None
        self.registry = Registry(dist.rank)
        self.sinks: list = []
        self.probe = self.system = self.energy = None
        self.model_parts, self.optimizers = model_parts, optimizers
        self._activation_bytes = 0  # saved activations per micro-batch, from the trainer's memory keys
        self.start_step = step_fn()
        self._window: int | None = None
        self._window_stats: dict[str, Any] = {}
        self._write_s = 0.0
        self.prometheus = None
        self.trackers: list = []
        if not section.enabled:
            self._open_trackers(jsonl_path)
            return
        if section.prometheus_port or section.pushgateway_url:  # first: a busy port fails before any hook
            port = section.prometheus_port + dist.local_rank if section.prometheus_port else 0
            self.prometheus = PrometheusSink(self.registry, section.prometheus_host, port, section.pushgateway_url,
                                             section.pushgateway_job)
            self.sinks.append(self.prometheus)
        if section.tensorboard and jsonl_path is not None:
            self.sinks.append(TensorBoardSink(tensorboard_dir or jsonl_path.parent / "tensorboard",
                                              config_params(jsonl_path.parent)))
        self.probe = StepProbe(model_parts, optimizers, device, step_fn, section.interval_steps,
                               section.activation_stats, section.profile_every, section.top_ops, opt_parts)
        self.system = SystemSampler(device)
        self.energy = EnergySampler(device, dist.local_rank)
        self._open_trackers(jsonl_path)

    def _open_trackers(self, jsonl_path: Path | None) -> None:
        """Last (a tracker that fails to open leaves no endpoint bound): the trackers take
        the records as metrics.jsonl holds them, monitored or not, on rank 0."""
        if jsonl_path is None:
            return
        try:
            _trackers(self.section, jsonl_path.parent, self.start_step > 0, self.trackers)
        except BaseException:
            for sink in (*self.sinks, *self.trackers):
                sink.close()
            raise

    # -- the sink interface the trainer uses ------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        if self.probe is None:
            if self.jsonl is not None:
                self.jsonl.write(record)
            for tracker in self.trackers:
                tracker.log(int(record.get("step", self.step_fn())), record)
            return
        t0 = time.perf_counter()
        self.probe.mark_other_work()  # logging, validation, checkpointing: not data wait
        if self.jsonl is None and not self.sinks:  # a rank > 0 without an endpoint: nobody reads it
            self._write_s += time.perf_counter() - t0
            return
        window = None
        acts = [v for k, v in record.items() if k.startswith("mem_activations_") and k.endswith("_bytes")]
        if acts:
            self._activation_bytes = sum(acts)
        if "loss" in record and "step" in record:
            record = {**record}
            window = self.step_fn()  # steps done when the window's records are written
            self._enrich(record, window)
        t1 = time.perf_counter()
        if self.jsonl is not None:
            self.jsonl.write(record)  # what an unmonitored run pays too: not counted in monitor_s
        t2 = time.perf_counter()
        samples = self.registry.ingest(record, window)
        step = int(record.get("step", self.step_fn()))
        for sink in self.sinks:
            sink.emit(step, samples)
        for tracker in self.trackers:
            tracker.log(step, record)
        self._write_s += (t1 - t0) + (time.perf_counter() - t2)

    def self_seconds(self) -> float:
        """Host seconds this process spent in monitoring: hooks, enrichment, registry, sinks."""
        return (self.probe.self_s if self.probe is not None else 0.0) + self._write_s

    def flush(self) -> None:
        if self.jsonl is not None:
            self.jsonl.flush()
        for sink in (*self.sinks, *self.trackers):
            sink.flush()

    def close(self, failed: bool = False) -> None:
        """Remove the hooks, push to the Pushgateway (if set), keep the endpoint up for
        ``linger_s``, then close every sink; ``failed`` (the run ended by an error) is told
        to the experiment trackers, which record the run's status."""
        if self.probe is not None:
            self.probe.close()
        if self.energy is not None:
            self.energy.close()
        if self.section.linger_s and self.prometheus is not None and self.prometheus.address is not None:
            time.sleep(self.section.linger_s)
        for sink in self.sinks:
            sink.close()
        for tracker in self.trackers:
            tracker.close(failed)
        self.sinks, self.trackers = [], []
        if self.jsonl is not None:
            self.jsonl.close()

    # -- what the monitor adds to a step record -----------------------------------------

    def _enrich(self, record: dict[str, Any], window: int) -> None:
        step = int(record["step"])
        ours: dict[str, Any] = {}
        ours.update(self.probe.timings(step))
        ours.update(self.probe.sampled(step))
        if window != self._window:
            self._window, self._window_stats = window, self._collect_window(record, window)
        ours.update(self._window_stats)
        if "step_s" in ours:
            share = record.get("comm_share", ours.get("comm_share"))
            if share is not None:
                ours["collective_s"] = share * ours["step_s"]
        for k, v in ours.items():
            record.setdefault(k, v)  # the trainer's own value of a key wins

    def _collect_window(self, record: dict[str, Any], window: int) -> dict[str, Any]:
        """Once per logging window: system counters (``system.py``, ``energy.py``) and
        the values that hold by construction for this layout (a single process has no
        collectives and sends no gradient bytes; without a pipeline there is no bubble;
        without loss scaling the scale is 1)."""
        out = self.system.sample()
        out.update(self._energy_window(record, window))
        out["monitor_s"] = self.self_seconds()
        out["optimizer_skipped_steps"] = max(0, (self.step_fn() - self.start_step) - self.probe.optimizer_steps)
        out["parallel_degree"] = dict(self.axes)
        out["loss_scale"] = 1.0
        out["precision"] = dict(self.probe.precision)
        if self.world_size == 1:
            out["comm_share"] = 0.0
            out["wire_bytes_per_step"] = 0.0
        if self.pp == 1:
            out["bubble_fraction"] = 0.0
        return out

    def _energy_window(self, record: dict[str, Any], window: int) -> dict[str, Any]:
        """Energy, power and memory bandwidth since the last window; the trainer's record
        gives the tokens per step (``tokens`` / ``step``) and the window's steps per second."""
        tokens, step, tps = record.get("tokens"), record.get("step"), record.get("tokens_per_s")
        per_step = tokens / step if isinstance(tokens, (int, float)) and isinstance(step, int) and step > 0 else None
        steps_per_s = tps / per_step if per_step and isinstance(tps, (int, float)) else None
        forwards = self.probe.last_forwards // max(1, len(self.model_parts))
        step_bytes = training_step_bytes(self.model_parts, self.optimizers, forwards, self._activation_bytes)
        return self.energy.sample(per_step * window if per_step else None, step_bytes, steps_per_s)


def _trackers(section: MonitorSection, run_dir: Path, resumed: bool, out: list) -> None:
    """Append to ``out`` the experiment-tracker sinks the section turns on (``log(step,
    record)``, ``flush``, ``close``), opened now: before the first step, so a bad login or
    URI fails before any training."""
    if not (section.wandb or section.mlflow):
        return
    params = config_params(run_dir)
    if section.wandb:
        from trainforge.monitor.wandb_sink import WandbSink

        out.append(WandbSink(section, run_dir, params, resumed))
    if section.mlflow:
        from trainforge.monitor.mlflow_sink import MlflowSink

        out.append(MlflowSink(section, run_dir, params, resumed))
