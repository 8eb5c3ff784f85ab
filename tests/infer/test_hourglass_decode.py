"""Decoding hourglass models in the engine (model/hourglass_cache.py, model/hourglass_decode.py,
infer/hourglass_pools.py): prefill and decode, by the fast step and by the plain forward, give
the training forward's logits, greedy tokens are the training forward's, continuous batching
mixes rows at every phase of k, and the shortened depths' pools hold one entry per k tokens.
Every spec of the model tests; tiny shapes, seconds on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.infer.helpers import argmax_loop, sharpen
from tests.model.test_hourglass import SPECS, hourglass_config
from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model.attention_cache import kv_bytes_per_token
from trainforge.model.hourglass_decode import HourglassDecoder
from trainforge.model.llama import build_model

GREEDY = SamplingParams(max_new_tokens=14, temperature=0.0)


def hourglass_model(spec: str, pool: str = "mean", seed: int = 0):
    return sharpen(build_model(hourglass_config(spec, pool, max_seq_len=64), seed=seed), seed).eval()


def recorded_logits(engine: Engine) -> list[torch.Tensor]:
    """Every logits tensor the engine's runner returns, in order (prefill and decode steps)."""
    seen: list[torch.Tensor] = []
    runner = engine.runner
    for name in ("prefill", "decode"):
        fn = getattr(runner, name)
        setattr(runner, name, lambda *a, _fn=fn, **kw: seen.append(_fn(*a, **kw).clone()) or seen[-1])
    return seen


# HourglassDecoder with the C++ decode ops, with torch's ops (a machine without a compiler: the
# attention's plan is bound for one context length, so plans must be keyed by it), or the
# model's plain forward.
@pytest.mark.parametrize("step", ["fast", "fast-torch-ops", "forward"])
@pytest.mark.parametrize("T", [1, 5, 6])  # prompts ending at each phase of k = 2 and 3, and one token
@pytest.mark.parametrize("spec, pool", SPECS)
def test_prefill_and_decode_give_the_training_forwards_logits(spec, pool, T, step, monkeypatch):
    if step == "fast-torch-ops":
        import trainforge.infer.runner as runner

        monkeypatch.setattr(runner, "decode_kernels", lambda model: None)
    model = hourglass_model(spec, pool)
    engine = Engine(model, EngineConfig(max_batch_size=1, block_size=4, max_context=40))
    assert isinstance(engine.runner.decoder, HourglassDecoder)
    if step == "forward":
        engine.runner.decoder = None  # the runner's path for models without decode_calls
    seen = recorded_logits(engine)
    prompt = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    out = engine.generate([prompt], GREEDY)[0].output_ids
    with torch.no_grad():
        full = model(torch.tensor([prompt + out]))[0]  # (T + n, V)
    got = torch.cat([seen[0].reshape(1, -1)] + [s.reshape(1, -1) for s in seen[1:]])  # position T-1, T, ...
    want = full[T - 1:T - 1 + got.shape[0]]
    assert len(seen) == GREEDY.max_new_tokens  # one prefill, then one decode step per further token
    assert (got - want).abs().max() < 1e-5
    assert out == full[T - 1:-1].argmax(-1).tolist()  # greedy tokens are the training forward's


@pytest.mark.parametrize("spec, pool", [("1@1 2@2/2 1@1", "linear"), ("1@1 1@3/2 2@1", "mean"),
                                        ("1@1 1@2 1@6/2 1@2 1@1", "mean")])
def test_continuous_batching_mixes_rows_at_every_phase(spec, pool):
    """7 requests of different prompt lengths and budgets through 3 rows: requests join the
    running batch and leave it (the last row moves into the hole) while the others sit at
    other phases of k; each gets exactly what it gets alone and what the training forward
    chooses."""
    model = hourglass_model(spec, pool)
    engine = Engine(model, EngineConfig(max_batch_size=3, block_size=4, max_context=48))
    phases = []
    set_decode = engine.hourglass.set_decode
    engine.hourglass.set_decode = lambda ids, pos: phases.append(pos.copy()) or set_decode(ids, pos)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 2, 3, 5, 6, 7, 11)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in (9, 4, 13, 6, 8, 3, 10)]
    reqs = engine.generate(prompts, params)
    for prompt, p, req in zip(prompts, params, reqs):
        assert req.output_ids == argmax_loop(model, prompt, p.max_new_tokens)
    k = model.hourglass.shorten["0"].k
    mixed = [pos for pos in phases if len(pos) > 1 and len(set((pos % k == 0).tolist())) == 2]
    assert len(mixed) >= 5  # steps where some rows ran the middle and others did not
    assert engine.pool.utilisation()["sequences"] == 0
    assert all(pool.utilisation()["sequences"] == 0 and pool.blocks_used == 0
               for pool in engine.hourglass.pools.values())


def test_the_shortened_depths_store_one_entry_per_k_tokens():
    spec = "1@1 2@2/2 1@1"
    model = hourglass_model(spec)
    engine = Engine(model, EngineConfig(max_batch_size=1, block_size=4, max_context=40))
    lengths = []
    step = engine.step

    def watch():
        step()
        for req in engine._rows:
            lengths.append((engine.pool.length(req.id), engine.hourglass.pools[1].length(req.id)))
    engine.step = watch
    engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=10, temperature=0.0))
    # The first step prefills 5 tokens (groups 0..2: entries 3) and decodes token 5 (no group
    # closes); then tokens 6, 7, 8: a new entry at each even one.
    assert lengths[:4] == [(6, 3), (7, 4), (8, 4), (9, 5)]
    # Bytes per token: 2 full-rate blocks (2 kv heads x (16 + 16) fp32) + 2 blocks at half the
    # width every 2 tokens; the dense model of the same depth stores 4 x 256.
    assert engine.kv_bytes_per_token == 2 * 256 + 2 * 128 / 2 == kv_bytes_per_token(model.cfg, 4)
    assert engine.stats()["kv_bytes_per_token"] == 640 < 4 * 256


def test_fusion_and_int8_weights_decode_an_hourglass():
    """prepare_model's swaps apply to the blocks and the shortenings' linears alike; greedy
    tokens of the fused model match the plain one, int8 decodes (within quantisation noise)."""
    from trainforge.infer.quantize import quantize_model

    plain = hourglass_model("1@1 2@2/2 1@1", "linear")
    want = Engine(plain).generate([[5, 6, 7]], GREEDY)[0].output_ids
    fused = prepare_model(hourglass_model("1@1 2@2/2 1@1", "linear"))
    assert Engine(fused).generate([[5, 6, 7]], GREEDY)[0].output_ids == want
    q = hourglass_model("1@1 2@2/2 1@1", "linear")
    quantize_model(q, "int8", group_size=32)
    out = Engine(prepare_model(q)).generate([[5, 6, 7]], GREEDY)[0].output_ids
    assert len(out) == GREEDY.max_new_tokens


def test_speculative_decoding_and_compile_are_refused_naming_the_key():
    from trainforge.infer.speculative import Drafter

    model = hourglass_model("1@1 2@2 1@1")
    with pytest.raises(ConfigError, match="model.hourglass.*compile"):
        Engine(model, EngineConfig(compile=True))
    with pytest.raises(ConfigError, match="model.hourglass.*speculative"):
        Engine(model, EngineConfig(), drafter=Drafter())


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_block_quantised_weights_decode_rows_at_different_phases(mode):
    """A block-quantised model (its embedding table in blocks too) through the mixed-phase step:
    prompts of 3 and 4 tokens sit at different phases of k = 2, so every step is mixed. Each
    request gets the greedy tokens of the quantised model's own forward, and every step's logits
    are that forward's. (The mixed step once gathered the embedding's block codes as floats: both
    requests ended with finish_reason "abort" after one token.)"""
    from trainforge.infer.quantize import quantize_model

    model = hourglass_model("1@1 2@2/2 1@1", "linear")
    assert quantize_model(model, mode, group_size=32)["embedding"] == mode
    prepare_model(model)  # fusion and the block kernels: the engine's fast step
    engine = Engine(model, EngineConfig(max_batch_size=2, block_size=4, max_context=40))
    assert isinstance(engine.runner.decoder, HourglassDecoder)
    phases, seen = [], []
    set_decode, decode = engine.hourglass.set_decode, engine.runner.decode
    engine.hourglass.set_decode = lambda ids, pos: phases.append(pos.copy()) or set_decode(ids, pos)
    engine.runner.decode = lambda B, S: seen.append(decode(B, S).clone()) or seen[-1]
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = engine.generate(prompts, params)
    assert [r.finish_reason for r in reqs] == ["length", "length"]
    assert all(len(set((pos % 2).tolist())) == 2 for pos in phases)  # every step mixed
    with torch.no_grad():
        full = [model(torch.tensor([p + r.output_ids]))[0] for p, r in zip(prompts, reqs)]
    for i, logits in enumerate(seen):  # decode step i: row r's token at position len(prompt_r) + i
        want = torch.stack([f[len(p) + i] for f, p in zip(full, prompts)])
        assert (logits - want).abs().max() < 1e-5
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == argmax_loop(model, prompt, params.max_new_tokens)
