"""The engine's side of decoding an hourglass model: one paged pool per shortened depth and
each step's metadata for it (the model side is ``model/hourglass_cache.py``).

The engine's own ``KVPool`` holds the full-rate blocks (``KVPool.for_model`` counts only
those). Each depth d >= 1 (blocks inside d shortenings) gets a ``KVPool`` of its blocks, at its
width (heads kept, head dim / width_ratio) and its rate: a sequence of L tokens holds
ceil(L / rate) entries there, at positions 0, 1, 2, ... of that rate. So an hourglass model's KV
bytes per token are sum over blocks of (its K/V per entry) / rate, not n_layers times one.

Bookkeeping mirrors the engine's for its pool: a request reserves ceil(budget / rate) entries
per depth at admission (``can_reserve`` / ``add``), its prompt's entries are handed out for the
prefill, and in a decode step only the rows whose token is at a multiple of the depth's rate
take a slot there (``HourglassCache.due_rows`` lists them; the engine's positions say which).
Each depth's ``PagedCache`` then gets those rows' slots, page tables padded with the padding
block, and masks, laid out (B', S') in the same order. Sizing: with the engine's pool of
``n_blocks`` blocks, depth d gets ceil((n_blocks - 1) / rate) + max_rows + 1 blocks (each row
may round up one block more), so whatever the engine's pool admits fits here too.
"""

from __future__ import annotations

import numpy as np
import torch

from trainforge.infer.kv_pool import KVPool
from trainforge.model.attention_cache import PagedCache
from trainforge.model.hourglass_cache import HourglassCache, block_depths


class HourglassPools:
    """Pools and step metadata of the shortened depths of ``cfg`` for ``max_rows`` rows of
    up to ``max_context`` tokens; ``full`` is the engine's PagedCache of the full-rate blocks."""

    def __init__(self, cfg, full: PagedCache, max_rows: int, max_context: int, n_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        depths = block_depths(cfg)
        self.block_size, self.device = block_size, device
        self.rates: dict[int, int] = {}
        self.pools: dict[int, KVPool] = {}
        self.caches: dict[int, PagedCache] = {}
        self._index_rows: dict[int, np.ndarray] = {}
        self._bias_rows: dict[int, np.ndarray] = {}
        self._pad: dict[int, np.ndarray] = {}  # a row's gather when empty: the padding block
        bs = block_size
        for d in sorted(set(depths) - {0}):
            first = depths.index(d)
            stage = cfg.layer_stage(first)
            head_dim = cfg.dim // stage.width_ratio // cfg.n_heads
            rate = stage.shorten
            blocks = -(-(n_blocks - 1) // rate) + max_rows + 1
            pool = KVPool(depths.count(d), cfg.n_kv_heads, head_dim, blocks, bs, dtype, device)
            context_slots = -(-(-(-max_context // rate)) // bs) * bs
            self.rates[d], self.pools[d] = rate, pool
            self.caches[d] = PagedCache(pool.k, pool.v, max_rows, context_slots)
            pad = np.tile(np.arange(bs, dtype=np.int64), context_slots // bs + 1)[:context_slots]
            self._pad[d] = pad
            self._index_rows[d] = np.tile(pad, (max_rows, 1))
            self._bias_rows[d] = np.full((max_rows, context_slots), -np.inf, dtype=np.float32)
        caches = [full] + [self.caches.get(d) for d in range(1, max(depths) + 1)]
        self.cache = HourglassCache(cfg, caches, max_rows, dtype, device)

    # -- requests: a member of the engine's pool set (pool_set.py) ---------------------------

    def entries(self, d: int, n_tokens: int) -> int:
        return -(-n_tokens // self.rates[d])

    def can_reserve(self, n_tokens: int) -> bool:
        return all(p.can_reserve(self.entries(d, n_tokens)) for d, p in self.pools.items())

    def add(self, seq_id: int, row: int, reserve_tokens: int, prompt_tokens: int) -> None:
        """Reserve for a new sequence in engine row ``row`` and set up its prefill."""
        bs = self.block_size
        for d, pool in self.pools.items():
            pool.add(seq_id, self.entries(d, reserve_tokens))
            n = self.entries(d, prompt_tokens)
            slots = pool.append_slots(seq_id, n)
            for j, blk in enumerate(pool.table(seq_id)):
                self._index_rows[d][row, j * bs:(j + 1) * bs] = blk * bs + np.arange(bs)
            self._bias_rows[d][row, :n] = 0.0
            self.caches[d].set_prefill(torch.tensor(slots, dtype=torch.long, device=self.device))
        self.cache.set_prefill(row)

    def set_decode(self, seq_ids: list[int], positions: np.ndarray) -> None:
        """One token for rows 0..B-1 (sequences ``seq_ids``) at ``positions``: the slots,
        gathers and masks of the rows that run at each depth."""
        self.cache.set_decode(positions)
        bs = self.block_size
        for d, pool in self.pools.items():
            rows = self.cache.due_rows(d - 1)  # depth d's blocks run in level d - 1's inner part
            if not len(rows):
                continue
            p = positions[rows] // self.rates[d]  # each row's entry at this depth
            slots = np.empty(len(rows), dtype=np.int64)
            for i, (r, q) in enumerate(zip(rows, p)):
                slots[i] = pool.append_slots(seq_ids[r], 1)[0]
                if q % bs == 0:  # the entry opens a new block
                    self._index_rows[d][r, q:q + bs] = slots[i] // bs * bs + np.arange(bs)
                self._bias_rows[d][r, q] = 0.0
            S = -(-int(p.max() + 1) // bs) * bs
            c, n = self.caches[d], len(rows)
            c.slots[:n].copy_(torch.from_numpy(slots))
            c.gather[:n * S].copy_(torch.from_numpy(np.ascontiguousarray(self._index_rows[d][rows, :S]).reshape(-1)))
            c.bias[:n * S].copy_(torch.from_numpy(self._bias_rows[d][rows, :S].reshape(-1)))
            c.set_decode(n, S)

    def before_decode(self, seq_ids: list[int], positions: np.ndarray) -> None:
        """The engine's decode hook (engine_parts.py): ``set_decode`` before each decode forward."""
        self.set_decode(seq_ids, positions)

    # -- a row-state participant (row_state.py) ---------------------------------------------

    def move_row(self, src: int, dst: int) -> None:
        """The sequence in row ``src`` moves to row ``dst`` (``src`` is then empty)."""
        for d in self.pools:
            self._index_rows[d][dst] = self._index_rows[d][src]
            self._bias_rows[d][dst] = self._bias_rows[d][src]
        self.cache.move_row(src, dst)

    def clear_row(self, row: int) -> None:
        for d in self.pools:
            self._index_rows[d][row] = self._pad[d]
            self._bias_rows[d][row] = -np.inf

    def free(self, seq_id: int) -> None:
        for pool in self.pools.values():
            pool.free(seq_id)

    # -- reporting --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())  # the cache's groups count as workspace

    def bytes_per_token(self) -> float:
        """Pool bytes per token of sequence over the shortened depths (entries / rate)."""
        return sum(p.bytes_per_token / self.rates[d] for d, p in self.pools.items())
