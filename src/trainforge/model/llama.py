"""A Llama-style decoder written for one device.

Token embedding -> N x [RMSNorm -> grouped-query attention with rotary embeddings
-> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output projection.

The model knows nothing about parallelism, precision or compression: those are
applied from outside (``trainforge.parallel``, ``trainforge.precision``). Rotary
embeddings use the "rotate half" layout of Hugging Face's ``LlamaForCausalLM``, so
weights convert between the two by renaming only (see ``hf.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.model.config import ModelConfig


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


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (max_seq_len, head_dim), computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D): rotate-half layout
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache(nn.Module):
    """Pre-allocated per-layer key/value cache for incremental decoding, (B, H_kv, T_max, D)."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device=None):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_pos + k.shape[2]
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           cache: KVCache | None, start_pos: int) -> torch.Tensor:
    """Causal attention of (B, H, T, D) queries over (B, Hkv, T, D) keys/values: rotary
    embeddings, then the cache (if any) appended to, then SDPA. Shared by the model and
    the inference fusion pass, so both attend identically. Returns (B, H, T, D)."""
    T = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k, v = cache.update(start_pos, k, v)
    S = k.shape[2]
    if S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # Decoding against a cache: query i sits at absolute position start_pos + i.
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=start_pos)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the projections' output sizes (-1), not the config, so the
        # same code runs when tensor parallelism leaves n_heads / tp heads on each rank.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, cos, sin, self.cache, start_pos)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, start_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(tokens)`` -> logits (B, T, vocab), fp32 unless cast.

    Blocks live in a ``ModuleDict`` keyed "0".."N-1" so pipeline stages can delete
    blocks and keep fully-qualified names stable (the torchtitan convention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Non-persistent: recomputed from the config, never stored in checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2/Llama-style init: N(0, 0.02), output projections of residual branches
        scaled by 1/sqrt(2·n_layers) so the residual stream's variance does not grow with depth.
        Also recomputes the rope tables (needed after building on the meta device)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        std = 0.02
        out_std = std / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, out_std, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                               device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab). ``start_pos`` is the absolute
        position of tokens[:, 0] when decoding against caches set by ``setup_caches``.

        A pipeline stage sets ``tok_embeddings`` / ``norm`` / ``output`` to None when it
        does not own them; it then takes and/or returns hidden states (B, T, dim)."""
        T = tokens.shape[1]
        if start_pos + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
        cos = self.rope_cos[start_pos:start_pos + T]
        sin = self.rope_sin[start_pos:start_pos + T]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, cos, sin, start_pos)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def setup_caches(self, batch_size: int, max_seq_len: int | None = None) -> None:
        """Allocate static KV caches for generation (``clear_caches`` removes them)."""
        max_seq_len = max_seq_len or self.cfg.max_seq_len
        w = self.output.weight
        for layer in self.layers.values():
            layer.attention.cache = KVCache(batch_size, self.cfg.n_kv_heads, max_seq_len, self.cfg.head_dim,
                                            w.dtype, w.device)

    def clear_caches(self) -> None:
        for layer in self.layers.values():
            layer.attention.cache = None


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """Build and initialise. ``device="meta"`` allocates nothing (shapes and counts only)."""
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model
