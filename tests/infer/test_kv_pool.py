"""The paged KV pool: blocks taken as sequences grow, returned when they end, shared by
sequences of different lengths without fragmentation; reservations keep a running
sequence from ever finding the pool empty; utilisation is reported."""

from __future__ import annotations

import pytest

from trainforge.infer.kv_pool import KVPool, PoolExhausted


def pool(n_blocks=9, block_size=4):
    return KVPool(n_layers=2, n_kv_heads=2, head_dim=8, n_blocks=n_blocks, block_size=block_size)


def test_slots_follow_the_page_table():
    p = pool()
    p.add(1, 10)
    slots = p.append_slots(1, 6) + p.append_slots(1, 3)
    table = p.table(1)
    assert len(table) == 3 and 0 not in table  # block 0 is the padding block, never handed out
    assert slots == [table[t // 4] * 4 + t % 4 for t in range(9)]
    assert p.k.shape == (2, 2, 9 * 4, 8)


def test_interleaved_sequences_share_the_pool_without_fragmentation():
    p = pool(n_blocks=9, block_size=4)  # 8 usable blocks
    lengths = {1: 7, 2: 3, 3: 13}
    for s, n in lengths.items():
        p.add(s, n)
    for t in range(13):  # grow one token at a time, interleaved, as decoding does
        for s, n in lengths.items():
            if t < n:
                p.append_slots(s, 1)
    assert p.utilisation()["blocks_used"] == 2 + 1 + 4
    p.free(2)
    p.free(1)
    # Freed blocks are scattered between sequence 3's; a new sequence still gets all of them.
    p.add(4, 16)
    p.append_slots(4, 16)
    assert sorted(p.table(4) + p.table(3)) == list(range(1, 9))
    u = p.utilisation()
    assert u["block_utilisation"] == 1.0 and u["tokens_stored"] == 29
    assert u["slot_utilisation"] == pytest.approx(29 / 32)


def test_reservations_gate_admission_and_are_returned():
    p = pool(n_blocks=5, block_size=4)  # 4 usable blocks
    p.add(1, 12)  # reserves 3, takes none yet
    assert not p.can_reserve(5) and p.can_reserve(4)
    with pytest.raises(PoolExhausted):
        p.add(2, 8)
    p.append_slots(1, 12)
    with pytest.raises(PoolExhausted, match="reservation"):
        p.append_slots(1, 1)
    with pytest.raises(PoolExhausted, match="the pool has 4"):
        p.add(3, 17)
    p.free(1)
    assert p.utilisation()["blocks_reserved"] == 0 and p.can_reserve(16)
    assert p.utilisation()["blocks_peak"] == 3
