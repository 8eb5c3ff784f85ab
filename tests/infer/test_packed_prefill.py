"""Packed prefill: the prompts admitted in one step prefill together in one forward
(``ModelRunner.prefill_packed``, ``PagedCache.set_packed_prefill``), each attending to itself
only. Against each prompt's own plain prefill (``prefill_forward``): the same last-position
logits and the same keys/values in the pool, float32, tolerance 1e-5; and an engine that packs
prompts generates the same greedy tokens as one that admits one request at a time, also when
requests end on their first token in the middle of a pack."""

from __future__ import annotations

import pytest
import torch

from tests.infer.helpers import model_for
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.kv_pool import KVPool
from trainforge.infer.prepare import prepare_model
from trainforge.infer.runner import ModelRunner
from trainforge.infer.sampling import SamplingParams

TOL = dict(atol=1e-5, rtol=1e-5)
LENGTHS = [1, 5, 16, 17, 40]  # a one-token prompt, block-aligned (4) and unaligned ones, the fast-path limit


def _runner(name: str, fuse: bool) -> tuple[ModelRunner, KVPool]:
    model = prepare_model(model_for(name), fuse=fuse)
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 64, 4)
    return ModelRunner(model, pool, 2, 96), pool


@pytest.mark.parametrize("name,fuse", [("gqa4", False), ("gqa4", True), ("moe", False)])
def test_packed_prompts_prefill_as_each_prompt_alone(name, fuse):
    runner, pool = _runner(name, fuse)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.cfg.vocab_size, (T,), generator=gen) for T in LENGTHS]
    packed_slots, alone_slots = [], []
    for i, p in enumerate(prompts):
        for seq, slots in ((i, packed_slots), (100 + i, alone_slots)):
            pool.add(seq, len(p))
            slots.append(torch.tensor(pool.append_slots(seq, len(p))))
    want = torch.cat([runner.prefill_forward(p, s) for p, s in zip(prompts, alone_slots)])  # (n, V)
    got = runner.prefill_packed(torch.cat(prompts), torch.cat(packed_slots), LENGTHS)
    assert got.shape == (len(LENGTHS), runner.cfg.vocab_size)
    torch.testing.assert_close(got, want, **TOL)
    for cache in (pool.k, pool.v):  # the keys / values the decode steps will read
        for packed, alone in zip(packed_slots, alone_slots):
            torch.testing.assert_close(cache[:, :, packed], cache[:, :, alone], **TOL)
    # The cache is back to a single prompt's prefill afterwards.
    torch.testing.assert_close(runner.prefill_forward(prompts[3], alone_slots[3]), want[3:4], **TOL)


def test_packed_prefill_refuses_a_prompt_outside_the_context():
    runner, pool = _runner("gqa4", False)
    with pytest.raises(ValueError, match=r"prompt of 97 tokens: must be 1..96 \(max_context\)"):
        runner.prefill_packed(torch.zeros(99, dtype=torch.long), torch.zeros(99, dtype=torch.long), [2, 97])
    with pytest.raises(ValueError, match="lengths"):
        runner.prefill_packed(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), [2, 2])


# FIFO packs of at most 30 prompt tokens: [5, 9, 13], then 41 alone (longer than the limit),
# [2, 20, 8] (exactly 30), and 16 alone (the last one).
PROMPT_LENGTHS = [5, 9, 13, 41, 2, 20, 8, 16]
PACKED = [[5, 9, 13], [2, 20, 8]]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (T,), generator=gen).tolist() for T in PROMPT_LENGTHS]


def _generate(max_batch_size: int, params: list[SamplingParams]) -> tuple[Engine, list, list[list[int]]]:
    """Engine over gqa4 (GQA, 4 query heads per kv head); returns it, its requests and the
    lengths of the prompts ``prefill_packed`` ran on, call by call."""
    engine = Engine(model_for("gqa4"), EngineConfig(max_batch_size=max_batch_size, block_size=4, max_context=96,
                                                    max_prefill_tokens=30))
    packed: list[list[int]] = []
    real = engine.runner.prefill_packed
    engine.runner.prefill_packed = lambda tokens, slots, lengths: packed.append(list(lengths)) or real(
        tokens, slots, lengths)
    return engine, engine.generate(_prompts(), params), packed


def test_an_engine_packing_prompts_generates_what_one_request_at_a_time_does():
    params = [SamplingParams(max_new_tokens=12, temperature=0)] * len(PROMPT_LENGTHS)
    _, alone, none_packed = _generate(1, params)
    engine, reqs, packed = _generate(8, params)
    assert none_packed == [] and packed == PACKED
    assert [r.output_ids for r in reqs] == [r.output_ids for r in alone]
    assert all(len(r.output_ids) == 12 and r.ttft_s is not None for r in reqs)
    assert engine.stats()["prompt_tokens"] == sum(PROMPT_LENGTHS) and engine.stats()["peak_batch"] == 8
    assert engine.pool.utilisation()["blocks_used"] == 0


def test_requests_ending_on_their_first_token_leave_a_pack_without_disturbing_the_others():
    """Requests 1 (mid first pack), 5 and 6 (mid and end of the second) end on their first
    token: their rows leave only after every pack is prefilled, last row first."""
    params = [SamplingParams(max_new_tokens=1 if i in (1, 5, 6) else 10, temperature=0)
              for i in range(len(PROMPT_LENGTHS))]
    _, alone, _ = _generate(1, params)
    engine, reqs, packed = _generate(8, params)
    assert packed == PACKED
    assert [r.output_ids for r in reqs] == [r.output_ids for r in alone]
    assert [len(r.output_ids) for r in reqs] == [sp.max_new_tokens for sp in params]
    assert engine.pool.utilisation()["blocks_used"] == 0 and not engine._rows


def test_max_prefill_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens=0: must be >= 1"):
        EngineConfig(max_prefill_tokens=0).validate()
