"""Shard integrity: every shard is checked against its manifest size and sha256 the
first time it enters a cache tier, and a shard that is bad in every tier is either
quarantined (logged, counted, its windows replaced) or stops the run, per
``data.on_corrupt``. A truncated, modified or missing shard never yields tokens.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable

from trainforge.data.loader_metrics import DataMetrics
from trainforge.errors import DataError


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest describes it."""

    file: str  # name inside the prepared directory, e.g. train_00003.bin
    nbytes: int
    sha256: str


def problem(info: ShardInfo, data: bytes | memoryview) -> str | None:
    """Why ``data`` is not ``info``'s shard, or None when size and sha256 match."""
    if len(data) != info.nbytes:
        kind = "truncated" if len(data) < info.nbytes else "too long"
        return f"{kind}: {len(data)} bytes, manifest says {info.nbytes}"
    if hashlib.sha256(data).hexdigest() != info.sha256:
        return "sha256 does not match the manifest (modified or corrupted)"
    return None


class ShardQuarantined(DataError):
    """Raised to the reader of a quarantined shard (``on_corrupt = "skip"``): its windows
    must be replaced, never read."""


class Quarantine:
    """Shards bad in every tier. ``condemn`` records one and, per policy, raises
    ``DataError`` (fail: the run stops naming the shard) or ``ShardQuarantined`` (skip)."""

    def __init__(self, on_corrupt: str, source_name: str, log: Callable[[str], None],
                 metrics: DataMetrics | None = None):
        if on_corrupt not in ("fail", "skip"):
            raise ValueError(f"on_corrupt {on_corrupt!r}")
        self.on_corrupt, self.source_name, self.log, self.metrics = on_corrupt, source_name, log, metrics
        self._bad: dict[str, str] = {}
        self._lock = threading.Lock()

    def __contains__(self, file: str) -> bool:
        return file in self._bad

    def __len__(self) -> int:
        return len(self._bad)

    def check(self, file: str) -> None:
        if file in self._bad:
            raise ShardQuarantined(f"shard {file} is quarantined: {self._bad[file]}")

    def condemn(self, file: str, reason: str) -> None:
        message = f"shard {file} from {self.source_name} is bad in every tier: {reason}"
        if self.on_corrupt == "fail":
            raise DataError(f"{message}; re-run `trainforge prepare` or restore the file "
                            "(data.on_corrupt = \"skip\" would quarantine it and train on the rest)")
        with self._lock:
            first = file not in self._bad
            self._bad[file] = reason
            if self.metrics is not None:
                self.metrics.quarantined = len(self._bad)
        if first:
            self.log(f"{message}; quarantined (data.on_corrupt = \"skip\"): its windows are replaced by others")
        raise ShardQuarantined(f"shard {file} is quarantined: {reason}")
