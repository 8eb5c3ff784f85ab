import dataclasses

import pytest
import torch

from trainforge.model import FLAVORS, build_model
from trainforge.model.attention_cache import StaticCache
from trainforge.errors import ConfigError


@pytest.mark.parametrize("tie", [False, True])
def test_kv_cache_decoding_matches_full_forward(tie):
    cfg = dataclasses.replace(FLAVORS["debug"], tie_embeddings=tie)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = StaticCache.for_model(model, 2, 32)
        parts = [model(tokens[:, :9], cache.advance(9), cache)]
        parts += [model(tokens[:, i:i + 1], cache.advance(1), cache) for i in range(9, 20)]
        parts.append(model(tokens[:, 20:], cache.advance(4), cache))  # a multi-token chunk after decoding
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_causality_future_tokens_do_not_change_past_logits():
    model = build_model(FLAVORS["debug"], seed=0).eval()
    a = torch.randint(0, 512, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 512
    with torch.no_grad():
        torch.testing.assert_close(model(a)[:, :10], model(b)[:, :10], atol=0, rtol=0)
        assert not torch.allclose(model(a)[:, 10:], model(b)[:, 10:])


@pytest.mark.parametrize("flavor, billions", [("llama-1b", 1.24), ("llama-8b", 8.03), ("llama-70b", 70.55),
                                              ("llama-405b", 405.85)])
def test_real_size_flavors_build_on_meta(flavor, billions):
    model = build_model(FLAVORS[flavor], device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert n == FLAVORS[flavor].num_params()
    assert abs(n / 1e9 - billions) < 0.01
    assert model.output.weight.is_meta


def test_small_flavors_sizes_and_same_seed_same_weights():
    assert FLAVORS["debug"].num_params() < 1_000_000
    assert 8e6 < FLAVORS["tiny"].num_params() < 12e6
    assert 100e6 < FLAVORS["small"].num_params() < 140e6
    a, b = build_model(FLAVORS["debug"], seed=3), build_model(FLAVORS["debug"], seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_invalid_shapes_are_rejected():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        dataclasses.replace(FLAVORS["debug"], n_kv_heads=3)
    with pytest.raises(ConfigError, match="n_heads"):
        dataclasses.replace(FLAVORS["debug"], dim=66)
