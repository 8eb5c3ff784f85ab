"""Attention caches: the object an inference forward passes to the model's attention.

``Transformer.forward(tokens, positions, cache)`` hands each block ``cache.layer(i)``; the
attention computes q, k, v and rotary embeddings itself, then calls
``layer_cache.attend(q, k, v)``, which stores the new keys/values and attends over the
context the cache's owner set up for this step (vLLM's attention backends and gpt-fast's
single forward work the same way). The model's math is written once; a cache decides only
where keys and values live and which of them a query sees.

- ``StaticCache``: contiguous (B, H_kv, T_max, D) per layer, every row at the same
  position (gpt-fast's static cache). ``advance(T)`` returns the positions of the next T
  tokens and is called once per forward.
- ``PagedCache``: the engine's paged KV pool (``infer/kv_pool.py`` holds the block
  bookkeeping and hands over its tensors, (n_layers, H_kv, slots, D)). The owner writes the
  step's metadata into the cache's buffers: ``slots`` (where each row's new token goes),
  ``gather`` (each row's first S slots, its page table padded with the padding block) and
  ``bias`` (0 up to the row's length, -inf past it), then calls ``set_decode(B, S)``; a
  prompt goes in with ``set_prefill(slots)``, several prompts packed into one row of tokens
  with ``set_packed_prefill(slots, lengths)`` (each attends to itself only). Speculative
  decoding's verification forward (T new tokens per row: the last accepted token and T - 1
  drafts) goes in with ``set_verify(B, T, S)``: ``slots`` then holds B * T slots, row-major, and ``bias`` is 0 over
  each row's context *including* its T new tokens, which are the row's last T valid slots.

``PagedCache.decode_calls`` is the allocation-free form of its ``attend`` for one token per
row (see ``fast_decode.py``), with a parity test against ``attend``.

Latent attention (MLA, ``mla.py``) over a paged pool: ``cache_layout(cfg)`` (``cache_layout.py``) says what a
config stores per token and layer. For MLA that is one "head" of width kv_lora_rank +
qk_rope_head_dim (the normalised latent c_kv, then the rotated shared rotary key k_pe) and no
values; a ``PagedCache`` built without ``v`` is such a latent cache (``latent`` is True) and
the module calls ``attend_latent`` instead of ``attend``: the per-head up-projections are
folded into the query and the output by the module (the absorbed form), so the cache attends
in latent space. ``StaticCache`` and training keep the naive form (per-head k / v).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

# What a pool stores per token, from the config alone (the config layer's memory estimates read
# it too): re-exported here, where the caches that hold it live.
from trainforge.model.cache_layout import CacheLayout, cache_layout, cached_layers, kv_bytes_per_token

if TYPE_CHECKING:
    from trainforge.model.decode_workspace import DecodeWorkspace

__all__ = ["CacheLayout", "cache_layout", "cached_layers", "kv_bytes_per_token"]  # with the caches below


def latent_attention(q: torch.Tensor, k: torch.Tensor, r: int, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T + mask) @ k[..., :r] for one key head shared by every query head:
    q (B, H, T, D), k (B, S, D), mask additive, broadcastable to (B, H, T, S) -> (B, H, T, r).
    Heads fold into the query rows, so it is two ``bmm`` over the stored keys as they are (SDPA
    with ``enable_gqa`` repeats k and v per head on CPU: 2.5x slower decode at 1k context)."""
    B, H, T, D = q.shape
    S = k.shape[1]
    scores = torch.bmm((q * scale).reshape(B, H * T, D), k.transpose(1, 2)).view(B, H, T, S) + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.view(B, H * T, S), k[..., :r]).view(B, H, T, r)


def verify_bias(bias: torch.Tensor, T: int) -> torch.Tensor:
    """The additive mask (B, T, S) of T new tokens per row from each row's context mask
    ``bias`` (B, S) (0 over its valid slots, the T new ones included, -inf past them). The new
    tokens are each row's last T valid slots: new token j (of T) sees slots up to
    valid - T + j, so the causal limit comes from the row's mask, no extra metadata. Used by the
    verification forward (``PagedCache.set_verify``) and by a step that runs the B * T tokens
    as one-token rows (``infer/runner.py``)."""
    B, S = bias.shape
    bias = bias.view(B, 1, S)
    valid = (bias == 0).sum(-1, keepdim=True)  # (B, 1, 1)
    limit = valid - T + torch.arange(T, device=bias.device).view(1, T, 1)  # (B, T, 1)
    seen = torch.arange(S, device=bias.device).view(1, 1, S) <= limit  # (B, T, S)
    return bias.masked_fill(~seen, float("-inf"))


class AttentionCache:
    """What ``Transformer.forward`` needs of a cache: a per-layer view whose ``attend``
    takes rotated q (B, H, T, D), k and v (B, H_kv, T, D) and returns (B, H, T, D)."""

    n_layers: int
    latent = False  # True: stores MLA's latent; the module calls ``attend_latent``
    # Whether several prompts may prefill in one forward (``PagedCache.set_packed_prefill``).
    packs_prompts = False

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        # Made once: forward asks for a layer's view every step.
        self._layers = [LayerCache(self, i) for i in range(n_layers)]

    def layer(self, index: int) -> LayerCache:
        return self._layers[index]

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        raise NotImplementedError

    def attend_latent(self, index: int, q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, scale: float) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} stores per-head keys and values, not latents")

    def decode_calls(self, index: int, ws: DecodeWorkspace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> list[Callable[[], None]]:
        raise NotImplementedError(f"{type(self).__name__} has no allocation-free decode step")


class LayerCache:
    """One layer's view of a cache: what an attention module receives."""

    def __init__(self, cache: AttentionCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``scale``: the softmax scale (None: SDPA's 1/sqrt(q's last dim); MLA passes its own)."""
        return self.cache.attend(self.index, q, k, v, scale)

    @property
    def latent(self) -> bool:
        """Whether this cache stores MLA's latent (call ``attend_latent``, not ``attend``)."""
        return self.cache.latent

    def attend_latent(self, q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """Absorbed latent attention: stores c_kv (B, T, r) and the rotated k_pe (B, T, rope)
        of the step's tokens and returns softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv,
        (B, H, T, r), over each row's context; q_latent (B, H, T, r) is the query already
        multiplied by each head's key up-projection, q_pe (B, H, T, rope) rotated."""
        return self.cache.attend_latent(self.index, q_latent, q_pe, c_kv, k_pe, scale)

    def decode_calls(self, ws: DecodeWorkspace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> list[Callable[[], None]]:
        return self.cache.decode_calls(self.index, ws, q, k, v, out)


class StaticCache(AttentionCache):
    """Contiguous keys/values (n_layers, B, H_kv, T_max, D), all rows at the same position.
    ``v_head_dim`` (default ``head_dim``) sizes the values apart: latent attention (naive
    form) stores per-head keys of nope+rope dims and values of v_head_dim."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                 v_head_dim: int | None = None):
        super().__init__(n_layers)
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len)
        self.k = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, v_head_dim or head_dim, dtype=dtype, device=device)
        self.length = 0  # tokens stored
        self.start_pos = 0  # position of the current forward's first token

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int | None = None) -> StaticCache:
        cfg, w = model.cfg, model.tok_embeddings.weight
        T = max_seq_len or cfg.max_seq_len
        if cfg.is_mla:  # every head has its own k / v once the latent is expanded
            return cls(cfg.n_layers, batch_size, cfg.n_heads, T, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                       w.dtype, w.device, v_head_dim=cfg.v_head_dim)
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, T, cfg.head_dim, w.dtype, w.device)

    def advance(self, n_tokens: int) -> torch.Tensor:
        """Positions (T,) of the next ``n_tokens`` tokens; the forward that follows stores them there."""
        end = self.length + n_tokens
        if end > self.k.shape[3]:
            raise ValueError(f"{end} tokens exceed the cache's {self.k.shape[3]} (raise max_seq_len)")
        self.start_pos, self.length = self.length, end
        return torch.arange(self.start_pos, end, device=self.k.device)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        start, T = self.start_pos, q.shape[2]
        end = start + T
        self.k[index, :, :, start:end] = k
        self.v[index, :, :, start:end] = v
        k, v = self.k[index, :, :, :end], self.v[index, :, :, :end]
        gqa = q.shape[1] != k.shape[1]
        if end == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
        # Query i sits at absolute position start + i.
        mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


class PagedCache(AttentionCache):
    """Keys/values in a paged pool, k / v (n_layers, H_kv, n_slots, D), for up to
    ``max_rows`` sequences of up to ``context_slots`` slots each (see the module docstring
    for the metadata the owner fills). ``v`` None: a latent cache, k (n_layers, 1, n_slots,
    kv_lora_rank + rope) holding [c_kv, k_pe] per token (``attend_latent``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor | None, max_rows: int, context_slots: int,
                 max_tokens_per_row: int = 1):
        super().__init__(k.shape[0])
        self.k, self.v = k, v
        self.latent = v is None
        self.max_rows, self.context_slots = max_rows, context_slots
        dev = dict(device=k.device)
        R, C = max_rows, context_slots
        self.slots = torch.zeros(R * max_tokens_per_row, dtype=torch.long, **dev)
        self.gather = torch.zeros(R * C, dtype=torch.long, **dev)
        self.bias = torch.zeros(R * C, dtype=k.dtype, **dev)
        # The decode step's context length S, as a tensor: the C++ attention reads it at run time,
        # so one bound fast step serves every S (fast_decode.FastDecoder.plan sets it).
        self.context = torch.zeros(1, dtype=torch.long, **dev)
        self._prefill_slots: torch.Tensor | None = None
        # A packed prefill's prompt lengths, a host list: the segment bounds need no device read.
        self._packed_lengths: list[int] | None = None
        self._shape = (0, 0)  # (B, S) of the decode step
        self._verify_tokens = 0  # T of a verification forward; 0 = one decode token per row

    @property
    def decode_shape(self) -> tuple[int, int]:
        """(rows, context slots) of the decode step ``set_decode`` last set."""
        return self._shape

    def set_prefill(self, slots: torch.Tensor) -> None:
        """The next forward is one sequence's prompt (positions 0..T-1) stored at ``slots`` (T,)."""
        self._prefill_slots, self._packed_lengths = slots, None

    def set_packed_prefill(self, slots: torch.Tensor, lengths: list[int]) -> None:
        """The next forward is several sequences' prompts packed into one row of sum(T_i)
        tokens, prompt i's T_i = ``lengths[i]`` tokens after the ones before it (positions
        0..T_i-1), stored at ``slots`` (sum T_i,). Each prompt attends to itself only."""
        if sum(lengths) != slots.shape[0]:
            raise ValueError(f"packed prefill of {sum(lengths)} tokens (lengths {lengths}) given "
                             f"{slots.shape[0]} slots")
        self._prefill_slots, self._packed_lengths = slots, list(lengths)

    def set_decode(self, rows: int, context: int) -> None:
        """The next forward is one token for each of ``rows`` sequences; ``gather`` / ``bias``
        hold ``context`` slots per row and ``slots`` each row's new slot."""
        self._prefill_slots, self._packed_lengths, self._shape, self._verify_tokens = None, None, (rows, context), 0

    def set_verify(self, rows: int, tokens_per_row: int, context: int) -> None:
        """The next forward is ``tokens_per_row`` (T) consecutive tokens for each of ``rows``
        sequences (speculative verification): ``slots`` holds rows * T new slots, row-major;
        ``gather`` / ``bias`` ``context`` slots per row, the T new ones included as the row's
        last valid slots. Each new token attends to the row's earlier context and to the new
        tokens up to itself."""
        if rows * tokens_per_row > self.slots.numel():
            raise ValueError(f"verify of {rows} x {tokens_per_row} tokens exceeds the cache's "
                             f"{self.slots.numel()} slots (max_tokens_per_row)")
        self._prefill_slots, self._packed_lengths = None, None
        self._shape, self._verify_tokens = (rows, context), tokens_per_row

    @property
    def packs_prompts(self) -> bool:
        """Per-head keys and values pack prompts; a latent cache prefills one prompt at a time."""
        return not self.latent

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        if self.latent:
            raise RuntimeError("attend on a latent cache: latent attention calls attend_latent")
        kp, vp = self.k[index], self.v[index]  # (H_kv, slots, D)
        gqa = q.shape[1] != k.shape[1]
        if self._prefill_slots is not None:  # the prompt attends to itself only
            kp.index_copy_(1, self._prefill_slots, k[0])
            vp.index_copy_(1, self._prefill_slots, v[0])
            if self._packed_lengths is not None:
                return self._attend_packed(q, k, v, gqa, scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
        B, S = self._shape
        Hkv, D = k.shape[1], k.shape[3]
        if self._verify_tokens:
            return self._attend_verify(kp, vp, q, k, v, B, S, gqa, scale)
        kp.index_copy_(1, self.slots[:B], k[:, :, 0].transpose(0, 1))  # (H_kv, B, D)
        vp.index_copy_(1, self.slots[:B], v[:, :, 0].transpose(0, 1))
        gather = self.gather[:B * S]
        kg = kp.index_select(1, gather).view(Hkv, B, S, D).transpose(0, 1)  # (B, H_kv, S, D)
        vg = vp.index_select(1, gather).view(Hkv, B, S, D).transpose(0, 1)
        mask = self.bias[:B * S].view(B, 1, 1, S)
        return F.scaled_dot_product_attention(q, kg, vg, attn_mask=mask, enable_gqa=gqa, scale=scale)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool,
                       scale: float | None) -> torch.Tensor:
        """Causal attention within each packed prompt: q (1, H, sum T, D), k / v (1, H_kv, sum T,
        D) -> (1, H, sum T, D). One SDPA per prompt, as its own prefill runs it: a block-diagonal
        mask over the whole pack would score every prompt against every other (~30x the work
        for 32 short prompts) only to mask it away."""
        out, a = [], 0
        for T in self._packed_lengths:
            b = a + T
            out.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                      enable_gqa=gqa, scale=scale))
            a = b
        return torch.cat(out, dim=2)

    def _attend_verify(self, kp: torch.Tensor, vp: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       B: int, S: int, gqa: bool, scale: float | None) -> torch.Tensor:
        T = self._verify_tokens
        Hkv, D = k.shape[1], k.shape[3]
        slots = self.slots[:B * T]
        kp.index_copy_(1, slots, k.transpose(0, 1).reshape(Hkv, B * T, D))  # row-major, as the slots
        vp.index_copy_(1, slots, v.transpose(0, 1).reshape(Hkv, B * T, D))
        gather = self.gather[:B * S]
        kg = kp.index_select(1, gather).view(Hkv, B, S, D).transpose(0, 1)  # (B, H_kv, S, D)
        vg = vp.index_select(1, gather).view(Hkv, B, S, D).transpose(0, 1)
        return F.scaled_dot_product_attention(q, kg, vg, attn_mask=self._verify_mask(B, S), enable_gqa=gqa,
                                              scale=scale)

    def _verify_mask(self, B: int, S: int) -> torch.Tensor:
        """(B, 1, T, S) additive mask of a verification forward's T new tokens per row."""
        return verify_bias(self.bias[:B * S].view(B, S), self._verify_tokens).unsqueeze(1)

    def attend_latent(self, index: int, q_latent: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, scale: float) -> torch.Tensor:
        """See ``LayerCache.attend_latent``: the key is the stored [c_kv, k_pe], the value its
        c_kv part (a view), one key head for all query heads (``latent_attention``)."""
        if not self.latent:
            raise RuntimeError("attend_latent on a cache of per-head keys and values (build it without v)")
        pool = self.k[index, 0]  # (slots, r + rope)
        if self._packed_lengths is not None:
            raise RuntimeError("packed prefill on a latent (MLA) cache: prefill each prompt alone (set_prefill)")
        T = c_kv.shape[1]
        new = torch.cat((c_kv, k_pe), dim=-1)  # (B, T, r + rope)
        q = torch.cat((q_latent, q_pe), dim=-1)  # (B, H, T, r + rope)
        if self._prefill_slots is not None:  # the prompt attends to itself only
            pool.index_copy_(0, self._prefill_slots, new[0])
            causal = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
            return latent_attention(q, new, c_kv.shape[-1], causal, scale)
        rows, S = self._shape
        if self._verify_tokens:
            pool.index_copy_(0, self.slots[:rows * T], new.reshape(rows * T, -1))  # row-major, as the slots
            mask = self._verify_mask(rows, S)
        else:
            pool.index_copy_(0, self.slots[:rows], new[:, 0])
            mask = self.bias[:rows * S].view(rows, 1, 1, S)
        k = pool.index_select(0, self.gather[:rows * S]).view(rows, S, -1)  # (B, S, r + rope)
        return latent_attention(q, k, c_kv.shape[-1], mask, scale)

    def decode_calls(self, index: int, ws: DecodeWorkspace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> list[Callable[[], None]]:
        """``attend`` for one token per row without allocation: q (B, H*D), k / v (B, H_kv*D)
        (views of the workspace, rotated), out (B, H*D). Every row's first S slots are
        gathered with one ``index_select`` into (H_kv, B*S, D), which views as the batch of
        H_kv*B key matrices ``bmm`` wants (no permute copy); q is scaled before q.k (SDPA
        scales the product: equal to float rounding)."""
        B, D = ws.rows, ws.head_dim
        H, Hkv = q.shape[1] // D, k.shape[1] // D
        G = H // Hkv
        kp, vp = self.k[index], self.v[index]
        if ws.kernels is not None and kp.shape == vp.shape:  # the same steps as one fused op (DecodeWorkspace)
            # The whole gather / bias buffers: the op reads S from ``context`` (set by the step).
            return [functools.partial(ws.kernels.paged_attention, q, k, v, kp, vp, self.slots[:B], self.gather,
                                      self.bias, self.context, D ** -0.5, out)]
        S = ws.context
        slots, gather, bias = self.slots[:B], self.gather[:B * S], self.bias[:B * S].view(1, B, 1, S)
        kg, vg, qt, scores, probs, ao = ws.attention_scratch()  # flat buffers, sized for the largest step
        n = B * S
        kg, vg = kg[:Hkv * n * D].view(Hkv, n, D), vg[:Hkv * n * D].view(Hkv, n, D)
        qt, ao = qt[:H * B * D].view(Hkv, B, G, D), ao[:H * B * D].view(Hkv * B, G, D)
        scores, probs = scores[:H * n].view(Hkv * B, G, S), probs[:H * n].view(Hkv * B, G, S)
        kg_t = kg.view(Hkv * B, S, D).transpose(1, 2)
        vg_b = vg.view(Hkv * B, S, D)
        qt_b, scores4 = qt.view(Hkv * B, G, D), scores.view(Hkv, B, G, S)
        ao_perm = ao.view(Hkv, B, G, D).permute(1, 0, 2, 3)
        q_perm = q.view(B, Hkv, G, D).permute(1, 0, 2, 3)
        p = functools.partial
        return [p(kp.index_copy_, 1, slots, k.view(B, Hkv, D).transpose(0, 1)),
                p(vp.index_copy_, 1, slots, v.view(B, Hkv, D).transpose(0, 1)),
                p(torch.index_select, kp, 1, gather, out=kg), p(torch.index_select, vp, 1, gather, out=vg),
                p(torch.mul, q_perm, ws.scalar(D ** -0.5), out=qt),
                p(torch.bmm, qt_b, kg_t, out=scores), p(scores4.add_, bias),
                p(torch.ops.aten._softmax.out, scores, -1, False, out=probs),
                p(torch.bmm, probs, vg_b, out=ao),
                p(out.view(B, Hkv, G, D).copy_, ao_perm)]
