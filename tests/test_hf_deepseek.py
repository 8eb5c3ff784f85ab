"""DeepSeek-V3 Hugging Face interop (model/hf_deepseek.py, infer/loading.py, infer/hf_export.py)
against ``transformers.DeepseekV3ForCausalLM`` built from tiny random configs on CPU:

* a directory written by transformers' ``save_pretrained`` loads into trainforge with fp32
  logits within 1e-4 of transformers' and 64 identical greedy tokens, with and without
  group-limited routing and with and without ``q_lora_rank`` (YaRN and a selection bias on);
* a trainforge checkpoint exported as a Hugging Face directory loads in transformers with the
  same logits, and reads back into trainforge bit for bit, MTP modules included;
* the router's group mask: both sides mask unchosen groups with -inf (DeepSeek's reference);
* bad config.json values are refused naming the key.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.infer.helpers import argmax_loop
from trainforge.errors import CheckpointError
from trainforge.infer.hf_export import export_hf
from trainforge.infer.loading import load_model
from trainforge.model.config import FLAVORS
from trainforge.model.hf_deepseek import from_hf_state_dict, model_config_from_hf, to_hf_state_dict
from trainforge.model.llama import build_model
from trainforge.model.moe import Router
from trainforge.train import checkpoint as ckpt

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

ATOL = 1e-4
GREEDY_TOKENS = 64

# Two shapes, each a config.json as a user would hold it: 3 blocks (the first dense), 8 experts
# top-2 + 1 shared, YaRN. "groups_qlora": 4 groups of which a token uses 2, low-rank queries;
# "flat_fullq": no groups, full-rank queries, 2 dense blocks.
BASE = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=24,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=160,
            rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 40, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 0.707})
CONFIGS = {
    "groups_qlora": {**BASE, "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1},
    "flat_fullq": {**BASE, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 2},
}


@torch.no_grad()
def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Decisive logits (random init's are near-uniform, where float noise flips an argmax),
    norms away from ones, and selection biases of both signs (some strongly negative, so that
    unchosen groups masked with 0.0 instead of -inf would win: see test_group_mask_is_minus_inf)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.6 - 0.4)


def _hf_model(d: dict, seed: int):
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    _sharpen(model, seed)
    return model


@torch.no_grad()
def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logits


@torch.no_grad()
def _hf_argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_hf_logits(model, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def _tokens(vocab: int, T: int = 48) -> torch.Tensor:
    # 48 positions: beyond YaRN's original 40, so the scaled frequencies take part.
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_directory_loads_with_same_logits_and_greedy_tokens(name, tmp_path):
    theirs = _hf_model(CONFIGS[name], seed=3)
    theirs.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    ours = loaded.model
    assert loaded.source == "huggingface" and ours.cfg.is_mla and ours.cfg.is_moe
    # save_pretrained writes num_nextn_predict_layers = 1 but no MTP layer: no MTP modules built.
    assert ours.cfg.mtp_depth == 0
    x = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        got = ours(x)
    want = _hf_logits(theirs, x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    prompt = [5, 17, 42, 8]
    assert argmax_loop(ours, prompt, GREEDY_TOKENS) == _hf_argmax_loop(theirs, prompt, GREEDY_TOKENS)


def test_group_mask_is_minus_inf():
    """Experts of unchosen groups are masked with -inf on both sides (DeepSeek's reference
    ``Gate``; transformers 5 as well, where its 4.x DeepseekV3 and the checkpoints' remote code
    masked with 0.0). Here the kept group's biased scores are all negative, so a 0.0 mask would
    pick experts of the dropped group: equal choices mean both sides use -inf."""
    cfg = dataclasses.replace(FLAVORS["dsv3-debug"], n_group=4, topk_group=1)
    hcfg = transformers.DeepseekV3Config(hidden_size=cfg.dim, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                         topk_group=1, routed_scaling_factor=cfg.route_scale, norm_topk_prob=True)
    ours, theirs = Router(cfg), hf_ds.DeepseekV3TopkRouter(hcfg)
    x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours.gate.weight.normal_(0.0, 0.05)  # scores near 0.5
        ours.expert_bias.copy_(torch.tensor([-0.9, 1.5, -0.6, -0.7, -0.6, -0.7, -0.6, -0.7]))
        theirs.weight.copy_(ours.gate.weight)
        theirs.e_score_correction_bias.copy_(ours.expert_bias)
        w_ours, idx_ours = ours(x, seq_len=64)
        _, w_theirs, idx_theirs = theirs(x)
    # Group 0 (experts 0, 1) wins on every token; its expert 0 scores below 0: a 0.0 mask would
    # choose it last, after the masked experts.
    assert ((ours.scores(x) + ours.expert_bias)[:, 0] < 0).all()
    assert torch.equal(idx_ours.sort(-1).values, idx_theirs.sort(-1).values)
    assert set(idx_ours.flatten().tolist()) == {0, 1}
    order_o, order_t = idx_ours.argsort(-1), idx_theirs.argsort(-1)
    torch.testing.assert_close(w_ours.gather(1, order_o), w_theirs.gather(1, order_t), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A dsv3-debug trainforge checkpoint with one MTP module, and its Hugging Face export."""
    cfg = dataclasses.replace(FLAVORS["dsv3-debug"], max_seq_len=128, bias_update_rate=0.0, mtp_depth=1)
    model = build_model(cfg, seed=0).eval()
    _sharpen(model, seed=4)
    root = tmp_path_factory.mktemp("dsv3")
    ck = ckpt.save_checkpoint(root / "checkpoints", 1, model, {}, {}, dataclasses.asdict(cfg), None, keep_last=1)
    return model, ck, export_hf(ck, root / "hf")


def test_exported_checkpoint_loads_in_transformers_with_same_logits(exported):
    model, _, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    # transformers keeps no MTP layer in DeepseekV3ForCausalLM: it reports the layer as unexpected keys.
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    x = _tokens(model.cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(theirs, x), model(x), atol=ATOL, rtol=0)
    prompt = [3, 1, 4, 1, 5]
    assert _hf_argmax_loop(theirs, prompt, GREEDY_TOKENS) == argmax_loop(model, prompt, GREEDY_TOKENS)


@pytest.mark.parametrize("via", ["python", "cli"])
def test_round_trip_is_bit_identical_mtp_included(exported, via, tmp_path):
    model, ck, hf_dir = exported
    if via == "cli":
        from trainforge.cli import main as cli_main

        hf_dir = tmp_path / "hf"
        assert cli_main(["export", "--checkpoint", str(ck), "--output", str(hf_dir)]) == 0
    back = load_model(hf_dir).model
    want, got = model.state_dict(), back.state_dict()
    assert got.keys() == want.keys()
    assert any(k.startswith("mtp.0.block.feed_forward.experts") for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # The state-dict functions alone too: ours -> HF -> ours.
    again = from_hf_state_dict(to_hf_state_dict(want, model.cfg), model.cfg)
    assert again.keys() == want.keys() and all(torch.equal(again[k], want[k]) for k in want)


def test_transformers_in_memory_state_dict_converts(exported):
    """transformers' fused expert tensors (``gate_up_proj``) convert like the files' per-expert keys."""
    model, _, hf_dir = exported
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    # DeepseekV3ForCausalLM has no MTP layer: convert as a model without MTP modules.
    sd = from_hf_state_dict(theirs.state_dict(), dataclasses.replace(model.cfg, mtp_depth=0))
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in sd.items())


def _write(tmp_path, **changes):
    src = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in CONFIGS["groups_qlora"].items() if k != "model_type"}))
    d = tmp_path / "hf"
    src.save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("changes,named", [
    ({"n_group": 3}, "'n_group'"),
    ({"num_experts_per_tok": 0}, "'num_experts_per_tok'"),
    ({"qk_rope_head_dim": 7}, "'qk_rope_head_dim'"),
    ({"kv_lora_rank": "wide"}, "'kv_lora_rank'"),
    ({"norm_topk_prob": False}, "'norm_topk_prob'"),
    ({"scoring_func": "softmax"}, "'scoring_func'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'rope_parameters'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "'quantization_config'"),
])
def test_bad_config_json_is_refused_naming_the_key(tmp_path, changes, named):
    d = _write(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=named):
        load_model(d)


def test_config_round_trip():
    for d in CONFIGS.values():
        cfg = model_config_from_hf(d)
        hd = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()
        assert model_config_from_hf(hd, mtp_weights=False) == cfg  # transformers writes num_nextn_predict_layers = 1
    from trainforge.model.hf_deepseek import to_hf_config_dict
    assert model_config_from_hf(to_hf_config_dict(cfg)) == cfg
