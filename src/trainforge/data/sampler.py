"""The batch order: a pure function of (seed, epoch, position).

Windows of ``seq_len + 1`` tokens start every ``seq_len`` tokens within a shard; each
epoch is a seeded permutation of all windows; global batch ``p`` of an epoch is the
slice ``[p * G, (p + 1) * G)`` of it (G = batch_size x ranks), and rank ``r`` reads
the r-th ``batch_size`` rows of that slice. So the whole state is two integers, any
rank can compute any batch of any epoch, and the loader knows the future: which
shards the next batches read (prefetch) and when each shard is next needed (Belady
eviction in the cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from trainforge.errors import DataError


def window_index(token_counts: Sequence[int], seq_len: int) -> np.ndarray:
    """(W, 2) int64 rows of (shard index, start offset) of every window."""
    starts = []
    for i, n_tokens in enumerate(token_counts):
        n = (int(n_tokens) - 1) // seq_len
        if n > 0:
            starts.append(np.stack([np.full(n, i), np.arange(n) * seq_len], axis=1))
    return np.concatenate(starts).astype(np.int64) if starts else np.zeros((0, 2), dtype=np.int64)


class BatchPlan:
    """Which windows each batch of this rank reads, and the resumable position.

    ``epoch``/``position`` count global batches consumed; ``advance()`` returns the
    (epoch, position) of the batch to read now and moves past it."""

    def __init__(self, token_counts: Sequence[int], seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, name: str = "train"):
        self.windows = window_index(token_counts, seq_len)
        self.num_shards = len(token_counts)
        global_batch = batch_size * world_size
        if len(self.windows) < global_batch:
            raise DataError(
                f"{name} split has {len(self.windows)} windows of {seq_len + 1} tokens, fewer than one global "
                f"batch ({batch_size} x {world_size} ranks); lower training.batch_size or training.seq_len, "
                "or prepare more text")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.batches_per_epoch = len(self.windows) // global_batch
        self.epoch, self.position = 0, 0
        self._orders: dict[int, np.ndarray] = {}
        self._uses: dict[int, list[np.ndarray]] = {}

    # -- order ---------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Permutation of window ids for ``epoch`` (the two most recent are kept)."""
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
            else:
                order = np.arange(len(self.windows))
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def sample_ids(self, epoch: int, position: int) -> np.ndarray:
        """(batch_size,) indices into the epoch order of this rank's rows of a batch: the
        same global sample index whatever the number of ranks (augmentation seeds on it)."""
        start = (position * self.world_size + self.rank) * self.batch_size
        return np.arange(start, start + self.batch_size)

    def batch_windows(self, epoch: int, position: int) -> np.ndarray:
        """(batch_size, 2) rows of (shard, offset) this rank reads for the batch."""
        return self.windows[self.epoch_order(epoch)[self.sample_ids(epoch, position)]]

    def global_batch_windows(self, epoch: int, position: int) -> np.ndarray:
        """Sample ids of global batch ``position`` of ``epoch``: (shard index, token offset)
        of each of its sequences, every rank's slice in rank order; (batch_size x ranks, 2)."""
        n = self.batch_size * self.world_size
        return self.windows[self.epoch_order(epoch)[position * n:(position + 1) * n]]

    def batch_at(self, epoch: int, position: int) -> tuple[int, int]:
        """Normalise a state to the batch it reads next (rolls over at an epoch's end)."""
        return (epoch + 1, 0) if position >= self.batches_per_epoch else (epoch, position)

    def advance(self) -> tuple[int, int]:
        epoch, position = self.batch_at(self.epoch, self.position)
        self.epoch, self.position = epoch, position + 1
        return epoch, position

    # -- the future, for prefetch and eviction ------------------------------------------------

    def _shard_uses(self, epoch: int) -> list[np.ndarray]:
        """Per shard, the sorted positions of this rank's batches in ``epoch`` that read it."""
        uses = self._uses.get(epoch)
        if uses is None:
            order = self.epoch_order(epoch)[: self.batches_per_epoch * self.world_size * self.batch_size]
            rows = order.reshape(self.batches_per_epoch, self.world_size, self.batch_size)[:, self.rank, :]
            shards = self.windows[rows, 0]  # (batches, batch_size)
            pos = np.repeat(np.arange(self.batches_per_epoch), self.batch_size)
            pairs = np.unique(shards.reshape(-1) * self.batches_per_epoch + pos)  # sorted by (shard, pos)
            shard_of, pos_of = pairs // self.batches_per_epoch, pairs % self.batches_per_epoch
            bounds = np.searchsorted(shard_of, np.arange(self.num_shards + 1))
            uses = [pos_of[bounds[s]:bounds[s + 1]] for s in range(self.num_shards)]
            self._uses = {e: u for e, u in self._uses.items() if e >= epoch - 1}
            self._uses[epoch] = uses
        return uses

    def batches_until(self, shard: int, epoch: int, position: int) -> float:
        """Batches from (epoch, position) to this rank's next read of ``shard`` (0 = that
        batch), looking one epoch ahead; inf beyond."""
        epoch, position = self.batch_at(epoch, position)
        uses = self._shard_uses(epoch)[shard]
        i = np.searchsorted(uses, position)
        if i < len(uses):
            return float(uses[i] - position)
        nxt = self._shard_uses(epoch + 1)[shard]
        if len(nxt):
            return float(self.batches_per_epoch - position + nxt[0])
        return math.inf

    def upcoming_shards(self, epoch: int, position: int, count: int, horizon: int = 64) -> list[int]:
        """The next ``count`` distinct shards this rank reads, in first-use order, from
        (epoch, position), looking at most ``horizon`` batches ahead."""
        seen: dict[int, None] = {}
        for _ in range(horizon):
            if len(seen) >= count:
                break
            epoch, position = self.batch_at(epoch, position)
            for s in self.batch_windows(epoch, position)[:, 0]:
                seen.setdefault(int(s))
            position += 1
        return list(seen)[:count]

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "world_size": self.world_size, "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position. The number of data-parallel ranks may change as long as the
        global batch (batch_size x ranks) stays the same: positions count global batches,
        so the remapped run reads exactly the windows the old layout would have."""
        for key, name in (("seed", "training.seed"), ("seq_len", "training.seq_len")):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data position was saved with {name} = {state[key]}, this run has "
                    f"{getattr(self, key)}: resume with the same value, or start a new run")
        saved_global = int(state["batch_size"]) * int(state["world_size"])
        if saved_global != self.batch_size * self.world_size:
            raise DataError(
                f"the checkpoint was saved with a global batch of {state['batch_size']} (training.batch_size) x "
                f"{state['world_size']} data-parallel ranks = {saved_global} sequences; this run has "
                f"{self.batch_size} x {self.world_size} = {self.batch_size * self.world_size}. The data position "
                f"can only be remapped at the same global batch: set training.batch_size = "
                f"{saved_global // self.world_size if saved_global % self.world_size == 0 else '(not possible)'} "
                "for this number of ranks")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
