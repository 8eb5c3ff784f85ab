"""Fused module kinds for inference: alternative implementations of the model's modules,
swapped in from outside (``trainforge.infer.fusion`` holds the rules that apply them).

- ``FusedAttention``: ``wq``, ``wk``, ``wv`` as one ``wqkv`` (rows concatenated), one matmul.
- ``FusedFeedForward``: the SwiGLU gate ``w1`` and up ``w3`` as one ``w13``.
- ``FusedRMSNorm``: the norm that follows each residual add computed as
  x * rsqrt(x.x + d*eps) * (w * sqrt(d)): the sum of squares as one dot product and the
  sqrt(d) folded into the weight, add + 5 ops instead of add + 7 in the decode step, no
  temporaries. On CUDA it is ``aten._fused_rms_norm``, a single kernel there; on CPU that op
  is a composite of the same five ops plus scalar temporaries, so it is not used.
  ``torch.compile`` of the decode step puts add and norm in one loop.
- ``FusedTransformerBlock``: a ``TransformerBlock`` whose norms are ``FusedRMSNorm``.

Each computes the same sums per output element as the module it replaces, so logits
match to float rounding (tests: 1e-5), and each has its ``decode_calls`` beside its forward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.llama import RMSNorm, TransformerBlock, attend, attention_decode_calls

if TYPE_CHECKING:
    from trainforge.model.attention_cache import LayerCache
    from trainforge.model.decode_workspace import DecodeWorkspace


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` the fused way (see the module docstring) for fp32; other dtypes use
    ``RMSNorm.forward``, which computes in fp32 itself."""
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return RMSNorm.forward(norm, x)
    d = x.shape[-1]
    if x.is_cuda:
        return torch.ops.aten._fused_rms_norm(x, [d], norm.weight, norm.eps)[0]
    r = torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) + d * norm.eps)
    return x * r * (norm.weight * d ** 0.5)


class FusedRMSNorm(RMSNorm):
    """``RMSNorm`` computed the fused way; same ``weight`` (shared with the norm it replaces)."""

    @classmethod
    def of(cls, norm: RMSNorm) -> FusedRMSNorm:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.eps, new.weight = norm.eps, norm.weight
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self)

    def decode_calls(self, ws: DecodeWorkspace, x: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
        if x.dtype != torch.float32:
            return [lambda: out.copy_(self(x))]
        B, d = x.shape
        if x.is_cuda:
            return [lambda: out.copy_(torch.ops.aten._fused_rms_norm(x, [d], self.weight, self.eps)[0])]
        _, ms = ws.norm_scratch(B)
        w = ws.derived(("fused_norm", id(self)), lambda: (self.weight.detach() * d ** 0.5).to(x.dtype))
        if ws.kernels is not None:  # the same formula as one op (DecodeWorkspace)
            return [functools.partial(ws.kernels.rms_norm, x, w, d * self.eps, out)]
        d_eps = ws.scalar(d * self.eps)
        p = functools.partial
        return [p(torch.bmm, x.view(B, 1, d), x.view(B, d, 1), out=ms.view(B, 1, 1)),  # sum of squares
                p(ms.add_, d_eps), ms.rsqrt_, p(torch.mul, x, ms, out=out), p(out.mul_, w)]


class FusedAttention(nn.Module):
    """``Attention`` with one ``wqkv`` projection; same forward contract."""

    def __init__(self, wqkv: nn.Module, wo: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.wqkv, self.wo = wqkv, wo
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.split = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, cos, sin, cache)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def decode_calls(self, ws: DecodeWorkspace, h: torch.Tensor, out: torch.Tensor,
                     cache: LayerCache) -> list[Callable[[], None]]:
        """One projection into one buffer; q and k, adjacent in it, rotated in one pass."""
        B, D = h.shape[0], self.head_dim
        nq, nkv = self.split[0], self.split[1]
        qkv, q, k, v = ws.qkv_views(B, nq, nkv, fused=True)
        ropes = [qkv[:, :nq + nkv].view(B, -1, D)]
        return [ws.linear(self.wqkv).bind(h, qkv), *attention_decode_calls(ws, ropes, q, k, v, cache, self.wo, out)]


class FusedFeedForward(nn.Module):
    """SwiGLU with one ``w13`` = [gate; up] projection: w2(silu(g) * u)."""

    def __init__(self, w13: nn.Module, w2: nn.Module, hidden_dim: int):
        super().__init__()
        self.w13, self.w2, self.hidden_dim = w13, w2, hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w13(x).split(self.hidden_dim, dim=-1)
        return self.w2(F.silu(g) * u)

    def decode_calls(self, ws: DecodeWorkspace, h: torch.Tensor, out: torch.Tensor) -> list[Callable[[], None]]:
        gu, g, u, act = ws.gate_up_views(h.shape[0], self.hidden_dim, fused=True)
        if ws.kernels is not None:  # silu(g) * u as one op (DecodeWorkspace)
            gate = [functools.partial(ws.kernels.silu_mul, g, u, act)]
        else:
            gate = [functools.partial(F.silu, g, inplace=True), functools.partial(torch.mul, g, u, out=act)]
        return [ws.linear(self.w13).bind(h, gu), *gate, ws.linear(self.w2).bind(act, out)]


class FusedTransformerBlock(TransformerBlock):
    """``TransformerBlock`` whose norms are ``FusedRMSNorm``: the norm runs on the residual
    just added. Same submodule names, so quantisation and the engine find them where they were."""

    def __init__(self, block: TransformerBlock):
        nn.Module.__init__(self)
        self.attention_norm = FusedRMSNorm.of(block.attention_norm)
        self.attention = block.attention
        self.ffn_norm = FusedRMSNorm.of(block.ffn_norm)
        self.feed_forward = block.feed_forward
