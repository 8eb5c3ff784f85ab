"""The int4 grid: groups along the input dim, asymmetric min/max, an integer zero point.

Stored form: ``<layer>.weight`` uint8 (N, K/2), two 4-bit codes per byte (even k in the high
nibble), ``<layer>.scales`` fp32 (N, K/group_size) and ``<layer>.zeros`` int8
(N, K/group_size): a code q in [0, 15] stands for ((q - 8) - z) * scale. That is
compressed-tensors' asymmetric int4 grid, so an exported directory decompresses to these
weights bit for bit (``compressed_tensors.py``). Directories written before 2026-12-01 hold
fp32 value-domain ``zeros`` ((q - 8) * scale + zero); ``dequantize_int4`` reads both by dtype.
The engine's kernels for it are ``infer/quantize/int4.py``; QAT (``train/qat.py``)
fake-quantises with the same functions.
"""

from __future__ import annotations

import torch


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (uint8 codes (N, K/2), fp32 scales (N, K/g), int8 zero points (N, K/g))."""
    n, k = w.shape
    if k % group_size or k % 2:
        raise ValueError(f"int4: in_features {k} is not a multiple of group_size {group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    lo, hi = lo.clamp_(max=0.0), hi.clamp_(min=0.0)
    scales = (hi - lo).clamp_(min=1e-6) / 15.0
    zp = torch.round(-lo / scales).clamp_(0, 15)  # unsigned zero point: the code that stands for 0.0
    q = torch.div(g, scales).round_().add_(zp).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return packed, scales.reshape(n, -1), (zp - 8).to(torch.int8).reshape(n, -1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K/2) -> int32 codes (N, K)."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 (N, K) weight the stored form stands for (int8 zero points, or a pre-2026-12 fp32
    value-domain zero)."""
    q = unpack_int4(packed)
    n, k = q.shape
    group_size = k // scales.shape[1]
    q = q.reshape(n, -1, group_size) - 8
    if zeros.dtype == torch.int8:
        g = (q - zeros.to(torch.int32)[..., None]).float() * scales[..., None]
    else:
        g = q.float() * scales[..., None] + zeros[..., None]
    return g.reshape(n, k)


def value_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 value-domain zero the aten int4pack kernels take ((q - 8) * scale + zero)."""
    return -zeros.float() * scales if zeros.dtype == torch.int8 else zeros
