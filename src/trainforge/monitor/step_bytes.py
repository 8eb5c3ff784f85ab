"""An estimate of the memory traffic of one training step, for the memory bandwidth the
monitor reports where no counter is readable (source ``step_bytes_estimate``).

The model counts each tensor the step must touch once per pass, at its stored size
(this rank's shard of a sharded tensor), per micro-batch:

- forward: read the weights; write the saved activations;
- backward: read the weights again (input gradients), read the saved activations, and
  write the weight gradients (read them too when accumulating over micro-batches);
- optimizer: read the parameters it steps, their gradients and its state (AdamW: two
  moments), write the parameters and the state (AdamW in fp32: 16 bytes read and 12
  written per parameter).

So it is a lower bound: it leaves out activations not saved for backward (the MLP's
intermediate, attention scores recomputed or not), re-reads of a matrix that does not
fit in cache, and communication buffers. Saved-activation bytes come from the trainer's
memory accounting (the ``mem_activations_*_bytes`` record keys, rank 0) when present,
else that term is left out. Hand-written: the bytes are a sum over the run's own
tensors, which no profiler API gives without instrumenting every kernel.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def stored_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' values on this rank (a DTensor: its local shard); 0-dim
    tensors (AdamW's step count) are left out."""
    total = 0
    for t in tensors:
        if t is None or t.dim() == 0:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def training_step_bytes(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                        micro_batches: int, activation_bytes: int = 0) -> int:
    """Bytes read plus written by one training step under the model above.
    ``micro_batches``: forward passes per model part per step (gradient accumulation);
    ``activation_bytes``: what one micro-batch saves for backward. Reads metadata only
    (no device sync)."""
    weights = stored_bytes(p for part in model_parts for p in part.parameters())
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    stepped = stored_bytes(opt_params)  # the fp32 master copy when there is one
    state = stored_bytes(v for opt in optimizers for st in opt.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor))
    mb = max(1, micro_batches)
    per_micro = 2 * weights + 2 * activation_bytes
    grads = weights * (2 * mb - 1)  # written once, then read and written per later micro-batch
    optimizer = 2 * stepped + stepped + 2 * state  # read p, g, state; write p, state
    return mb * per_micro + grads + optimizer
