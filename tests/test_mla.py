"""Multi-head latent attention (model/mla.py), YaRN (model/yarn.py) and the DeepSeek-V3
flavors: parity of the attention against transformers' ``DeepseekV3Attention`` (weights
mapped by model/hf_deepseek.py, the interleaved rotary layout included), training through
the CLI, cached decode against the training forward, the 671B counts and config errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from trainforge.cli import main as cli_main
from trainforge.errors import ConfigError
from trainforge.model.attention_cache import StaticCache
from trainforge.model.config import FLAVORS, ModelConfig
from trainforge.model.hf_deepseek import attention_from_hf, attention_to_hf
from trainforge.model.llama import build_model
from trainforge.model.rope import model_rope_tables, rope_tables
from trainforge.model.mla import MLA

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

YARN = dict(rope_factor=4.0, rope_original_max_seq_len=32, rope_beta_fast=32.0, rope_beta_slow=1.0,
            rope_mscale=0.707, rope_mscale_all_dim=0.5)


def small_mla(q_lora_rank: int, yarn: bool) -> ModelConfig:
    return ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_hidden_dim=128,
                       max_seq_len=128, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=12, **(YARN if yarn else {}))


def hf_config(cfg: ModelConfig, interleave: bool):
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_factor > 1:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    c = transformers.DeepseekV3Config(
        hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, max_position_embeddings=cfg.max_seq_len,
        rope_parameters=rope, rope_interleave=interleave, vocab_size=cfg.vocab_size, num_hidden_layers=1,
        attention_bias=False)
    c._attn_implementation = "sdpa"
    return c


@pytest.mark.parametrize("q_lora_rank,yarn,interleave", [(0, False, True), (24, False, True), (0, True, True),
                                                        (24, True, True), (24, True, False)])
def test_mla_matches_transformers_deepseek_v3_attention(q_lora_rank, yarn, interleave):
    torch.manual_seed(0)
    cfg = small_mla(q_lora_rank, yarn)
    hcfg = hf_config(cfg, interleave)
    theirs = hf_ds.DeepseekV3Attention(hcfg, layer_idx=0).eval()
    for p in theirs.parameters():  # non-trivial norms too
        p.data.normal_(0.0, 0.2) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    ours = MLA(cfg).eval()
    sd = attention_from_hf(theirs.state_dict(), cfg, rope_interleave=interleave)
    ours.load_state_dict(sd, strict=True)
    # The inverse mapping gives the HF weights back (what writing a checkpoint needs).
    back = attention_to_hf(ours.state_dict(), cfg, rope_interleave=interleave)
    assert all(torch.equal(back[k], v) for k, v in theirs.state_dict().items()) and back.keys() == \
        theirs.state_dict().keys()
    T = 48  # beyond rope_original_max_seq_len = 32: the YaRN-scaled frequencies matter
    x = torch.randn(2, T, cfg.dim)
    pos = torch.arange(T).unsqueeze(0).expand(2, -1)
    cos_h, sin_h = hf_ds.DeepseekV3RotaryEmbedding(hcfg)(x, pos)
    cos, sin = model_rope_tables(cfg)
    torch.testing.assert_close(cos[:T], cos_h[0], rtol=0, atol=1e-6)  # our tables are HF's (rotate-half layout)
    torch.testing.assert_close(sin[:T], sin_h[0], rtol=0, atol=1e-6)
    with torch.no_grad():
        want, _ = theirs(x, (cos_h, sin_h), attention_mask=None)
        got = ours(x, cos[:T], sin[:T])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert ours.softmax_scale == pytest.approx(theirs.scaling, rel=1e-12)


def test_dense_llama_rope_tables_unchanged():
    cfg = FLAVORS["debug"]
    cos, sin = model_rope_tables(cfg)
    ref = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    assert build_model(cfg, seed=0).rope_cos.shape == (cfg.max_seq_len, cfg.head_dim)


def test_static_cache_prefill_and_decode_match_the_training_forward():
    cfg = dataclasses.replace(FLAVORS["dsv3-debug"], **YARN)  # YaRN tables and softmax scale on the cached path too
    model = build_model(cfg, seed=0).eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(tokens)
        cache = StaticCache.for_model(model, batch_size=2, max_seq_len=16)
        got = [model(tokens[:, :7], cache.advance(7), cache)]  # prefill 7, then one token at a time
        got += [model(tokens[:, t:t + 1], cache.advance(1), cache) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-5)
    assert cache.k.shape[-1] == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim and cache.v.shape[-1] == cfg.v_head_dim


def test_dsv3_debug_trains_through_the_cli(small_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", "--model.flavor", "dsv3-debug", "--data.path", str(small_data), "--run_dir", str(run),
                     "--training.batch_size", "4", "--training.seq_len", "32", "--training.steps", "12",
                     "--training.log_interval", "1", "--training.warmup_steps", "2", "--training.val_batches", "1",
                     "--training.lr", "3e-3", "--training.threads", "1", "--checkpoint.interval", "0"]) == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    out = capsys.readouterr().out
    assert "sample:\n" in out and "skipped" not in out  # the engine serves MLA (absorbed decode)
    ckpt = out.split("checkpoint: ")[1].split()[0]
    assert cli_main(["generate", "--checkpoint", ckpt, "--prompt_ids", "5,6,7", "--print_ids", "--quantize", "int8",
                     "--temperature", "0", "--max_new_tokens", "6", "--ignore_eos"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 6


def test_flavor_counts():
    for name in ("dsv3-debug", "dsv3-tiny", "deepseek-v3-671b"):
        cfg = FLAVORS[name]
        model = build_model(cfg, device="meta")
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), name
    assert FLAVORS["dsv3-debug"].num_params() < 1_000_000
    tiny = FLAVORS["dsv3-tiny"]
    assert 9e6 < tiny.num_params(active=True) < 12e6
    v3 = FLAVORS["deepseek-v3-671b"]
    assert v3.num_params(mtp=False) == pytest.approx(671e9, rel=0.01)
    # The released checkpoint's 685B counts the MTP layer with its own copies of the embedding and head.
    assert v3.num_params() + 2 * v3.vocab_size * v3.dim == pytest.approx(685e9, rel=0.01)
    # "37B activated" is 37.55B counted as the 671B is (embedding and output head included):
    # the published figure is rounded down, hence 2%.
    assert v3.num_params(active=True, mtp=False) == pytest.approx(37e9, rel=0.02)
    inactive = v3.n_moe_layers * (v3.n_routed_experts - v3.n_activated_experts) * 3 * v3.dim * v3.moe_inter_dim
    assert v3.num_params(mtp=False) - v3.num_params(active=True, mtp=False) == inactive
    # Attention FLOPs use the q·k (nope + rope) and value widths; the MTP depth adds a block and a head pass.
    n = v3.num_params(include_embedding=False, active=True) + v3.vocab_size * v3.dim
    assert v3.flops_per_token(4096) == 6 * n + 6 * (61 + 1) * 128 * (192 + 128) * 4096
    dense = FLAVORS["tiny"]
    assert dense.flops_per_token(256) == 6 * dense.num_params(include_embedding=False) + 12 * 8 * 256 * 256


@pytest.mark.parametrize("change,key", [
    (dict(qk_rope_head_dim=7), "model.qk_rope_head_dim"),
    (dict(v_head_dim=0), "model.v_head_dim"),
    (dict(rope_factor=0.5), "model.rope_factor"),
    (dict(rope_beta_slow=40.0), "model.rope_beta_slow"),
    (dict(kv_lora_rank=0), "model.q_lora_rank"),  # the rest of MLA set without the latent
])
def test_config_errors_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(FLAVORS["dsv3-debug"], **change)


def test_overrides_and_yarn_on_dense_refused_via_the_cli_config():
    from trainforge.config import load_config
    from trainforge.model.config import model_config_from_section

    cfg = load_config(None, ["--model.flavor", "dsv3-debug", "--model.kv_lora_rank", "16"])
    assert model_config_from_section(cfg.model, 512).kv_lora_rank == 16
    bad = load_config(None, ["--model.flavor", "debug", "--model.rope_factor", "4"])
    with pytest.raises(ConfigError, match="model.rope_factor"):
        model_config_from_section(bad.model, 512)


def test_tensor_parallel_takes_dense_latent_attention_and_refuses_its_experts():
    """MLA splits over TP (tests/parallel/test_mla_parallel.py); the dsv3 flavors' MoE blocks do not."""
    from trainforge.parallel.tensor_parallel import check_tensor_parallel

    dense_mla = dataclasses.replace(FLAVORS["dsv3-debug"], n_routed_experts=0)
    check_tensor_parallel(dense_mla, 2)
    with pytest.raises(ConfigError, match="parallel.tp.*mixture-of-experts"):
        check_tensor_parallel(FLAVORS["dsv3-debug"], 2)
