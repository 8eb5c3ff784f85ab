"""The training loss of a model with multi-token prediction modules (``model.mtp_depth`` > 0;
model/mtp.py), and its metrics, as one of the loop's components (DeepSeek-V3 §2.2.2):

    loss = CE(main) + lambda x mean_k CE_k,   k = 1 .. mtp_depth

CE_k is depth k's mean cross-entropy against ``targets[:, k:]`` (at position t, token
t + k + 1). lambda is ``training.mtp_loss_weight`` (default 0.3), and
``training.mtp_loss_weight_final`` after step ``training.mtp_loss_weight_switch_step``
(DeepSeek-V3 trains with 0.3, then 0.1): a function of the step, so resume needs no state.

The model's forward defines the math (``model(tokens, mtp=True)``); this file only adds the
cross-entropies, through the chunked head when ``training.loss_chunk_tokens`` is set (then
no depth's whole logits exist either). Validation returns the MAIN loss alone, so
``val_loss`` compares with runs without MTP; the depths' losses over the validation set
are ``val_mtp_loss`` (+ ``val_mtp_loss_{k}``). Training records get ``mtp_loss`` (mean
over depths) and ``mtp_loss_{k}`` of each step, means over the data-parallel ranks like
``loss``, and ``mtp_loss_weight`` (lambda of the step).
The record's ``loss`` stays what was optimised (main + lambda x mtp_loss).

Layouts: the MTP modules are ordinary parameters of the model, so DDP and FSDP2 need
nothing more (FSDP2 gathers them with the root unit). Tensor parallelism splits them with
their own plan (``model/mtp_tp.py``, applied by ``parallel/tensor_parallel.py``), and the depths' logits
are vocab-sharded like the main ones, so ``cross_entropy_loss`` computes every depth's loss
loss-parallel, exactly. Under pipeline parallelism they live on the last stage with a copy
of the token embedding (parallel/pipeline.py), whose module returns (logits, h);
``stage_loss`` is the schedule's loss there: it runs the MTP chain on h with the input
tokens rebuilt from the targets, which that stage already has (each depth reads tokens
t + k, k >= 1, the targets t + k - 1). The two embedding copies' gradients are summed after
each backward (parallel/shared_embedding.py). Pipeline and tensor parallelism together are
refused (``check_mtp_layout``): each is tested with MTP alone, not the two combined.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainforge.errors import ConfigError
from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.train.chunked_loss import chunked_cross_entropy, hidden_states
from trainforge.train.component import Component, Window

DEFAULT_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
_KEYS = ("mtp_loss_weight", "mtp_loss_weight_final", "mtp_loss_weight_switch_step")


def check_mtp_layout(tcfg: Any, model_config: Any, dims: Any) -> None:
    """Refuse, naming the keys, MTP settings without MTP modules and MTP on the layout it
    does not run on, tensor and pipeline parallelism together (``tcfg``: ``[training]``;
    ``dims``: the resolved ``ParallelDims``). Each alone runs it: TP with the MTP modules'
    own plan, PP with the MTP modules on the last stage."""
    depth = model_config.mtp_depth
    if not depth:
        set_keys = [k for k in _KEYS if getattr(tcfg, k) not in (None, 0)]
        if set_keys:
            raise ConfigError(f"config key 'training.{set_keys[0]}' = {getattr(tcfg, set_keys[0])!r} weights the "
                              "multi-token prediction loss, but model.mtp_depth = 0 (no MTP modules); set "
                              "model.mtp_depth >= 1 or remove the training.mtp_loss_weight* keys")
        return
    if dims.tp > 1 and dims.pp > 1:
        raise ConfigError(f"config key 'model.mtp_depth' = {depth} with parallel.tp = {dims.tp} and parallel.pp = "
                          f"{dims.pp}: multi-token prediction runs under tensor or pipeline parallelism, not both "
                          "at once yet; set parallel.tp = 1 or parallel.pp = 1 (or model.mtp_depth = 0)")
    # Alone, each needs nothing here: the MTP modules have a TP plan (model/mtp_tp.py),
    # and live on the last pipeline stage (pipeline.py). MoE blocks, a MoE config's
    # MTP block included, are refused under TP for every model by ParallelDims.check_model.
    if tcfg.seq_len <= depth:
        raise ConfigError(f"config key 'training.seq_len' = {tcfg.seq_len}: MTP depth k trains on seq_len - k "
                          f"positions, so seq_len must exceed model.mtp_depth = {depth}")


def mtp_weight_at(step: int, weight: float, final: float | None, switch_step: int) -> float:
    """lambda for optimizer step ``step`` (1-based): ``weight`` up to ``switch_step``, then
    ``final`` (``switch_step`` 0: never switch)."""
    return final if switch_step and final is not None and step > switch_step else weight


def _cross_entropies(logits: torch.Tensor, depth_logits: list[torch.Tensor], targets: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(main mean cross-entropy, (D,) per-depth ones): logits (B, T, V), depth k's (B, T-k, V)."""
    main = cross_entropy_loss(logits, targets)
    per_depth = [cross_entropy_loss(lg, targets[:, k:]) for k, lg in enumerate(depth_logits, 1)]
    return main, torch.stack(per_depth)


def tokens_from_targets(targets: torch.Tensor) -> torch.Tensor:
    """The model's input tokens (B, T) as far as the MTP chain reads them, from the
    next-token targets (B, T): depth k reads tokens[:, k:] (k >= 1), and tokens[:, j] =
    targets[:, j - 1] for j >= 1. Column 0, which no depth reads, repeats targets[:, 0]."""
    return torch.cat((targets[:, :1], targets[:, :-1]), dim=1)


class MTPLoss(Component):
    """The loss function of ``LocalStep`` for an MTP model (``__call__``), or of the
    pipeline's last stage (``stage_loss``), and its metrics. ``depth``:
    ``model.mtp_depth``; ``tcfg``: ``[training]``."""

    name = "mtp_loss"

    def __init__(self, depth: int, tcfg: Any):
        self.depth = depth
        self.weight = DEFAULT_WEIGHT if tcfg.mtp_loss_weight is None else float(tcfg.mtp_loss_weight)
        self.final = tcfg.mtp_loss_weight_final
        self.switch_step = tcfg.mtp_loss_weight_switch_step
        self.chunk_tokens = tcfg.loss_chunk_tokens
        self.micro_batches = tcfg.grad_accum_steps
        self.current_weight = self.weight
        # Per step of the logging window: lambda and the (D,) losses (mean over micro-batches, on the device).
        self._weights: list[float] = []
        self._step_losses: list[torch.Tensor | None] = []
        self._eval_sum: torch.Tensor | None = None  # (D,) sum over validation batches
        self._eval_batches = 0
        self._pipelined = False  # bind_stage: ranks without the last stage report zeros (summed over pp)
        self._stage: nn.Module | None = None
        self._pp_microbatches = 1

    def losses(self, model: nn.Module, owner: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(main mean cross-entropy, (D,) per-depth mean cross-entropies), fp32, attached.
        ``model``: what to call (maybe a DDP wrapper); ``owner``: the module holding ``output``."""
        if self.chunk_tokens:
            head = owner.output
            main_h, depth_h = hidden_states(model, owner, inputs, mtp=True)
            main = chunked_cross_entropy(main_h, head, targets, self.chunk_tokens)
            per_depth = [chunked_cross_entropy(h, head, targets[:, k:], self.chunk_tokens)
                         for k, h in enumerate(depth_h, 1)]
            return main, torch.stack(per_depth)
        logits, depth_logits = model(inputs, mtp=True)  # (B, T, V), [(B, T-k, V)]
        return _cross_entropies(logits, depth_logits, targets)

    def __call__(self, model: nn.Module, owner: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                 ) -> torch.Tensor:
        """Training (``owner.training``): main + lambda x mean over depths. Evaluation: the
        main loss alone; the depths' losses are kept for ``val_mtp_loss``."""
        main, per_depth = self.losses(model, owner, inputs, targets)
        return self._combine(main, per_depth, owner.training, self.micro_batches)

    def bind_stage(self, stage: nn.Module | None, pp_microbatches: int) -> None:
        """A pipelined run (every rank): ``stage``, the last stage's module where this rank
        holds it (else None); ``pp_microbatches``: ``parallel.microbatches``."""
        self._pipelined, self._stage, self._pp_microbatches = True, stage, pp_microbatches

    def stage_loss(self, output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """``__call__`` on the pipeline's last stage (``bind_stage``), per microbatch: output
        (logits (B, T, V), h (B, T, dim) before the final norm), targets (B, T). The MTP
        chain runs on the stage's own modules, with the input tokens rebuilt from the targets
        (``tokens_from_targets``: exact wherever the chain reads)."""
        stage = self._stage
        assert stage is not None, "stage_loss runs only where bind_stage gave the last stage"
        logits, h = output
        depth_h = stage.mtp_hidden(h, tokens_from_targets(targets))  # [(B, T-k, dim)]
        main, per_depth = _cross_entropies(logits, [stage.head(hk, k) for k, hk in enumerate(depth_h, 1)], targets)
        return self._combine(main, per_depth, stage.training, self.micro_batches * self._pp_microbatches)

    def _combine(self, main: torch.Tensor, per_depth: torch.Tensor, training: bool, shares: int) -> torch.Tensor:
        """The loss to optimise (training) or the main loss (evaluation), recording the
        depths' losses; ``shares``: the calls a training step's mean is made of."""
        if not training:
            d = per_depth.detach()
            self._eval_sum = d if self._eval_sum is None else self._eval_sum + d
            self._eval_batches += 1
            return main
        if not self._step_losses:  # train_step without the loop's on_step_start (a direct call)
            self.on_step_start(None)
        d = per_depth.detach() / shares  # the step's mean over micro-batches
        last = self._step_losses[-1]
        self._step_losses[-1] = d if last is None else last + d
        return main + self.current_weight * per_depth.mean()

    # -- events -------------------------------------------------------------------------

    def on_step_start(self, loop: Any) -> None:
        step = loop.step + 1 if loop is not None else len(self._weights) + 1
        self.current_weight = mtp_weight_at(step, self.weight, self.final, self.switch_step)
        self._weights.append(self.current_weight)
        self._step_losses.append(None)

    def on_log(self, loop: Any, window: Window) -> None:
        """Per step of the window: ``mtp_loss``, ``mtp_loss_{k}`` (mean over data-parallel
        ranks) and ``mtp_loss_weight``; one all-reduce for the window."""
        n = len(window.steps)
        steps, weights = self._step_losses[-n:], self._weights[-n:]
        self._step_losses, self._weights = [], []
        if len(steps) < n or (any(s is None for s in steps) and not self._pipelined):
            return  # steps taken without this loss (cannot happen in the loop): nothing to report
        # A pipeline rank without the last stage computed no MTP loss: zeros, summed over pp below.
        steps = [torch.zeros(self.depth, device=loop.layout.device) if s is None else s for s in steps]
        per_depth = loop.layout.mean_over_dp(torch.stack(steps)).tolist()  # (S, D)
        window.per_step["mtp_loss"] = [sum(row) / len(row) for row in per_depth]
        window.per_step["mtp_loss_weight"] = weights
        for k in range(self.depth):
            window.per_step[f"mtp_loss_{k + 1}"] = [row[k] for row in per_depth]

    def on_evaluation(self, loop: Any, step: int, val_loss: float) -> dict[str, Any]:
        if self._eval_sum is None and not self._pipelined:
            return {}
        if self._eval_sum is None:  # a pipeline rank without the last stage: zeros, summed over pp
            mean = torch.zeros(self.depth, dtype=torch.float64, device=loop.layout.device)
        else:
            mean = self._eval_sum.double() / self._eval_batches
        per_depth = loop.layout.mean_over_dp(mean).tolist()
        self._eval_sum, self._eval_batches = None, 0
        out: dict[str, Any] = {"val_mtp_loss": sum(per_depth) / len(per_depth)}
        out.update({f"val_mtp_loss_{k}": v for k, v in enumerate(per_depth, 1)})
        return out
