"""``[data]``: where the prepared tokens come from and how they are read, with its
sub-tables ``[data.cache]`` (the tiered shard cache) and ``[data.augment]`` (the
augmentation pipeline)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainforge.config_base import _f, _require
from trainforge.errors import ConfigError


@dataclass
class CacheSection:
    dir: str | None = _f(None, "local directory for the disk tier (tier 1) of the shard cache; setting it turns the "
                               "tiered cache on for a local data.path too. Unset: no disk tier")
    memory_mb: int = _f(1024, "memory tier (tier 0) budget in MiB: verified shards held in RAM")
    disk_mb: int = _f(20480, "disk tier budget in MiB (per process)")

    def validate(self) -> None:
        _require(self.dir is None or self.dir != "", "data.cache.dir", self.dir, "a directory path, or leave unset")
        _require(self.memory_mb >= 0, "data.cache.memory_mb", self.memory_mb, "an integer >= 0 (MiB)")
        _require(self.disk_mb >= 0, "data.cache.disk_mb", self.disk_mb, "an integer >= 0 (MiB)")


@dataclass
class AugmentSection:
    transforms: list = field(default_factory=list, metadata={"help": (
        "per-sample transforms applied in list order, each an inline table with name, p (probability) and "
        "its parameters, e.g. [{name = \"span_corruption\", p = 0.5, rate = 0.15}]; names: doc_shuffle, "
        "span_corruption, token_dropout, token_replace, seq_curriculum")})
    seed: int = _f(0, "mixed with training.seed into every sample's augmentation RNG")

    def validate(self) -> None:
        from trainforge.data.augment import build_transforms

        _require(self.seed >= 0, "data.augment.seed", self.seed, "an integer >= 0")
        build_transforms(self.transforms)  # raises ConfigError naming data.augment.transforms[i].<param>


@dataclass
class DataSection:
    path: str | None = _f(
        None,
        "directory written by `trainforge prepare` (holds manifest.json), or an fsspec URL of one (file://, "
        "http://, s3:// with its backend installed; read through the tiered cache); unset = the built-in "
        "corpus (Python standard library sources), prepared on first use",
    )
    vocab_size: int = _f(8192, "tokenizer vocabulary size when preparing the built-in corpus")
    cache_dir: str | None = _f(None, "where the built-in corpus is prepared; default ~/.cache/trainforge "
                                     "(not the shard cache: that is data.cache.dir)")
    prefetch_depth: int = _f(8, "tiered cache: shards fetched ahead of use, in the order the sampler will read them")
    fetch_workers: int = _f(4, "tiered cache: background threads fetching shards")
    on_corrupt: Literal["fail", "skip"] = _f(
        "fail", "a shard that fails its manifest sha256 (or is missing/truncated) in every tier: fail = stop the "
                "run naming it; skip = quarantine it (logged, counted) and read other windows in its place")
    timeout_s: float = _f(60.0, "longest wait for one shard (or the manifest) from data.path before the run "
                                "stops with an error")
    cache: CacheSection = field(default_factory=CacheSection, metadata={"help": "[data.cache] sub-table"})
    augment: AugmentSection = field(default_factory=AugmentSection, metadata={"help": "[data.augment] sub-table"})

    def validate(self) -> None:
        _require(257 <= self.vocab_size <= 1 << 20, "data.vocab_size", self.vocab_size,
                 "an integer in [257, 1048576] (byte-level BPE needs 256 byte tokens + specials)")
        _require(self.prefetch_depth >= 0, "data.prefetch_depth", self.prefetch_depth, "an integer >= 0 (0 = off)")
        _require(self.fetch_workers >= 1, "data.fetch_workers", self.fetch_workers, "an integer >= 1")
        _require(math.isfinite(self.timeout_s) and self.timeout_s > 0, "data.timeout_s", self.timeout_s,
                 "a number of seconds > 0")
        self.cache.validate()
        self.augment.validate()
        if self.path is not None:
            _require(self.path != "", "data.path", self.path, "a directory path or URL, or leave unset")
            from trainforge.data.sources import check_url, is_url

            if is_url(self.path):
                check_url(self.path)  # the protocol's fsspec backend is importable; nothing is fetched
            elif not (Path(self.path) / "manifest.json").is_file():
                raise ConfigError(
                    f"config key 'data.path' = {self.path!r}: no manifest.json there; "
                    "run `trainforge prepare --input ... --output DIR` first, or unset data.path "
                    "to use the built-in corpus")


def is_list_of_tables(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)
