"""Early stopping on the validation-loss curve, as a loop component (``on_evaluation``).

Two modes, both never stopping before ``min_steps``:

- ``predict``: stop when the learning-curve ensemble (``curve_predictor``) says the
  improvement still to come before ``budget_steps`` is below ``min_delta`` with
  probability >= ``confidence``. When the loss has turned up (overfitting) the
  predictor reports the best point in the past and this stops.
- ``patience``: the classic rule, for comparison: stop after ``patience``
  evaluations in a row that did not beat the best loss by more than ``min_delta``.

Whatever the mode, every evaluation is predicted and returned as a record
(predicted stop step, final loss and its std, probability...), which the trainer
logs, so the prediction's quality can be judged against the finished run.

The only effect on training is ``trainer.request_stop(reason)`` (the loop makes rank 0's
request everyone's, as a ``Stop`` of kind ``early_stop``). The decision is a
pure function of the (step, val_loss) history and the settings (the predictor's
bootstrap is seeded), so ranks that see the same validation losses decide alike.
``state_dict`` holds the history as plain lists (``weights_only``-safe).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from trainforge.train.component import Component
from trainforge.train.curve_predictor import CurvePredictor


class Stoppable(Protocol):
    def request_stop(self, reason: str) -> None: ...


class EarlyStopping(Component):
    """A loop component (``on_evaluation``), checkpointed where older runs kept it
    (``callbacks/EarlyStopping`` in ``train_state.pt``).
    ``budget_steps``: the run's step budget (``training.steps``) the prediction aims at;
    ``min_delta``: loss improvement worth training for (absolute, in loss units);
    ``confidence``: probability needed to stop in predict mode; ``patience``: evaluations
    without improvement in patience mode; ``predictor``: fitting settings."""

    def __init__(self, budget_steps: int, mode: str = "predict", min_steps: int = 0, min_delta: float = 1e-3,
                 confidence: float = 0.9, patience: int = 3, predictor: CurvePredictor | None = None):
        if mode not in ("predict", "patience"):
            raise ValueError(f"early stopping mode {mode!r} is unknown: use 'predict' or 'patience'")
        if budget_steps < 1 or min_steps < 0:
            raise ValueError(f"early stopping needs budget_steps >= 1 and min_steps >= 0, got {budget_steps}, "
                             f"{min_steps}")
        if not (math.isfinite(min_delta) and min_delta > 0):
            raise ValueError(f"early stopping min_delta = {min_delta} must be > 0")
        if not 0.0 < confidence <= 1.0:
            raise ValueError(f"early stopping confidence = {confidence} must be in (0, 1]")
        if patience < 1:
            raise ValueError(f"early stopping patience = {patience} must be >= 1")
        self.budget_steps, self.mode, self.min_steps = budget_steps, mode, min_steps
        self.min_delta, self.confidence, self.patience = min_delta, confidence, patience
        self.predictor = predictor or CurvePredictor()
        # The history is the whole state: everything else is recomputed from it.
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.last_record: dict[str, Any] | None = None

    name = "callbacks/EarlyStopping"  # its key when it was a trainer callback: old checkpoints load as they are

    def patience_state(self) -> tuple[float, int, int]:
        """(best loss, its step, evaluations since it) over the history, where "best"
        means beating the previous best by more than ``min_delta``."""
        best, best_step, since = math.inf, -1, 0
        for step, loss in zip(self.steps, self.losses):
            if math.isfinite(loss) and loss < best - self.min_delta:
                best, best_step, since = loss, step, 0
            else:
                since += 1
        return best, best_step, since

    def on_evaluation(self, trainer: Stoppable, step: int, val_loss: float) -> dict[str, Any]:
        """Record ``val_loss`` at ``step``, predict, and call ``trainer.request_stop`` when
        the mode's rule says so. Returns the record to log. A step at or before one
        already recorded (a rollback) drops the later history first."""
        while self.steps and self.steps[-1] >= step:
            self.steps.pop()
            self.losses.pop()
        self.steps.append(int(step))
        self.losses.append(float(val_loss))
        best, best_step, since = self.patience_state()
        pred = self.predictor.predict(self.steps, self.losses, self.budget_steps, self.min_delta)
        prob = pred.prob_improvement_below(self.min_delta) if pred is not None else None
        reason = None
        if step >= self.min_steps:
            if self.mode == "patience" and since >= self.patience:
                reason = (f"early stop (patience): {since} evaluations without val_loss improving on "
                          f"{best:.4f} (step {best_step}) by more than {self.min_delta}")
            elif self.mode == "predict" and pred is not None and pred.overfitting:
                reason = (f"early stop (predicted): val_loss has risen since its best {pred.best_loss:.4f} "
                          f"at step {pred.best_step}")
            elif self.mode == "predict" and prob is not None and prob >= self.confidence:
                reason = (f"early stop (predicted): improvement left before step {self.budget_steps} is < "
                          f"{self.min_delta} with probability {prob:.2f}; predicted final val_loss "
                          f"{pred.final_loss:.4f} +- {pred.final_loss_std:.4f}")
        if reason is not None:
            trainer.request_stop(reason)
        record: dict[str, Any] = {
            "step": int(step), "val_loss": float(val_loss), "early_stop_mode": self.mode,
            "predicted_final_loss": None, "predicted_final_loss_std": None, "predicted_stop_step": None,
            "predicted_remaining_improvement": None, "overfitting": None, "curve_weights": None,
            "prob_improvement_below_min_delta": prob, "best_val_loss": best if math.isfinite(best) else None,
            "best_step": best_step,
            "evals_without_improvement": since, "early_stop": reason is not None,
        }
        if pred is not None:
            record.update(pred.to_record())
        self.last_record = record
        return record

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = [int(s) for s in state["steps"]]
        self.losses = [float(x) for x in state["losses"]]
        self.last_record = None
