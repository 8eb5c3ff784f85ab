"""The single-device model (``llama.py``; latent attention ``mla.py``, experts ``moe.py``),
its shapes (``config.py``), Hugging Face weight interop (``hf.py``) and memory preflight
(``preflight.py``); ``[model]`` is ``section.py``.

Exports resolve lazily (PEP 562), so loading the config (``model.section``) does not
import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {"FLAVORS": "config", "ModelConfig": "config", "model_config_from_section": "config",
            "Transformer": "llama", "build_model": "llama"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"trainforge.model.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'trainforge.model' has no attribute {name!r}")
