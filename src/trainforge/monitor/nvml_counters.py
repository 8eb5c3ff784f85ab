"""A GPU's energy, power and memory bandwidth from NVML (``nvidia-ml-py``, the ``gpu`` extra).

- energy: ``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded
  (Volta and later); power: ``nvmlDeviceGetPowerUsage`` (milliwatts, the board's
  average over about a second), used only where the energy counter is missing.
- memory bandwidth: GPU Performance Monitoring (GPM, Hopper and later) counts DRAM
  traffic between two samples; its ``DRAM_BW_UTIL`` (percent of the theoretical peak)
  times the peak is the achieved bandwidth over the logging window (source ``nvml_gpm``).
  Older GPUs only report the share of time the memory was busy
  (``nvmlDeviceGetUtilizationRates().memory``); that times the peak is an upper bound, not
  a measurement of bytes (source ``nvml_busy_x_peak``).
- peak: bus width (bits) / 8 x the maximum memory clock x 2 (double data rate): an H100
  SXM's 5120 bits at 2619 MHz give the published 3.35 TB/s.

Every query is tried once when the counters are made; one that fails (not supported on
this GPU, MIG, permissions) is left out for the run, so its metric is absent, never zero.
"""

from __future__ import annotations

from typing import Any


def open_nvml(index: int) -> tuple[Any, Any] | None:
    """(the pynvml module, the handle of torch's CUDA device ``index``), or None without
    nvidia-ml-py or NVML. Found by UUID: NVML numbers every GPU of the machine, CUDA only
    those in CUDA_VISIBLE_DEVICES, so the same index can name two different GPUs."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver: the GPU metrics are absent
        return None
    try:
        import torch

        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:  # an older torch without .uuid, a MIG slice: NVML's index
        pass
    try:
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


def _call(nv: Any, name: str, *args):
    """``nv.name(*args)``, or None when it fails or an older nvidia-ml-py lacks it."""
    try:
        return getattr(nv, name)(*args)
    except Exception:
        return None


class NvmlCounters:
    """``nv``: the pynvml module (or a stand-in with the same functions); ``handle``: the
    device's. Each reader returns {} when its counter is missing."""

    def __init__(self, nv: Any, handle: Any):
        self.nv, self.handle = nv, handle
        self.has_energy = _call(nv, "nvmlDeviceGetTotalEnergyConsumption", handle) is not None
        self.has_power = _call(nv, "nvmlDeviceGetPowerUsage", handle) is not None
        bus_bits = _call(nv, "nvmlDeviceGetMemoryBusWidth", handle)
        clock_mhz = _call(nv, "nvmlDeviceGetMaxClockInfo", handle, nv.NVML_CLOCK_MEM)
        self.peak_bytes_per_s = (bus_bits / 8 * clock_mhz * 1e6 * 2) if bus_bits and clock_mhz else None
        self._gpm = self._open_gpm() if self.peak_bytes_per_s else None
        self.has_busy = (self._gpm is None and self.peak_bytes_per_s is not None
                         and _call(nv, "nvmlDeviceGetUtilizationRates", handle) is not None)

    @property
    def has_gpm(self) -> bool:
        return self._gpm is not None

    def _open_gpm(self) -> list | None:
        """Two GPM samples, the first taken now (the window's start), or None."""
        nv = self.nv
        support = _call(nv, "nvmlGpmQueryDeviceSupport", self.handle)
        if support is None or not support.isSupportedDevice:
            return None
        samples = [_call(nv, "nvmlGpmSampleAlloc"), _call(nv, "nvmlGpmSampleAlloc")]
        if None in samples or _call(nv, "nvmlGpmSampleGet", self.handle, samples[0]) is None:
            return None
        return samples

    def energy_j(self) -> dict[str, float]:
        """{"gpu": joules since the driver loaded}, or {}."""
        if not self.has_energy:
            return {}
        mj = _call(self.nv, "nvmlDeviceGetTotalEnergyConsumption", self.handle)
        return {} if mj is None else {"gpu": mj / 1e3}

    def power_w(self) -> dict[str, float]:
        """{"gpu": watts now}, or {}."""
        mw = _call(self.nv, "nvmlDeviceGetPowerUsage", self.handle) if self.has_power else None
        return {} if mw is None else {"gpu": mw / 1e3}

    def bandwidth(self) -> dict[str, float]:
        """{source: bytes/s}: GPM's DRAM bandwidth since the previous call, or the busy
        share x peak of NVML's last sample period; {} without either."""
        nv = self.nv
        if self._gpm is not None:
            first, second = self._gpm
            if _call(nv, "nvmlGpmSampleGet", self.handle, second) is None:
                return {}
            get = nv.c_nvmlGpmMetricsGet_t()
            get.version, get.numMetrics, get.sample1, get.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 1, first, second
            get.metrics[0].metricId = nv.NVML_GPM_METRIC_DRAM_BW_UTIL
            self._gpm = [second, first]  # this window's end is the next one's start
            if _call(nv, "nvmlGpmMetricsGet", get) is None or get.metrics[0].nvmlReturn != nv.NVML_SUCCESS:
                return {}
            return {"nvml_gpm": get.metrics[0].value / 100.0 * self.peak_bytes_per_s}
        if self.has_busy:
            util = _call(nv, "nvmlDeviceGetUtilizationRates", self.handle)
            if util is not None:
                return {"nvml_busy_x_peak": util.memory / 100.0 * self.peak_bytes_per_s}
        return {}
