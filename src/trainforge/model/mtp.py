"""Multi-token prediction (DeepSeek-V3 §2.2): ``mtp_depth`` sequential modules after the
main model, module k (1-based) predicting the token k + 1 places beyond the next one.

Module k at position t combines the previous depth's hidden state h_{k-1}[t] (h_0: the
main model's last hidden state, before its final norm) with the embedding of token t + k:

    h_k[t] = block_k(proj_k(cat(enorm_k(emb(token[t + k])), hnorm_k(h_{k-1}[t]))))

embedding first in the concatenation (the order of the released checkpoints, torchtitan
and Megatron), then predicts token t + k + 1 from ``output(norm_k(h_k[t]))``. The token
embedding and the output projection are the main model's (shared, as in DeepSeek-V3); the
final RMSNorm is each module's own (the released checkpoints' ``shared_head.norm``). The
block is a ``TransformerBlock`` with layer index ``n_layers + k - 1``, so a MoE config gives
it a MoE feed-forward, as DeepSeek-V3's MTP layer has.

In training depth k sees positions 0 .. T-1-k of a T-token sequence (the last k have no
token t + k among the inputs), with the same rotary positions as the main model there.
The chain over depths and the sequence shifts are ``Transformer.mtp_hidden`` (llama.py);
this module is one depth on aligned inputs, which is also what a speculative decoder
calls one token at a time with an attention cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from trainforge.model.config import ModelConfig

if TYPE_CHECKING:
    from trainforge.model.attention_cache import LayerCache
    from trainforge.model.decode_workspace import DecodeWorkspace


class MTPModule(nn.Module):
    """One MTP depth around ``block`` (a ``TransformerBlock`` with layer index
    ``n_layers + depth - 1``); ``norm``: the RMSNorm class (``llama.py`` builds both and
    passes them in, so this file does not import it back)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module, norm: Callable[[int, float], nn.Module]):
        super().__init__()
        self.enorm = norm(cfg.dim, cfg.norm_eps)
        self.hnorm = norm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = norm(cfg.dim, cfg.norm_eps)  # before the shared output projection

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None) -> torch.Tensor:
        """h: the previous depth's hidden states (B, T, dim), before any final norm; emb:
        the embeddings (B, T, dim) of the tokens one place further on, aligned with h;
        cos/sin: the rotary rows of h's positions. Returns this depth's hidden states
        (B, T, dim), before ``self.norm``."""
        x = self.proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))  # (B, T, dim)
        return self.block(x, cos, sin, cache)

    def decode_calls(self, ws: DecodeWorkspace, x: torch.Tensor, emb: torch.Tensor, pair: torch.Tensor,
                     cache: LayerCache) -> list[Callable[[], None]]:
        """``forward`` for one token per row without allocation (fast_decode.py): x (B, dim)
        holds the previous depth's hidden state and receives this depth's, in place; emb
        (B, dim) the tokens' embeddings; pair (B, 2 dim) scratch for the concatenation."""
        d = x.shape[1]
        return [*self.enorm.decode_calls(ws, emb, pair[:, :d]), *self.hnorm.decode_calls(ws, x, pair[:, d:]),
                ws.linear(self.proj).bind(pair, x), *self.block.decode_calls(ws, x, cache)]
