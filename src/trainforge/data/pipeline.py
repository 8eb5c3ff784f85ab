"""From the ``[data]`` section to a dataset and its loaders: the one place that decides
how shards are read.

* A local ``data.path`` (or the built-in corpus) without ``data.cache.dir``: shards are
  verified (sha256) once and memory-mapped, as before the tiered cache existed.
* A URL (``file://``, ``http://``, ``s3://``...) or a configured ``data.cache.dir``: the
  manifest and tokenizer are fetched (the tokenizer verified and kept locally, because
  checkpoints copy it), and shards are read through ``TieredShardCache`` with prefetch;
  each shard is verified when it first enters a tier, not up front.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from trainforge.data.augment import Augmenter
from trainforge.data.dataset import ManifestFields, PreparedData, load_prepared, parse_manifest
from trainforge.data.integrity import Quarantine, ShardInfo
from trainforge.data.loader import CachedShards, MmapShards, ShardLoader
from trainforge.data.loader_metrics import DataMetrics
from trainforge.data.prepare import MANIFEST, default_data_dir
from trainforge.data.section import DataSection
from trainforge.data.sampler import BatchPlan
from trainforge.data.sources import is_url, open_source
from trainforge.data.tiered_cache import TieredShardCache
from trainforge.errors import DataError
from trainforge.storage.atomic import atomic_write_bytes
from trainforge.storage.manifest import sha256_bytes


@dataclass
class CachedData(ManifestFields):
    """A prepared dataset read through the tiered cache (same attributes the trainer uses
    from ``PreparedData``)."""

    path: str
    manifest: dict
    tokenizer_path: Path
    cache: TieredShardCache
    metrics: DataMetrics = field(default_factory=DataMetrics)

    def num_tokens(self, split: str) -> int:
        return sum(int(e["tokens"]) for e in self.manifest["splits"][split])

    def files(self, split: str) -> list[str]:
        return [e["file"] for e in self.manifest["splits"][split]]


def _local_tokenizer(data: bytes, sha256: str, cache_dir: Path | None) -> Path:
    """Keep the verified tokenizer on local disk (atomic write), content-addressed."""
    root = cache_dir if cache_dir is not None else Path(tempfile.gettempdir()) / "trainforge-tokenizers"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"tokenizer-{sha256[:16]}.json"
    if not path.is_file():
        atomic_write_bytes(path, data)
    return path


def open_cached(dcfg: DataSection, path: str, cache_dir: Path | None, log: Callable[[str], None]) -> CachedData:
    source = open_source(path, dcfg.timeout_s)
    try:
        text = source.read(MANIFEST)
    except FileNotFoundError:
        raise DataError(f"{source.name}/{MANIFEST} does not exist; point data.path at a directory written by "
                        "`trainforge prepare`") from None
    except DataError as e:  # unreachable or too slow: the first read decides, before anything is written
        raise DataError(f"config key 'data.path' = {path!r}: {e}") from None
    manifest, dtype = parse_manifest(text.decode("utf-8", errors="replace"), f"{source.name}/{MANIFEST}")
    tok = manifest["tokenizer"]
    try:
        tok_bytes = source.read(tok["file"])
    except FileNotFoundError:
        raise DataError(f"{source.name}/{tok['file']} is missing (named in {MANIFEST})") from None
    if sha256_bytes(tok_bytes) != tok["sha256"]:
        raise DataError(f"{source.name}/{tok['file']}: sha256 does not match {MANIFEST}; the tokenizer was "
                        "changed after prepare")
    infos = {e["file"]: ShardInfo(e["file"], int(e["tokens"]) * dtype.itemsize, e["sha256"])
             for split in ("train", "val") for e in manifest["splits"][split]}
    metrics = DataMetrics()
    quarantine = Quarantine(dcfg.on_corrupt, source.name, log, metrics)
    cache = TieredShardCache(source, infos, dtype, dcfg.cache.memory_mb << 20, cache_dir, dcfg.cache.disk_mb << 20,
                             quarantine, metrics, log)
    return CachedData(path, manifest, _local_tokenizer(tok_bytes, tok["sha256"], cache_dir), cache, metrics)


def open_data(dcfg: DataSection, rank: int = 0, world_size: int = 1,
              log: Callable[[str], None] = print, tokenizer: Path | None = None) -> PreparedData | CachedData:
    """The dataset ``[data]`` names (see the module docstring). With several processes
    each gets its own disk tier under ``data.cache.dir/rank_NNNNN`` (budgets are per process).
    ``tokenizer``: the tokenizer.json the built-in corpus is prepared with when ``data.path``
    is unset (a fine-tuned model's; None trains one of ``data.vocab_size``)."""
    path = dcfg.path or str(default_data_dir(dcfg.vocab_size, dcfg.cache_dir, tokenizer))
    if not is_url(path) and dcfg.cache.dir is None:
        # Verified up front; under on_corrupt = "skip" a bad shard is quarantined here, as the cache would.
        return load_prepared(path, quarantine=Quarantine(dcfg.on_corrupt, str(path), log, DataMetrics()))
    cache_dir = None
    if dcfg.cache.dir is not None:
        cache_dir = Path(dcfg.cache.dir) / f"rank_{rank:05d}" if world_size > 1 else Path(dcfg.cache.dir)
    return open_cached(dcfg, path, cache_dir, log)


def build_loader(data: PreparedData | CachedData, split: str, dcfg: DataSection, seq_len: int, batch_size: int,
                 seed: int, rank: int = 0, world_size: int = 1, train: bool = True,
                 device: torch.device | str = "cpu") -> ShardLoader:
    """The loader of ``split``. ``train=False`` (validation): windows in order, no
    augmentation, read in the caller's thread."""
    plan = BatchPlan(data_token_counts(data, split), seq_len, batch_size, seed, rank, world_size,
                     shuffle=train, name=split)
    if isinstance(data, CachedData):
        store = CachedShards(data.cache, data.files(split))
        metrics = data.metrics
    else:
        store, metrics = MmapShards(data.splits[split]), DataMetrics()
        metrics.quarantined = data.metrics.quarantined  # all quarantined when the set was opened
    augmenter = None
    if train and dcfg.augment.transforms:
        augmenter = Augmenter(dcfg.augment.transforms, seed, dcfg.augment.seed, data.vocab_size, data.eos_id,
                              seq_len)
    return ShardLoader(plan, store, metrics, augmenter, prefetch_depth=dcfg.prefetch_depth,
                       fetch_workers=dcfg.fetch_workers, ready_batches=2 if train else 0,
                       device=device if train else "cpu")


def data_token_counts(data: PreparedData | CachedData, split: str) -> list[int]:
    if isinstance(data, CachedData):
        return [int(e["tokens"]) for e in data.manifest["splits"][split]]
    return [len(s) for s in data.splits[split]]
