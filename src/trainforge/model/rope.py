"""Rotary embedding tables and their application (rotate-half layout, as Hugging Face's
``LlamaForCausalLM``); ``model_rope_tables`` picks the tables a config needs (YaRN for latent
attention, ``yarn.py``). Shared by ``llama.py`` and ``mla.py``."""

from __future__ import annotations

import torch

from trainforge.model.config import ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (max_seq_len, head_dim), computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D): rotate-half layout
    return emb.cos(), emb.sin()


def model_rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``Transformer`` keeps: ``rope_tables`` over the head dim for standard
    attention; over ``qk_rope_head_dim`` for latent attention, with YaRN when
    ``rope_factor`` > 1 (``yarn.py``). On the meta device (a model built to be loaded by
    assignment), shapes only: computing there runs torch's Python reference kernels, whose first
    call imports ``torch._dynamo`` (2-4 s of every ``generate``/``serve``/``export`` start,
    measured), for tables the loader recomputes on the real device anyway."""
    if (torch.device(device) if device is not None else torch.get_default_device()).type == "meta":
        d = cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        return torch.empty(cfg.max_seq_len, d, device="meta"), torch.empty(cfg.max_seq_len, d, device="meta")
    if not cfg.is_mla:
        return rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
    if cfg.rope_factor <= 1:
        return rope_tables(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
    from trainforge.model.yarn import yarn_rope_tables

    return yarn_rope_tables(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_factor,
                            cfg.rope_original_max_seq_len, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_mscale,
                            cfg.rope_mscale_all_dim, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
