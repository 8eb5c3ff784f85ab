"""A Llama-style decoder written for one device.

Token embedding -> N x [RMSNorm -> grouped-query attention with rotary embeddings
-> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output projection.

The model knows nothing about parallelism, precision or compression: those are
applied from outside (``trainforge.parallel``, ``trainforge.precision``). Rotary
embeddings (``rope.py``) use the "rotate half" layout of Hugging Face's ``LlamaForCausalLM``,
so weights convert between the two by renaming only (see ``hf.py``). A config with
``kv_lora_rank`` > 0 swaps the attention for DeepSeek's latent attention (``mla.py``).

This forward is the only definition of the model's math. Training calls
``forward(tokens)``; inference calls ``forward(tokens, positions, cache)`` with an
``AttentionCache`` (``attention_cache.py``) that the attention writes keys/values into and
reads its context from, so prefill and batched decode run these very modules. Modules also
carry ``decode_calls``: the same computation for one token per row, allocation-free, bound
to a preallocated workspace (``fast_decode.py``), each tested against its ``forward``.
Fused kinds (``fused.py``) and quantised linears are module swaps applied from outside.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainforge.errors import ConfigError
from trainforge.model.config import ModelConfig
from trainforge.model.norm import RMSNorm
from trainforge.model.rope import apply_rope, model_rope_tables
from trainforge.model.mtp import MTPModule
from trainforge.model.swiglu import FeedForward

if TYPE_CHECKING:
    from trainforge.model.attention_cache import AttentionCache, LayerCache
    from trainforge.model.decode_workspace import DecodeWorkspace

# The decode step's residual add as the operator itself (a bound ``x.add_`` is the same op): a
# ``functools.partial`` of an operator is what the C++ call program runs (infer/cpu_kernels/call_program.py).
add_ = torch.ops.aten.add_.Tensor


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           cache: LayerCache | None) -> torch.Tensor:
    """Attention of (B, H, T, D) queries over (B, Hkv, T, D) keys/values: rotary embeddings,
    then causal SDPA over the sequence itself (training) or the cache's attention, which
    stores k/v and reads the context the cache's owner set for this step. Shared by every
    attention kind (plain, fused), so all attend identically. Returns (B, H, T, D)."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return cache.attend(q, k, v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the projections' output sizes (-1), not the config, so the
        # same code runs when tensor parallelism leaves n_heads / tp heads on each rank.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, cos, sin, cache)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def decode_calls(self, ws: DecodeWorkspace, h: torch.Tensor, out: torch.Tensor,
                     cache: LayerCache) -> list[Callable[[], None]]:
        """The allocation-free decode step of ``forward`` for h (B, dim) -> out (B, dim)
        (fast_decode.py): three projections into the workspace, rotary in place, the
        cache's attention, ``wo``."""
        B, D = h.shape[0], self.head_dim
        q, k, v = ws.qkv_views(B, self.n_heads * D, self.n_kv_heads * D, fused=False)
        calls = [ws.linear(m).bind(h, o) for m, o in ((self.wq, q), (self.wk, k), (self.wv, v))]
        ropes = [q.view(B, -1, D), k.view(B, -1, D)]
        return calls + attention_decode_calls(ws, ropes, q, k, v, cache, self.wo, out)


def attention_decode_calls(ws: DecodeWorkspace, ropes: list[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, cache: LayerCache, wo: nn.Module, out: torch.Tensor
                           ) -> list[Callable[[], None]]:
    """What every attention kind's decode step does once q, k, v (B, H*D) / (B, Hkv*D) are
    projected: rotary in place on the (B, n, D) views ``ropes`` (``apply_rope``'s formula,
    see ``RopeInto``), the cache's attention into the workspace, ``wo`` into ``out``."""
    at = ws.attention_out(q.shape[0], q.shape[1])
    if ws.kernels is not None:  # one fused op for every rotated tensor (DecodeWorkspace)
        calls: list[Callable[[], None]] = [functools.partial(ws.kernels.rope, ropes, *ws.rope_tables(q.shape[0]))]
    else:
        calls = [ws.rope(x) for x in ropes]
    calls += cache.decode_calls(ws, q, k, v, at)
    calls.append(ws.linear(wo).bind(at, out))
    return calls


class TransformerBlock(nn.Module):
    """``layer``: the block's index; a MoE config gives blocks from ``n_dense_layers`` on
    a mixture-of-experts feed-forward (``moe.py``) instead of the dense SwiGLU, and an MLA
    config (``kv_lora_rank`` > 0) latent attention (``mla.py``) instead of ``Attention``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_mla:
            from trainforge.model.mla import MLA

            self.attention: nn.Module = MLA(cfg)
        else:
            self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            from trainforge.model.moe import MoE

            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return x + self.feed_forward(self.ffn_norm(x))

    def decode_calls(self, ws: DecodeWorkspace, x: torch.Tensor, cache: LayerCache) -> list[Callable[[], None]]:
        """``forward`` for one token per row, x (B, dim) updated in place, no allocation.
        Each submodule contributes its own ``decode_calls``."""
        h, delta = ws.hidden(x.shape[0])
        return [*self.attention_norm.decode_calls(ws, x, h), *self.attention.decode_calls(ws, h, delta, cache),
                functools.partial(add_, x, delta), *self.ffn_norm.decode_calls(ws, x, h),
                *self.feed_forward.decode_calls(ws, h, delta), functools.partial(add_, x, delta)]


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(tokens)`` -> logits (B, T, vocab), fp32 unless cast.

    Blocks live in a ``ModuleDict`` keyed "0".."N-1" so pipeline stages can delete
    blocks and keep fully-qualified names stable (the torchtitan convention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # An hourglass config (hourglass.py) builds each block at its stage's width.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg.stage_config(i), i) for i in range(cfg.n_layers)})
        self.hourglass = None
        if cfg.is_hourglass:
            from trainforge.model.hourglass import HourglassTrunk

            self.hourglass = HourglassTrunk(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Multi-token prediction modules (mtp.py), keyed "0".."D-1" for depths 1..D; empty
        # (no parameters, nothing in state dicts) when cfg.mtp_depth = 0.
        self.mtp = nn.ModuleDict({str(k): MTPModule(cfg, TransformerBlock(cfg, cfg.n_layers + k), RMSNorm)
                                  for k in range(cfg.mtp_depth)})
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = model_rope_tables(cfg)
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
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                p.normal_(0.0, out_std, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in self.named_buffers():
            if name.endswith("expert_bias"):  # loss-free balancing starts unbiased
                b.zero_()
        cos, sin = model_rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.hourglass is not None:
            self.hourglass.reset_rope()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None, output_rows: slice | torch.Tensor | None = None,
                mtp: bool = False, return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """tokens: (B, T) int64 -> logits (B, T, vocab).

        Training passes tokens alone: positions 0..T-1, causal attention within the
        sequence. Inference passes ``positions`` (T,) shared by the rows or (B, T) per row
        (rotary tables are indexed by them) and an ``AttentionCache`` (attention_cache.py)
        that stores each layer's keys/values and supplies the context to attend to; its
        owner sets the step's metadata (slots, lengths) before the call. ``output_rows``, a
        slice or a LongTensor of indices, keeps only those positions before the final norm
        (prefill needs the last one; a packed prefill each prompt's last).

        ``mtp=True`` (training only: no positions, cache or output_rows) also runs the
        multi-token prediction modules and returns ``(logits, [logits_1, ..., logits_D])``,
        depth k's (B, T-k, vocab) at position t predicting token t+k+1 (``mtp_hidden``).
        ``return_hidden=True`` returns ``(logits, h)`` instead, h (B, T', dim) the last block's
        output (before the final norm) at the kept rows: the input of MTP depth 1 when
        drafting (``mtp_step``).

        A pipeline stage sets ``tok_embeddings`` / ``norm`` / ``output`` to None when it
        does not own them; it then takes and/or returns hidden states (B, T, dim). A
        floating-point ``tokens`` (B, T, dim) is such hidden states even where the
        embedding is kept (the last stage of an MTP model holds a copy for its MTP modules).
        With ``output`` None (also the chunked loss's convention) every returned tensor is the
        normed hidden states (B, T[-k], dim) instead of logits."""
        cos, sin = self._rope(tokens.shape[1], positions)
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embed else tokens  # (B, T, dim)
        if self.hourglass is not None:
            # The trunk needs a cache that does its shortening's bookkeeping (``shorten``, ``upsample``:
            # hourglass_cache.py, a layer above the model, so asked by what it does, not its class).
            if not hasattr(cache, "shorten") and (cache is not None or positions is not None):
                raise ConfigError(f"model.hourglass = {self.cfg.hourglass!r}: an hourglass model decodes through an "
                                  f"HourglassCache (model/hourglass_cache.py; the inference engine builds one), not "
                                  f"a {type(cache).__name__}: its middle stages keep their own state at the "
                                  "shortened rate")
            h = self.hourglass(h, self.layers, cos, sin, cache)
        else:
            for name, layer in self.layers.items():
                h = layer(h, cos, sin, cache.layer(int(name)) if cache is not None else None)
        if mtp:
            if positions is not None or cache is not None or output_rows is not None:
                raise ValueError("mtp=True is the training forward: pass tokens alone (no positions, cache or "
                                 "output_rows)")
            return self.head(h), [self.head(hk, depth) for depth, hk in enumerate(self.mtp_hidden(h, tokens), 1)]
        if output_rows is not None:
            h = h[:, output_rows]
        return (self.head(h), h) if return_hidden else self.head(h)

    def _rope(self, T: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary rows for T tokens at ``positions`` (None: 0..T-1)."""
        if positions is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
            return self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        if positions.dim() == 1:
            return self.rope_cos[positions], self.rope_sin[positions]  # (T, D)
        # (B, T): (B, 1, T, D), broadcast over heads
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def head(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Final norm and output projection of hidden states h (..., dim): the main model's
        norm for ``depth`` 0, MTP depth k's own norm for k >= 1; the output projection is
        shared. Either step is skipped where unset (pipeline stages, the chunked loss)."""
        norm = self.norm if depth == 0 else self.mtp[str(depth - 1)].norm
        h = norm(h) if norm is not None else h
        return self.output(h) if self.output is not None else h

    def mtp_step(self, depth: int, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: AttentionCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP depth ``depth`` (1..D) on aligned inputs, as a drafter calls it. h (B, T, dim):
        depth-1's hidden states before its norm at ``positions`` (depth 1: ``forward(...,
        return_hidden=True)``'s); tokens (B, T): the token depth ``depth`` reads beside each
        one, token t+depth at position t (depth 1: the token just chosen after position t).
        The block attends through ``cache.layer(n_layers + depth - 1)`` (a cache with
        ``n_layers + mtp_depth`` layers) like the main blocks, so it needs its own keys and
        values for the earlier positions. Returns (logits (B, T, vocab) for token t+depth+1,
        this depth's hidden states (B, T, dim) for depth + 1)."""
        cos, sin = self._rope(tokens.shape[1], positions)
        layer = cache.layer(self.cfg.n_layers + depth - 1) if cache is not None else None
        h = self.mtp[str(depth - 1)](h, self.tok_embeddings(tokens), cos, sin, layer)
        return self.head(h, depth), h

    def mtp_hidden(self, h: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The MTP chain of one training sequence. h: the main model's last hidden states
        (B, T, dim) before its final norm; tokens: the model's input tokens (B, T). Returns
        depth k's hidden states (B, T-k, dim) for k = 1..D, before their norms: position t
        combines h_{k-1}[t] with the embedding of tokens[t+k] and predicts token t+k+1
        (``targets[:, k:]`` for the usual next-token targets)."""
        out = []
        for k, module in enumerate(self.mtp.values(), start=1):
            T = h.shape[1] - 1  # depth k has one position fewer than depth k-1
            h = module(h[:, :T], self.tok_embeddings(tokens[:, k:]), self.rope_cos[:T], self.rope_sin[:T])
            out.append(h)
        return out


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """Build and initialise. ``device="meta"`` allocates nothing (shapes and counts only)."""
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model
