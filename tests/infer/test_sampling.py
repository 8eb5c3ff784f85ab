"""Batch sampling: filters do what they say, seeds reproduce draws, the repetition penalty
matches Hugging Face's processor, and rows of one batch sample independently."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from trainforge.infer.sampling import BatchSampler, SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def draws(n_seeds=200, **kw) -> set[int]:
    """Tokens drawn from LOGITS over ``n_seeds`` seeds."""
    sampler = BatchSampler(1, 5)
    out = torch.empty(1, dtype=torch.long)
    seen = []
    for seed in range(n_seeds):
        sampler.set_row(0, SamplingParams(seed=seed, **kw), [])
        sampler.sample(LOGITS.clone(), 0, out)
        seen.append(int(out))
    return seen


def test_filters_and_seeds():
    assert draws(temperature=1.0) == draws(temperature=1.0)
    assert len(set(draws(temperature=1.0))) >= 4  # plain sampling explores
    assert set(draws(temperature=1.0, top_k=2)) == {0, 1}
    assert set(draws(temperature=1.0, top_p=0.01)) == {0}  # only the top token survives
    p = LOGITS.softmax(-1)[0]
    assert set(draws(temperature=1.0, top_p=float(p[0] + p[1]) - 1e-4)) == {0, 1}
    assert set(draws(temperature=0)) == {0}
    low = draws(temperature=0.2)
    assert low.count(0) > 150  # cold: nearly always the top token
    # The frequencies follow softmax(logits): the most likely token is drawn most.
    hot = draws(n_seeds=2000, temperature=1.0)
    freq = torch.bincount(torch.tensor(hot), minlength=5).float() / len(hot)
    torch.testing.assert_close(freq, p, atol=0.04, rtol=0)


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 3
    history = [[3, 7, 7, 20], [1, 2]]
    hf = RepetitionPenaltyLogitsProcessor(1.3)
    want = torch.stack([hf(torch.tensor([h]), logits[i:i + 1].clone())[0] for i, h in enumerate(history)])
    sampler = BatchSampler(2, 50)
    for i, h in enumerate(history):
        sampler.set_row(i, SamplingParams(temperature=0, repetition_penalty=1.3), h)
    got = logits.clone()
    out = torch.empty(2, dtype=torch.long)
    sampler.sample(got, 0, out)  # greedy rows: the penalised logits are what argmax saw
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert out.tolist() == want.argmax(-1).tolist()
    assert not sampler.unseen[0, out[0]] and not sampler.unseen[0, 7]  # the new token now counts as seen


def test_rows_of_a_batch_sample_independently():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.7, top_k=10, seed=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.8, seed=9)]
    batch = BatchSampler(3, 100)
    for i, sp in enumerate(params):
        batch.set_row(i, sp, [])
    together = torch.empty(3, dtype=torch.long)
    batch.sample(logits.clone(), 0, together)
    for i, sp in enumerate(params):
        alone = BatchSampler(1, 100)
        alone.set_row(0, sp, [])
        out = torch.empty(1, dtype=torch.long)
        alone.sample(logits[i:i + 1].clone(), 0, out)
        assert int(out) == int(together[i])
    assert int(together[1]) == int(logits[1].argmax())


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_new_tokens": 0},
                                {"repetition_penalty": 0}, {"stop": ("",)}])
def test_bad_sampling_params_are_rejected_naming_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw).validate()
