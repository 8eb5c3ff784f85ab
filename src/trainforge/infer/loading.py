"""Load a model for the engine: ``trainforge.loading``'s reader with the engine's quantised
modules (``infer/quantize/``) for a quantised checkpoint's layers.

The reading itself (trainforge checkpoints, Hugging Face directories, GGUF files) lives in
``loading/``, below both training and inference, so ``model.init_from`` reads weights without
importing the serving engine. What only the engine has is the modules that hold a quantised
layer's stored form and run its kernels; ``load_model`` here hands them to the reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainforge.loading import loader
from trainforge.loading.loader import KVSlots, LoadedModel


def swap_engine_modules(model: torch.nn.Module, quantization: dict[str, Any], dtype: torch.dtype) -> None:
    """``loading.loader.SwapQuantized`` for the engine: the quantised linears and experts of
    ``infer/quantize`` in place of the float ones, and a block-quantised embedding's rows
    dequantised into ``dtype``, the float dtype of the rest."""
    from trainforge.infer.quantize import BlockEmbedding, swap_quantized_linears

    swap_quantized_linears(model, quantization)
    if isinstance(model.tok_embeddings, BlockEmbedding):
        model.tok_embeddings.dtype = dtype


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None, kv_slots: KVSlots | None = None,
               mapped: bool = False, verify: bool = True, quantize_to: dict[str, Any] | None = None,
               weights: str = "final") -> LoadedModel:
    """``trainforge.loading.loader.load_model`` (arguments and errors as there), quantised
    checkpoints included: their layers become the engine's quantised modules."""
    return loader.load_model(path, device, dtype, kv_slots, mapped, verify, quantize_to,
                             swap_quantized=swap_engine_modules, weights=weights)
