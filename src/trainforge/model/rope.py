"""Rotary embedding tables and their application (rotate-half layout, as Hugging Face's
``LlamaForCausalLM``); ``model_rope_tables`` picks the tables a config needs (YaRN for latent
attention, ``yarn.py``). Shared by ``llama.py`` and ``mla.py``."""

from __future__ import annotations

import numpy as np
import torch

from trainforge.model.config import ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (max_seq_len, head_dim): the angles position * inv_freq in fp32, as
    Hugging Face's Llama forms them, their cos and sin in fp64 rounded once to fp32.

    In numpy, not torch: a decode process runs no other cos / sin / pow, and torch's would map
    ~1.4 MiB of libtorch code into it for good (the 90m q4_0 GGUF's generate peaked 1.3-1.4 MiB
    lower; issue 24's memory bound, docs/benchmarks-archive.md). The values are the exact ones rounded:
    torch's fp32 cos / sin (SLEEF, 1 ulp) differ from them by 1 ulp in ~5% of entries."""
    # fp32 exponents and inverse frequencies, as ``1 / theta ** (arange(0, d, 2).float() / d)``.
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float64(np.float32(theta)) ** exponent.astype(np.float64)).astype(np.float32)
    freqs = np.outer(np.arange(max_seq_len, dtype=np.float32), inv_freq)  # (T, D/2) fp32 products
    emb = np.concatenate((freqs, freqs), axis=-1).astype(np.float64)  # (T, D): rotate-half layout
    cos, sin = torch.from_numpy(np.cos(emb).astype(np.float32)), torch.from_numpy(np.sin(emb).astype(np.float32))
    if device is not None and torch.device(device).type != "cpu":
        cos, sin = cos.to(device), sin.to(device)
    return cos, sin


def model_rope_tables(cfg: ModelConfig, device=None, positions: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables ``Transformer`` keeps, for positions ``0..positions-1`` (default and at most
    ``cfg.max_seq_len``): ``rope_tables`` over the head dim for standard
    attention; over ``qk_rope_head_dim`` for latent attention, with YaRN when
    ``rope_factor`` > 1 (``yarn.py``). On the meta device (a model built to be loaded by
    assignment), shapes only: computing there runs torch's Python reference kernels, whose first
    call imports ``torch._dynamo`` (2-4 s of every ``generate``/``serve``/``export`` start,
    measured), for tables the loader recomputes on the real device anyway."""
    if (torch.device(device) if device is not None else torch.get_default_device()).type == "meta":
        d = cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        return torch.empty(cfg.max_seq_len, d, device="meta"), torch.empty(cfg.max_seq_len, d, device="meta")
    n = cfg.max_seq_len if positions is None else max(1, min(positions, cfg.max_seq_len))
    if not cfg.is_mla:
        return rope_tables(cfg.head_dim, n, cfg.rope_theta, device=device)
    if cfg.rope_factor <= 1:
        return rope_tables(cfg.qk_rope_head_dim, n, cfg.rope_theta, device=device)
    from trainforge.model.yarn import yarn_rope_tables

    return yarn_rope_tables(cfg.qk_rope_head_dim, n, cfg.rope_theta, cfg.rope_factor,
                            cfg.rope_original_max_seq_len, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_mscale,
                            cfg.rope_mscale_all_dim, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
