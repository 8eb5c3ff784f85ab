"""Per-step measurements of a distributed run: communication share and peak memory.

Communication share = time spent in collectives / step time, for one profiled step
per logging window (``torch.profiler``; the collectives of gloo and NCCL show up as
``gloo:*`` / ``nccl:*`` events). Collectives that overlap compute still count, so
this is the share of the step during which the network was busy, an upper bound on
what communication costs. Only multi-process runs are profiled: a single process
has nothing to measure and pays nothing.
"""

from __future__ import annotations

import contextlib
import resource
import time

import torch
from torch.profiler import ProfilerActivity, profile

COMM_EVENT_PREFIXES = ("gloo:", "nccl:")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class CommShareProbe:
    def __init__(self, device: torch.device):
        self.device = device
        self.last_share: float | None = None

    @contextlib.contextmanager
    def measure(self, enabled: bool):
        if not enabled:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed_us = (time.perf_counter() - t0) * 1e6
        self.last_share = min(1.0, collective_us(prof) / max(elapsed_us, 1.0))


def collective_us(prof) -> float:
    """CPU microseconds inside collectives (events named ``gloo:*`` / ``nccl:*``) of a finished
    profile: ``sum(e.cpu_time_total for e in prof.events() if e.name.startswith(...))`` (checked
    in the tests), read from the profiler's raw events. ``prof.events()`` first builds a Python
    event object of every operator of the step and their tree, ~1.7 s of CPU per 20k events,
    which each rank of a DTensor run paid at every logging window (0.2 s for the 4-rank debug
    runs' steps, 1-2 s for their events); the raw events take ~1% of that."""
    from torch._C._autograd import DeviceType

    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # another torch's internals: the slow public path
        return sum(e.cpu_time_total for e in prof.events() if e.name.startswith(COMM_EVENT_PREFIXES))
    # cpu_time_total counts CPU events only (a device event's is 0).
    return sum(e.duration_ns() for e in events
               if e.device_type() == DeviceType.CPU and e.name().startswith(COMM_EVENT_PREFIXES)) / 1e3


def window_resources(device: torch.device, world_size: int, probe: CommShareProbe) -> dict:
    """Peak memory (max over ranks) and, when distributed, the communication share
    (mean over ranks) for a logging window's records. Collective when distributed."""
    import torch.distributed as dist

    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64)
    stats: dict = {}
    if world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if probe.last_share is not None:
            share = torch.tensor([probe.last_share], dtype=torch.float64)
            dist.all_reduce(share)  # mean over ranks
            stats["comm_share"] = share.item() / world_size
    stats["peak_memory_bytes"] = int(peak.item())
    return stats
