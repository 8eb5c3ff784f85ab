"""Hugging Face interop of MoE models with standard attention (model/hf_moe.py, infer/loading.py,
infer/hf_export.py) against transformers' ``Glm4MoeForCausalLM`` (sigmoid routing) and
``MixtralForCausalLM`` (softmax), tiny random models on CPU, fp32, atol = rtol = 1e-5:

* a trainforge model written by ``save_hf_dir`` loads with ``AutoModelForCausalLM.from_pretrained``
  and gives our logits; selection biases are large enough to change which experts are chosen,
  so a bias dropped, or one that also scaled the weights, would fail; reading the directory
  back into trainforge is bit-identical (MTP modules included);
* a directory written by transformers' ``save_pretrained`` loads with ``load_model`` and gives
  transformers' logits; transformers' in-memory (fused-expert) state dict converts too;
* configs neither class expresses are refused naming the key to change.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from trainforge.errors import CheckpointError
from trainforge.infer.hf_export import save_hf_dir
from trainforge.infer.loading import load_model
from trainforge.model.config import ModelConfig
from trainforge.model.hf_moe import from_hf_state_dict, model_config_from_hf, to_hf_config_dict, to_hf_state_dict
from trainforge.model.llama import build_model
from trainforge.model.moe import routers

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm4_moe")

ATOL = RTOL = 1e-5
_BASE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=96, n_routed_experts=8,
             n_activated_experts=2, moe_inter_dim=32, norm_eps=1e-6, rope_theta=50000.0, max_seq_len=64)
CONFIGS = {
    # moe-debug / moe-tiny: sigmoid, 4 groups of which 2 are used, a shared expert, first block dense.
    "glm_groups": ModelConfig(**_BASE, score_func="sigmoid", n_shared_experts=1, n_dense_layers=1, route_scale=2.5,
                              n_group=4, topk_group=2),
    # No shared experts (transformers' zero-width ones), no groups, no dense block, tied embeddings.
    "glm_flat_tied": ModelConfig(**_BASE, score_func="sigmoid", n_shared_experts=0, tie_embeddings=True),
    "mixtral": ModelConfig(**_BASE, score_func="softmax"),
}
EXPECTED_CLASS = {"glm_groups": "Glm4MoeForCausalLM", "glm_flat_tied": "Glm4MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


@torch.no_grad()
def _sharpen(model: torch.nn.Module, seed: int, bias: bool) -> None:
    """Weights of a trained-looking scale, norms away from ones, selection biases of both signs."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.numel():
            p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[-1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.6 - 0.4 if bias else torch.zeros(b.shape))


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", CONFIGS)
def test_exported_model_loads_in_transformers_with_same_logits(name, tmp_path):
    torch.set_num_threads(1)
    cfg = CONFIGS[name]
    sigmoid = cfg.score_func == "sigmoid"
    ours = build_model(cfg, seed=0).eval()
    _sharpen(ours, seed=2, bias=sigmoid)
    if sigmoid:  # the bias changes the choice of a fifth of the tokens or more
        router = routers(ours)[0][1]
        x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            scores = router.scores(x)
            with_bias = router.select(scores).sort(-1).values
            bias = router.expert_bias.clone()
            router.expert_bias.zero_()
            without = router.select(scores).sort(-1).values
            router.expert_bias.copy_(bias)
        assert (with_bias != without).any(-1).float().mean() > 0.2
    hf_dir = save_hf_dir(tmp_path / "hf", ours.state_dict(), cfg)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [EXPECTED_CLASS[name]]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(theirs).__name__ == EXPECTED_CLASS[name]
    x = _tokens(cfg)
    with torch.no_grad():
        want, got = ours(x), theirs(x).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # And back into trainforge, bit for bit.
    back = load_model(hf_dir).model.state_dict()
    sd = ours.state_dict()
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_mtp_modules_round_trip_and_transformers_ignores_them(tmp_path):
    """MTP depth d is written as layer n_layers + d (GLM-4.5's layout); Glm4MoeForCausalLM loads the
    main model without it (the logits are the main model's) and trainforge reads it back."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(CONFIGS["glm_groups"], mtp_depth=1)
    ours = build_model(cfg, seed=0).eval()
    _sharpen(ours, seed=5, bias=True)
    hf_dir = save_hf_dir(tmp_path / "hf", ours.state_dict(), cfg)
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x), atol=ATOL, rtol=RTOL)
    back = load_model(hf_dir).model
    assert back.cfg == cfg
    sd, got = ours.state_dict(), back.state_dict()
    assert any(k.startswith("mtp.0.block.feed_forward.experts") for k in sd)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def _hf_model(name: str, seed: int):
    d = to_hf_config_dict(CONFIGS[name])
    config = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k not in ("architectures",)})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _sharpen(model, seed, bias=True)
    return model


@pytest.mark.parametrize("name", ["glm_groups", "mixtral"])
def test_transformers_directory_loads_with_same_logits(name, tmp_path):
    torch.set_num_threads(1)
    theirs = _hf_model(name, seed=7)
    theirs.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    assert loaded.source == "huggingface"
    # save_pretrained writes num_nextn_predict_layers = mtp depth 0 here, and no MTP layer.
    assert loaded.model.cfg.mtp_depth == 0
    x = _tokens(loaded.model.cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), theirs(x).logits, atol=ATOL, rtol=RTOL)
    # transformers' in-memory layout (fused experts, Mixtral's router under mlp.gate) converts alike.
    sd = from_hf_state_dict(theirs.state_dict(), loaded.model.cfg)
    want = loaded.model.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)


def test_config_round_trip():
    for name, cfg in CONFIGS.items():
        back = model_config_from_hf(to_hf_config_dict(cfg))
        # Mixtral has no dense blocks: its intermediate_size is the experts' width.
        want = dataclasses.replace(cfg, ffn_hidden_dim=cfg.moe_inter_dim) if name == "mixtral" else cfg
        assert back == want, name


@pytest.mark.parametrize("changes,named", [
    (dict(n_shared_experts=1), "model.n_shared_experts"),
    (dict(n_dense_layers=1), "model.n_dense_layers"),
    (dict(n_group=4, topk_group=2), "model.n_group"),
    (dict(route_scale=2.0), "model.route_scale"),
    (dict(norm_topk_prob=False), "model.norm_topk_prob"),
    (dict(mtp_depth=1), "model.mtp_depth"),
])
def test_softmax_config_mixtral_cannot_express_is_refused(changes, named):
    cfg = dataclasses.replace(CONFIGS["mixtral"], **changes)
    with pytest.raises(CheckpointError, match=named):
        to_hf_config_dict(cfg)


def test_softmax_selection_bias_is_refused(tmp_path):
    cfg = CONFIGS["mixtral"]
    ours = build_model(cfg, seed=0)
    routers(ours)[0][1].expert_bias[3] = 0.1  # as loss-free balancing (bias_update_rate > 0) leaves it
    with pytest.raises(CheckpointError, match="bias_update_rate"):
        save_hf_dir(tmp_path / "hf", ours.state_dict(), cfg)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointError, match="bias_update_rate"):
        to_hf_state_dict(ours.state_dict(), cfg)


@pytest.mark.parametrize("name,changes,named", [
    ("glm_groups", {"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "'partial_rotary_factor'"),
    ("glm_groups", {"use_qk_norm": True}, "'use_qk_norm'"),
    ("glm_groups", {"attention_bias": True}, "'attention_bias'"),
    ("glm_groups", {"norm_topk_prob": False}, "'norm_topk_prob'"),
    ("glm_groups", {"n_group": 3}, "'n_group'"),
    ("glm_groups", {"n_routed_experts": "many"}, "'n_routed_experts'"),
    ("mixtral", {"sliding_window": 16}, "'sliding_window'"),
    ("mixtral", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'rope_parameters'"),
    ("mixtral", {"num_experts_per_tok": 9}, "'num_experts_per_tok'"),
])
def test_bad_config_json_is_refused_naming_the_key(tmp_path, name, changes, named):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**to_hf_config_dict(CONFIGS[name]), **changes}))
    with pytest.raises(CheckpointError, match=named):
        load_model(d)
