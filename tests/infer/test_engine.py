"""The engine: greedy decoding equals the model's own argmax loop, batched decode of
sequences of different lengths equals decoding each alone (also when requests join and
leave mid-way), seeds reproduce samples, the queue is bounded, aborts free their blocks,
and a float32 decode step allocates nothing."""

from __future__ import annotations

import pytest

from tests.conftest import needs_cpu_compile
from tests.infer.helpers import argmax_loop, model_for
from trainforge.infer.engine import Engine, EngineConfig, QueueFull, RequestTooLong
from trainforge.infer.prepare import prepare_model
from trainforge.infer.runner import count_allocations
from trainforge.infer.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
PROMPTS = [[5, 17, 300, 42], list(range(1, 38)), [7], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89]]


@pytest.mark.parametrize("fuse", [False, True])
def test_greedy_matches_the_models_own_argmax_loop(fuse):
    model = model_for("gqa2")
    want = [argmax_loop(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    engine = Engine(prepare_model(model, fuse=fuse), EngineConfig(max_batch_size=4, block_size=8, max_context=128))
    got = [r.output_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert got == want


def test_batched_decode_equals_decoding_each_alone():
    """Different prompt lengths and budgets share a batch; rows leave as they finish and
    queued requests take their place (continuous batching)."""
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in (30, 9, 21, 4, 17, 12)]
    prompts = PROMPTS + [[1, 2], list(range(200, 260))]
    alone = []
    for p, sp in zip(prompts, params):
        engine = Engine(model_for("gqa4"), EngineConfig(max_batch_size=1, block_size=4, max_context=128))
        alone.append(engine.generate([p], sp)[0].output_ids)
    engine = Engine(model_for("gqa4"), EngineConfig(max_batch_size=3, block_size=4, max_context=128))
    batched = engine.generate(prompts, params)
    assert [r.output_ids for r in batched] == alone
    assert [len(r.output_ids) for r in batched] == [sp.max_new_tokens for sp in params]
    assert engine.stats()["peak_batch"] == 3
    assert engine.pool.utilisation()["blocks_used"] == 0  # everything went back


def test_requests_join_a_running_batch_at_step_boundaries():
    model = model_for("gqa2")
    alone = [Engine(model_for("gqa2"), EngineConfig(max_batch_size=1, max_context=128)).generate([p], GREEDY)[0]
             .output_ids for p in PROMPTS[:3]]
    engine = Engine(model, EngineConfig(max_batch_size=4, max_context=128))
    first = engine.submit(PROMPTS[0], GREEDY)
    for _ in range(5):
        engine.step()
    assert len(first.output_ids) == 6 and len(engine._rows) == 1
    later = [engine.submit(p, GREEDY) for p in PROMPTS[1:3]]
    engine.step()
    assert len(engine._rows) == 3  # both joined the running batch at the next step
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in [first, *later]] == alone


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    sampled = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1,
                             seed=123)
    alone = Engine(model_for("gqa2"), EngineConfig(max_batch_size=1, max_context=128)).generate(
        [PROMPTS[0]], sampled)[0].output_ids
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=4, max_context=128))
    reqs = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                           [GREEDY, sampled, SamplingParams(max_new_tokens=20, temperature=1.0, seed=7)])
    assert reqs[1].output_ids == alone
    other_seed = Engine(model_for("gqa2"), EngineConfig(max_batch_size=1, max_context=128)).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=20, temperature=0.9, seed=124))[0].output_ids
    assert other_seed != alone


def test_stop_tokens_end_a_request_and_length_limits_hold():
    model = model_for("gqa2")
    free = Engine(model_for("gqa2"), EngineConfig(max_context=128)).generate([PROMPTS[0]], GREEDY)[0]
    stop_at = free.output_ids[5]
    engine = Engine(model, EngineConfig(max_context=128), eos_ids=(stop_at,))
    r = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert r.finish_reason == "stop" and r.output_ids == free.output_ids[:free.output_ids.index(stop_at)]
    ignored = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))[0]
    assert ignored.output_ids == free.output_ids and ignored.finish_reason == "length"


def test_queue_is_bounded_and_bad_requests_are_refused():
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=1, max_queue=2, max_context=64))
    for _ in range(3):  # one for the free batch row (taken at the next step) + max_queue
        engine.submit([1, 2], GREEDY)
    with pytest.raises(QueueFull, match="max_batch_size \\+ max_queue = 3"):
        engine.submit([1, 2], GREEDY)
    with pytest.raises(RequestTooLong, match="exceeds the context of 64"):
        engine.check(list(range(50)), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.check([1, 512], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.check([1], SamplingParams(top_p=0))


def test_abort_frees_the_requests_blocks():
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=2, block_size=4, max_context=128))
    long = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=60, temperature=0))
    waiting = [engine.submit(PROMPTS[0], GREEDY) for _ in range(2)]
    engine.step()
    assert engine.pool.utilisation()["blocks_used"] >= 10 and len(engine._waiting) == 1
    engine.abort(long)
    engine.abort(waiting[1])
    engine.step()
    assert long.finish_reason == "abort" and long.done.is_set() and waiting[1].finish_reason == "abort"
    assert [r.id for r in engine._rows] == [waiting[0].id] and not engine._waiting
    while engine.has_work():
        engine.step()
    assert engine.pool.utilisation()["blocks_used"] == 0 and engine.pool.utilisation()["blocks_reserved"] == 0


@pytest.mark.parametrize("fuse", [False, True])
def test_a_float32_decode_step_allocates_nothing(fuse):
    """Counted by the profiler's allocator events: the runner's decode step (every layer)
    and a whole engine step (bookkeeping + greedy/top-k sampling) in steady state."""
    engine = Engine(prepare_model(model_for("gqa4"), fuse=fuse),
                    EngineConfig(max_batch_size=4, block_size=4, max_context=128))
    engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=60, temperature=0))
    engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=60, temperature=0.8, top_k=20, repetition_penalty=1.2,
                                             seed=1))
    for _ in range(3):
        engine.step()
    assert count_allocations(engine.runner.decode, 2, 48) == {"count": 0, "bytes": 0}
    assert count_allocations(engine.step) == {"count": 0, "bytes": 0}
    # Top-p sorts, and torch.sort allocates its index scratch even with out=: one allocation.
    engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=60, temperature=0.8, top_p=0.9, seed=2))
    engine.step()
    assert count_allocations(engine.step)["count"] == 1


@pytest.mark.slow
@needs_cpu_compile
def test_compiled_decode_step_matches_eager():
    """EngineConfig.compile: same greedy tokens as the eager engine; the compile time is
    reported. Slow: inductor compiles for tens of seconds on CPU."""
    want = [r.output_ids for r in Engine(model_for("gqa2"), EngineConfig(max_batch_size=3, max_context=64))
            .generate(PROMPTS[:3], GREEDY)]
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=3, max_context=64, compile=True))
    assert engine.stats()["compile_s"] > 0
    assert [r.output_ids for r in engine.generate(PROMPTS[:3], GREEDY)] == want


def test_a_failing_step_in_the_engine_thread_fails_requests_instead_of_hanging():
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=2, max_context=64))
    engine.runner.decode = lambda B, S: (_ for _ in ()).throw(RuntimeError("boom"))
    engine.start()
    try:
        reqs = [engine.submit(p, GREEDY) for p in PROMPTS[:3]]
        assert all(r.done.wait(timeout=30) for r in reqs)
    finally:
        engine.stop()
    # The batch's own step failed: every request ends with reason "error" (not "abort": no client left).
    assert {r.finish_reason for r in reqs} == {"error"} and "boom" in engine.last_error
    assert all("boom" in r.error for r in reqs)
    assert engine.pool.utilisation()["blocks_reserved"] == 0 and not engine.has_work()
