"""The trainer's data loader: ``BatchPlan``'s deterministic order (the same batches as
``TokenBatches``), assembled ahead of use by a background thread, read from memory-
mapped local shards or from the tiered cache with predictive prefetch, augmented per
sample, and resumable from ``state_dict()`` (the consumer's position: batches taken by
the loop, not those assembled ahead).

On CPU the next batch is assembled while the current step runs; on CUDA batches are
also staged in pinned memory and copied to the device on a side stream, one batch
ahead. ``window_stats()`` reports the data metrics at the logging interval.

Hand-written rather than torchdata's StatefulDataLoader: the order is already a pure
function of (seed, epoch, position), so the state is two integers; the cache and the
prefetcher need that order (future shard reads), which a sampler/worker split hides;
and worker processes would copy every shard's bytes across process boundaries.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import numpy as np
import torch

from trainforge.data.augment import Augmenter
from trainforge.data.integrity import ShardQuarantined
from trainforge.data.loader_metrics import DataMetrics
from trainforge.data.prefetch import ShardPrefetcher
from trainforge.data.sampler import BatchPlan
from trainforge.data.tiered_cache import TieredShardCache
from trainforge.errors import DataError


class ShardStore(Protocol):
    cached: bool  # True: reads go through the tiered cache (its metrics are reported)

    def read_windows(self, shard: int, offsets: np.ndarray, length: int) -> np.ndarray: ...


class MmapShards:
    """Local shards memory-mapped once (verified when opened): the page cache is the cache."""

    cached = False

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays

    def read_windows(self, shard: int, offsets: np.ndarray, length: int) -> np.ndarray:
        return np.stack([self.arrays[shard][o:o + length] for o in offsets])


class CachedShards:
    """One split's shards, read through a ``TieredShardCache``."""

    cached = True

    def __init__(self, cache: TieredShardCache, files: list[str]):
        self.cache, self.files = cache, files
        self.index = {f: i for i, f in enumerate(files)}

    def read_windows(self, shard: int, offsets: np.ndarray, length: int) -> np.ndarray:
        return self.cache.read_windows(self.files[shard], offsets, length)


class ShardLoader:
    """(inputs, targets) batches, each (batch_size, T) int64 (T = seq_len, or the length
    curriculum's; ``serve_seq_len``: (batch_size x seq_len / n, n)); targets of padding are
    -100. ``ready_batches = 0`` assembles in the caller's thread (validation, tests)."""

    def __init__(self, plan: BatchPlan, store: ShardStore, metrics: DataMetrics | None = None,
                 augmenter: Augmenter | None = None, prefetch_depth: int = 0, fetch_workers: int = 1,
                 ready_batches: int = 2, device: torch.device | str = "cpu"):
        self.plan, self.store, self.augmenter = plan, store, augmenter
        self.metrics = metrics or DataMetrics()
        self.batches_per_epoch = plan.batches_per_epoch
        self.ready_batches, self.device = ready_batches, torch.device(device)
        self.prefetch_depth, self.fetch_workers = prefetch_depth, fetch_workers
        self._cursor = plan.batch_at(plan.epoch, plan.position)  # the batch being assembled
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._prefetcher: ShardPrefetcher | None = None
        self._staged: tuple | None = None  # CUDA: the next batch, already copying to the device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._row_len = plan.seq_len  # tokens per served row (serve_seq_len)
        if isinstance(store, CachedShards):
            # Belady: the cache asks how far away each shard's next read is.
            store.cache.next_use = self._next_use

    # -- the future ---------------------------------------------------------------------------

    def _next_use(self, file: str) -> float:
        shard = self.store.index.get(file)  # type: ignore[attr-defined]
        if shard is None:
            return float("inf")  # another split's shard: least-recently-used among those
        return self.plan.batches_until(shard, *self._cursor)

    def _upcoming(self, count: int) -> list[str]:
        files = self.store.files  # type: ignore[attr-defined]
        return [files[s] for s in self.plan.upcoming_shards(*self._cursor, count)]

    # -- assembly ---------------------------------------------------------------------------

    def _rows(self, epoch: int, position: int) -> np.ndarray:
        """(batch_size, T+1) tokens; windows of a quarantined shard are replaced by the
        next windows of the epoch order that lie in healthy shards."""
        windows = self.plan.batch_windows(epoch, position)
        length = self.plan.seq_len + 1
        rows = np.empty((len(windows), length), dtype=np.int64)
        for shard in np.unique(windows[:, 0]):
            at = np.flatnonzero(windows[:, 0] == shard)
            try:
                rows[at] = self.store.read_windows(int(shard), windows[at, 1], length)
            except ShardQuarantined:
                for j in at:
                    rows[j] = self._replacement(epoch, int(self.plan.sample_ids(epoch, position)[j]), length)
        return rows

    def _replacement(self, epoch: int, sample_id: int, length: int) -> np.ndarray:
        order = self.plan.epoch_order(epoch)
        for k in range(1, len(order)):
            shard, offset = self.plan.windows[order[(sample_id + k) % len(order)]]
            try:
                return self.store.read_windows(int(shard), np.array([offset]), length)[0]
            except ShardQuarantined:
                continue
        raise DataError("every shard of the split is quarantined (data.on_corrupt = \"skip\"): nothing left to read")

    def _assemble(self, epoch: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows(epoch, position)
        if self.augmenter is None:
            batch = torch.from_numpy(rows)  # (B, T+1)
            inputs, targets = batch[:, :-1], batch[:, 1:]
        else:
            step = epoch * self.batches_per_epoch + position
            ids = self.plan.sample_ids(epoch, position)
            pairs = [self.augmenter(rows[j], epoch, int(ids[j]), step) for j in range(len(rows))]
            inputs = torch.from_numpy(np.stack([p[0] for p in pairs]))
            targets = torch.from_numpy(np.stack([p[1] for p in pairs]))
        if self._stream is not None:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs, targets

    def _run(self, out: queue.Queue, stop: threading.Event, epoch: int, position: int) -> None:
        # The queue and stop flag are this thread's own: after _halt abandons a thread stuck
        # in a slow read, it can never feed a later assembler's queue.
        while not stop.is_set():
            self._cursor = (epoch, position)
            if self._prefetcher is not None:
                self._prefetcher.poke()
            try:
                item: tuple = (epoch, position, self._assemble(epoch, position))
            except BaseException as e:  # raised in the training loop by next()
                item = (epoch, position, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[2], BaseException):
                return
            epoch, position = self.plan.batch_at(epoch, position + 1)

    def _start(self) -> None:
        self._cursor = self.plan.batch_at(self.plan.epoch, self.plan.position)
        if isinstance(self.store, CachedShards) and self.prefetch_depth > 0 and self._prefetcher is None:
            self._prefetcher = ShardPrefetcher(self.store.cache, self._upcoming, self.prefetch_depth,
                                               self.fetch_workers)
        self._queue, self._stop = queue.Queue(maxsize=max(self.ready_batches, 1)), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._queue, self._stop, *self._cursor),
                                        name="trainforge-batch-assembler", daemon=True)
        self._thread.start()

    def _halt(self, wait_s: float = 2.0) -> None:
        """Stop the assembler and drop batches assembled ahead (they are re-made on demand).
        A thread still blocked in a source read after ``wait_s`` is left to finish on its
        own (daemon; bounded by data.timeout_s) so shutdown never hangs on a slow source."""
        if self._thread is not None:
            self._stop.set()
            deadline = time.monotonic() + wait_s
            while self._thread.is_alive() and time.monotonic() < deadline:
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None
        self._staged = None

    # -- consumer ---------------------------------------------------------------------------

    def _take(self, block: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next batch in order, advancing the consumer position; None if not ready."""
        if self._failed is not None:
            raise self._failed
        if self.ready_batches == 0:
            t0 = time.perf_counter()
            epoch, position = self.plan.advance()
            self._cursor = (epoch, position)
            batch = self._assemble(epoch, position)
            self.metrics.waited(time.perf_counter() - t0)
            return batch
        if self._thread is None:
            self._start()
        t0 = time.perf_counter()
        try:
            epoch, position, batch = self._queue.get(block=block)
        except queue.Empty:
            return None
        self.metrics.waited(time.perf_counter() - t0)
        if isinstance(batch, BaseException):
            self._failed = batch
            raise batch
        assert (epoch, position) == self.plan.batch_at(self.plan.epoch, self.plan.position)
        self.plan.epoch, self.plan.position = epoch, position + 1
        return batch

    def verify_next(self) -> None:
        """Fetch and check the shards of the next batch without taking it, so a bad or
        unreachable shard fails during setup (memory-mapped shards were checked when opened)."""
        if not isinstance(self.store, CachedShards):
            return
        windows = self.plan.batch_windows(*self.plan.batch_at(self.plan.epoch, self.plan.position))
        for shard in np.unique(windows[:, 0]):
            self.store.cache.verify(self.store.files[int(shard)])

    def _to_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        with torch.cuda.stream(self._stream):
            moved = tuple(t.to(self.device, non_blocking=True) for t in batch)
        done = torch.cuda.Event()
        done.record(self._stream)
        return moved, done

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stream is None:
            batch = self._take()
        else:
            staged = self._staged or self._to_device(self._take())
            (inputs, targets), done = staged
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in (inputs, targets):  # allocated on the side stream, used on the current one
                t.record_stream(current)
            ahead = self._take(block=False)
            self._staged = self._to_device(ahead) if ahead is not None else None
            batch = (inputs, targets)
        if self._prefetcher is not None:
            self.metrics.depth(self._prefetcher.cached_ahead())
        if self._row_len != self.plan.seq_len:
            # (B, seq_len) -> (B x seq_len / n, n): row r's pieces in order, each input with its own
            # next-token target (targets are the inputs shifted in the seq_len + 1 window).
            batch = tuple(t.reshape(-1, self._row_len) for t in batch)
        return batch  # type: ignore[return-value]

    def serve_seq_len(self, n: int) -> None:
        """Serve each window as ``seq_len / n`` rows of ``n`` tokens from the next batch on
        (``train/seq_len_schedule.py``). The same windows in the same order: the position,
        the tokens per batch and every (input, target) pair are unchanged; only the context a
        token sees is cut at multiples of ``n``. Applied as batches are taken, so batches
        assembled ahead need no re-making."""
        if n < 1 or self.plan.seq_len % n:
            raise ValueError(f"a served length must divide the window's {self.plan.seq_len} tokens, got {n}")
        if self.augmenter is not None and self.augmenter.changes_length:
            raise ValueError("the augmentation already changes the sequence length (seq_curriculum)")
        self._row_len = n

    # -- state, metrics, shutdown --------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def position(self) -> int:
        return self.plan.position

    def state_dict(self) -> dict[str, int]:
        """The consumer's position (epoch, position), plus what it is only valid for. The
        augmentation RNG is derived from (seed, epoch, sample index), so it needs no state."""
        state = self.plan.state_dict()
        if self._staged is not None:  # CUDA: the staged batch was taken but not yet returned
            state["position"] -= 1
            if state["position"] < 0:
                state["epoch"], state["position"] = state["epoch"] - 1, self.batches_per_epoch
        return state

    def global_batch_windows(self, epoch: int, position: int) -> np.ndarray:
        """(shard, offset) of every sequence of a global batch (bad-step sample ids)."""
        return self.plan.global_batch_windows(epoch, position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._halt()
        self.plan.load_state_dict(state)
        self._cursor = self.plan.batch_at(self.plan.epoch, self.plan.position)
        self._failed = None

    def window_stats(self) -> dict[str, float | int]:
        return self.metrics.window(cache=self.store.cached)

    def close(self) -> None:
        self._halt()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
