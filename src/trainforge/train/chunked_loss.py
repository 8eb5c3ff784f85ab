"""Cross-entropy without the whole logits tensor: the output projection and the loss run
``chunk_tokens`` tokens at a time, each chunk under activation checkpointing.

Why: the logits are (tokens x vocab). For ``small`` at 8 x 1024 tokens with an 8192-token
vocabulary that is 256 MiB in fp32, and the loss saves as many fp32 log-probabilities for
backward, whose start then creates two more full-size gradients: about 0.75 GiB at the
memory peak (the end of the forward, when every activation is still held), in every
precision policy, since the loss computes in fp32 under all of them. Chunked, the peak
holds one chunk's logits and their gradient; what backward keeps is the hidden states
(tokens x dim, already saved by the output projection anyway).

Cost: each chunk's projection runs again in backward (``torch.utils.checkpoint``), one
more ``tokens x dim x vocab`` matmul per step: for ``small`` (vocab 8192) about 7% of the
forward's FLOPs. The sum runs in a different order, so the loss agrees with the
unchunked one to fp32 rounding, not bit for bit (tested: 1e-6 relative).

The model is not changed: ``hidden_states`` runs it with its ``output`` projection
unset (the pipeline stages' convention: the model then returns hidden states), and the
projection is called here, chunk by chunk, as the same module (so precision rules and
hooks on it still apply). Single-device or DDP only: tensor parallelism shards the
projection (its loss-parallel path already avoids gathering the logits), a pipeline's
last stage owns it inside the schedule, and FSDP2 frees it after the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainforge.errors import ConfigError
from trainforge.parallel.data_parallel import data_parallel_kind

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets count neither in the sum nor in the mean


def check_chunked_loss(chunk_tokens: int, dims) -> None:
    """Refuse ``training.loss_chunk_tokens`` on layouts where another part owns the
    output projection (``dims``: the resolved ``ParallelDims``)."""
    if chunk_tokens and (dims.tp > 1 or dims.pp > 1 or data_parallel_kind(dims) in ("fsdp", "hsdp")):
        raise ConfigError(f"config key 'training.loss_chunk_tokens' = {chunk_tokens}: the chunked loss runs on "
                          "single-device and DDP runs only (tensor parallelism's loss-parallel path, the "
                          "pipeline's last stage and FSDP2 own the output projection); set it to 0, or use "
                          "tp = pp = 1 and parallel.dp_shard = 1")


def hidden_states(model: nn.Module, owner: nn.Module, tokens: torch.Tensor, **kwargs):
    """``model(tokens, **kwargs)`` without its output projection: (B, T, dim) (and, with
    ``mtp=True``, the MTP depths' normed hidden states). ``owner`` is the module holding
    ``output`` (``model`` itself, or what a DDP wrapper wraps)."""
    head = owner.output
    owner.output = None
    try:
        return model(tokens, **kwargs)
    finally:
        owner.output = head


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 loss as in ``cross_entropy_loss``, whatever dtype the projection computed in.
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """Mean token cross-entropy of ``head(hidden)`` (B, T, V) against targets (B, T), in
    fp32, with at most ``chunk_tokens`` tokens' logits alive at a time."""
    h = hidden.flatten(0, 1)  # (B*T, dim)
    t = targets.flatten(0, 1)
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    for hc, tc in zip(h.split(chunk_tokens), t.split(chunk_tokens)):
        # Non-reentrant checkpoint keeps the autocast state for the recompute, and passes
        # the head's parameters' gradients through like an ordinary call.
        total = total + checkpoint(_chunk_loss, head, hc, tc, use_reentrant=False)
    return total / (t != IGNORE_INDEX).sum().clamp(min=1)
