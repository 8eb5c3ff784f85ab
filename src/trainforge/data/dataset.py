"""Reading prepared token shards: integrity checks and deterministic, resumable batches.

The batch order is a pure function of (seed, epoch, position): each epoch is a
seeded permutation of fixed-length windows, so a loader's whole state is two
integers and a resumed run reads exactly the batches an uninterrupted run would.
With several data-parallel ranks, each global batch is cut into disjoint slices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainforge.data.prepare import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file
from trainforge.errors import DataError


@dataclass
class PreparedData:
    """A verified prepared-data directory: memory-mapped shards per split."""

    path: Path
    manifest: dict
    splits: dict[str, list[np.memmap]]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]

    def num_tokens(self, split: str) -> int:
        return sum(len(s) for s in self.splits[split])


def load_prepared(path: str | Path, verify: str = "full") -> PreparedData:
    """Open ``path`` (a ``trainforge prepare`` output). ``verify="full"`` checks every
    shard's sha256 and the tokenizer's; ``"size"`` only checks lengths (fast for huge sets).

    Raises DataError naming the file that is missing, truncated or tampered with."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{mpath} does not exist; run `trainforge prepare --input ... --output {path}` first")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{mpath} is not valid JSON ({e}); re-run `trainforge prepare`") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{mpath}: format {manifest.get('format')!r} v{manifest.get('version')!r} is not "
                        f"{FORMAT!r} v{FORMAT_VERSION}; re-run `trainforge prepare`")
    try:
        dtype = np.dtype(manifest["dtype"])
        tok = manifest["tokenizer"]
        split_entries = manifest["splits"]
        int(manifest["vocab_size"]), int(manifest["eos_id"])
    except (KeyError, TypeError) as e:
        raise DataError(f"{mpath}: missing or malformed field {e}; re-run `trainforge prepare`") from None
    tok_file = path / tok["file"]
    if not tok_file.is_file():
        raise DataError(f"{tok_file} is missing (named in {mpath})")
    if verify == "full" and sha256_file(tok_file) != tok["sha256"]:
        raise DataError(f"{tok_file}: sha256 does not match {mpath}; the tokenizer was changed after prepare")
    splits: dict[str, list[np.memmap]] = {}
    for split in ("train", "val"):
        if split not in split_entries or not split_entries[split]:
            raise DataError(f"{mpath}: no '{split}' split; re-run `trainforge prepare`")
        arrays = []
        for entry in split_entries[split]:
            f = path / entry["file"]
            if not f.is_file():
                raise DataError(f"shard {f} is missing (named in {mpath})")
            expected = int(entry["tokens"]) * dtype.itemsize
            if f.stat().st_size != expected:
                raise DataError(f"shard {f} has {f.stat().st_size} bytes, manifest says {expected}: "
                                "truncated or replaced; re-run `trainforge prepare`")
            if verify == "full" and sha256_file(f) != entry["sha256"]:
                raise DataError(f"shard {f}: sha256 does not match {mpath}; the file was modified "
                                "after prepare (re-run `trainforge prepare`)")
            arrays.append(np.memmap(f, dtype=dtype.newbyteorder("<"), mode="r"))
        splits[split] = arrays
    return PreparedData(path, manifest, splits)


class TokenBatches:
    """Seeded, resumable stream of (inputs, targets) batches, each (batch_size, seq_len) int64.

    Windows of ``seq_len + 1`` tokens start every ``seq_len`` tokens within a shard;
    targets are inputs shifted by one. ``shuffle=False`` reads windows in order
    (validation). State: ``{"epoch", "position"}`` counts global batches consumed."""

    def __init__(self, shards: list[np.ndarray], seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, name: str = "train"):
        starts = []
        for i, shard in enumerate(shards):
            n = (len(shard) - 1) // seq_len
            if n > 0:
                starts.append(np.stack([np.full(n, i), np.arange(n) * seq_len], axis=1))
        self.windows = np.concatenate(starts) if starts else np.zeros((0, 2), dtype=np.int64)
        global_batch = batch_size * world_size
        if len(self.windows) < global_batch:
            raise DataError(
                f"{name} split has {len(self.windows)} windows of {seq_len + 1} tokens, fewer than one global "
                f"batch ({batch_size} x {world_size} ranks); lower training.batch_size or training.seq_len, "
                "or prepare more text")
        self.shards, self.seq_len, self.batch_size = shards, seq_len, batch_size
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.batches_per_epoch = len(self.windows) // global_batch
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._order = self._order_of(self.epoch)
        return self._order

    def _order_of(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        return np.arange(len(self.windows))

    def global_batch_windows(self, epoch: int, position: int) -> np.ndarray:
        """Sample ids of global batch ``position`` of ``epoch``: (shard index, token offset)
        of each of its sequences, every rank's slice in rank order; (batch_size x ranks, 2)."""
        order = self._epoch_order() if epoch == self.epoch else self._order_of(epoch)
        n = self.batch_size * self.world_size
        return self.windows[order[position * n:(position + 1) * n]]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        order = self._epoch_order()
        start = (self.position * self.world_size + self.rank) * self.batch_size
        rows = []
        for shard_idx, offset in self.windows[order[start:start + self.batch_size]]:
            rows.append(self.shards[shard_idx][offset:offset + self.seq_len + 1])
        self.position += 1
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return batch[:, :-1], batch[:, 1:]

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
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
