"""Parity of ``trainforge.model.hf`` against ``transformers.LlamaForCausalLM``.

Both directions load with ``strict=True`` and compare fp32 logits at atol = rtol = 1e-5.
Norm weights are perturbed away from their init of ones so a swapped or dropped norm
mapping changes the logits; HF runs eager attention, ours SDPA, so the attention
math is checked too, not only the key names."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from trainforge.errors import CheckpointError
from trainforge.model import FLAVORS, ModelConfig, build_model
from trainforge.model.hf import from_hf_state_dict, model_config_from_hf, to_hf_config_dict, to_hf_state_dict
from trainforge.model.llama import Transformer

ATOL = RTOL = 1e-5

CONFIGS = {
    "debug": FLAVORS["debug"],
    # More query heads per kv head, a non-default theta and eps: a config conversion
    # that dropped either would shift the logits.
    "gqa4": ModelConfig(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=320, ffn_hidden_dim=256,
                        norm_eps=1e-6, rope_theta=500000.0, max_seq_len=64),
    "tied": ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                        max_seq_len=64, tie_embeddings=True),
}


def _hf_model(cfg: ModelConfig) -> transformers.LlamaForCausalLM:
    hf_cfg = transformers.LlamaConfig(**to_hf_config_dict(cfg), attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_cfg).eval()


@torch.no_grad()
def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", CONFIGS)
def test_ours_to_hf_logits_match(name):
    cfg = CONFIGS[name]
    ours = build_model(cfg, seed=0).eval()
    _perturb_norms(ours, seed=2)
    hf = _hf_model(cfg)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=True)
    if cfg.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight

    tokens = _tokens(cfg)
    with torch.no_grad():
        expected = ours(tokens)
        actual = hf(input_ids=tokens).logits
    assert expected.dtype == actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    print(f"{name} ours->hf max abs logit diff {_max_diff(actual, expected):.3e}")


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_to_ours_logits_match(name):
    cfg = CONFIGS[name]
    torch.manual_seed(3)  # HF initialises from the global generator
    hf = _hf_model(cfg)
    _perturb_norms(hf, seed=4)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)

    tokens = _tokens(cfg)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    print(f"{name} hf->ours max abs logit diff {_max_diff(actual, expected):.3e}")


def test_wrong_mapping_is_detected():
    """Negative control: swapping gate and up projections must break parity at this tolerance."""
    cfg = CONFIGS["debug"]
    ours = build_model(cfg, seed=0).eval()
    hf_sd = dict(to_hf_state_dict(ours.state_dict(), cfg))
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    hf_sd[gate], hf_sd[up] = hf_sd[up], hf_sd[gate]
    hf = _hf_model(cfg)
    hf.load_state_dict(hf_sd, strict=True)
    tokens = _tokens(cfg)
    with torch.no_grad():
        assert _max_diff(hf(input_ids=tokens).logits, ours(tokens)) > 100 * ATOL


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_is_exact(name):
    cfg = CONFIGS[name]
    sd = build_model(cfg, seed=5).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg), cfg)
    assert back.keys() == sd.keys()
    for key, tensor in sd.items():
        assert torch.equal(back[key], tensor), key


def test_tied_hf_checkpoint_without_lm_head_loads():
    """HF's save_pretrained drops lm_head.weight when embeddings are tied."""
    cfg = CONFIGS["tied"]
    hf_sd = to_hf_state_dict(build_model(cfg, seed=6).state_dict(), cfg)
    del hf_sd["lm_head.weight"]
    hf_sd["model.rotary_emb.inv_freq"] = torch.zeros(cfg.head_dim // 2)  # stored by some old checkpoints
    ours = Transformer(cfg)
    ours.load_state_dict(from_hf_state_dict(hf_sd, cfg), strict=True)
    assert torch.equal(ours.output.weight, hf_sd["model.embed_tokens.weight"])


def test_untied_lm_head_into_tied_config_raises():
    cfg = CONFIGS["tied"]
    hf_sd = dict(to_hf_state_dict(build_model(cfg, seed=6).state_dict(), cfg))
    hf_sd["lm_head.weight"] = torch.randn_like(hf_sd["lm_head.weight"])
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        from_hf_state_dict(hf_sd, cfg)


def test_missing_and_unexpected_keys_are_named():
    cfg = CONFIGS["debug"]
    sd = dict(build_model(cfg, seed=0).state_dict())
    del sd["layers.1.ffn_norm.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn_norm\.weight"):
        to_hf_state_dict(sd, cfg)

    hf_sd = dict(to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg))
    hf_sd["model.layers.2.self_attn.q_proj.weight"] = hf_sd["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight"):
        from_hf_state_dict(hf_sd, cfg)

    del hf_sd["model.layers.2.self_attn.q_proj.weight"]
    del hf_sd["lm_head.weight"]  # untied: the output projection is required
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        from_hf_state_dict(hf_sd, cfg)


def test_wrong_shape_is_named():
    cfg = CONFIGS["debug"]
    other = dataclasses.replace(cfg, ffn_hidden_dim=cfg.ffn_hidden_dim * 2)
    with pytest.raises(CheckpointError, match=r"layers\.0\.feed_forward\.w1\.weight"):
        to_hf_state_dict(build_model(cfg, seed=0).state_dict(), other)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_round_trip(name):
    cfg = CONFIGS[name]
    assert model_config_from_hf(to_hf_config_dict(cfg)) == cfg
    # What transformers itself writes to config.json (v5: rope theta under rope_parameters only).
    assert model_config_from_hf(transformers.LlamaConfig(**to_hf_config_dict(cfg)).to_dict()) == cfg


@pytest.mark.parametrize("key, value", [
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
    ("head_dim", 32),
])
def test_unsupported_hf_config_raises_naming_the_key(key, value):
    d = to_hf_config_dict(CONFIGS["debug"])
    d[key] = value
    with pytest.raises(CheckpointError, match=key):
        model_config_from_hf(d)
