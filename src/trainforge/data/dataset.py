"""Reading prepared token shards from a local directory: integrity checks, memory
maps, and ``TokenBatches``, the plain synchronous batch reader.

The batch order is a pure function of (seed, epoch, position) (``sampler.BatchPlan``),
so a loader's whole state is two integers and a resumed run reads exactly the batches
an uninterrupted run would. With several data-parallel ranks, each global batch is cut
into disjoint slices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from trainforge.data.integrity import Quarantine, ShardQuarantined
from trainforge.data.loader_metrics import DataMetrics
from trainforge.data.prepare import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file
from trainforge.data.sampler import BatchPlan
from trainforge.errors import DataError


class ManifestFields:
    """What the manifest says, for any dataset holding it as ``self.manifest``: the
    memory-mapped ``PreparedData`` here and the cache-backed ``CachedData``."""

    manifest: dict

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])


@dataclass
class PreparedData(ManifestFields):
    """A verified prepared-data directory: memory-mapped shards per split."""

    path: Path
    manifest: dict
    splits: dict[str, list[np.memmap]]
    metrics: DataMetrics = field(default_factory=DataMetrics)  # quarantined shards (on_corrupt = "skip")

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]

    def num_tokens(self, split: str) -> int:
        return sum(len(s) for s in self.splits[split])


def parse_manifest(text: str, where: str) -> tuple[dict, np.dtype]:
    """The manifest's JSON and token dtype; DataError naming ``where`` if it is not a
    ``trainforge prepare`` manifest of this format version."""
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise DataError(f"{where} is not valid JSON ({str(e)[:120]}); re-run `trainforge prepare`") from None
    if not isinstance(manifest, dict):
        manifest = {}
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{where}: format {manifest.get('format')!r} v{manifest.get('version')!r} is not "
                        f"{FORMAT!r} v{FORMAT_VERSION}; re-run `trainforge prepare`")
    try:
        dtype = np.dtype(manifest["dtype"])
        manifest["tokenizer"]["file"], manifest["tokenizer"]["sha256"]
        for split in ("train", "val"):
            if split not in manifest["splits"] or not manifest["splits"][split]:
                raise DataError(f"{where}: no '{split}' split; re-run `trainforge prepare`")
            for entry in manifest["splits"][split]:
                entry["file"], int(entry["tokens"]), entry["sha256"]
        int(manifest["vocab_size"]), int(manifest["eos_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: missing or malformed field {e}; re-run `trainforge prepare`") from None
    names = [manifest["tokenizer"]["file"], *(e["file"] for split in ("train", "val") for e in manifest["splits"][split])]
    for name in names:  # prepare writes plain names in its own directory: never a path out of it
        if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() \
                or ".." in PurePosixPath(name).parts or "\0" in name:
            raise DataError(f"{where}: file {name!r:.80} is not a name inside the data directory; re-run "
                            "`trainforge prepare`")
    return manifest, dtype


class QuarantinedShard:
    """Stands in for a bad shard (``data.on_corrupt = "skip"``): it has the manifest's
    length, so the batch order is unchanged, and every read raises ``ShardQuarantined``
    so the loader replaces its windows."""

    def __init__(self, file: str, tokens: int, reason: str):
        self.file, self.tokens, self.reason = file, tokens, reason

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, index) -> np.ndarray:
        raise ShardQuarantined(f"shard {self.file} is quarantined: {self.reason}")


def load_prepared(path: str | Path, verify: str = "full", quarantine: Quarantine | None = None) -> PreparedData:
    """Open ``path`` (a ``trainforge prepare`` output). ``verify="full"`` checks every
    shard's sha256 and the tokenizer's; ``"size"`` only checks lengths (fast for huge sets).

    Raises DataError naming the file that is missing, truncated or tampered with. With a
    ``quarantine`` whose policy is "skip", a bad shard is quarantined instead (logged,
    counted in its metrics) and a ``QuarantinedShard`` takes its place."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{mpath} does not exist; run `trainforge prepare --input ... --output {path}` first")
    manifest, dtype = parse_manifest(mpath.read_bytes().decode("utf-8", errors="replace"), str(mpath))
    tok, split_entries = manifest["tokenizer"], manifest["splits"]
    tok_file = path / tok["file"]
    if not tok_file.is_file():
        raise DataError(f"{tok_file} is missing (named in {mpath})")
    if verify == "full" and sha256_file(tok_file) != tok["sha256"]:
        raise DataError(f"{tok_file}: sha256 does not match {mpath}; the tokenizer was changed after prepare")
    skip = quarantine is not None and quarantine.on_corrupt == "skip"
    metrics = quarantine.metrics if skip and quarantine.metrics is not None else DataMetrics()
    splits: dict[str, list[np.memmap]] = {}
    for split in ("train", "val"):
        arrays = []
        for entry in split_entries[split]:
            f = path / entry["file"]
            expected = int(entry["tokens"]) * dtype.itemsize
            if not f.is_file():
                why, message = "missing", f"shard {f} is missing (named in {mpath})"
            elif f.stat().st_size != expected:
                why = f"{f.stat().st_size} bytes, manifest says {expected}"
                message = f"shard {f} has {why}: truncated or replaced; re-run `trainforge prepare`"
            elif verify == "full" and sha256_file(f) != entry["sha256"]:
                why = "sha256 does not match the manifest (modified or corrupted)"
                message = (f"shard {f}: sha256 does not match {mpath}; the file was modified "
                           "after prepare (re-run `trainforge prepare`)")
            else:
                arrays.append(np.memmap(f, dtype=dtype.newbyteorder("<"), mode="r"))
                continue
            if not skip:
                raise DataError(message)
            try:
                quarantine.condemn(entry["file"], why)  # type: ignore[union-attr]
            except ShardQuarantined:
                pass
            arrays.append(QuarantinedShard(entry["file"], int(entry["tokens"]), why))  # type: ignore[arg-type]
        splits[split] = arrays
    return PreparedData(path, manifest, splits, metrics)


class TokenBatches:
    """Seeded, resumable stream of (inputs, targets) batches, each (batch_size, seq_len) int64,
    read synchronously from in-memory or memory-mapped shards (the plain reference the
    trainer's ``ShardLoader`` is tested against; the order is ``BatchPlan``'s).

    Windows of ``seq_len + 1`` tokens start every ``seq_len`` tokens within a shard;
    targets are inputs shifted by one. ``shuffle=False`` reads windows in order
    (validation). State: ``{"epoch", "position"}`` counts global batches consumed."""

    def __init__(self, shards: list[np.ndarray], seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, name: str = "train"):
        self.plan = BatchPlan([len(s) for s in shards], seq_len, batch_size, seed, rank, world_size, shuffle, name)
        self.shards, self.seq_len, self.batch_size = shards, seq_len, batch_size
        self.windows, self.batches_per_epoch = self.plan.windows, self.plan.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def position(self) -> int:
        return self.plan.position

    def global_batch_windows(self, epoch: int, position: int) -> np.ndarray:
        return self.plan.global_batch_windows(epoch, position)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.shards[s][o:o + self.seq_len + 1] for s, o in self.plan.batch_windows(*self.plan.advance())]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return self.plan.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.plan.load_state_dict(state)
