"""Paged KV cache: one fixed pool of blocks, allocated once per engine, shared by all sequences.

Every layer's keys (and values) live in one tensor of shape (n_layers, H_kv, n_slots, D)
with ``n_slots = n_blocks * block_size``. A sequence owns a list of blocks (its *page
table*); token ``t`` of the sequence lives in slot ``table[t // block_size] * block_size +
t % block_size``. Sequences of different lengths therefore share the pool without
fragmentation: a sequence holds ``ceil(len / block_size)`` blocks, wherever they are, and a
finished sequence's blocks go straight back to the free list.

The slot axis sits between heads and head dim, (H_kv, slots, D), so gathering the slots of B
sequences with one ``index_select`` gives (H_kv, B * S, D), which views as the batch of
(H_kv * B) key matrices that ``bmm`` wants, without a permute copy (see
``model/attention_cache.py``, whose ``PagedCache`` the runner builds over ``k`` / ``v``).

A latent-attention (MLA) model's pool has one "head" of width kv_lora_rank + qk_rope_head_dim
per token and layer (its latent and rotary key) and no value tensor (``v`` is None):
``KVPool.for_model`` takes the shape from ``model.attention_cache.cache_layout``.

Block 0 is never handed out: it is the padding block. Gather indices past a sequence's
length point into it, and their scores are masked, so padding reads harmless zeros.

Admission control: a sequence *reserves* the blocks for its whole budget (prompt +
max_new_tokens) when it is admitted and *takes* them one at a time as it grows. A running
sequence therefore never finds the pool empty (no preemption needed), and blocks reserved
but not yet taken stay free for the moment. vLLM's block manager does the same bookkeeping
with preemption on top; the pool here is hand-written because the tensor layout has to
match the paged cache's gather, which no PyTorch library provides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainforge.model.attention_cache import cache_layout, cached_layers


class PoolExhausted(RuntimeError):
    """Not enough free blocks for a sequence's reservation."""


@dataclass
class _Seq:
    blocks: list[int]
    reserved: int  # blocks promised at admission, including those already taken
    length: int = 0  # tokens whose slots have been handed out


class KVPool:
    """Fixed pool of KV blocks. ``k`` / ``v``: (n_layers, H_kv, n_blocks * block_size, D);
    ``v_width`` sizes the values apart (None: ``head_dim``; 0: no values, ``v`` is None).

    Host-side bookkeeping only (Python lists); the runner reads slots through index
    tensors the engine builds from ``table(seq_id)``."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", v_width: int | None = None):
        if n_blocks < 2:
            raise ValueError(f"n_blocks={n_blocks}: the pool needs at least 2 blocks (block 0 is padding)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_layers, n_kv_heads, n_blocks * block_size, head_dim)
        # Zeros, not empty: the padding block is read (and masked); 0 * NaN would poison a row.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        v_width = head_dim if v_width is None else v_width
        self.v = torch.zeros(*shape[:3], v_width, dtype=dtype, device=device) if v_width else None
        self._free = list(range(n_blocks - 1, 0, -1))  # a stack; block 0 is reserved for padding
        self._seqs: dict[int, _Seq] = {}
        self._outstanding = 0  # reserved but not yet taken, over all sequences
        self.peak_blocks_used = 0

    @classmethod
    def for_model(cls, cfg, n_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> KVPool:
        """A pool shaped for ``cfg`` (``cache_layout``: GQA keys and values, or MLA's latent;
        an hourglass model's full-rate blocks only, ``cached_layers``)."""
        layout = cache_layout(cfg)
        return cls(cached_layers(cfg), layout.heads, layout.k_width, n_blocks, block_size, dtype, device,
                   v_width=layout.v_width)

    # -- capacity ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (self.v.nbytes if self.v is not None else 0)

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token slot takes, over all layers."""
        return self.nbytes // (self.n_blocks * self.block_size)

    @property
    def usable_blocks(self) -> int:
        return self.n_blocks - 1

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_reserve(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= len(self._free) - self._outstanding

    # -- sequences --------------------------------------------------------------------------

    def add(self, seq_id: int, reserve_tokens: int) -> None:
        """Register a sequence and reserve blocks for ``reserve_tokens`` tokens.
        Raises ``PoolExhausted`` when the free blocks cannot cover the reservation."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the pool")
        need = self.blocks_for(reserve_tokens)
        if need > self.usable_blocks:
            raise PoolExhausted(f"a sequence of {reserve_tokens} tokens needs {need} blocks; the pool has "
                                f"{self.usable_blocks} (raise n_blocks or block_size)")
        if not self.can_reserve(reserve_tokens):
            raise PoolExhausted(f"{need} blocks needed, {len(self._free) - self._outstanding} unreserved")
        self._seqs[seq_id] = _Seq(blocks=[], reserved=need)
        self._outstanding += need

    def append_slots(self, seq_id: int, n_tokens: int) -> list[int]:
        """Slots for the next ``n_tokens`` tokens of ``seq_id``, taking blocks from its
        reservation as the sequence crosses block boundaries. Returns the slot indices."""
        s = self._seqs[seq_id]
        start, end = s.length, s.length + n_tokens
        need = self.blocks_for(end)
        if need > s.reserved:
            raise PoolExhausted(f"sequence {seq_id} grew past its reservation of {s.reserved} blocks")
        while len(s.blocks) < need:
            s.blocks.append(self._free.pop())
            self._outstanding -= 1
        self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
        s.length = end
        bs = self.block_size
        return [s.blocks[t // bs] * bs + t % bs for t in range(start, end)]

    def truncate(self, seq_id: int, n_tokens: int) -> int:
        """Roll ``seq_id`` back to its first ``n_tokens`` tokens (speculative decoding drops
        rejected drafts): blocks past them go back to the free list but stay in the
        sequence's reservation, so it can grow again. Returns the blocks freed."""
        s = self._seqs[seq_id]
        if not 0 <= n_tokens <= s.length:
            raise ValueError(f"truncate sequence {seq_id} to {n_tokens} tokens: it holds {s.length}")
        keep = self.blocks_for(n_tokens)
        dropped = s.blocks[keep:]
        del s.blocks[keep:]
        self._free.extend(reversed(dropped))
        self._outstanding += len(dropped)
        s.length = n_tokens
        return len(dropped)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's page table: block ids in token order."""
        return self._seqs[seq_id].blocks

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks and the rest of its reservation to the pool."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        self._outstanding -= s.reserved - len(s.blocks)
        self._free.extend(reversed(s.blocks))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # -- reporting --------------------------------------------------------------------------

    @property
    def blocks_used(self) -> int:
        return self.usable_blocks - len(self._free)

    def utilisation(self) -> dict[str, float]:
        """blocks_used / blocks_reserved / blocks_total, tokens_stored, ``block_utilisation``
        (blocks taken / usable blocks) and ``slot_utilisation`` (tokens stored / slots of
        the taken blocks: what partly filled last blocks waste)."""
        used = self.blocks_used
        tokens = sum(s.length for s in self._seqs.values())
        return {
            "blocks_total": self.usable_blocks,
            "blocks_used": used,
            "blocks_reserved": used + self._outstanding,
            "blocks_peak": self.peak_blocks_used,
            "sequences": len(self._seqs),
            "tokens_stored": tokens,
            "block_utilisation": used / self.usable_blocks,
            "slot_utilisation": tokens / (used * self.block_size) if used else 1.0,
        }
