"""``[model]``: which model shape to train (a named flavor, optionally overridden).
``model_config_from_section`` (``config.py`` beside it) turns it into a ``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.config_base import _f, _require


@dataclass
class ModelSection:
    flavor: str = _f("tiny", "named model shape: debug, tiny, small, llama-1b, llama-8b, llama-70b, llama-405b")
    dim: int | None = _f(None, "override the flavor's hidden size")
    n_layers: int | None = _f(None, "override the flavor's number of transformer blocks")
    n_heads: int | None = _f(None, "override the flavor's number of query heads")
    n_kv_heads: int | None = _f(None, "override the flavor's number of key/value heads (GQA)")
    ffn_hidden_dim: int | None = _f(None, "override the flavor's SwiGLU hidden size")
    tie_embeddings: bool | None = _f(None, "share input embedding and output projection weights")

    def validate(self) -> None:
        from trainforge.model.config import FLAVORS

        _require(self.flavor in FLAVORS, "model.flavor", self.flavor, f"one of {sorted(FLAVORS)}")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"model.{name}", v, "a positive integer")
