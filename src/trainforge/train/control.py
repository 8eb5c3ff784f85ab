"""Trainer-side glue of training control: what the loop needs to carry out the
bad-step policy, run evaluation callbacks with one decision for all ranks, and
checkpoint the controllers. The decisions themselves live in ``bad_steps.py``,
``early_stopping.py`` and ``adaptive_lr.py``.

Cost of the bad-step guard (only when ``[bad_steps] enabled``): every step, after the
gradient norm and before the optimizer, this rank's loss and the global gradient norm
go into one 2-value float64 tensor, are summed over all ranks (one all-reduce when
distributed) and read on the host (one ``.tolist()``). The update must be skipped or
applied before the next step starts, so this is the one host sync per step the
house rules otherwise forbid; on CPU it is free (ops are synchronous anyway), on
CUDA it stalls the launch queue once per step. A non-finite value on any rank makes
the sum non-finite on every rank, and an all-reduce returns the same bits to every
rank, so all ranks feed the policy identical values and take the same decision.
With the guard off the loop has neither the collective nor the read.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from trainforge.train.bad_steps import StepAction, StepDecision


def step_health(loss: torch.Tensor, grad_norm: torch.Tensor, world_size: int, dp: int, tp: int) -> tuple[float, float]:
    """(mean loss over data-parallel ranks, global grad norm) as host floats, bitwise
    identical on every rank; non-finite on every rank when non-finite on any.

    ``loss`` is this rank's mean loss (zero on pipeline stages other than the last);
    ``grad_norm`` the global pre-clip norm, the same on every rank. Tensor-parallel
    ranks hold the same loss, hence the division by ``dp x tp``. Collective when
    ``world_size > 1``; one host sync."""
    v = torch.stack([loss.detach().reshape(()).double(), grad_norm.detach().reshape(()).double()])
    if world_size == 1:
        loss_v, norm_v = v.tolist()
        return loss_v, norm_v
    dist.all_reduce(v)
    loss_v, norm_v = v.tolist()
    return loss_v / (dp * tp), norm_v / world_size


def step_batches(epoch: int, position: int, n: int, batches_per_epoch: int) -> list[tuple[int, int]]:
    """The (epoch, global batch) pairs the next ``n`` reads of a ``TokenBatches`` in state
    (epoch, position) return (it starts the next epoch once position reaches the end)."""
    out = []
    for _ in range(n):
        if position >= batches_per_epoch:
            epoch, position = epoch + 1, 0
        out.append((epoch, position))
        position += 1
    return out


def bad_step_record(decision: StepDecision, loss: float, grad_norm: float, batches: list[tuple[int, int]],
                    data: Any) -> dict[str, Any]:
    """Metrics record of a non-OK decision. ``samples`` lists every sequence the step
    trained on as (shard index, token offset) in the prepared data, with the
    (epoch, global batch) each came from in ``data_batches``."""
    samples = [[int(s), int(o)] for e, p in batches for s, o in data.global_batch_windows(e, p)]
    return {"step": decision.step, "bad_step": decision.action.value, "bad_step_reason": decision.reason,
            "step_loss": loss, "step_grad_norm": grad_norm, "spike": decision.spike,
            "spike_ratio": decision.spike_ratio, "consecutive_bad": decision.consecutive_bad,
            "data_batches": [list(b) for b in batches], "samples": samples}


def applies_update(decision: StepDecision | None) -> bool:
    return decision is None or decision.action in (StepAction.OK, StepAction.FLAG)


class _StopCollector:
    """Stands in for the trainer while evaluation callbacks run: every attribute reads
    through to the trainer, but ``request_stop`` is only collected, so the trainer can
    make rank 0's decision everyone's."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self.reason: str | None = None

    def request_stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def run_evaluation_callbacks(trainer: Any, callbacks: Iterable[Any], step: int, val_loss: float,
                             world_size: int) -> tuple[dict[str, Any], str | None]:
    """Call ``on_evaluation(trainer, step, val_loss)`` of each callback that has it;
    returns (the merged records they returned, the stop reason). With several ranks the
    stop reason is rank 0's, broadcast (a collective, only when some callback has the
    hook): callbacks fitting curves on equal inputs should agree, but one differing
    floating-point path must not leave ranks waiting on each other."""
    hooks = [h for cb in callbacks if (h := getattr(cb, "on_evaluation", None)) is not None]
    if not hooks:
        return {}, None
    proxy = _StopCollector(trainer)
    record: dict[str, Any] = {}
    for hook in hooks:
        record.update(hook(proxy, step, val_loss) or {})
    reason = proxy.reason
    if world_size > 1:
        box = [reason]
        dist.broadcast_object_list(box, src=0)
        reason = box[0]
    return record, reason


def callback_key(cb: Any) -> str:
    return getattr(cb, "state_key", type(cb).__name__)


def control_state(adaptive: Any, policy: Any, callbacks: Iterable[Any]) -> dict[str, Any]:
    """Checkpoint entries of the enabled controllers (none for the default config, so its
    ``train_state`` is unchanged). All plain values: ``weights_only``-loadable."""
    state: dict[str, Any] = {}
    if adaptive is not None:
        state["adaptive_lr"] = adaptive.state_dict()
    if policy is not None:
        state["bad_steps"] = policy.state_dict()
    cbs = {callback_key(cb): cb.state_dict() for cb in callbacks if hasattr(cb, "state_dict")}
    if cbs:
        state["callbacks"] = cbs
    return state


def load_control_state(state: dict[str, Any], adaptive: Any, policy: Any, callbacks: Iterable[Any]) -> None:
    """Restore what ``control_state`` saved. A controller enabled now but absent from the
    checkpoint starts fresh; ``policy=None`` leaves the policy alone (a rollback keeps
    the live one, so its rollback count survives)."""
    if adaptive is not None and "adaptive_lr" in state:
        adaptive.load_state_dict(state["adaptive_lr"])
    if policy is not None and "bad_steps" in state:
        policy.load_state_dict(state["bad_steps"])
    saved = state.get("callbacks", {})
    for cb in callbacks:
        if hasattr(cb, "load_state_dict") and callback_key(cb) in saved:
            cb.load_state_dict(saved[callback_key(cb)])
