"""Wiring optimizer offload (``[offload] optimizer = true``, ``mode = trainforge``) into a run:
each AdamW becomes an ``OffloadAdamW`` (``offload_optimizer.py``) fed gradients as the
backward produces them, and ``OffloadComponent`` hands it the step's gradient norm (for the
clip factor) and lands a delayed update before a checkpoint is written.

Gradient sources, per layout: a single model's parameters deliver through
post-accumulate-grad hooks; DDP delivers each bucket after its all-reduce, from a
communication hook (the all-reduce, then a copy: no second collective in the callback);
FSDP2 shards and fp32 master copies are read by the update tasks after the backward.
``offload.mode = fsdp`` is FSDP2's ``CPUOffloadPolicy``, applied in ``parallel/data_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainforge.train.component import Component
from trainforge.train.offload_optimizer import OffloadAdamW


def optimizer_device(section: Any, device: torch.device) -> torch.device:
    """Where the optimizer's update runs, for picking its kernel: the host under FSDP2's
    CPUOffloadPolicy (the sharded parameters live there), else ``device``."""
    return torch.device("cpu") if section.optimizer and section.mode == "fsdp" else device


def offload_optimizers(optimizers: list[torch.optim.Optimizer], section: Any, model: torch.nn.Module,
                       layout: Any, micro_batches: int) -> list[torch.optim.Optimizer]:
    """``optimizers`` unchanged unless ``section`` (``[offload]``) turns trainforge's offload on;
    then their ``OffloadAdamW`` replacements, wired to ``model`` (the module the step calls:
    a DDP wrapper gets a communication hook) and ``layout`` (a gradient finisher)."""
    if not section.optimizer or section.mode != "trainforge":
        return optimizers
    out = [OffloadAdamW.from_optimizer(o, delay=section.delay, fraction=section.fraction,
                                       bucket_mb=section.bucket_mb, threads=section.threads,
                                       micro_batches=micro_batches) for o in optimizers]
    for opt in out:
        layout.grad_finishers.append(opt.finish_backward)
    if isinstance(model, DistributedDataParallel):
        (opt,) = out  # DDP runs without pipeline parts: one optimizer
        model.register_comm_hook(model.process_group, _ddp_hook(opt))
    else:
        for opt in out:
            for p in opt.offloaded_params():
                if not isinstance(p, DTensor):  # FSDP2 assigns sharded gradients: no hook fires
                    p.register_post_accumulate_grad_hook(opt.on_param_grad)
    return out


def _ddp_hook(opt: OffloadAdamW):
    # DDP checks a hook's annotations against the real types, which `from __future__ import
    # annotations` turns into strings: the hook is left unannotated.
    def hook(group, bucket):
        params = bucket.parameters()

        def copy(fut):
            flat = fut.value()
            opt.on_reduced_bucket(params, flat)
            return flat

        return allreduce_hook(group, bucket).then(copy)

    return hook


class OffloadComponent(Component):
    """Hands each offloaded optimizer the step's pre-clip gradient norm, and lands a
    delayed update before a checkpoint (weights and state then include every gradient)."""

    name = "offload"

    def __init__(self, grad_clip: float):
        self.grad_clip = grad_clip

    def before_optimizer_step(self, loop: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        for opt in loop.optimizers:
            if isinstance(opt, OffloadAdamW):
                opt.set_grad_norm(grad_norm, self.grad_clip)
        return True

    def on_checkpoint(self, loop: Any) -> None:
        for opt in loop.optimizers:
            if isinstance(opt, OffloadAdamW):
                opt.flush()
