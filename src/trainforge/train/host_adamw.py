"""The host update of optimizer offload: one AdamW step on flat fp32 host buffers.

``HostAdamW`` is the interface (a plain function over one bucket's buffers), so a faster
CPU kernel plugs in without touching the offload machinery. ``torch_host_adamw`` is the
default: torch's own AdamW functional, fused or foreach as the device optimizer would have
run it, so the host update is the same arithmetic as AdamW on the device (AdamW is
elementwise: one call on a bucket's flat buffer gives the bits of per-parameter calls).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.optim.adam import adam


class HostAdamW(Protocol):
    """Update ``params`` (fp32, flat, host) in place from ``grads``, ``exp_avg`` and
    ``exp_avg_sq`` (same shape; the moments are updated in place). ``step`` is the step
    number after this update (1 on the first); ``lr`` and ``weight_decay`` are read from
    the param group at every step (schedules change them); decoupled weight decay."""

    def __call__(self, params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None: ...


def torch_host_adamw(implementation: str = "fused") -> HostAdamW:
    """torch's AdamW as a ``HostAdamW``: ``implementation`` fused (torch's fused CPU kernel)
    or foreach (the multi-tensor path torch picks for DTensors)."""
    fused = implementation == "fused"

    def update(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        # torch's AdamW increments the step tensor before the kernel reads it.
        step_t = torch.tensor(float(step - 1), dtype=torch.float32, device=params.device)
        adam([params], [grads], [exp_avg], [exp_avg_sq], [], [step_t], foreach=not fused, fused=fused,
             decoupled_weight_decay=True, amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
             weight_decay=weight_decay, eps=eps, maximize=False)

    return update
