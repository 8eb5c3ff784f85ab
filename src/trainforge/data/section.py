"""``[data.cache]`` and ``[data.augment]``: the sub-tables of ``[data]`` that configure
the tiered shard cache and the augmentation pipeline (``[data]`` itself is in
``trainforge.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainforge.config_base import _f, _require


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


def is_list_of_tables(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)
