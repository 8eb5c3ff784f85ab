"""A three-tier shard cache: tier 0 memory (bounded in bytes), tier 1 a local disk
directory (bounded in bytes, atomic writes), tier 2 the source (``sources.py``).

A read is served by the highest tier holding the shard and promoted upwards. The
unit is the whole shard because integrity is per shard (``integrity.py``): every
shard is checked against its manifest sha256 the first time it enters a tier in
this process (a source fetch, a disk-to-memory promotion, or a disk file left by an
earlier run); a bad disk copy is deleted and fetched again from the source.

Eviction is Belady-style: the loader knows its future order, so ``next_use(file)``
says how many batches away the next read of a shard is. To make room, the entries
needed furthest in the future go first, and a newcomer needed later than everything
it would displace is not admitted at all (Belady with bypass). Shards with no known
next use fall back to least-recently-used. An entry being read is pinned and never
evicted. Budgets bound what the tiers hold, checked under one lock before anything
is added, so they hold under concurrent prefetch; a shard read for the current batch
but admitted nowhere lives only until that batch is assembled.

Hand-written: fsspec's caching filesystems (``filecache``, ``blockcache``) cache per
file without a byte budget, a memory tier, future-aware eviction or manifest hashes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from trainforge.data.integrity import Quarantine, ShardInfo, ShardQuarantined, problem
from trainforge.data.loader_metrics import DataMetrics
from trainforge.data.sources import ShardSource
from trainforge.errors import ConfigError
from trainforge.storage.atomic import atomic_write_bytes


class _Budget:
    """Byte accounting of one tier: what it holds, pins, recency; picks Belady victims."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.sizes: dict[str, int] = {}
        self.pins: Counter[str] = Counter()
        self.last_used: dict[str, float] = {}
        self.used = 0
        self.peak = 0  # highest ``used`` ever seen: tests check it against the budget

    def __contains__(self, file: str) -> bool:
        return file in self.sizes

    def victims(self, nbytes: int, newcomer_use: float, next_use: Callable[[str], float]) -> list[str] | None:
        """Entries to evict so ``nbytes`` fit, or None if the newcomer should not be admitted."""
        if nbytes > self.budget:
            return None
        free = self.budget - self.used
        if free >= nbytes:
            return []
        # Furthest next use first; among equals (e.g. all unknown) the least recently used.
        candidates = sorted((f for f in self.sizes if not self.pins[f]),
                            key=lambda f: (-next_use(f), self.last_used.get(f, 0.0)))
        chosen = []
        for f in candidates:
            if next_use(f) < newcomer_use:
                break  # everything left is needed sooner than the newcomer: bypass it instead
            chosen.append(f)
            free += self.sizes[f]
            if free >= nbytes:
                return chosen
        return None

    def add(self, file: str, nbytes: int) -> None:
        self.sizes[file] = nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.last_used[file] = time.monotonic()
        assert self.used <= self.budget, (self.used, self.budget)

    def remove(self, file: str) -> None:
        self.used -= self.sizes.pop(file)
        self.last_used.pop(file, None)


class TieredShardCache:
    """Serves windows of shards from memory, disk or the source; see the module docstring.

    ``infos`` maps file name to its manifest entry; ``dtype`` is the token dtype.
    ``next_use`` (set by the loader) returns batches until a shard's next read (inf if
    unknown). Thread-safe: the batch assembler and the prefetch pool call it at once."""

    def __init__(self, source: ShardSource, infos: dict[str, ShardInfo], dtype: np.dtype, memory_bytes: int,
                 disk_dir: str | Path | None, disk_bytes: int, quarantine: Quarantine, metrics: DataMetrics,
                 log: Callable[[str], None] = lambda _: None):
        largest = max((i.nbytes for i in infos.values()), default=0)
        if largest > max(memory_bytes, disk_bytes if disk_dir is not None else 0):
            raise ConfigError(f"the largest shard is {largest / 2**20:.1f} MiB, larger than data.cache.memory_mb "
                              f"and data.cache.disk_mb{'' if disk_dir else ' (no data.cache.dir)'}: a shard must "
                              "fit in one tier; raise a budget or prepare with a smaller --shard_tokens")
        self.source, self.infos, self.dtype = source, infos, np.dtype(dtype).newbyteorder("<")
        self.quarantine, self.metrics, self.log = quarantine, metrics, log
        self.next_use: Callable[[str], float] = lambda _: math.inf
        self.memory = _Budget(memory_bytes)
        self._mem: dict[str, bytes] = {}
        self.disk = _Budget(disk_bytes) if disk_dir is not None else None
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self._disk_verified: set[str] = set()
        self._lock = threading.Lock()  # guards both tiers' bookkeeping; never held during I/O
        self._file_locks: dict[str, threading.Lock] = {f: threading.Lock() for f in infos}
        if self.disk_dir is not None:
            self._scan_disk()

    # -- disk tier files -------------------------------------------------------------------

    def _disk_path(self, file: str) -> Path:
        # Named by content: two datasets with the same shard names never share a file.
        return self.disk_dir / f"{self.infos[file].sha256[:16]}-{file}"  # type: ignore[operator]

    def _scan_disk(self) -> None:
        """Adopt copies left by earlier runs (verified on first use); drop torn temporaries."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        for tmp in self.disk_dir.glob(".tmp-*"):  # type: ignore[union-attr]
            tmp.unlink(missing_ok=True)
        for file, info in self.infos.items():
            p = self._disk_path(file)
            if not p.is_file():
                continue
            if p.stat().st_size != info.nbytes or info.nbytes > self.disk.budget - self.disk.used:  # type: ignore
                p.unlink(missing_ok=True)
                continue
            self.disk.add(file, info.nbytes)  # type: ignore[union-attr]

    def _write_disk(self, file: str, data: bytes) -> None:
        """Atomic: a ``.tmp-*`` file in the same directory (``_scan_disk`` drops torn ones), fsynced, renamed."""
        atomic_write_bytes(self._disk_path(file), data, tmp_prefix=".tmp-")

    # -- admission ----------------------------------------------------------------------

    def _admit_memory(self, file: str, data: bytes) -> bool:
        with self._lock:
            if file in self.memory:
                return True
            victims = self.memory.victims(len(data), self.next_use(file), self.next_use)
            if victims is None:
                return False
            for v in victims:
                self.memory.remove(v)
                del self._mem[v]
            self.memory.add(file, len(data))
            self._mem[file] = data
            return True

    def _admit_disk(self, file: str, data: bytes) -> None:
        if self.disk is None:
            return
        with self._lock:
            if file in self.disk:
                return
            victims = self.disk.victims(len(data), self.next_use(file), self.next_use)
            if victims is None:
                return
            for v in victims:  # space is freed before it is reserved: the directory never exceeds the budget
                self.disk.remove(v)
                self._disk_verified.discard(v)
                self._disk_path(v).unlink(missing_ok=True)
            self.disk.add(file, len(data))
            self.disk.pins[file] += 1  # reserved, not yet readable
        try:
            self._write_disk(file, data)
            with self._lock:
                self._disk_verified.add(file)
        except OSError as e:
            self.log(f"data cache: could not write {file} to {self.disk_dir} ({e}); reading it from the source")
            with self._lock:
                self.disk.remove(file)
        finally:
            with self._lock:
                self.disk.pins[file] -= 1

    # -- reading --------------------------------------------------------------------------

    def _fetch(self, file: str) -> bytes:
        """From the source, verified; a bad or missing shard is condemned (raises)."""
        info = self.infos[file]
        try:
            data = self.source.read(file)
        except FileNotFoundError:
            self.quarantine.condemn(file, f"missing at {self.source.name}")
        self.metrics.read("source", len(data))
        why = problem(info, data)
        if why is not None:
            self.quarantine.condemn(file, f"{why} (at {self.source.name})")
        return data

    def _disk_bytes(self, file: str) -> bytes | None:
        """The disk copy, verified (it is entering tier 0, or this process reads it first);
        a bad copy is deleted and None returned so the source is asked. Caller holds the
        shard's file lock, so no write of this shard is in progress."""
        with self._lock:
            if self.disk is None or file not in self.disk:
                return None
            self.disk.pins[file] += 1
        try:
            data = self._disk_path(file).read_bytes()
            self.metrics.read("disk", len(data))
            why = problem(self.infos[file], data)
        except OSError as e:
            data, why = b"", f"unreadable ({e})"
        with self._lock:
            self.disk.pins[file] -= 1
            if why is None:
                self._disk_verified.add(file)
                self.disk.last_used[file] = time.monotonic()
                return data
            self.disk.remove(file)
            self._disk_verified.discard(file)
            self._disk_path(file).unlink(missing_ok=True)
        self.metrics.corrupt()
        self.log(f"data cache: {file} in {self.disk_dir} failed its check ({why}); fetching it again from "
                 f"{self.source.name}")
        return None

    def _get(self, file: str, consumer: bool) -> tuple[np.ndarray, Callable[[], None], str | None]:
        """The shard as a token array, a release callback (unpins it), and the tier the
        array lives in ("memory", "disk"; None for bytes just read and already counted)."""
        self.quarantine.check(file)
        with self._file_locks[file]:  # one thread moves a shard between tiers at a time
            with self._lock:
                data = self._mem.get(file)
                if data is not None:
                    self.memory.pins[file] += 1
                    self.memory.last_used[file] = time.monotonic()
                    mmap_disk = False
                else:
                    # Verified in this process and memory would not keep it: read windows in place.
                    mmap_disk = (self.disk is not None and file in self._disk_verified and
                                 self.memory.victims(self.infos[file].nbytes, self.next_use(file),
                                                     self.next_use) is None)
                    if mmap_disk:
                        self.disk.pins[file] += 1  # type: ignore[union-attr]
                        self.disk.last_used[file] = time.monotonic()  # type: ignore[union-attr]
            if data is not None:
                if consumer:
                    self.metrics.hit("memory")
                return self._view(data), lambda: self._unpin(self.memory, file), "memory"
            if mmap_disk:
                if consumer:
                    self.metrics.hit("disk")
                arr = np.memmap(self._disk_path(file), dtype=self.dtype, mode="r")
                return arr, lambda: self._unpin(self.disk, file), "disk"  # type: ignore[arg-type]
            data = self._disk_bytes(file)
            tier = "disk"
            if data is None:
                data, tier = self._fetch(file), "source"
                self._admit_disk(file, data)
            if consumer:
                self.metrics.hit(tier)
            if self._admit_memory(file, data):
                with self._lock:
                    self.memory.pins[file] += 1
                return self._view(data), lambda: self._unpin(self.memory, file), None
            return self._view(data), lambda: None, None  # transient: dropped after this batch

    def _view(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=self.dtype)

    def _unpin(self, tier: _Budget, file: str) -> None:
        with self._lock:
            tier.pins[file] -= 1

    def read_windows(self, file: str, offsets: np.ndarray, length: int) -> np.ndarray:
        """Rows ``shard[o : o + length]`` for each offset, copied out: (len(offsets), length).
        Raises ShardQuarantined (skip) or DataError (fail) for a bad shard."""
        arr, release, tier = self._get(file, consumer=True)
        try:
            rows = np.stack([arr[o:o + length] for o in offsets])
        finally:
            release()
        if tier is not None:
            self.metrics.read(tier, rows.nbytes)
        return rows

    def prefetch(self, file: str) -> None:
        """Bring ``file`` into the highest tier that will keep it (nothing if none would)."""
        if file in self.quarantine or self.resident_tier(file) == "memory":
            return
        nbytes, use = self.infos[file].nbytes, self.next_use(file)
        with self._lock:
            mem_ok = self.memory.victims(nbytes, use, self.next_use) is not None
            disk_ok = self.disk is not None and (file in self.disk or
                                                 self.disk.victims(nbytes, use, self.next_use) is not None)
        if not (mem_ok or disk_ok) or (not mem_ok and self.resident_tier(file) == "disk"):
            return
        _, release, _ = self._get(file, consumer=False)
        release()

    def verify(self, file: str) -> None:
        """Read ``file`` into the highest tier that keeps it (or just read it), checking it:
        a bad or unreachable shard raises now. Quarantined shards are left alone."""
        if file in self.quarantine:
            return
        try:
            _, release, _ = self._get(file, consumer=False)
        except ShardQuarantined:
            return
        release()

    def resident_tier(self, file: str) -> str | None:
        with self._lock:
            if file in self._mem:
                return "memory"
            if self.disk is not None and file in self.disk:
                return "disk"
        return None
