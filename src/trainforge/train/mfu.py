"""Model-FLOPs utilisation: achieved training FLOP/s over the peak of the job's devices.

The peak comes from one of two places, and says which (``PeakFlops.source``, logged at
startup and in every train record as ``mfu_peak_source``, beside ``mfu_peak_flops``):

- published: a CUDA device in ``PUBLISHED_TFLOPS`` (NVIDIA's dense figures for the
  compute dtype; fp32 is TF32 when torch lets matmuls use it). Load cannot spoil it.
- measured: anything else (CPUs, GPUs not in the table): the best of ``PROBES`` short
  dense-matmul probes, cached per (device, dtype, threads, torch version) because a
  vendor figure means nothing on a shared CPU and probing costs most of a second.

A peak measured while the machine was busy is too low, and MFU used to read above 100%.
What keeps that from happening: the probes are spread over ~0.7 s and the best one counts
(a burst of load spoils some, not all); the cache only ever rises (a busy run cannot lower
a good figure), and each run checks it with one short probe (~0.1 s), measuring again when
that beats it; and a logging window that beats the peak re-probes and raises it to at
least the achieved rate. MFU is clamped at 1 only for rounding after that.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

import torch

from trainforge.json_cache import read_json_cache, write_json_cache

PROBES = 5  # short matmul probes per measurement; the best counts
PROBE_S = 0.1  # seconds per probe
PAUSE_S = 0.05  # between probes: a short burst of load then spoils fewer of them

# Dense (no structured sparsity) peak TFLOP/s per device from NVIDIA's datasheets; the
# sparse figures there are twice these. First match wins, so variants precede the family.
PUBLISHED_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100 NVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100 PCIe\b", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5
    (r"\bH200 NVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bV100-SXM2\b", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bV100-PCIE\b", {"fp16": 112.0, "fp32": 14.0}),
)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _cache_file() -> Path:
    root = Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    return root / "peak_flops.json"


def _device_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{os.cpu_count()}cores-{torch.get_num_threads()}threads"
    return f"{name}|{dtype}|torch-{torch.__version__}"


def _size(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 1024


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
                        probes: int = PROBES, probe_s: float = PROBE_S, pause_s: float = PAUSE_S) -> float:
    """Best FLOP/s of an n x n matmul over ``probes`` probes of ~``probe_s`` each (best,
    not mean: the peak is what the hardware does when nothing else interferes)."""
    n = n or _size(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # Several matmuls between CUDA syncs, so the sync's latency does not count; one on CPU,
    # where a 1024 x 1024 matmul already takes tens of milliseconds on one thread.
    reps = 8 if device.type == "cuda" else 1
    for _ in range(2):  # warm-up
        a @ b
    best = 0.0
    for i in range(probes):
        if i:
            time.sleep(pause_s)
        deadline = time.perf_counter() + probe_s
        timed = False  # at least one round per probe: on a busy CPU one round can outlast probe_s
        while not timed or time.perf_counter() < deadline:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = max(best, reps * 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
            timed = True
    return best


def _store_peak(device: torch.device, dtype: torch.dtype, peak: float) -> float:
    """Keep the larger of ``peak`` and the cached figure; returns what is cached."""
    path = _cache_file()
    cache = read_json_cache(path)
    key = _device_key(device, dtype)
    try:
        peak = max(peak, float(cache.get(key, 0.0)))
    except (TypeError, ValueError):  # a damaged entry is no figure
        pass
    cache[key] = peak
    write_json_cache(path, cache)
    return peak


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, check: bool = False) -> float:
    """Cached ``measure_matmul_peak`` (measured on the first call per device key).
    ``check``: one short probe first; when it beats the cached figure (measured under load,
    perhaps by an older version), measure again in full and raise the cache."""
    cached = read_json_cache(_cache_file()).get(_device_key(device, dtype))
    if isinstance(cached, (int, float)) and cached > 0:
        if not check or measure_matmul_peak(device, dtype, probes=1) <= cached:
            return float(cached)
    return _store_peak(device, dtype, measure_matmul_peak(device, dtype))


def _tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may run as TF32 (then the TF32 figure is the peak)."""
    if getattr(torch.backends.cuda.matmul, "fp32_precision", None) == "tf32":
        return True
    return torch.get_float32_matmul_precision() != "highest"


def published_peak(device_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str] | None:
    """(FLOP/s, source) of a device in ``PUBLISHED_TFLOPS``, or None when it or the dtype is not there."""
    name = dtype_name(dtype)
    if name == "fp32" and tf32:
        name = "tf32"
    for pattern, peaks in PUBLISHED_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            if name not in peaks:
                return None
            return peaks[name] * 1e12, f"published: {device_name} {name} dense"
    return None


def format_flops(flops_per_s: float) -> str:
    """``1.23 TFLOP/s``: the unit picked so that the figure is at least 1."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.3g} {unit}"
    return f"{flops_per_s / 1e6:.3g} MFLOP/s"


class PeakFlops:
    """The peak FLOP/s of ``world_size`` devices, where it came from, and MFU against it.

    ``dtype``: the run's compute dtype (its matmuls are what MFU counts). When a logging
    window achieves more per device than the peak, the peak was measured under load (or
    the table or the FLOP count is off): probe again and keep the largest of the old peak,
    the new probe and the achieved rate, so MFU never reads above 100% and the next run
    starts from the corrected figure. ``log``: called with one line when that happens."""

    def __init__(self, device: torch.device, world_size: int = 1, dtype: torch.dtype = torch.float32,
                 log: Callable[[str], None] | None = None):
        self.device, self.dtype, self.world_size, self.log = device, dtype, world_size, log
        self.measured = True
        published = None
        if device.type == "cuda":
            published = published_peak(torch.cuda.get_device_name(device), dtype,
                                       tf32=dtype == torch.float32 and _tf32_matmuls())
        if published is not None:
            self.per_device, self.source = published
            self.measured = False
        else:
            self.per_device = matmul_peak_flops(device, dtype, check=True)  # ~0.1 s when cached
            self.source = f"measured: best of {PROBES} {dtype_name(dtype)} matmul probes"

    @property
    def total(self) -> float:
        """The job's peak: per device x devices (``mfu_peak_flops``)."""
        return self.per_device * self.world_size

    def record(self) -> dict[str, float | str]:
        """What every train record carries about the peak."""
        return {"mfu_peak_flops": self.total, "mfu_peak_source": self.source}

    def describe(self) -> str:
        per = f" ({self.world_size} x {format_flops(self.per_device)})" if self.world_size > 1 else ""
        return f"{format_flops(self.total)}{per}, {self.source}"

    def mfu(self, flops_per_s: float, step: int | None = None) -> float:
        """Achieved FLOP/s of the job / peak of its devices, at most 1."""
        achieved = flops_per_s / self.world_size
        if achieved > self.per_device:
            self._raise(achieved, step)
        return min(1.0, achieved / self.per_device)

    def _raise(self, achieved: float, step: int | None) -> None:
        old = self.per_device
        probed = measure_matmul_peak(self.device, self.dtype)
        self.per_device = max(old, probed, achieved)
        if self.measured:
            self.per_device = _store_peak(self.device, self.dtype, self.per_device)
        at = f"step {step}" if step is not None else "a logging window"
        probes = f"{PROBES} {dtype_name(self.dtype)} matmul probes"
        if probed >= achieved:
            self.source = f"measured: best of {probes}, re-probed at {at}"
        else:
            self.source = f"achieved: {at} beat the best of {probes}"
        if self.log is not None:
            self.log(f"mfu peak raised from {format_flops(old)} to {format_flops(self.per_device)} per device: "
                     f"{at} ran at {format_flops(achieved)} per device ({self.source})")
