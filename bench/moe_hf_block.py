"""``transformers``' own MoE blocks built from our ``ModelConfig``, with our weights copied in.

Used by ``bench/moe.py`` (speed against the same block in transformers) and
``bench/tests/test_moe_hf_block.py`` (output parity). Built offline from a config, no download:

* ``score_func = "sigmoid"`` -> ``DeepseekV3MoE``: sigmoid scores, ``e_score_correction_bias``
  added for selection only, groups ranked by the sum of their top-2 biased scores,
  ``topk_group`` groups kept, top-k among them, the chosen unbiased scores normalised
  (``norm_topk_prob=True``) and multiplied by ``routed_scaling_factor``, plus shared
  experts. The same rule as our ``Router``, which always normalises sigmoid weights, so
  the HF config sets ``norm_topk_prob=True``. DeepSeek-V3's block always has shared
  experts (``n_shared_experts >= 1``).
* ``score_func = "softmax"`` -> ``MixtralSparseMoeBlock``: softmax over all experts, top-k,
  always renormalised (ours with ``norm_topk_prob=True``), no groups, no bias, no shared
  experts, no ``route_scale``.

Weight layout: HF stores each expert's gate and up projections concatenated,
``gate_up_proj`` (E, 2 * hidden, dim) = [w1; w3] along dim 1, and ``down_proj`` (E, dim,
hidden) = our ``w2``; the router's ``weight`` (E, dim) is our ``gate.weight``; the bias is
``e_score_correction_bias`` (fp32 buffer). ``experts_implementation`` picks HF's expert
kernel: ``"eager"`` (a loop over the experts hit, ``one_hot`` + ``where`` per expert; what
a block built standalone from a config runs) or ``"grouped_mm"`` (sort + ``torch._grouped_mm``;
what ``PreTrainedModel`` picks by default in transformers 5).
"""

from __future__ import annotations

import torch
from torch import nn

from trainforge.model.config import ModelConfig
from trainforge.model.moe import MoE


def hf_moe_block(cfg: ModelConfig, experts_implementation: str = "eager") -> nn.Module:
    """The ``transformers`` block computing what ``MoE(cfg)`` computes (weights uninitialised)."""
    common = dict(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  vocab_size=cfg.vocab_size, num_experts_per_tok=cfg.n_activated_experts,
                  experts_implementation=experts_implementation)
    if cfg.score_func == "sigmoid":
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        if cfg.n_shared_experts < 1:
            raise ValueError("DeepseekV3MoE always has shared experts: n_shared_experts must be >= 1")
        hf_cfg = DeepseekV3Config(**common, n_routed_experts=cfg.n_routed_experts,
                                  n_shared_experts=cfg.n_shared_experts, moe_intermediate_size=cfg.moe_inter_dim,
                                  n_group=cfg.n_group, topk_group=cfg.topk_group,
                                  routed_scaling_factor=cfg.route_scale, norm_topk_prob=True, hidden_act="silu",
                                  num_hidden_layers=1, first_k_dense_replace=0)
        return DeepseekV3MoE(hf_cfg)
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    if cfg.n_shared_experts or cfg.n_group > 1 or cfg.route_scale != 1.0 or not cfg.norm_topk_prob:
        raise ValueError("MixtralSparseMoeBlock has no shared experts, groups or route scale and always "
                         "renormalises: use n_shared_experts=0, n_group=1, route_scale=1, norm_topk_prob=True")
    hf_cfg = MixtralConfig(**common, num_local_experts=cfg.n_routed_experts, intermediate_size=cfg.moe_inter_dim,
                           router_jitter_noise=0.0, num_hidden_layers=1)
    return MixtralSparseMoeBlock(hf_cfg)


@torch.no_grad()
def copy_moe_weights(ours: MoE, hf: nn.Module) -> None:
    """Copy ``ours``' weights (router gate and bias, experts, shared experts) into ``hf``."""
    hf.gate.weight.copy_(ours.router.gate.weight)
    if hasattr(hf.gate, "e_score_correction_bias"):
        hf.gate.e_score_correction_bias.copy_(ours.router.expert_bias)
    elif bool(ours.router.expert_bias.any()):
        raise ValueError("the transformers block has no selection bias: ours must be zero")
    hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
    hf.experts.down_proj.copy_(ours.experts.w2)
    shared = getattr(hf, "shared_experts", None)
    if (shared is None) != (ours.shared_experts is None):
        raise ValueError("shared experts on one side only")
    if shared is not None:
        shared.gate_proj.weight.copy_(ours.shared_experts.w1.weight)
        shared.up_proj.weight.copy_(ours.shared_experts.w3.weight)
        shared.down_proj.weight.copy_(ours.shared_experts.w2.weight)


@torch.no_grad()
def init_moe(moe: MoE, seed: int, bias_std: float = 0.0) -> None:
    """Deterministic weights of a trained-looking scale; ``bias_std`` > 0 also sets a selection bias."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in moe.named_parameters():
        fan_in = p.shape[-1]
        p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    if bias_std:
        moe.router.expert_bias.copy_(bias_std * torch.randn(moe.router.expert_bias.shape, generator=gen))
