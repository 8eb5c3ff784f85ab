import numpy as np
import pytest
import torch

from trainforge.data.dataset import TokenBatches
from trainforge.errors import DataError


def _shards():
    return [np.arange(1000, dtype=np.uint16), np.arange(5000, 5700, dtype=np.uint16)]


def test_targets_are_inputs_shifted_and_windows_stay_in_a_shard():
    b = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=0)
    for _ in range(30):
        x, y = b.next()
        assert x.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.all(y - x == 1)  # consecutive ids: never straddles the two shards


def test_resume_reads_the_same_batches_across_epochs():
    a = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=7)
    ref = [a.next()[0] for _ in range(60)]  # > one epoch (104 windows / 4 = 26 batches)
    b = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=7)
    for _ in range(37):
        b.next()
    state = b.state_dict()
    c = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=7)
    c.load_state_dict(state)
    assert all(torch.equal(c.next()[0], r) for r in ref[37:])
    other_seed = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=8)
    assert not torch.equal(other_seed.next()[0], ref[0])


def test_ranks_read_disjoint_slices():
    seen = []
    for rank in range(2):
        b = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=1, rank=rank, world_size=2)
        seen.append({tuple(row.tolist()) for _ in range(13) for row in b.next()[0]})
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 104  # one epoch covers every window exactly once


def test_mismatched_resume_and_too_little_data_fail_clearly():
    b = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=1)
    state = b.state_dict()
    with pytest.raises(DataError, match="training.batch_size = 2"):
        TokenBatches(_shards(), seq_len=16, batch_size=8, seed=1, world_size=2).load_state_dict(state)
    with pytest.raises(DataError, match="training.seq_len"):
        TokenBatches(_shards(), seq_len=8, batch_size=4, seed=1).load_state_dict(state)


def test_position_remaps_to_another_number_of_ranks_at_the_same_global_batch():
    one = TokenBatches(_shards(), seq_len=16, batch_size=4, seed=5)
    for _ in range(9):
        one.next()
    state = one.state_dict()
    ref = one.next()[0]
    halves = []
    for rank in range(2):
        b = TokenBatches(_shards(), seq_len=16, batch_size=2, seed=5, rank=rank, world_size=2)
        b.load_state_dict(state)
        halves.append(b.next()[0])
    assert torch.equal(torch.cat(halves), ref)
    with pytest.raises(DataError, match="fewer than one global batch"):
        TokenBatches([np.arange(100, dtype=np.uint16)], seq_len=64, batch_size=4, seed=0)
