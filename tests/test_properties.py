"""Property tests (hypothesis): invariants that must hold for any input, not just the examples."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainforge.config import config_to_toml, load_config
from trainforge.data.dataset import TokenBatches


@settings(max_examples=40, deadline=None)
@given(seq_len=st.integers(2, 32), batch_size=st.integers(1, 6), world=st.integers(1, 4),
       stop=st.integers(0, 80), seed=st.integers(0, 2**31))
def test_batches_resume_anywhere_and_ranks_are_disjoint(seq_len, batch_size, world, stop, seed):
    shards = [np.arange(n, dtype=np.uint32) + 10_000 * i for i, n in enumerate((900, 450, 1300))]
    n_windows = sum((len(s) - 1) // seq_len for s in shards)
    if n_windows < batch_size * world:
        return
    ranks = [TokenBatches(shards, seq_len, batch_size, seed, rank=r, world_size=world) for r in range(world)]
    for _ in range(stop):
        for b in ranks:
            b.next()
    state = ranks[0].state_dict()
    resumed = TokenBatches(shards, seq_len, batch_size, seed, rank=0, world_size=world)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next()[0], ranks[0].next()[0])
    rows = [tuple(r.tolist()) for b in ranks[1:] for r in b.next()[0]]
    assert len(set(rows)) == len(rows) == batch_size * (world - 1)  # same step: no window twice


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(1, 10**6), lr=st.floats(1e-7, 10, allow_nan=False), prompt=st.text(max_size=20),
       clip=st.floats(0, 100, allow_nan=False), tie=st.sampled_from(["true", "false", "none"]))
def test_resolved_config_round_trips_through_toml(tmp_path_factory, steps, lr, prompt, clip, tie):
    cfg = load_config(None, [f"--training.steps={steps}", f"--training.lr={lr!r}", f"--sample.prompt={prompt}",
                             f"--training.grad_clip={clip!r}", f"--model.tie_embeddings={tie}"])
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
