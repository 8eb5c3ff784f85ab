"""The trainer's side of ``[precision]``: one object the loop calls at fixed points.

``trainforge.precision`` holds the techniques; this file is their order inside a step
(``Trainer.train_step``)::

    with mp.autocast(track):            forward + loss, in the policy's compute dtype
    mp.scaler.scale(loss).backward()    fp16: scaled loss (a no-op otherwise)
    mp.unscale_(optimizers)             grads -> fp32 master weights; true (unscaled) gradients
    clip(mp.opt_parts(model_parts))     global norm over the parameters the optimizers step
    mp.scaler.step(opt) per optimizer   skipped on an fp16 overflow
    mp.finish_step(loss, grad_norm)     scale update; master -> model; signals buffered (dynamic)

Every ``precision.dynamic_interval_steps`` steps ``observe`` reads the buffered signals
(one host sync), feeds the controller and applies its switches from the next step on.
Everything a resumed run needs (scaler, controller, the signals still buffered) is in
``state_dict``: plain Python values, loadable with ``torch.load(weights_only=True)``.

With the default ``fp32`` policy nothing is installed: no hooks, no autocast, a
disabled scaler whose calls pass straight through, so training is bit-identical to a
trainer without precision support.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from trainforge.errors import ConfigError
from trainforge.precision.casting import PrecisionRuntime
from trainforge.precision.dynamic import PrecisionController, StepSignals, Switch, build_controller
from trainforge.precision.hardware import DTYPE_NAMES
from trainforge.precision.loss_scale import LossScaler
from trainforge.precision.memory import MemoryReport, memory_report
from trainforge.precision.policy import DEFAULT_GROUP, FP32, PrecisionPolicy, fsdp_mixed_precision
from trainforge.train.component import Component


def check_precision_layout(policy: PrecisionPolicy, dims, kind: str) -> str | None:
    """Refuse combinations the techniques cannot serve, naming the key; returns a note
    (or None) for settings that a layout overrides. ``kind`` is ``data_parallel_kind``."""
    n = DTYPE_NAMES
    sharded = kind in ("fsdp", "hsdp")
    if policy.param_dtype != FP32 and not sharded and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(f"config key 'precision.param_dtype' = {n[policy.param_dtype]!r}: low-precision "
                          "parameter storage under tensor or pipeline parallelism needs FSDP2 (parallel.dp_shard "
                          "> 1), whose sharded fp32 parameters are the master weights; use param_dtype = auto")
    if policy.param_dtype != FP32 and not sharded and getattr(dims, "ep", 1) > 1:
        raise ConfigError(f"config key 'precision.param_dtype' = {n[policy.param_dtype]!r}: low-precision "
                          "parameter storage with expert parallelism (parallel.ep > 1) needs FSDP2 (parallel.dp_shard "
                          "> 1); use param_dtype = auto")
    if policy.param_dtype == torch.float16 and policy.optimizer_state_dtype == torch.float16 and not sharded:
        raise ConfigError("config key 'precision.optimizer_state_dtype' = 'fp16': fp16 parameters with an fp16 "
                          "optimizer cannot be loss-scaled (GradScaler does not unscale fp16 gradients); use "
                          "optimizer_state_dtype = fp32 (fp32 master weights)")
    if sharded and (policy.param_dtype != FP32 or policy.optimizer_state_dtype != FP32):
        return (f"FSDP2 keeps the sharded parameters and optimizer state in fp32 (the master weights) and "
                f"gathers them in {n[policy.compute_dtype]}; precision.param_dtype/optimizer_state_dtype "
                "apply to single-device and DDP runs")
    if kind == "ddp" and policy.param_dtype != policy.reduce_dtype:
        return (f"DDP reduces gradients in the parameter dtype ({n[policy.param_dtype]}), not "
                f"precision.reduce_dtype ({n[policy.reduce_dtype]})")
    return None


def compile_note(runtime: PrecisionRuntime) -> str | None:
    """What ``parallel.compile`` changes about the installed techniques (None: nothing).

    The saved-tensor hooks stay on under compile: a compiled block is one autograd
    function whose saved tensors still pass the pack hook, so low-precision activation
    storage applies to them. Weight recast does not: it recognises autocast's weight
    copies by their ``ToCopyBackward0`` node, which a compiled block does not have (its
    partitioner decides what backward keeps, here the bf16 copies)."""
    acts = runtime.activations
    if not acts.recast_weights:
        return None
    return ("parallel.compile: precision.recast_weights applies only to the weights used outside the compiled "
            "blocks (the output projection); inside them the compiler keeps its own low-precision weight copies "
            "for backward" + (f"; saved activations are still stored in {DTYPE_NAMES[acts.store_dtype]}"
                              if acts.store_dtype is not None else ""))


@dataclass
class _Pending:
    """One step's signals for the controller: device tensors until read, then floats
    (already reduced over data-parallel ranks)."""

    step: int
    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    overflow: torch.Tensor | float | None
    scale: torch.Tensor | float | None
    group_norms: dict[str, torch.Tensor | float] | None


class TrainerPrecision:
    """``runtime`` is ``apply_precision``'s result on the whole model (before parallelism);
    ``sharded``: FSDP2 follows. ``pp_group``: the pipeline group, so fp16 overflow checks
    agree across stages."""

    def __init__(self, section, policy: PrecisionPolicy, runtime: PrecisionRuntime, device: torch.device,
                 sharded: bool = False, log: logging.Logger | None = None, pp_group=None):
        self.section, self.policy, self.runtime, self.device = section, policy, runtime, device
        self.sharded = sharded
        self.master = runtime.master
        self.scaler = LossScaler.from_section(section, policy.loss_scaling, device.type, process_group=pp_group)
        self.controller: PrecisionController | None = build_controller(policy, section, log)
        self.interval_steps = section.dynamic_interval_steps
        self.pending: list[_Pending] = []
        self.memory: MemoryReport | None = None
        # FQN prefixes of the named dynamic groups: FQNs survive FSDP, TP and pipeline splits.
        self._group_prefixes = {g: tuple(f + "." for f in fqns) for g, fqns in runtime.group_modules.items() if fqns}

    @property
    def stage_activation_dtype(self) -> torch.dtype:
        """Dtype of the hidden states between pipeline stages: the residual stream follows
        the embedding's weights, so bf16/fp16 where FSDP2 gathers them low, else fp32."""
        if self.sharded and self.policy.low_precision:
            return fsdp_mixed_precision(self.policy).param_dtype or FP32
        return FP32  # unsharded pipelines keep fp32 weights (check_precision_layout)

    # -- per step --------------------------------------------------------------------

    def opt_parts(self, model_parts: list[nn.Module]) -> list[nn.Module]:
        """What optimizers, clipping and checkpoints see: the fp32 master copy when there
        is one (same FQNs), else the model parts themselves."""
        return [self.master.module] if self.master is not None else model_parts

    def autocast(self, track_activations: bool = False):
        return self.runtime.autocast(track_activations=track_activations)

    def unscale_(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """After backward, before clipping."""
        if self.master is not None:
            self.master.grads_to_master()
        self.scaler.ensure_scale(self.device)
        for opt in optimizers:
            self.scaler.unscale_(opt)

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss the pipeline schedule returned scaled (its loss function scales): exact,
        the scale is a power of two."""
        scale = self.scaler.scale_tensor()
        return loss if scale is None else loss / scale.to(loss.device)

    def group_grad_norms(self, parts: list[nn.Module], norm_of: Callable[[list[torch.Tensor]], torch.Tensor]
                         ) -> dict[str, torch.Tensor] | None:
        """Per-group gradient norms for the controller (only with named dynamic groups)."""
        if self.controller is None or not self._group_prefixes:
            return None
        grads: dict[str, list[torch.Tensor]] = {g: [] for g in [DEFAULT_GROUP, *self._group_prefixes]}
        for part in parts:
            for fqn, p in part.named_parameters():
                if p.grad is not None:
                    group = next((g for g, pre in self._group_prefixes.items() if fqn.startswith(pre)), DEFAULT_GROUP)
                    grads[group].append(p.grad)
        return {g: norm_of(gs) for g, gs in grads.items()}

    def finish_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                    group_norms: dict[str, torch.Tensor] | None = None) -> None:
        """After every optimizer's ``scaler.step``: adjust the scale, round the master
        weights into the model, buffer the controller's signals (device tensors, no sync)."""
        overflow = self.scaler.update()
        if self.master is not None:
            self.master.master_to_model()
        if self.controller is not None:
            self.pending.append(_Pending(step, loss.detach(), grad_norm.detach(), overflow,
                                         self.scaler.scale_tensor(), group_norms))

    def record_memory(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                      with_activations: bool) -> None:
        """Bytes per dtype now (gradients still held), for the next metrics record."""
        acts = dict(self.runtime.activations.bytes_by_dtype) if with_activations else None
        masters = [self.master.module] if self.master is not None else []
        self.memory = memory_report(model_parts, optimizers, self.device, activations=acts, master_modules=masters)

    # -- dynamic switching (one host sync per interval) ----------------------------------------

    def resolve_pending(self, mean_over_dp: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read the buffered device values as floats. Collective when distributed (the
        data-parallel mean loss): every rank calls it at the same step."""
        fresh = [p for p in self.pending if isinstance(p.loss, torch.Tensor)]
        if not fresh:
            return
        losses = mean_over_dp(torch.stack([p.loss.reshape(()).float() for p in fresh])).tolist()
        # Everything else is already global (the norm over all shards, the reduced inf check):
        # one stacked read for all buffered steps.
        tensors = [v.reshape(()).float().to(self.device) for p in fresh
                   for v in (p.grad_norm, p.overflow, p.scale, *(p.group_norms or {}).values())
                   if isinstance(v, torch.Tensor)]
        floats = iter(torch.stack(tensors).tolist() if tensors else [])

        def read(v):
            return next(floats) if isinstance(v, torch.Tensor) else v

        for p, loss in zip(fresh, losses):  # the same order as ``tensors`` was built in
            p.loss, p.grad_norm, p.overflow, p.scale = loss, read(p.grad_norm), read(p.overflow), read(p.scale)
            if p.group_norms is not None:
                p.group_norms = {g: read(v) for g, v in p.group_norms.items()}

    def observe(self, mean_over_dp: Callable[[torch.Tensor], torch.Tensor]) -> list[Switch]:
        """Feed every buffered step to the controller and apply its switches (they take
        effect from the next step). Returns them; the controller logs each with its reason."""
        if self.controller is None:
            return []
        self.resolve_pending(mean_over_dp)
        switches: list[Switch] = []
        for p in self.pending:
            switches += self.controller.observe(p.step, StepSignals(
                loss=p.loss, grad_norm=p.grad_norm, overflow=bool(p.overflow), loss_scale=p.scale,
                group_grad_norms=p.group_norms))
        self.pending.clear()
        for sw in switches:
            self.runtime.set_compute_dtype(sw.group, sw.new)
        return switches

    # -- reading and checkpointing ------------------------------------------------------

    def window_metrics(self) -> dict[str, Any]:
        """For the metrics record at the logging interval (host syncs: the scale, skipped steps)."""
        out: dict[str, Any] = {"precision": {g: DTYPE_NAMES[d] for g, d in self.runtime.compute_dtypes.items()}}
        if self.scaler.enabled:
            out["loss_scale"] = self.scaler.get_scale()
            out["skipped_steps"] = self.scaler.skipped_steps()
        if self.memory is not None:
            out.update(self.memory.as_metrics())
            self.memory = None
        return out

    def state_dict(self) -> dict[str, Any] | None:
        """None when there is nothing to keep (no loss scaling, no controller): the
        checkpoints of fp32 runs are unchanged. Call ``resolve_pending`` first (on every rank)."""
        if not self.scaler.enabled and self.controller is None:
            return None
        pending = [{"step": p.step, "loss": p.loss, "grad_norm": p.grad_norm, "overflow": p.overflow,
                    "scale": p.scale, "group_norms": p.group_norms} for p in self.pending]
        assert all(not isinstance(v, torch.Tensor) for p in pending for v in p.values()), "resolve_pending first"
        return {"scaler": self.scaler.state_dict() if self.scaler.enabled else None,
                "controller": self.controller.state_dict() if self.controller is not None else None,
                "pending": pending}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint without precision state (an fp32 run) leaves everything initial."""
        if not state:
            return
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.controller is not None and state.get("controller"):
            self.controller.load_state_dict(state["controller"])
            for group, level in self.controller.current.items():
                self.runtime.set_compute_dtype(group, level)
            self.pending = [_Pending(**p) for p in state.get("pending", [])]


class PrecisionComponent(Component):
    """The loop's component for what ``TrainerPrecision`` keeps across steps: the loss
    scale and the dynamic controller. Checkpointed under ``precision`` (nothing for fp32
    runs); every ``precision.dynamic_interval_steps`` steps, after the records of the
    steps it read, the controller sees the buffered steps (one host sync) and each
    switch becomes a metrics record with its reason."""

    name = "precision"

    def __init__(self, mp: TrainerPrecision):
        self.mp = mp
        if mp.controller is None:  # nothing to observe: keep the hook off the loop
            self.after_step = None  # type: ignore[assignment]

    def on_log(self, loop: Any, window: Any) -> dict[str, Any]:
        return self.mp.window_metrics()  # precision per group, loss scale, memory per dtype

    def after_step(self, loop: Any, step: int) -> None:
        if step % self.mp.interval_steps == 0:
            for sw in self.mp.observe(loop.layout.mean_over_dp):
                loop.metrics.write({"step": step, "precision_switch": f"{sw.group} {sw.old} -> {sw.new}",
                                    "group": sw.group, "from": sw.old, "to": sw.new, "reason": sw.reason,
                                    "decided_at_step": sw.step})

    def on_checkpoint(self, loop: Any) -> None:
        self.mp.resolve_pending(loop.layout.mean_over_dp)  # collective: every rank, before rank 0 writes

    def state_dict(self) -> dict[str, Any]:
        return self.mp.state_dict() or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mp.load_state_dict(state)
