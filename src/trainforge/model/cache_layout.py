"""What a paged KV pool stores per token and layer for a model config: pure functions of the
config, below both the caches that hold it (``attention_cache.py``) and the memory estimates
of the config layer (``preflight.py``)."""

from __future__ import annotations

from typing import NamedTuple


class CacheLayout(NamedTuple):
    """Per token and layer, what a paged pool stores: ``heads`` x ``k_width`` key values and
    ``heads`` x ``v_width`` value values (``v_width`` 0: no value tensor, MLA's latent)."""

    heads: int
    k_width: int
    v_width: int

    @property
    def values_per_token_layer(self) -> int:
        return self.heads * (self.k_width + self.v_width)


def cache_layout(cfg) -> CacheLayout:
    """The paged pool's per-token shape for ``cfg``: standard attention (GQA) keeps
    ``n_kv_heads`` keys and values of ``head_dim``; latent attention (``cfg.is_mla``) one
    latent of ``kv_lora_rank + qk_rope_head_dim`` (c_kv, then k_pe) and no values. For an
    hourglass model it is the full-rate blocks' shape (its shortened depths have pools of
    their own, ``infer/hourglass_pools.py``)."""
    if cfg.is_mla:
        return CacheLayout(1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0)
    return CacheLayout(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim)


def cached_layers(cfg) -> int:
    """Blocks whose keys/values the engine's main pool holds: all, or an hourglass model's
    full-rate ones."""
    if getattr(cfg, "is_hourglass", False):
        return sum(cfg.layer_stage(j).shorten == 1 for j in range(cfg.n_layers))
    return cfg.n_layers


def kv_bytes_per_token(cfg, element_size: int) -> float:
    """Paged-pool bytes one token takes over all layers; an hourglass block at rate 1/s and
    width dim/r stores one entry of 1/r the width every s tokens."""
    if getattr(cfg, "is_hourglass", False):
        per_layer = cache_layout(cfg).values_per_token_layer
        return element_size * sum(per_layer / cfg.layer_stage(j).width_ratio / cfg.layer_stage(j).shorten
                                  for j in range(cfg.n_layers))
    return cfg.n_layers * cache_layout(cfg).values_per_token_layer * element_size
