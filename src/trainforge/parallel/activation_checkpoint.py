"""Activation checkpointing: recompute each block's activations during backward
instead of storing them (memory for ~1/3 more compute), via PyTorch's non-reentrant
``checkpoint_wrapper``. FQNs are unchanged (the wrapper's prefix is stripped by
``state_dict``), so checkpoints move freely between runs with and without it."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"parallel.activation_checkpointing = {mode!r}: use none or full")
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    for module in getattr(model, "mtp", nn.ModuleDict()).values():  # multi-token prediction (model/mtp.py)
        module.block = checkpoint_wrapper(module.block, preserve_rng_state=False)
