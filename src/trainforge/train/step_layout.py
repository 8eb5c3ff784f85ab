"""What one step does differently per parallel layout, so the loop does not branch on it.

``StepLayout`` holds the reductions every layout needs (the global gradient norm over
all shards and pipeline stages, the mean over data-parallel ranks) and two step
mechanics: ``LocalStep`` runs forward and backward per micro-batch on one model (DDP,
FSDP2, TP wrap it from outside), ``PipelineStep`` hands the micro-batches to the
pipeline schedule and validates through the stages. Both return the step's mean loss
as a device tensor: no host sync here. ``grad_finishers`` run once after each step's
backward, before clipping (expert parallelism reduces the expert gradients there).

Gradients may be DTensors on different meshes (FSDP2's dp mesh, expert parallelism's
(edp, ep) mesh): the norm is taken per mesh and combined, and clipping scales the
local shards (``scale_grads_to_norm_``). A parameter held twice (the token embedding on the
first and the last pipeline stage of an MTP model, whose gradients a finisher makes
equal) is in ``counted_elsewhere`` once: norms leave that copy out, clipping scales both.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainforge.parallel.tensor_parallel import cross_entropy_loss, loss_context

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StepLayout:
    """``dims``/``mesh``: the parallel layout; ``mp``: the step's precision
    (``TrainerPrecision``); ``loss_parallel``: TP vocab-sharded logits need ``loss_context``."""

    tracks_activations = True  # saved activations can be counted on one forward (not through a schedule)
    loss_splits = 1  # pieces each micro-batch's mean loss is divided into before backward (pipeline microbatches)

    def __init__(self, dims: Any, mesh: Any, device: torch.device, mp: Any, loss_parallel: bool):
        self.dims, self.mesh, self.device, self.mp = dims, mesh, device, mp
        self._loss_parallel = dims.tp > 1 and loss_parallel
        self._pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
        self.grad_finishers: list[Callable[[], None]] = []
        self.counted_elsewhere: list[torch.nn.Parameter] = []  # copies left out of gradient norms

    def finish_grads(self) -> None:
        for finish in self.grad_finishers:
            finish()

    def next_batch(self, batches: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) micro-batch, on the device (non-blocking from pinned memory)."""
        inputs, targets = batches.next()
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def loss_ctx(self):
        return loss_context(self._loss_parallel)

    def global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of ``grads`` over every rank's shards and pipeline stages (collective);
        the gradients of ``counted_elsewhere`` are left out."""
        skip = {id(p.grad) for p in self.counted_elsewhere if p.grad is not None}
        groups = by_mesh([g for g in grads if id(g) not in skip])
        norms = []
        for group in groups:
            norm = torch.nn.utils.get_total_norm(group, foreach=True)
            if isinstance(norm, DTensor):  # sharded grads: per-shard partial norms -> the full norm
                norm = norm.full_tensor()
            norms.append(norm)
        norm = norms[0] if len(norms) == 1 else torch.stack(norms).pow(2).sum().sqrt()
        if self._pp_group is not None:  # each pipeline rank holds different layers: combine squared norms
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self._pp_group)
            norm = sq.sqrt()
        return norm

    def clip(self, parts: list[torch.nn.Module], max_norm: float) -> torch.Tensor:
        """Global gradient norm of ``parts`` (the modules the optimizers step), then clip
        (0 = measure only). Returns the pre-clip norm."""
        params = [p for part in parts for p in part.parameters()]
        norm = self.global_norm([p.grad for p in params if p.grad is not None])
        if max_norm > 0:
            scale_grads_to_norm_(params, max_norm, norm)
        return norm

    def mean_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Average per-rank values over the data-parallel ranks (after summing over pipeline
        stages, where only the last holds a loss). Logging and validation only."""
        if self.mesh is None or (self.dims.dp == 1 and self.dims.pp == 1):
            return values
        values = values.clone()
        if self._pp_group is not None:  # the loss lives on the last stage; others hold zeros
            dist.all_reduce(values, group=self._pp_group)
        dist.all_reduce(values, group=self.mesh.dp.get_group())  # gloo has no AVG
        return values / self.dims.dp

    def forward_backward(self, batches: Any, micro_batches: int, track_activations: bool) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, val_set: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's mean validation loss (0-d device tensor; reduce with ``mean_over_dp``)."""
        raise NotImplementedError

    def window_stats(self) -> dict[str, Any]:
        return {}


@torch.no_grad()
def scale_grads_to_norm_(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)``: every gradient times
    min(max_norm / (norm + 1e-6), 1), in place, with no host sync; ``norm`` is a plain tensor.
    A DTensor gradient is scaled through its local shard: a product with one replicated scalar
    is the same on every placement (Shard, Replicate, Partial), so these are the same bits
    (the same kernel on the same local data). Through DTensor, the first ``_foreach_mul_`` of
    each list of gradients is resolved by enumerating sharding strategies over the whole list
    and mesh, which on FSDP2's 2-D (dp_replicate, dp_shard) mesh took 48 s of an HSDP x 2-D TP
    run's first step (8 ranks on 2 cores; torch 2.13)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for p in params if (g := p.grad) is not None]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in local:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device))


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by DTensor mesh (plain tensors together), in first-seen order;
    ``[[]]`` for none, so a norm of nothing is still computed (and is 0). Meshes are compared
    by value: FSDP2 over tensor-parallel DTensors gives every parameter its own, equal,
    (dp, tp...) mesh object; grouped by identity, each parameter was a group (a norm
    reduction each, and an optimizer param group each, whose empty first no-decay group
    failed DCP's optimizer load on resume)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values()) or [[]]


class LocalStep(StepLayout):
    """One model on this rank (wrapped for DDP/FSDP2/TP or not). ``loss_fn(inputs,
    targets)`` is the mean cross-entropy of ``model`` (the trainer's ``_loss``)."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, **kw):
        super().__init__(**kw)
        self.model, self.loss_fn = model, loss_fn

    def forward_backward(self, batches: Any, micro_batches: int, track_activations: bool) -> torch.Tensor:
        mp = self.mp
        total = torch.zeros((), device=self.device)
        for micro in range(micro_batches):
            inputs, targets = self.next_batch(batches)
            with self.loss_ctx():
                with mp.autocast(track_activations=track_activations and micro == 0):
                    loss = self.loss_fn(inputs, targets) / micro_batches
                mp.scaler.scale(loss).backward()
            total += loss.detach()
        self.finish_grads()
        return total

    def evaluate(self, val_set: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self.model.eval()
        with self.loss_ctx(), self.mp.autocast():
            losses = [self.loss_fn(x.to(self.device), y.to(self.device)) for x, y in val_set]
        self.model.train()
        return torch.stack(losses).mean()


def pipeline_loss(mp: Any, micro_batches: int, base: Callable[[Any, torch.Tensor], torch.Tensor] = cross_entropy_loss
                  ) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss the pipeline schedule runs backward on: each microbatch's mean (``base`` of
    the last stage's output and the targets), scaled so accumulated micro-batches sum to
    the mean, with fp16 loss scaling applied here."""
    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        return mp.scaler.scale(base(output, targets) / micro_batches)
    return loss


class PipelineStep(StepLayout):
    """This rank's pipeline stages (``model_parts``) driven by ``pipeline``'s schedule.
    ``act_shape``: (B, T, D) of the hidden states between stages, for validation;
    ``eval_loss``: the validation loss of the last stage's output (the main loss)."""

    tracks_activations = False  # a schedule's tracking would hold every microbatch's activations

    def __init__(self, pipeline: Any, model_parts: list[torch.nn.Module], act_shape: tuple[int, int, int],
                 eval_loss: Callable[[Any, torch.Tensor], torch.Tensor] = cross_entropy_loss, **kw):
        super().__init__(**kw)
        self.pipeline, self.model_parts, self.act_shape = pipeline, model_parts, act_shape
        self.eval_loss = eval_loss
        self.loss_splits = pipeline.microbatches  # build_pipeline divides each microbatch's loss by them

    def forward_backward(self, batches: Any, micro_batches: int, track_activations: bool) -> torch.Tensor:
        mp = self.mp
        total = torch.zeros((), device=self.device)
        for _ in range(micro_batches):
            inputs, targets = self.next_batch(batches)
            # The schedule runs forward and backward; the loss exists on the last stage only.
            with self.loss_ctx(), mp.autocast():
                loss = self.pipeline.step(inputs, targets)
            if loss is not None:
                total += mp.unscale_loss(loss)
        self.finish_grads()
        return total

    def evaluate(self, val_set: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward-only through the stages; zero except on the last stage (``mean_over_dp``
        sums over pp)."""
        from trainforge.parallel.pipeline import forward_only_loss

        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64)
        with self.loss_ctx(), self.mp.autocast():
            for x, y in val_set:
                loss = forward_only_loss(self.pipeline, x, y, self._pp_group, self.mesh.local_rank("pp"),
                                         self.dims.pp, self.act_shape, self.eval_loss,
                                         act_dtype=self.mp.stage_activation_dtype)
                if loss is not None:
                    total += loss.double().cpu()
        for part in self.model_parts:
            part.train()
        return total / len(val_set)

    def window_stats(self) -> dict[str, Any]:
        """Bubble fraction (mean over stages) and per-stage compute seconds, averaged over
        the dp x tp ranks holding each stage: identical on every rank (collectives)."""
        last = self.pipeline.last_step_stats()
        bubble = torch.tensor([last.bubble_fraction], dtype=torch.float64)
        dist.all_reduce(bubble, group=self._pp_group)
        n_stages = len(self.pipeline.stages) * self.dims.pp
        times = torch.zeros(n_stages, dtype=torch.float64)
        for sid, t in last.stage_compute_s.items():
            times[sid] = t
        dist.all_reduce(times)
        return {"bubble_fraction": bubble.item() / self.dims.pp,
                "stage_compute_s": (times / (self.dims.world_size // self.dims.pp)).tolist()}
