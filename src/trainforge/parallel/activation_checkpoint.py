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
    # Every block of the kinds the model's layers are, wherever it sits: the trunk's, and any
    # a family keeps elsewhere (a prediction head around a block of its own).
    kinds = {type(block) for block in model.layers.values()}
    blocks = [name for name, m in model.named_modules() if type(m) in kinds]
    for name in blocks:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, checkpoint_wrapper(owner.get_submodule(child), preserve_rng_state=False))
