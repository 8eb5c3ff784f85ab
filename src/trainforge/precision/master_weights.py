"""fp32 master weights for a model whose parameters are stored in bf16/fp16.

Updating low-precision weights directly loses small updates (in bf16, 1 + 1e-3 == 1),
so the optimizer steps an fp32 mirror instead and the result is rounded into the
model after each step. The mirror is a full copy of the module, so the optimizer
builder, gradient clipping and checkpoints keep using fully-qualified names
unchanged: pass ``master.module`` wherever the trainer passes the model part.

Single-device and DDP only. Under FSDP2 the sharded fp32 parameters already are the
master weights (``policy.fsdp_mixed_precision``), so no mirror is made there.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class MasterWeights:
    """Made from the model *before* its parameters are cast down (``apply_precision``
    does this), so the master starts from the exact fp32 initial weights.

    Per optimizer step::

        loss.backward()                # grads land on the low-precision model
        master.grads_to_master()       # fp32 copies on master.module; model grads freed
        clip / scaler.unscale_ / optimizer.step() on master.module's parameters
        master.master_to_model()       # round the updated weights into the model
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32):
        self.module = copy.deepcopy(model)
        with torch.no_grad():
            for p in self.module.parameters():
                p.data = p.data.to(dtype)
        model_params = dict(model.named_parameters())
        # named_parameters drops tied duplicates on both sides alike, so names pair up.
        self.pairs = [(model_params[name], p) for name, p in self.module.named_parameters()]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Move gradients to the fp32 mirror (model grads set to None to free them)."""
        for p, m in self.pairs:
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.to(m.dtype)
            else:
                m.grad.copy_(p.grad)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the fp32 master weights into the model's parameters."""
        for p, m in self.pairs:
            p.copy_(m)

    def zero_grad(self) -> None:
        for _, m in self.pairs:
            m.grad = None
