"""Weight mapping between trainforge's DeepSeek-V3 modules and Hugging Face's
``DeepseekV3ForCausalLM`` layout. For now the attention only (``MLA`` <-> ``DeepseekV3Attention``);
the whole-checkpoint load/write builds on these functions.

Names: wq <-> q_proj, wq_a <-> q_a_proj, q_norm <-> q_a_layernorm, wq_b <-> q_b_proj,
wkv_a <-> kv_a_proj_with_mqa, kv_norm <-> kv_a_layernorm, wkv_b <-> kv_b_proj, wo <-> o_proj.

Rotary layout: HF with ``rope_interleave=True`` (the released checkpoints) rotates
interleaved pairs (x0, x1), (x2, x3), ...; ``MLA`` rotates halves (``llama.apply_rope``).
Rotating interleaved pairs of x is rotating halves of x's de-interleaved copy
[x0, x2, ..., x1, x3, ...], and q·k is unchanged when q and k are permuted alike, so the
conversion permutes the output rows of the rope dims of the query projection (per head)
and of ``wkv_a`` (its last qk_rope_head_dim rows) once; ``rope_interleave=False`` needs no
permutation.
"""

from __future__ import annotations

import torch

from trainforge.model.config import ModelConfig

# (ours, HF) per attention parameter; names relative to the attention module.
ATTENTION_NAMES = (("wq.weight", "q_proj.weight"), ("wq_a.weight", "q_a_proj.weight"),
                   ("q_norm.weight", "q_a_layernorm.weight"), ("wq_b.weight", "q_b_proj.weight"),
                   ("wkv_a.weight", "kv_a_proj_with_mqa.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
                   ("wkv_b.weight", "kv_b_proj.weight"), ("wo.weight", "o_proj.weight"))


def deinterleave(rope_dim: int) -> torch.Tensor:
    """Index (rope_dim,): even dims then odd dims (interleaved pairs -> halves)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def _permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, name: str, index: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows of a query projection (per head: the last rope rows of each
    nope+rope block) or of ``wkv_a`` (its last rope rows) by ``index``; other weights as they are."""
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if name in ("wq.weight", "wq_b.weight"):
        w = w.view(cfg.n_heads, nope + rope, -1)
        return torch.cat((w[:, :nope], w[:, nope:][:, index]), dim=1).reshape(cfg.n_heads * (nope + rope), -1)
    if name == "wkv_a.weight":
        return torch.cat((w[:cfg.kv_lora_rank], w[cfg.kv_lora_rank:][index]), dim=0)
    return w


def attention_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                      ) -> dict[str, torch.Tensor]:
    """An ``MLA`` state dict from a ``DeepseekV3Attention`` one (names relative to the module)."""
    index = deinterleave(cfg.qk_rope_head_dim) if rope_interleave else None
    out = {}
    for ours, theirs in ATTENTION_NAMES:
        if theirs in hf:
            w = hf[theirs]
            out[ours] = _permute_rope_rows(w, cfg, ours, index) if index is not None else w
    return out


def attention_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
                    ) -> dict[str, torch.Tensor]:
    """The inverse of ``attention_from_hf``."""
    index = torch.argsort(deinterleave(cfg.qk_rope_head_dim)) if rope_interleave else None
    out = {}
    for ours, theirs in ATTENTION_NAMES:
        if ours in sd:
            w = sd[ours]
            out[theirs] = _permute_rope_rows(w, cfg, ours, index) if index is not None else w
    return out
