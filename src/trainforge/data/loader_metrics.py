"""Counters of the data pipeline, reported at the trainer's logging interval:
how long the loop waited for batches (I/O wait fraction), which tier served each
shard read (hit rate per tier), bytes read per tier, and how many of the next
``prefetch_depth`` shards were already cached when a batch was taken.

Background threads update the counters; ``window()`` reads and resets them once
per logging interval (no host sync: these are plain Python numbers).
"""

from __future__ import annotations

import threading
import time

TIERS = ("memory", "disk", "source")


class DataMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.quarantined = 0  # cumulative, not per window
        self.corrupt_refetched = 0  # cumulative: tier copies that failed their hash and were fetched again
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.hits = dict.fromkeys(TIERS, 0)
        self.bytes = dict.fromkeys(TIERS, 0)
        self.io_wait_s = 0.0
        self.depth_sum, self.depth_n = 0, 0
        self.window_start = now

    def hit(self, tier: str) -> None:
        """One shard read by the batch assembler was served by ``tier``."""
        with self._lock:
            self.hits[tier] += 1

    def read(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[tier] += nbytes

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.io_wait_s += seconds

    def depth(self, cached: int) -> None:
        with self._lock:
            self.depth_sum += cached
            self.depth_n += 1

    def corrupt(self) -> None:
        with self._lock:
            self.corrupt_refetched += 1

    def window(self, cache: bool = True) -> dict[str, float | int]:
        """Metrics since the previous call (keys prefixed ``data_``); resets the window.
        ``cache=False`` (memory-mapped local data) reports only the I/O wait (and the
        quarantined shards, once there are any)."""
        now = time.perf_counter()
        with self._lock:
            wall = max(now - self.window_start, 1e-9)
            out: dict[str, float | int] = {"data_io_wait_frac": round(min(self.io_wait_s / wall, 1.0), 5)}
            if cache:
                reads = sum(self.hits.values())
                for t in TIERS:
                    out[f"data_hit_rate_{t}"] = round(self.hits[t] / reads, 4) if reads else 0.0
                for t in TIERS:
                    out[f"data_bytes_{t}"] = self.bytes[t]
                out["data_prefetch_depth"] = round(self.depth_sum / self.depth_n, 3) if self.depth_n else 0.0
                out["data_corrupt_refetched"] = self.corrupt_refetched
                out["data_quarantined"] = self.quarantined
            elif self.quarantined:  # memory-mapped data under on_corrupt = "skip"
                out["data_quarantined"] = self.quarantined
            self._reset(now)
        return out
