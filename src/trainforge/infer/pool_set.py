"""The engine's cache pools as one: the paged KV pool and any pools a model adds beside it.

Every model keeps its attention keys/values in the engine's ``KVPool`` (kv_pool.py). Some
models need more per-sequence cache than that one pool holds, in a pool of a different shape
or rate; such a pool joins the set as a *member* (``PoolMember``), and the engine reserves,
hands out and frees through the set, so it never asks which pools a model has. (vLLM v1's
KV-cache coordinator does the same over its KV-cache groups.)

A sequence reserves its whole budget in every pool at admission (``can_reserve`` /
``reserve``): a running sequence then never finds a pool empty, so no preemption.
"""

from __future__ import annotations

from typing import Protocol

from trainforge.infer.kv_pool import KVPool


class PoolMember(Protocol):
    """A model's extra pool, sized once for the engine's rows and context."""

    def can_reserve(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` tokens could be reserved now."""

    def add(self, seq_id: int, row: int, reserve_tokens: int, prompt_tokens: int) -> None:
        """Reserve for a new sequence in batch row ``row`` and hand out its prompt's entries."""

    def free(self, seq_id: int) -> None:
        """The sequence's entries go back to the pool."""

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors."""

    def bytes_per_token(self) -> float:
        """Pool bytes one token of sequence takes."""


class PoolSet:
    """``kv``: the engine's KVPool; ``members``: the model's extra pools (often none)."""

    def __init__(self, kv: KVPool, members: list[PoolMember] | tuple = ()):
        self.kv = kv
        self.members = list(members)

    def can_reserve(self, n_tokens: int) -> bool:
        return self.kv.can_reserve(n_tokens) and all(m.can_reserve(n_tokens) for m in self.members)

    def reserve(self, seq_id: int, row: int, reserve_tokens: int, prompt_tokens: int) -> list[int]:
        """Reserve ``reserve_tokens`` tokens for a new sequence in row ``row`` in every pool;
        returns the KV slots of its first ``prompt_tokens`` tokens (its prompt)."""
        self.kv.add(seq_id, reserve_tokens)
        slots = self.kv.append_slots(seq_id, prompt_tokens)
        for m in self.members:
            m.add(seq_id, row, reserve_tokens, prompt_tokens)
        return slots

    def free(self, seq_id: int) -> None:
        self.kv.free(seq_id)
        for m in self.members:
            m.free(seq_id)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(m.nbytes for m in self.members)

    @property
    def bytes_per_token(self) -> float:
        return self.kv.bytes_per_token + sum(m.bytes_per_token() for m in self.members)
