"""Small random-weight models for the inference tests, built locally (no downloads)."""

from __future__ import annotations

import dataclasses

import torch

from trainforge.model import FLAVORS, ModelConfig, build_model

# Two grouped-query shapes: 2 query heads per kv head, and 4 with a non-default theta and eps.
SHAPES = {
    "gqa2": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=192,
                        max_seq_len=256),
    "gqa4": ModelConfig(dim=128, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=320, ffn_hidden_dim=256,
                        norm_eps=1e-6, rope_theta=500000.0, max_seq_len=256),
}

# Mixture of experts (moe-debug: first block dense, 8 experts top-2 + 1 shared; HF: Glm4MoeForCausalLM).
MOE_SHAPES = {"moe": dataclasses.replace(FLAVORS["moe-debug"], max_seq_len=256)}


@torch.no_grad()
def sharpen(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random init gives near-uniform logits, where float noise could flip a greedy argmax;
    larger weights and perturbed norms give decisive logits and exercise every weight."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.mul_(4.0)
    return model


def model_for(name: str, seed: int = 0):
    return sharpen(build_model({**SHAPES, **MOE_SHAPES}[name], seed=seed), seed).eval()


@torch.no_grad()
def argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the plain training forward, recomputing the whole sequence for every token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]
