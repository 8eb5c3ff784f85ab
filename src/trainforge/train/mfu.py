"""Model-FLOPs utilisation: achieved training FLOP/s over the device's measured
dense-matmul peak. The peak is measured once per (device, dtype, threads, torch
version) and cached, because vendor peak numbers are meaningless on a shared
CPU and the measurement costs about a second. A peak measured while the machine
was busy is too low (MFU over 100% was the symptom): ``PeakFlops`` re-measures
when a run beats it and keeps the larger value."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from trainforge.json_cache import read_json_cache, write_json_cache


def _cache_file() -> Path:
    root = Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    return root / "peak_flops.json"


def _device_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{os.cpu_count()}cores-{torch.get_num_threads()}threads"
    return f"{name}|{dtype}|torch-{torch.__version__}"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                        seconds: float = 0.5) -> float:
    """Best observed FLOP/s of an n x n matmul over ~``seconds`` (best, not mean:
    the peak is what the hardware can do when nothing else interferes)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    for _ in range(2):  # warm-up
        a @ b
    # At least one timed round: on a busy CPU the warm-up alone can outlast ``seconds``, and
    # a peak of 0 was cached and divided by (ZeroDivisionError at the first logged step).
    while best == 0.0 or time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Cached ``measure_matmul_peak``."""
    path = _cache_file()
    key = _device_key(device, dtype)
    cache = read_json_cache(path)
    if key in cache:
        return float(cache[key])
    return _store_peak(device, dtype, measure_matmul_peak(device, dtype, n=_size(device)))


def _size(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 1024


def _store_peak(device: torch.device, dtype: torch.dtype, peak: float) -> float:
    path = _cache_file()
    cache = read_json_cache(path)
    cache[_device_key(device, dtype)] = peak
    write_json_cache(path, cache)
    return peak


class PeakFlops:
    """The peak FLOP/s of ``world_size`` devices, and MFU against it.

    When a run achieves more per device than the cached peak, the cache was measured under
    load: measure again and keep the larger of the new measurement and the achieved rate,
    so MFU never reads above 100% and the next run starts from the corrected figure."""

    def __init__(self, device: torch.device, world_size: int = 1, dtype: torch.dtype = torch.float32):
        self.device, self.dtype, self.world_size = device, dtype, world_size
        self.per_device = matmul_peak_flops(device, dtype)

    @property
    def total(self) -> float:
        return self.per_device * self.world_size

    def mfu(self, flops_per_s: float) -> float:
        """Achieved FLOP/s of the job / peak of its devices."""
        achieved = flops_per_s / self.world_size
        if achieved > self.per_device:
            remeasured = measure_matmul_peak(self.device, self.dtype, n=_size(self.device))
            self.per_device = _store_peak(self.device, self.dtype, max(remeasured, achieved))
        return achieved / self.per_device
