"""System metrics of this process and its device, read at the logging interval.

Linux ``/proc`` for CPU, memory and I/O (no psutil needed); torch.cuda for the
allocator; NVML (``nvidia-ml-py``, the ``gpu`` extra) for GPU utilisation and PCIe
traffic, each left out when unavailable rather than reported as zero.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from trainforge.monitor.nvml_counters import open_nvml


def _proc_stat_busy() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs."""
    try:
        vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already in user
    return float(total - idle), float(total)


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _io_bytes() -> dict[str, int] | None:
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return {"storage": int(fields["read_bytes"]), "syscall": int(fields["rchar"])}
    except (OSError, ValueError, KeyError):
        return None  # some containers hide /proc/self/io


class SystemSampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.ncpu = os.cpu_count() or 1
        self._t, self._cpu, self._stat = time.perf_counter(), self._cpu_s(), _proc_stat_busy()
        self._nvml = None
        if device.type == "cuda":  # None without nvidia-ml-py or NVML: those metrics are left out
            self._nvml = open_nvml(device.index if device.index is not None else torch.cuda.current_device())

    @staticmethod
    def _cpu_s() -> float:
        t = os.times()
        return t.user + t.system

    def sample(self) -> dict[str, Any]:
        """Values now, and CPU utilisation since the previous call."""
        now, cpu, stat = time.perf_counter(), self._cpu_s(), _proc_stat_busy()
        out: dict[str, Any] = {"cpu_seconds": cpu,
                               "cpu_util": (cpu - self._cpu) / max(now - self._t, 1e-9) / self.ncpu}
        if stat is not None and self._stat is not None and stat[1] > self._stat[1]:
            out["host_cpu_util"] = (stat[0] - self._stat[0]) / (stat[1] - self._stat[1])
        self._t, self._cpu, self._stat = now, cpu, stat
        if (rss := _rss_bytes()) is not None:
            out["rss_bytes"] = rss
        if (io := _io_bytes()) is not None:
            out["io_read_bytes"] = io
        if self.device.type == "cuda":
            out["gpu_memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            out["gpu_memory_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        if self._nvml is not None:
            nv, handle = self._nvml
            try:
                out["gpu_util"] = nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                # NVML counts from the GPU's side: RX = host -> device. KB/s over a 20 ms sample.
                out["pcie_bytes_per_s"] = {
                    "h2d": 1024.0 * nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES),
                    "d2h": 1024.0 * nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES)}
            except Exception:  # NVML can refuse per query (MIG, permissions); keep the rest
                pass
        return out
