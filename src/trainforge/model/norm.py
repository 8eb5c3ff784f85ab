"""RMSNorm (Zhang & Sennrich 2019), fp32 statistics whatever the input dtype; shared by the
decoder (``llama.py``) and latent attention (``mla.py``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from trainforge.model.decode_workspace import DecodeWorkspace


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the input dtype: the mean of squares overflows fp16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def decode_calls(self, ws: DecodeWorkspace, x: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
        """out <- forward(x) for x (B, dim) without allocation: in float32 the same ops
        (``mean`` is sum / d), each ``out=`` or in place; other dtypes call ``forward``."""
        if x.dtype != torch.float32:
            return [lambda: out.copy_(self(x))]
        sq, ms = ws.norm_scratch(x.shape[0])
        d, eps = ws.scalar(float(x.shape[1])), ws.scalar(self.eps)
        p = functools.partial
        return [p(torch.mul, x, x, out=sq), p(torch.sum, sq, dim=-1, keepdim=True, out=ms), p(ms.div_, d),
                p(ms.add_, eps), ms.rsqrt_, p(torch.mul, x, ms, out=out), p(out.mul_, self.weight)]
