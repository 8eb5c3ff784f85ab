"""Config sections of training control ([adaptive_lr], [early_stop], [bad_steps]) and
the builders that turn each into its component. Everything is off by default: a run
with the default config executes exactly the loop it did before these existed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainforge.config_base import _f, _require


@dataclass
class AdaptiveLRSection:
    enabled: bool = _f(False, "multiply the LR schedule by a factor that drops when the training loss "
                              "plateaus or oscillates and climbs back cautiously (observed once per "
                              "log interval, after warmup)")
    window: int = _f(20, "logging intervals per judged window (each contributes its mean loss)")
    plateau_rel_delta: float = _f(1e-3, "plateau: the window's second half improved on its first by less "
                                        "than this fraction")
    band_rel: float = _f(0.05, "oscillation: the loss's spread around the window's trend line exceeds this "
                               "fraction of its mean")
    factor: float = _f(0.5, "multiply the LR factor by this on a plateau or oscillation")
    restore_factor: float = _f(1.25, "raise the LR factor by this (capped at 1) after restore_patience "
                                     "healthy windows")
    restore_patience: int = _f(2, "consecutive healthy windows before each raise")
    min_multiplier: float = _f(0.05, "lowest LR factor")

    def validate(self) -> None:
        _require(self.window >= 4, "adaptive_lr.window", self.window, "an integer >= 4")
        _require(0 <= self.plateau_rel_delta < 1, "adaptive_lr.plateau_rel_delta", self.plateau_rel_delta,
                 "a number in [0, 1)")
        _require(self.band_rel > 0, "adaptive_lr.band_rel", self.band_rel, "a number > 0")
        _require(0 < self.factor < 1, "adaptive_lr.factor", self.factor, "a number in (0, 1)")
        _require(self.restore_factor > 1, "adaptive_lr.restore_factor", self.restore_factor, "a number > 1")
        _require(self.restore_patience >= 1, "adaptive_lr.restore_patience", self.restore_patience,
                 "an integer >= 1")
        _require(0 < self.min_multiplier <= 1, "adaptive_lr.min_multiplier", self.min_multiplier,
                 "a number in (0, 1]")

    def build(self):
        """The ``AdaptiveLR`` controller, or None when disabled."""
        if not self.enabled:
            return None
        from trainforge.train.adaptive_lr import AdaptiveLR

        return AdaptiveLR(self.window, self.plateau_rel_delta, self.band_rel, self.factor, self.restore_factor,
                          self.restore_patience, self.min_multiplier)


@dataclass
class EarlyStopSection:
    mode: Literal["off", "predict", "patience"] = _f(
        "off", "predict: stop when the fitted learning curve says the validation loss will improve by less than "
               "min_delta before training.steps, with probability >= confidence (or it has turned up); "
               "patience: stop after `patience` evaluations without improving by min_delta; off")
    min_steps: int = _f(0, "never stop before this step")
    min_delta: float = _f(0.01, "validation-loss improvement (absolute) worth training for")
    confidence: float = _f(0.9, "predict: probability the remaining improvement is below min_delta")
    patience: int = _f(5, "patience: evaluations in a row without improvement before stopping")
    n_bootstrap: int = _f(24, "predict: bootstrap refits per curve family (uncertainty; costs fit time "
                              "at each evaluation)")

    def validate(self) -> None:
        _require(self.min_steps >= 0, "early_stop.min_steps", self.min_steps, "an integer >= 0")
        _require(math.isfinite(self.min_delta) and self.min_delta > 0, "early_stop.min_delta", self.min_delta,
                 "a number > 0")
        _require(0 < self.confidence <= 1, "early_stop.confidence", self.confidence, "a number in (0, 1]")
        _require(self.patience >= 1, "early_stop.patience", self.patience, "an integer >= 1")
        _require(self.n_bootstrap >= 0, "early_stop.n_bootstrap", self.n_bootstrap, "an integer >= 0")

    def build(self, budget_steps: int):
        """The ``EarlyStopping`` callback aiming at ``budget_steps``, or None when off."""
        if self.mode == "off":
            return None
        from trainforge.train.curve_predictor import CurvePredictor
        from trainforge.train.early_stopping import EarlyStopping

        return EarlyStopping(budget_steps, self.mode, self.min_steps, self.min_delta, self.confidence, self.patience,
                             CurvePredictor(n_bootstrap=self.n_bootstrap))


@dataclass
class BadStepsSection:
    enabled: bool = _f(False, "check every step's loss and gradient norm before the update (costs one "
                              "host read per step, plus a 2-value all-reduce when distributed)")
    on_nonfinite: Literal["skip", "stop"] = _f(
        "skip", "a non-finite loss or grad norm: skip the update (LR not advanced) or stop the run")
    max_consecutive_bad: int = _f(5, "this many bad (skipped) steps in a row roll back to the last checkpoint; "
                                     "0 = never")
    max_rollbacks: int = _f(3, "after this many rollbacks a further one stops the run")
    spike_factor: float = _f(3.0, "flag a loss above this x the running median of accepted losses; 0 = off")
    spike_window: int = _f(50, "steps in the running median")
    spike_min_history: int = _f(20, "accepted steps needed before spikes are judged")
    skip_spikes: bool = _f(False, "skip flagged spikes (they count as bad steps) instead of applying them")

    def validate(self) -> None:
        for name in ("max_consecutive_bad", "max_rollbacks"):
            v = getattr(self, name)
            _require(v >= 0, f"bad_steps.{name}", v, "an integer >= 0")
        _require(self.spike_factor == 0 or self.spike_factor > 1, "bad_steps.spike_factor", self.spike_factor,
                 "a number > 1, or 0 to turn spike detection off")
        _require(self.spike_window >= 1, "bad_steps.spike_window", self.spike_window, "an integer >= 1")
        _require(1 <= self.spike_min_history <= self.spike_window, "bad_steps.spike_min_history",
                 self.spike_min_history, f"an integer in [1, bad_steps.spike_window = {self.spike_window}]")

    def build(self):
        """The ``BadStepPolicy``, or None when disabled."""
        if not self.enabled:
            return None
        from trainforge.train.bad_steps import BadStepPolicy

        return BadStepPolicy(self.on_nonfinite, self.max_consecutive_bad, self.max_rollbacks, self.spike_factor,
                             self.spike_window, self.spike_min_history, self.skip_spikes)
