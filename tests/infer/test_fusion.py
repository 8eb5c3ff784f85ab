"""The fusion pass: fused and unfused models give the same logits within 1e-5 (the model's
own forward, and the engine's prefill and decode), and the operator count drops."""

from __future__ import annotations

import pytest
import torch

from tests.infer.helpers import model_for
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.fusion import FusedAttention, FusedFeedForward, FusedTransformerBlock, count_ops, fuse_model
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model.attention_cache import StaticCache

ATOL = RTOL = 1e-5


@pytest.mark.parametrize("shape", ["gqa2", "gqa4"])
def test_fused_model_forward_matches_unfused(shape):
    plain, fused = model_for(shape), model_for(shape)
    assert fuse_model(fused) == {"qkv": 3 if shape == "gqa4" else 2, "gate_up": len(fused.layers),
                                 "add_norm": len(fused.layers)}
    block = fused.layers["0"]
    assert isinstance(block, FusedTransformerBlock) and isinstance(block.attention, FusedAttention)
    assert isinstance(block.feed_forward, FusedFeedForward)
    tokens = torch.randint(0, plain.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), plain(tokens), atol=ATOL, rtol=RTOL)
        # The model's own KV-cache path works on the fused modules too.
        cache = StaticCache.for_model(fused, 2, 48)
        fused(tokens, cache.advance(40), cache)
        step = fused(tokens[:, :1], cache.advance(1), cache)
        want = plain(torch.cat([tokens, tokens[:, :1]], dim=1))[:, -1:]
    torch.testing.assert_close(step, want, atol=ATOL, rtol=RTOL)


def engine_logits(fuse: bool):
    """Prefill logits and 12 decode steps of logits for a batch of 3 sequences."""
    engine = Engine(prepare_model(model_for("gqa4"), fuse=fuse),
                    EngineConfig(max_batch_size=3, block_size=4, max_context=96))
    seen = []
    prefill, decode = engine.runner.prefill, engine.runner.decode
    engine.runner.prefill = lambda *a, **k: (lambda o: (seen.append(o.clone()), o)[1])(prefill(*a, **k))
    engine.runner.decode = lambda *a: (lambda o: (seen.append(o.clone()), o)[1])(decode(*a))
    engine.generate([[1, 2, 3], list(range(40, 75)), [9] * 11], SamplingParams(max_new_tokens=12, temperature=0))
    return engine, seen


def test_fused_engine_matches_unfused_and_counts_fewer_ops():
    plain, a = engine_logits(fuse=False)
    fused, b = engine_logits(fuse=True)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=RTOL)

    def decode_ops(engine):
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0))
        engine.step()  # prefill; the next call to decode is a steady-state step
        return count_ops(engine.runner.decode, 1, 4)

    before, after = decode_ops(plain), decode_ops(fused)
    L = 3
    # Per layer: 3 QKV matmuls -> 1, 2 gate/up -> 1, one rope pass fewer (5 ops); 7 -> 5 ops per norm
    # (2 per layer + the final one).
    assert len(plain.runner.decoder.linears) - len(fused.runner.decoder.linears) == 3 * L  # linears launched per step
    assert before["compute"] - after["compute"] >= 3 * L + 5 * L + 2 * (2 * L + 1)
    print(f"decode step ops: {before['compute']} -> {after['compute']} (compute), "
          f"{before['total']} -> {after['total']} (with views)")
