"""The int8 grid: one scale per output channel, symmetric (absmax / 127).

Stored form: ``<layer>.weight`` int8 (N, K) and ``<layer>.scales`` fp32 (N,);
W ~= weight * scales[:, None]. The engine's kernels for it are ``infer/quantize/int8.py``;
QAT (``train/qat.py``) fake-quantises with the same two functions.
"""

from __future__ import annotations

import torch


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 weight (N, K), fp32 scales (N,)), per-row absmax."""
    w = w.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]
