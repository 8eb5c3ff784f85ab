"""The SwiGLU feed-forward: the dense blocks' MLP, and a MoE block's shared experts."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from trainforge.model.decode_workspace import DecodeWorkspace


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def decode_calls(self, ws: DecodeWorkspace, h: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
        """``forward`` without allocation: gate and up into the workspace, silu and the
        product in place (into the gate's buffer), ``w2`` into ``out``."""
        g, u = ws.gate_up_views(h.shape[0], self.w1.out_features, fused=False)
        return [ws.linear(self.w1).bind(h, g), ws.linear(self.w3).bind(h, u),
                functools.partial(F.silu, g, inplace=True), functools.partial(g.mul_, u),
                ws.linear(self.w2).bind(g, out)]
