"""Multi-head latent attention (DeepSeek-V2/V3), written for one device.

Queries: ``wq`` (dim -> H·(nope+rope)), or with ``q_lora_rank`` > 0 the low-rank
``wq_a`` -> RMSNorm ``q_norm`` -> ``wq_b``. Keys and values: ``wkv_a`` (dim ->
kv_lora_rank + rope) gives a latent, normalised by ``kv_norm`` and expanded by ``wkv_b``
(kv_lora_rank -> H·(nope + v)) into each head's key part without position and its value,
plus one rotary key of width ``qk_rope_head_dim`` shared by all heads (the decoupled rope).
Each head's key is [k_nope, k_rope], its query [q_nope, q_rope]; ``wo`` maps H·v -> dim.
Softmax scale: (nope + rope)^-0.5, times mscale² under YaRN (``yarn.softmax_mscale``).
The latent norms use eps 1e-6 whatever ``norm_eps`` (DeepSeek's reference and HF both do).

Rotary layout: this module applies ``rope.apply_rope`` (rotate-half, dims [x_0..x_{r/2-1}]
paired with [x_{r/2}..]) to the rope dims. DeepSeek's released weights pair interleaved
dims (x_0, x_1), (x_2, x_3), ... (HF ``rope_interleave=True``); the conversion in
``hf_deepseek.py`` permutes the rope rows of the query and ``wkv_a`` projections once
(even dims first, then odd), after which both layouts compute the same attention.

This forward (naive form: per-head keys/values are materialised) is the definition of the
math; training runs causal SDPA, and a ``StaticCache`` (``attention_cache.py``) stores the
per-head k (nope+rope wide) and v (v_head_dim wide).

Absorbed form (DeepSeek's reference ``attn_impl="absorb"``), taken when the cache is latent
(the engine's paged pool, ``cache.latent``): the pool keeps only c_kv = kv_norm(latent) and
the rotated k_pe per token. Since k_nope = c_kv W_uk and v = c_kv W_uv per head (W_uk, W_uv:
the key and value rows of ``wkv_b``), q_nope . k_nope = (q_nope W_uk) . c_kv and probs @ v =
(probs @ c_kv) W_uv: the query is multiplied by W_uk (nope -> kv_lora_rank), the cache attends
in latent space (``attend_latent``), and each head's latent output is multiplied by W_uv
before ``wo``. Both matrices are views of ``wkv_b.weight`` (read as a matrix, so
quantisation leaves ``wkv_b`` float: ``infer/quantize``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.config import ModelConfig
from trainforge.model.norm import RMSNorm
from trainforge.model.rope import apply_rope
from trainforge.model.yarn import softmax_mscale

if TYPE_CHECKING:
    from trainforge.model.attention_cache import LayerCache

LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank == 0:
            self.wq = nn.Linear(cfg.dim, H * qk, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        self.softmax_scale = qk ** -0.5 * softmax_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """x (B, T, dim); cos/sin (T, rope) or (B, 1, T, rope) -> (B, T, dim)."""
        B, T, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        # Head counts from the projections' sizes (-1), so a tensor-parallel shard runs this too.
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)  # (B, H, T, nope+rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)  # (B, T, r), (B, T, rope)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # (B, 1, T, rope): one key for all heads
        if cache is not None and cache.latent:
            return self._absorbed(q_nope, q_rope, self.kv_norm(latent), k_rope[:, 0], cache)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, H, T, nope), (B, H, T, v)
        H = q.shape[1]
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, H, -1, -1)), dim=-1)  # (B, H, T, nope+rope)
        if cache is None:
            # SDPA's fused kernels want one head dim for q, k and v (otherwise it takes the math
            # path, 1.8x slower on CPU at dsv3-tiny's shape): pad v with zeros, drop the zero columns after.
            pad = q.shape[-1] - self.v_dim
            out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)) if pad > 0 else v, is_causal=True,
                                                 scale=self.softmax_scale)[..., :self.v_dim]
        else:
            out = cache.attend(q, k, v, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, v) -> (B, T, dim)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, nope, r) and W_uv (H, v, r): views of ``wkv_b.weight``, no copy."""
        w = self.wkv_b.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise TypeError(f"MLA's absorbed decode reads wkv_b.weight as a matrix; {type(self.wkv_b).__name__} "
                            "has none (leave wkv_b a float linear)")
        w = w.view(-1, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                  cache: LayerCache) -> torch.Tensor:
        """The absorbed form over a latent cache: q_nope (B, H, T, nope), q_rope (B, H, T, rope)
        rotated, c_kv (B, T, r) normalised, k_rope (B, T, rope) rotated -> (B, T, dim)."""
        B, _, T, _ = q_nope.shape
        w_uk, w_uv = self._up_projections()
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
        out = cache.attend_latent(q_latent, q_rope, c_kv, k_rope, self.softmax_scale)  # (B, H, T, r)
        out = torch.einsum("bhtr,hvr->bhtv", out, w_uv)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))
