"""Auxiliary-loss-free load balancing of a mixture-of-experts model, and its routing
metrics, as one of the loop's components (DeepSeek-V3 §2.1.2; Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts").

Per training step:

- ``on_step_start``: zero every router's ``load`` (a step the bad-step guard rejects
  leaves its count behind, and it must not reach the next step) and set
  ``Router.aux_grad_scale`` = fp16 loss scale / ``training.grad_accum_steps``: the main
  loss is divided by the micro-batches and scaled before backward, and the auxiliary
  losses (``model/moe.py`` adds their gradient inside backward) must match it. A pipeline
  divides each of its microbatches' losses by their count (``StepLayout.loss_splits``),
  and the auxiliary losses of each microbatch by the same.
- ``after_optimizer_step``: the loads of all MoE layers as one (n_moe_layers, E) tensor
  (zeros for layers another pipeline stage holds), ONE all-reduce SUM over the default
  group (tensor parallelism is refused with MoE, so each data-parallel rank counts its
  tokens once; with pipelining each layer lives on one stage), then per layer
  ``expert_bias += gamma * sign(mean load - load)`` with gamma = ``model.bias_update_rate``
  (0: counted and reported, never moved). The update uses the step's forward only, so an
  fp16 step whose update the loss scaler skipped still moves the bias (as Megatron does).
  MaxVio_batch = (max load - mean load) / mean load stays on the device until ``on_log``.
- ``on_evaluation``: ``eval_load`` over the fixed validation set, all-reduced, gives
  MaxVio_global per layer.

The bias is a persistent buffer of the model, so it is in every checkpoint with the
weights. With fp32 master weights (parameters stored low) the optimizer's mirror holds
its own copy, which is what checkpoints save: the update writes both, and ``on_load``
copies the mirror's back into the model. The metric sums are empty at every checkpoint
(a save ends a logging window), so this component has no checkpoint state.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from trainforge.model.moe import Router, routers
from trainforge.train.component import Component, Window

_LAYER = re.compile(r"(?:^|\.)(layers|mtp)\.(\d+)\.")


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """(max load - mean load) / mean load per row of ``load`` (L, E); 0 for a row without tokens."""
    mean = load.mean(-1)
    return (load.amax(-1) - mean) / mean.clamp_min(1e-12)


class MoEBalance(Component):
    """``model_config``: the resolved ``ModelConfig`` (a MoE one); ``grad_accum_steps``:
    ``training.grad_accum_steps``. Adds ``moe_maxvio_batch`` (+ ``_layers``), ``moe_load``,
    ``moe_bias_spread`` (and ``moe_aux_loss`` when an auxiliary loss is on) to training
    records and ``moe_maxvio_global`` (+ ``_layers``) to validation records."""

    name = "moe_balance"

    def __init__(self, model_config: Any, grad_accum_steps: int):
        self.gamma = float(model_config.bias_update_rate)
        self.micro_batches = grad_accum_steps
        # MTP depth k's block (model/mtp.py) is layer n_layers + k - 1: the last MoE layers.
        n = model_config.n_layers + model_config.mtp_depth
        self.moe_layers = [i for i in range(n) if model_config.is_moe_layer(i)]
        self.n_main_layers = model_config.n_layers
        self.n_experts = model_config.n_routed_experts
        self.has_aux = bool(model_config.aux_loss_alpha or model_config.seq_aux_loss_alpha)
        self._held: list[tuple[int, Router, Router | None]] | None = None  # (MoE layer #, router, master's)
        self._device: torch.device | None = None
        self._aux_scale: torch.Tensor | None = None  # fp16: loss scale / micro-batches
        self._reset_window()

    # -- routers ------------------------------------------------------------------------

    def _bind(self, loop: Any) -> list[tuple[int, Router, Router | None]]:
        """This rank's routers (every pipeline stage it holds), once."""
        if self._held is None:
            held = []
            for part, opt_part in zip(loop.model_parts, loop.opt_parts):
                mirror = dict(routers(opt_part)) if opt_part is not part else {}
                for fqn, router in routers(part):
                    m = _LAYER.search(fqn)
                    layer = None if m is None else int(m.group(2)) + (self.n_main_layers if m.group(1) == "mtp" else 0)
                    if layer not in self.moe_layers:
                        raise RuntimeError(f"router {fqn} is not in a MoE layer of the model config")
                    held.append((self.moe_layers.index(layer), router, mirror.get(fqn)))
            self._held = held
            self._device = loop.device
        return self._held

    def _reset_window(self) -> None:
        self._steps = 0
        self._maxvio_sum: torch.Tensor | None = None  # (L,) sum over the window's applied steps
        self._load_sum: torch.Tensor | None = None    # (L, E)
        self._aux_window: torch.Tensor | None = None  # (L,)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return t

    # -- events -------------------------------------------------------------------------

    def on_step_start(self, loop: Any) -> None:
        held = self._bind(loop)
        splits = self.micro_batches * loop.layout.loss_splits
        scale: float | torch.Tensor = 1.0 / splits
        scaler = loop.mp.scaler
        if self.has_aux and scaler.enabled:
            scaler.ensure_scale(loop.device)  # GradScaler makes its scale on the first scale()
            if self._aux_scale is None:
                self._aux_scale = torch.empty((), device=scaler.scale_tensor().device)
            # One tensor updated in place (no host sync; a compiled block sees the same object).
            scale = self._aux_scale.copy_(scaler.scale_tensor() / splits)
        for _, router, _ in held:
            router.load.zero_()
            router.aux_loss_sum.zero_()
            router.aux_grad_scale = scale

    @torch.no_grad()
    def after_optimizer_step(self, loop: Any) -> None:
        held = self._bind(loop)
        L, E = len(self.moe_layers), self.n_experts
        # Columns: loads (E), this rank's mean auxiliary loss, 1 where this rank holds the layer.
        buf = torch.zeros(L, E + 2, device=self._device)
        for i, router, _ in held:
            buf[i, :E] = router.load
            buf[i, E] = router.aux_loss_sum[0] / router.aux_loss_sum[1].clamp_min(1)  # mean over forwards
            buf[i, E + 1] = 1.0
        self._all_reduce(buf)  # the one collective of the step
        load = buf[:, :E]  # (L, E) tokens per expert over the global batch
        if self.gamma:
            delta = self.gamma * torch.sign(load.mean(-1, keepdim=True) - load)
            for i, router, mirror in held:
                router.expert_bias.add_(delta[i].to(router.expert_bias.dtype))
                if mirror is not None:
                    mirror.expert_bias.copy_(router.expert_bias)
        maxvio = max_violation(load)
        aux = buf[:, E] / buf[:, E + 1].clamp_min(1)  # mean over the ranks holding each layer
        if self._steps == 0:
            self._maxvio_sum, self._load_sum, self._aux_window = maxvio, load.clone(), aux
        else:
            self._maxvio_sum += maxvio
            self._load_sum += load
            self._aux_window += aux
        self._steps += 1

    def on_log(self, loop: Any, window: Window) -> dict[str, Any]:
        held = self._bind(loop)
        # Bias spread per layer, from the stage holding it (a collective: every rank logs the window).
        spread = torch.zeros(len(self.moe_layers), 2, device=self._device)
        for i, router, _ in held:
            b = router.expert_bias
            spread[i, 0], spread[i, 1] = b.max() - b.min(), 1.0
        spread = self._all_reduce(spread)
        out: dict[str, Any] = {"moe_bias_spread": (spread[:, 0] / spread[:, 1].clamp_min(1)).tolist()}
        if self._steps:  # else every step of the window was rejected: nothing counted
            n = self._steps
            per_layer = (self._maxvio_sum / n).tolist()
            out["moe_maxvio_batch"] = sum(per_layer) / len(per_layer)
            out["moe_maxvio_batch_layers"] = per_layer
            out["moe_load"] = (self._load_sum / n).tolist()
            if self.has_aux:
                out["moe_aux_loss"] = float((self._aux_window / n).sum())
        self._reset_window()
        return out

    @torch.no_grad()
    def on_evaluation(self, loop: Any, step: int, val_loss: float) -> dict[str, Any]:
        held = self._bind(loop)
        load = torch.zeros(len(self.moe_layers), self.n_experts, device=self._device)
        for i, router, _ in held:
            load[i] = router.eval_load
            router.eval_load.zero_()
        self._all_reduce(load)  # every rank runs evaluation hooks
        if not bool((load.sum(-1) > 0).all()):
            return {}  # an empty validation set
        per_layer = max_violation(load).tolist()
        return {"moe_maxvio_global": sum(per_layer) / len(per_layer), "moe_maxvio_global_layers": per_layer}

    @torch.no_grad()
    def on_load(self, loop: Any) -> None:
        """Checkpoints hold the optimizer's mirror when there is one: its bias is the saved one."""
        for _, router, mirror in self._bind(loop):
            if mirror is not None:
                router.expert_bias.copy_(mirror.expert_bias)
