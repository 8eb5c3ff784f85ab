"""Bad-step policy: what to do with a step whose loss or gradient norm is not finite,
or whose loss spikes. Pure decision logic fed one pair of floats per step; the
trainer carries the decision out (skip the optimizer and LR step, stop, roll back).

All ranks must reach the same decision: feed the globally reduced values (loss
averaged over data-parallel ranks, the global gradient norm), which are identical
on every rank; this class is deterministic given the same sequence.

Decisions, in order of precedence for one step:

- non-finite loss or grad norm: ``STOP`` when ``on_nonfinite == "stop"``; otherwise
  ``SKIP``, or ``ROLLBACK`` when this makes ``max_consecutive_bad`` consecutive bad
  steps (0 = never roll back). A rollback past ``max_rollbacks`` becomes ``STOP``:
  replaying the same data from the same checkpoint can fail the same way forever.
- spike: a finite loss above ``spike_factor`` x the median of the last
  ``spike_window`` accepted losses (once ``spike_min_history`` are known) is
  ``FLAG``-ged (applied, reported with its step so the trainer can log its sample
  ids), or ``SKIP``-ped with ``spike=True`` when ``skip_spikes``. A skipped spike
  counts as a bad step, so a lasting level shift ends in a rollback, not an
  endless run of skips.
- otherwise ``OK``.

The median (not a mean) keeps one spike from hiding the next. Hand-written: torch
has no such policy (``GradScaler`` skips non-finite steps only under fp16 scaling).

``BadStepGuard`` is the loop's component: it feeds the policy and carries its verdict
out. Cost (only when ``[bad_steps] enabled``): every step, after the gradient norm and
before the optimizer, this rank's loss and the global gradient norm go into one 2-value
float64 tensor, are summed over all ranks (one all-reduce when distributed) and read on
the host (one ``.tolist()``). The update must be skipped or applied before the next step
starts, so this is the one host sync per step the house rules otherwise forbid; on CPU
it is free (ops are synchronous anyway), on CUDA it stalls the launch queue once per
step. A non-finite value on any rank makes the sum non-finite on every rank, and an
all-reduce returns the same bits to every rank, so all ranks feed the policy identical
values and take the same decision. With the guard off the loop has neither the
collective nor the read.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainforge.train.component import Component, Rollback, Stop, StopKind


class StepAction(enum.Enum):
    OK = "ok"
    FLAG = "flag"            # loss spike: step applied, log it with its sample ids
    SKIP = "skip"            # drop this update: no optimizer step, LR not advanced
    ROLLBACK = "rollback"    # reload the last good checkpoint
    STOP = "stop"            # request_stop: checkpoint (of the last good state) and end


@dataclass(frozen=True)
class StepDecision:
    action: StepAction
    step: int
    reason: str = ""
    spike: bool = False                 # the loss was a spike (FLAG, or SKIP with skip_spikes)
    spike_ratio: float | None = None    # loss / running median, when a median is known
    consecutive_bad: int = 0


class BadStepPolicy:
    """Settings as in the module docstring; ``spike_factor = 0`` turns spike detection off.
    ``counts`` (nonfinite, skipped, spikes) and ``rollbacks`` are for the log."""

    def __init__(self, on_nonfinite: str = "skip", max_consecutive_bad: int = 5, max_rollbacks: int = 3,
                 spike_factor: float = 2.0, spike_window: int = 50, spike_min_history: int = 20,
                 skip_spikes: bool = False):
        if on_nonfinite not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite = {on_nonfinite!r} is unknown: use 'skip' or 'stop'")
        if max_consecutive_bad < 0 or max_rollbacks < 0:
            raise ValueError(f"max_consecutive_bad ({max_consecutive_bad}) and max_rollbacks ({max_rollbacks}) "
                             "must be >= 0 (0 = never roll back)")
        if spike_factor <= 1.0 and spike_factor != 0:
            raise ValueError(f"spike_factor = {spike_factor} must be > 1 (0 = no spike detection)")
        if spike_window < 1 or not 1 <= spike_min_history <= spike_window:
            raise ValueError(f"need spike_window >= 1 and 1 <= spike_min_history <= spike_window, got "
                             f"{spike_window}, {spike_min_history}")
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_bad, self.max_rollbacks = max_consecutive_bad, max_rollbacks
        self.spike_factor, self.spike_window, self.spike_min_history = spike_factor, spike_window, spike_min_history
        self.skip_spikes = skip_spikes
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.counts = {"nonfinite": 0, "skipped": 0, "spikes": 0}
        self._recent: list[float] = []  # accepted finite losses, newest last

    def observe(self, step: int, loss: float, grad_norm: float) -> StepDecision:
        """Decide for ``step`` given its (globally reduced) loss and pre-clip grad norm.
        Mutates the counters and the running window."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.counts["nonfinite"] += 1
            reason = f"non-finite loss {loss} / grad norm {grad_norm} at step {step}"
            if self.on_nonfinite == "stop":
                return StepDecision(StepAction.STOP, step, reason, consecutive_bad=self.consecutive_bad + 1)
            return self._bad(step, reason, spike=False, ratio=None)
        ratio = None
        if self.spike_factor and len(self._recent) >= self.spike_min_history:
            median = statistics.median(self._recent)
            if median > 0:
                ratio = loss / median
        if ratio is not None and ratio > self.spike_factor:
            self.counts["spikes"] += 1
            reason = f"loss spike at step {step}: {loss:.4g} is {ratio:.2f}x the running median"
            if self.skip_spikes:
                return self._bad(step, reason, spike=True, ratio=ratio)
            self._accept(loss)
            return StepDecision(StepAction.FLAG, step, reason, spike=True, spike_ratio=ratio)
        self._accept(loss)
        return StepDecision(StepAction.OK, step, spike_ratio=ratio)

    def _accept(self, loss: float) -> None:
        self.consecutive_bad = 0
        self._recent.append(float(loss))
        if len(self._recent) > self.spike_window:
            self._recent.pop(0)

    def _bad(self, step: int, reason: str, spike: bool, ratio: float | None) -> StepDecision:
        self.consecutive_bad += 1
        n = self.consecutive_bad
        if self.max_consecutive_bad and n >= self.max_consecutive_bad:
            if self.rollbacks >= self.max_rollbacks:
                return StepDecision(StepAction.STOP, step, f"{reason}; {n} bad steps in a row and already "
                                    f"{self.rollbacks} rollbacks (max_rollbacks)", spike, ratio, n)
            self.rollbacks += 1
            self.consecutive_bad = 0
            return StepDecision(StepAction.ROLLBACK, step, f"{reason}; {n} bad steps in a row: roll back "
                                f"(rollback {self.rollbacks} of at most {self.max_rollbacks})", spike, ratio, n)
        self.counts["skipped"] += 1
        return StepDecision(StepAction.SKIP, step, reason, spike, ratio, n)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/floats/lists. On ROLLBACK do not load the checkpoint's copy of this
        state: keep the live object, so ``rollbacks`` and the counters survive."""
        return {"consecutive_bad": self.consecutive_bad, "rollbacks": self.rollbacks, "counts": dict(self.counts),
                "recent": list(self._recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_bad = int(state["consecutive_bad"])
        self.rollbacks = int(state["rollbacks"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        self._recent = [float(x) for x in state["recent"]]


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


class BadStepGuard(Component):
    """The policy as a loop component: judges every step before the optimizer (a
    rejected step changes no weights, optimizer state or LR), logs non-OK verdicts with
    the step's sample ids, and asks the loop to stop or roll back. ``decision`` is the
    verdict on the latest step. A rollback keeps this live state (its rollback count)."""

    name = "bad_steps"
    keep_on_rollback = True

    def __init__(self, policy: BadStepPolicy, grad_accum_steps: int):
        self.policy, self.grad_accum_steps = policy, grad_accum_steps
        self.decision: StepDecision | None = None
        self._data_before = (0, 0)

    def on_step_start(self, loop: Any) -> None:
        self._data_before = (loop.train_batches.epoch, loop.train_batches.position)

    def before_optimizer_step(self, loop: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        dims = loop.dims
        loss_v, norm_v = step_health(loss, grad_norm, dims.world_size, dims.dp, dims.tp)
        decision = self.decision = self.policy.observe(loop.step + 1, loss_v, norm_v)
        if decision.action is not StepAction.OK:
            batches = step_batches(*self._data_before, self.grad_accum_steps, loop.train_batches.batches_per_epoch)
            loop.metrics.write(bad_step_record(decision, loss_v, norm_v, batches, loop.train_batches))
            if loop.is_main:
                loop.log.warning(f"bad step {decision.step}: {decision.action.value}: {decision.reason}")
            if decision.action is StepAction.STOP:
                loop.request(Stop(decision.reason, StopKind.BAD_STEPS))
            elif decision.action is StepAction.ROLLBACK:
                loop.request(Rollback(decision.consecutive_bad))
        return decision.action in (StepAction.OK, StepAction.FLAG)

    def on_log(self, loop: Any, window: Any) -> dict[str, Any]:
        return {"skipped_steps": self.policy.counts["skipped"], "rollbacks": self.policy.rollbacks}

    def on_fit_end(self, loop: Any, summary: dict[str, Any]) -> None:
        summary["bad_steps"] = {**self.policy.counts, "rollbacks": self.policy.rollbacks}

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)
