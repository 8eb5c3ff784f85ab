"""The weight average a run trained with ``[ema]`` keeps (``train/ema.py``), read from a
trainforge checkpoint for ``--weights ema`` (generate, serve, export).

Where it lives: ``train_state.pt`` under ``ema`` -> ``weights``, FQN-keyed fp32 tensors in
the layout of ``model.safetensors`` (a tied output matrix stored once). The file also holds
the optimizer state, so it is memory-mapped (``torch.load(mmap=True, weights_only=True)``):
only the average's pages are read. No code runs on load: torch's weights-only unpickler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from trainforge.errors import CheckpointError
from trainforge.safe_unpickle import error_detail, refused_message

STATE_FILE = "train_state.pt"  # train/checkpoint.py's STATE_FILE
STATE_KEY = "ema"              # the component's name: its entry in train_state.pt
WEIGHTS_KEY = "weights"        # the averaged tensors inside it
WEIGHTS = ("final", "ema")     # --weights: the weights the run ended with, or their average
Weights = Literal["final", "ema"]


def check_weights_choice(weights: str) -> None:
    if weights not in WEIGHTS:
        raise CheckpointError(f"--weights {weights!r}: use final (the weights the run ended with) or ema "
                              "(their moving average, a run trained with [ema])")


def read_ema_weights(ck: Path) -> dict[str, torch.Tensor]:
    """The averaged weights of checkpoint directory ``ck`` (CPU, fp32, memory-mapped).
    Raises ``CheckpointError`` naming the checkpoint and the fix when it holds none."""
    f = ck / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"--weights ema: {ck} has no {STATE_FILE}, so no weight average; use --weights final")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # unpickling errors come in many types; all mean "unusable file"
        raise CheckpointError(refused_message(f, error_detail(e))) from None
    node = state.get(STATE_KEY) if isinstance(state, dict) else None
    weights = node.get(WEIGHTS_KEY) if isinstance(node, dict) else None
    if not weights:
        raise CheckpointError(f"--weights ema: {ck} holds no weight average (the run was trained without [ema]); "
                              "use --weights final, or train with --ema.enabled")
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise CheckpointError(refused_message(f, "its ema.weights is not a mapping of names to tensors"))
    return weights
