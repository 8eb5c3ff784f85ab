"""Our ``MoE`` block against ``transformers``' own blocks with the same weights.

Sigmoid + group-limited routing + selection bias + shared experts against ``DeepseekV3MoE``;
softmax routing against ``MixtralSparseMoeBlock``; both HF expert kernels (its eager
per-expert loop and its grouped GEMM). fp32 outputs and gradients (input, router, experts)
must agree within atol = rtol = 1e-5; the selection bias is large enough to change which
experts are chosen, so a bias that also scaled the weights, or a different group rule,
would fail.
"""

from __future__ import annotations

import pytest
import torch

from bench.moe_hf_block import copy_moe_weights, hf_moe_block, init_moe
from trainforge.model import ModelConfig
from trainforge.model.moe import MoE

pytest.importorskip("transformers.models.deepseek_v3")

ATOL = RTOL = 1e-5
_BASE = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
             n_routed_experts=8, n_activated_experts=2, moe_inter_dim=32)
CONFIGS = {
    "sigmoid-groups": ModelConfig(**_BASE, n_shared_experts=1, score_func="sigmoid", route_scale=2.5, n_group=4,
                                  topk_group=2),
    "softmax": ModelConfig(**_BASE, score_func="softmax", norm_topk_prob=True),
}


def _pair(name: str, impl: str) -> tuple[MoE, torch.nn.Module]:
    cfg = CONFIGS[name]
    ours = MoE(cfg).train()
    init_moe(ours, seed=0, bias_std=0.3 if cfg.score_func == "sigmoid" else 0.0)
    hf = hf_moe_block(cfg, experts_implementation=impl).train()
    copy_moe_weights(ours, hf)
    return ours, hf


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("name", CONFIGS)
def test_moe_matches_transformers_block(name, impl):
    ours, hf = _pair(name, impl)
    x = torch.randn(3, 17, 64, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), hf(xb)
    torch.testing.assert_close(ya, yb, atol=ATOL, rtol=RTOL)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(2))
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.router.gate.weight.grad, hf.gate.weight.grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat([ours.experts.w1.grad, ours.experts.w3.grad], dim=1),
                               hf.experts.gate_up_proj.grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.experts.w2.grad, hf.experts.down_proj.grad, atol=ATOL, rtol=RTOL)


def test_bias_changes_the_choice():
    """The parity above would be weak if the bias never changed a choice: it does here."""
    ours, _ = _pair("sigmoid-groups", "eager")
    x = torch.randn(51, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, with_bias = ours.router(x, 17)
        ours.router.expert_bias.zero_()
        _, without = ours.router(x, 17)
    assert (with_bias.sort(-1).values != without.sort(-1).values).any(-1).float().mean() > 0.2
