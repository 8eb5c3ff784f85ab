"""Operator fusion for inference, applied to a built model from outside (a module swap).

- QKV: ``wq``, ``wk``, ``wv`` become one ``wqkv`` (rows concatenated), one matmul instead of three.
- gate+up: the SwiGLU ``w1`` (gate) and ``w3`` (up) become one ``w13``.
- residual-add + RMSNorm: the norm that follows each residual add is computed as
  x * rsqrt(x.x + d*eps) * (w * sqrt(d)), the sum of squares as one dot product and the
  sqrt(d) folded into the weight (precomputed by the engine), straight after the add (in
  place in decode): add + 5 ops instead of add + 7, and no temporaries. On CUDA it is
  ``aten._fused_rms_norm``, a single kernel there; on CPU that op is a composite of the same
  five ops plus scalar temporaries, so it is not used. No eager kernel also does the add;
  ``torch.compile`` of the decode step (``EngineConfig.compile``) puts add and norm in one loop.

Fused layers compute the same sums in the same order per output element, so logits match the
unfused model to float rounding (tests: 1e-5). Quantised linears concatenate in their stored
form (``QuantLinear.cat``), so fusion may run before or after the quantisation swap, as long
as the layers are not packed yet. ``count_ops`` counts the ATen operators a call dispatches
(views included), for the before/after report. ``fuse_model`` mutates the model: the engine
owns the model it is given.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainforge.infer.quantize.common import QuantLinear
from trainforge.model.llama import Attention, FeedForward, RMSNorm, TransformerBlock, attend


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``norm(x)`` the fused way (see the module docstring) for fp32; other dtypes use the
    module, which computes in fp32 itself."""
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)
    d = x.shape[-1]
    if x.is_cuda:
        return torch.ops.aten._fused_rms_norm(x, [d], norm.weight, norm.eps)[0]
    r = torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) + d * norm.eps)
    return x * r * (norm.weight * d ** 0.5)


def cat_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the concatenation of ``mods``' outputs (same input),
    or None when they cannot be concatenated (mixed kinds, packed quantised layers)."""
    if all(type(m) is nn.Linear and m.bias is None for m in mods):
        w = torch.cat([m.weight.detach() for m in mods], dim=0)
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        return fused
    if all(type(m) is type(mods[0]) and isinstance(m, QuantLinear) for m in mods):
        if any(m.kernel_name not in (None, "reference") for m in mods):
            return None
        return type(mods[0]).cat(mods)
    return None


class FusedAttention(nn.Module):
    """``Attention`` with one ``wqkv`` projection; same forward contract (incl. ``cache``)."""

    def __init__(self, wqkv: nn.Module, wo: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.wqkv, self.wo = wqkv, wo
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.split = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
        self.cache = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, cos, sin, self.cache, start_pos)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FusedFeedForward(nn.Module):
    """SwiGLU with one ``w13`` = [gate; up] projection: w2(silu(g) * u)."""

    def __init__(self, w13: nn.Module, w2: nn.Module, hidden_dim: int):
        super().__init__()
        self.w13, self.w2, self.hidden_dim = w13, w2, hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w13(x).split(self.hidden_dim, dim=-1)
        return self.w2(F.silu(g) * u)


class FusedTransformerBlock(nn.Module):
    """``TransformerBlock`` whose norms run as one fused kernel on the just-added residual.
    Same submodule names, so quantisation and the engine find them where they were."""

    def __init__(self, block: TransformerBlock):
        super().__init__()
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        x = x + self.attention(rms_norm(x, self.attention_norm), cos, sin, start_pos)
        return x + self.feed_forward(rms_norm(x, self.ffn_norm))


def _unwrap(block: nn.Module) -> nn.Module:
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        block = getattr(block, attr, block)
    return block


@torch.no_grad()
def fuse_model(model: nn.Module, qkv: bool = True, gate_up: bool = True, add_norm: bool = True) -> dict[str, int]:
    """Swap every block's attention / MLP / block for the fused versions (in place).
    Returns how many of each fusion were applied."""
    done = {"qkv": 0, "gate_up": 0, "add_norm": 0}
    for name in list(model.layers.keys()):
        block = _unwrap(model.layers[name])
        attn, ffn = block.attention, block.feed_forward
        if qkv and isinstance(attn, Attention):
            wqkv = cat_linears([attn.wq, attn.wk, attn.wv])
            if wqkv is not None:
                block.attention = FusedAttention(wqkv, attn.wo, attn.n_heads, attn.n_kv_heads, attn.head_dim)
                done["qkv"] += 1
        if gate_up and isinstance(ffn, FeedForward):
            w13 = cat_linears([ffn.w1, ffn.w3])
            if w13 is not None:
                block.feed_forward = FusedFeedForward(w13, ffn.w2, ffn.w1.out_features)
                done["gate_up"] += 1
        if add_norm and not isinstance(block, FusedTransformerBlock):
            block = FusedTransformerBlock(block)
            done["add_norm"] += 1
        model.layers[name] = block
    return done


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


_VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "split", "split_with_sizes", "unbind", "alias", "detach", "as_strided", "reshape",
             "_reshape_alias", "chunk", "narrow", "lift_fresh"}


def count_ops(fn: Callable[..., Any], *args, **kwargs) -> dict[str, Any]:
    """ATen operators dispatched by ``fn(*args, **kwargs)`` (a composite op such as
    ``F.linear`` counts as the ops it decomposes into; ops a kernel calls internally are not
    seen): ``total``, ``compute`` (without views and other metadata-only ops) and ``by_op``."""
    with _OpCounter() as counter:
        fn(*args, **kwargs)
    counts = counter.counts
    compute = sum(n for op, n in counts.items() if op not in _VIEW_OPS)
    return {"total": sum(counts.values()), "compute": compute, "by_op": dict(counts.most_common())}
