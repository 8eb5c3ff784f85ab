"""Predictive prefetch: a background pool keeps the next ``prefetch_depth`` shards the
sampler will read (known exactly: the order is a function of seed, epoch and
position) in the highest cache tier that will keep them, ahead of the batch assembler.

A coordinator thread wakes when the assembler moves on (``poke``) or a fetch ends,
asks for the upcoming shards, and submits those not cached and not in flight to a
``ThreadPoolExecutor``. Fetches are I/O and hashing (both release the GIL), so threads
suffice. A failed fetch is not raised here: the assembler's own read of that shard
meets the same fault and raises it in the training loop, where the user sees it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from trainforge.data.tiered_cache import TieredShardCache


class ShardPrefetcher:
    def __init__(self, cache: TieredShardCache, upcoming: Callable[[int], list[str]], depth: int, workers: int):
        self.cache, self.upcoming, self.depth = cache, upcoming, depth
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainforge-prefetch")
        self._inflight: set[str] = set()
        # Tried since the assembler last moved: a shard no tier would admit is not fetched
        # over and over while the loop waits on the same batch.
        self._tried: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainforge-prefetch-coordinator", daemon=True)
        self._workers = workers
        self._thread.start()

    def poke(self) -> None:
        """The assembler moved on: the upcoming shards changed."""
        with self._lock:
            self._tried.clear()
        self._wake.set()

    def cached_ahead(self) -> int:
        """How many of the next ``depth`` shards are already in a cache tier (the depth achieved)."""
        return sum(self.cache.resident_tier(f) is not None for f in self.upcoming(self.depth))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                wanted = self.upcoming(self.depth)
            except Exception:  # the loader is being reset; try again on the next wake
                continue
            for file in wanted:
                with self._lock:
                    if file in self._inflight or file in self._tried or len(self._inflight) >= self._workers:
                        continue
                    if self.cache.resident_tier(file) == "memory" or file in self.cache.quarantine:
                        continue
                    self._inflight.add(file)
                    self._tried.add(file)
                try:
                    fut = self._pool.submit(self.cache.prefetch, file)
                except RuntimeError:  # pool shut down by close()
                    return
                fut.add_done_callback(lambda f, name=file: self._done(name, f))

    def _done(self, file: str, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(file)
        fut.exception()  # consumed: the assembler re-raises the same fault when it reads the shard
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
