"""The pools a model keeps beyond the engine's paged KV pool, chosen once from its config.

Most models attend through the one ``PagedCache`` over the engine's ``KVPool``; a model kind
whose blocks keep keys/values elsewhere too (an hourglass trunk's shortened depths:
``hourglass_pools.py``) gets an object that owns those pools and the cache the model attends
through (``.cache``), wrapping the paged one. The runner and the engine hold it without
naming its kind: a new kind adds a line here, not a branch there.
"""

from __future__ import annotations

from typing import Any

import torch

from trainforge.model.attention_cache import PagedCache


def extra_pools(cfg, cache: PagedCache, max_rows: int, max_context: int, n_blocks: int, block_size: int,
                dtype: torch.dtype, device: torch.device) -> Any | None:
    """The pools of ``cfg``'s model beyond the paged pool behind ``cache`` (for ``max_rows``
    rows of up to ``max_context`` tokens; the paged pool's ``n_blocks`` blocks of
    ``block_size`` slots), or None where it has none."""
    if cfg.is_hourglass:  # imported here: a dense model's decode process never maps this code
        from trainforge.infer.hourglass_pools import HourglassPools

        return HourglassPools(cfg, cache, max_rows, max_context, n_blocks, block_size, dtype, device)
    return None
