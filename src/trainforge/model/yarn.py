"""YaRN rotary scaling (Peng et al. 2023), as DeepSeek-V3 extends its context 4K -> 128K.

Each rotary frequency is blended between its original value (kept for the fast dims, which
turn more than ``beta_fast`` times over the original context) and the value divided by
``factor`` (the slow dims, fewer than ``beta_slow`` turns), with a linear ramp between the
two correction dims; the cos/sin tables are multiplied by an attention temperature. The
formulas are those of Hugging Face's ``_compute_yarn_parameters`` (``truncate`` on, the
default) and DeepSeek's ``precompute_freqs_cis``; ``softmax_mscale`` is the factor MLA
multiplies its softmax scale by (``yarn_get_mscale(factor, mscale_all_dim)`` squared).
Tables come out in the rotate-half layout of ``llama.rope_tables``.
"""

from __future__ import annotations

import math

import torch


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1·mscale·ln(factor) + 1 for factor > 1, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_mscale(factor: float, mscale_all_dim: float) -> float:
    """What MLA multiplies its softmax scale by: mscale² (1 without scaling or mscale_all_dim = 0)."""
    if factor <= 1 or not mscale_all_dim:
        return 1.0
    return yarn_get_mscale(factor, mscale_all_dim) ** 2


def yarn_inv_freq(head_dim: int, theta: float, factor: float, original_max_seq_len: int, beta_fast: float,
                  beta_slow: float, device=None) -> torch.Tensor:
    """(head_dim/2,) inverse frequencies, fp32."""
    def correction_dim(rotations: float) -> float:
        # The dim whose wavelength fits ``rotations`` times into the original context.
        return head_dim * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp
    freqs = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    extrapolated, interpolated = 1.0 / freqs, 1.0 / (factor * freqs)
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: divided by factor
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_rope_tables(head_dim: int, max_seq_len: int, theta: float, factor: float, original_max_seq_len: int,
                     beta_fast: float, beta_slow: float, mscale: float, mscale_all_dim: float,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (max_seq_len, head_dim), fp32, rotate-half layout, scaled by the
    attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim) (HF's rule; 1 for
    DeepSeek-V3, whose two coefficients are equal; mscale(factor) when either is 0)."""
    inv_freq = yarn_inv_freq(head_dim, theta, factor, original_max_seq_len, beta_fast, beta_slow, device)
    if mscale and mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    t = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos() * attention_factor, emb.sin() * attention_factor
