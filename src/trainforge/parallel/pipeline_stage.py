"""The pipeline stage ``build_pipeline`` (pipeline.py) runs: torch's ``PipelineStage`` with
its compute calls timed, the last stage's call arguments, and buffer-safe shape inference.

Its own module because ``torch.distributed.pipelining`` imports ``torch._dynamo`` (about a
second per process): only a run with a pipeline imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

if TYPE_CHECKING:
    from trainforge.parallel.pipeline import _Timer


class TimedStage(PipelineStage):
    """A PipelineStage whose compute calls are timed under its stage index.

    ``call_kwargs``: keyword arguments of every call of the stage's module (the model's stage
    plan gives the last stage's: ``model/pipeline_plans.py``); torch 2.13 calls it in
    ``forward_maybe_with_nosync`` and, for shape inference, ``_compute_outputs``.
    ``probe_loss``: the loss the one-off shape inference runs on the last stage's
    placeholder outputs instead of the schedule's (which may record metrics)."""

    def __init__(self, *args, timer: _Timer, call_kwargs: dict | None = None,
                 probe_loss: Callable | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer = timer
        self.call_kwargs = dict(call_kwargs or {})
        self._probe_loss = probe_loss

    def forward_maybe_with_nosync(self, *args, **kwargs):
        return super().forward_maybe_with_nosync(*args, **self.call_kwargs, **kwargs)

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        return super()._compute_outputs(*args, module=module, **self.call_kwargs, **kwargs)

    def _backward_metadata_inference(self, *args, loss_fn: Callable | None = None, **kwargs):
        """Shape inference of the gradients: only their shapes are learnt, so a loss
        without side effects (``probe_loss``) serves as well as the real one."""
        if loss_fn is not None and self._probe_loss is not None:
            loss_fn = self._probe_loss
        return super()._backward_metadata_inference(*args, loss_fn=loss_fn, **kwargs)

    def forward_one_chunk(self, *args, **kwargs):
        return self._timer.run(self.stage_index, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timer.run(self.stage_index, super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timer.run(self.stage_index, super().backward_weight_one_chunk, *args, **kwargs)

    def _forward_metadata_inference(self, *args, **kwargs):
        """torch runs the stage's forward once more on the first step, on placeholder
        tensors, to learn its output shapes; what that forward writes into buffers (an expert
        router's token counts) is put back, so the step counts only its real micro-batches."""
        saved = [(b, b.detach().clone()) for b in self.submod.buffers()]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, value in saved:
                    if not torch.equal(b, value):  # untouched ones keep their version: backward may need them
                        b.copy_(value)
