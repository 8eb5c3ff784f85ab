"""Model shapes. ``ModelConfig`` is everything the single-device model needs;
``FLAVORS`` are named shapes, from a < 1M-parameter test model to Llama 3.1 405B.

The real-size flavors follow the published Llama 3.x shapes so the planner and
memory estimates can build them on the meta device (no memory is allocated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainforge.model.preflight import MODEL_KEYS, check_shape

# Direct construction (checkpoint metadata, tests): the field names themselves.
_FIELD_KEYS = {**MODEL_KEYS, "vocab_size": "model.vocab_size", "max_seq_len": "model.max_seq_len"}


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        # Positive sizes first: 0 heads would otherwise be a ZeroDivisionError.
        check_shape({f: getattr(self, f) for f in _FIELD_KEYS}, _FIELD_KEYS)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count computed from the shape (no model needed)."""
        d, h = self.dim, self.head_dim
        attn = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
        mlp = 3 * d * self.ffn_hidden_dim
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d
        out = 0 if self.tie_embeddings else self.vocab_size * d
        total = self.n_layers * per_layer + d + out
        return total + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6·N for the matmuls plus
        the attention score/value products, 12·L·d·T (PaLM appendix B convention).
        The input embedding is a lookup, not a matmul, so it is excluded."""
        return 6.0 * self.num_params(include_embedding=False) + 12.0 * self.n_layers * self.dim * seq_len


FLAVORS: dict[str, ModelConfig] = {
    # < 1M parameters: unit tests and parity checks.
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=176),
    # ~10M: the quickstart model, trains in minutes on a laptop CPU.
    "tiny": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=704),
    # ~120M, GPT-2-small class.
    "small": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=2048),
    # Published Llama 3.x shapes (rope scaling of the originals is not modelled).
    "llama-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                            ffn_hidden_dim=8192, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True),
    "llama-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                            ffn_hidden_dim=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                             ffn_hidden_dim=28672, rope_theta=500000.0, max_seq_len=8192),
    "llama-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                              ffn_hidden_dim=53248, rope_theta=500000.0, max_seq_len=8192),
}


def model_config_from_section(section, vocab_size: int | None, seq_len: int | None = None) -> ModelConfig:
    """Resolve ``[model]`` (a ``ModelSection``) into a ModelConfig.

    ``vocab_size`` comes from the prepared data's tokenizer, so a flavor trains on
    any corpus; ``seq_len`` raises ``max_seq_len`` when training needs longer rope tables."""
    base = FLAVORS[section.flavor]
    changes = {k: getattr(section, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim",
                                                "tie_embeddings") if getattr(section, k) is not None}
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if seq_len is not None and seq_len > base.max_seq_len:
        changes["max_seq_len"] = seq_len
    # Named as the user set them (model.*, training.seq_len), before ModelConfig checks its fields.
    check_shape({f: changes.get(f, getattr(base, f)) for f in MODEL_KEYS}, MODEL_KEYS)
    return dataclasses.replace(base, **changes)
