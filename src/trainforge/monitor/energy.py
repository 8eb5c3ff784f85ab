"""Power, energy per token and memory bandwidth, once per logging window.

Read at the logging interval, after the trainer's synchronise, never inside a step:
the counters are files and NVML calls, not device work.

- energy per domain (``gpu`` from NVML on each rank's own GPU; ``package``, ``dram``,
  ``core``, ``uncore``, ``psys`` from RAPL, read by local rank 0 only, since RAPL counts
  the whole machine and every rank of a node would otherwise report it again): joules
  between two windows (validation and checkpoint saves in between included), the mean
  power over that time, and joules per token trained in it. Energy per token divides by
  the whole job's tokens, so summing a domain over ranks gives the job's figure.
- memory bandwidth per source: ``nvml_gpm`` (a GPU's DRAM counters), ``nvml_busy_x_peak``
  (an upper bound on GPUs without them), ``perf_uncore`` (the CPU memory controllers'
  counters, ``perf_uncore.py``, local rank 0, the whole machine), and always ``step_bytes_estimate``: the modelled
  bytes of one step (``step_bytes.py``) x steps per second. The source is a label of the
  metric, so an estimate is never read as a measurement.

A counter that is not readable here gives no value at all: the key is missing from the
record, and the metric from Prometheus, rather than a zero.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from trainforge.monitor import rapl
from trainforge.monitor.nvml_counters import NvmlCounters, open_nvml
from trainforge.monitor.perf_uncore import UncoreMeter


class EnergySampler:
    """``device``: this rank's; ``local_rank``: RAPL is read where it is 0; ``nvml``:
    a (module, handle) pair to use instead of opening NVML (tests); ``powercap``: the
    powercap directory (tests point it at a fake tree); ``uncore``: a meter of the memory
    controllers' bytes (default: opened on local rank 0)."""

    def __init__(self, device: torch.device, local_rank: int = 0, nvml: tuple[Any, Any] | None = None,
                 powercap: Path | None = None, uncore: UncoreMeter | None = None):
        self.rapl = rapl.RaplMeter(powercap or rapl.POWERCAP) if local_rank == 0 else None
        self.uncore = uncore if uncore is not None else UncoreMeter() if local_rank == 0 else None
        if nvml is None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            nvml = open_nvml(index)
        self.gpu = NvmlCounters(*nvml) if nvml is not None else None
        self._t = time.perf_counter()
        self._joules = self._read_joules()
        self._tokens: float | None = None
        self._dram_bytes = self._read_dram_bytes()

    def sources(self) -> dict[str, list[str]]:
        """What this process can read: {"energy": domains, "bandwidth": counter sources}."""
        energy = list(self.rapl.domains) if self.rapl is not None else []
        bandwidth = ["perf_uncore"] if self.uncore is not None and self.uncore.events else []
        if self.gpu is not None:
            energy += ["gpu"] if self.gpu.has_energy else []
            bandwidth += ["nvml_gpm"] if self.gpu.has_gpm else []
            bandwidth += ["nvml_busy_x_peak"] if self.gpu.has_busy else []
        return {"energy": energy, "bandwidth": bandwidth}

    def close(self) -> None:
        if self.uncore is not None:
            self.uncore.close()

    def _read_dram_bytes(self) -> float | None:
        counts = self.uncore.read() if self.uncore is not None else {}
        return sum(counts.values()) if counts else None

    def _read_joules(self) -> dict[str, float]:
        out = dict(self.rapl.read()) if self.rapl is not None else {}
        if self.gpu is not None:
            out.update(self.gpu.energy_j())
        return out

    def sample(self, tokens: float | None, step_bytes: int | None = None,
               steps_per_s: float | None = None) -> dict[str, Any]:
        """Record values for the window since the previous call. ``tokens``: tokens the
        job has trained so far (None if unknown); ``step_bytes`` x ``steps_per_s``: the
        estimated bandwidth."""
        now, joules, dram = time.perf_counter(), self._read_joules(), self._read_dram_bytes()
        dt = now - self._t
        # A counter that went backwards (driver reload, a zone gone) has no value this window.
        energy = {d: j - self._joules[d] for d, j in joules.items()
                  if d in self._joules and j >= self._joules[d]}
        d_tokens = tokens - self._tokens if tokens is not None and self._tokens is not None else None
        self._t, self._joules, self._tokens = now, joules, tokens
        out: dict[str, Any] = {}
        if energy and dt > 0:
            out["energy_j"] = energy
            out["power_w"] = {d: e / dt for d, e in energy.items()}
            if d_tokens is not None and d_tokens > 0:  # a resume or rollback moves tokens back: no value
                out["energy_per_token_j"] = {d: e / d_tokens for d, e in energy.items()}
        if self.gpu is not None and "gpu" not in energy:
            if power := self.gpu.power_w():  # no energy counter (older GPU): NVML's power reading
                out.setdefault("power_w", {}).update(power)
        bandwidth: dict[str, float] = self.gpu.bandwidth() if self.gpu is not None else {}
        if dram is not None and self._dram_bytes is not None and dt > 0:
            bandwidth["perf_uncore"] = (dram - self._dram_bytes) / dt
        self._dram_bytes = dram
        if step_bytes and steps_per_s:
            bandwidth["step_bytes_estimate"] = step_bytes * steps_per_s
        if bandwidth:
            out["memory_bandwidth_bytes_per_s"] = bandwidth
        if self.gpu is not None and self.gpu.peak_bytes_per_s:
            out["memory_bandwidth_peak_bytes_per_s"] = self.gpu.peak_bytes_per_s
        if step_bytes:
            out["step_bytes_estimate"] = step_bytes
        return out
