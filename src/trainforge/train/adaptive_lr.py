"""Adaptive LR modifier: a multiplier on top of the schedule that drops when the loss
plateaus or oscillates beyond a band, and climbs back cautiously once it is healthy.

Hand-written because ``torch.optim.lr_scheduler.ReduceLROnPlateau`` only ever
lowers the LR, knows nothing of oscillation, and writes ``group["lr"]`` itself, which
the schedule's ``LambdaLR`` overwrites on its next step. Here the schedule stays the
source of truth and ``apply`` multiplies its latest LR, so the two compose:
``lr = base_lr * schedule(k) * multiplier``.

Decisions use a window of the last ``window`` observed losses (feed it values that
are already averaged, e.g. one per logging interval or the validation loss):

- plateau: the second half's mean improved on the first half's by less than
  ``plateau_rel_delta`` (relative), or got worse;
- oscillation: the spread of the window around its least-squares line (residual
  standard deviation) exceeds ``band_rel`` times the window's mean loss.

Either lowers the multiplier by ``factor`` (not below ``min_multiplier``) and starts
a fresh window. While lowered, every ``restore_patience`` consecutive full healthy
windows (non-overlapping) raise it by ``restore_factor`` (capped at 1): restoring is
slower than lowering by design. Pure Python state: deterministic, and
``state_dict`` is plain floats and lists (``torch.load(weights_only=True)``-safe).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from trainforge.train.component import Component


class AdaptiveLR:
    """Settings as in the module docstring; ``multiplier`` (in [min_multiplier, 1]) is the
    live value, ``last_event`` what the latest ``observe`` did (for the log)."""

    def __init__(self, window: int = 20, plateau_rel_delta: float = 1e-3, band_rel: float = 0.05,
                 factor: float = 0.5, restore_factor: float = 1.25, restore_patience: int = 2,
                 min_multiplier: float = 0.05):
        if window < 4:
            raise ValueError(f"adaptive lr window = {window} must be >= 4 (two halves of two points)")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"adaptive lr factor = {factor} must be in (0, 1)")
        if restore_factor <= 1.0:
            raise ValueError(f"adaptive lr restore_factor = {restore_factor} must be > 1")
        if not 0.0 < min_multiplier <= 1.0:
            raise ValueError(f"adaptive lr min_multiplier = {min_multiplier} must be in (0, 1]")
        if restore_patience < 1:
            raise ValueError(f"adaptive lr restore_patience = {restore_patience} must be >= 1")
        if plateau_rel_delta < 0 or band_rel <= 0:
            raise ValueError(f"adaptive lr needs plateau_rel_delta >= 0 and band_rel > 0, got "
                             f"{plateau_rel_delta}, {band_rel}")
        self.window, self.plateau_rel_delta, self.band_rel = window, plateau_rel_delta, band_rel
        self.factor, self.restore_factor, self.restore_patience = factor, restore_factor, restore_patience
        self.min_multiplier = min_multiplier
        self.multiplier = 1.0
        self.last_event: str | None = None  # "plateau" | "oscillation" | "restore" at the latest observe
        self._losses: list[float] = []
        self._healthy_windows = 0

    def observe(self, loss: float) -> float:
        """Record one loss; returns the multiplier to use from now on. Non-finite
        losses are ignored (bad-step handling owns those)."""
        self.last_event = None
        if not math.isfinite(loss):
            return self.multiplier
        self._losses.append(float(loss))
        if len(self._losses) > self.window:
            self._losses.pop(0)
        if len(self._losses) < self.window:
            return self.multiplier
        problem = self._diagnose(self._losses)
        if problem is not None:
            self.multiplier = max(self.min_multiplier, self.multiplier * self.factor)
            self.last_event = problem
            self._losses, self._healthy_windows = [], 0
        elif self.multiplier < 1.0:
            self._healthy_windows += 1
            self._losses = []  # judge the next window on fresh data only
            if self._healthy_windows >= self.restore_patience:
                self.multiplier = min(1.0, self.multiplier * self.restore_factor)
                self.last_event, self._healthy_windows = "restore", 0
        return self.multiplier

    def _diagnose(self, xs: list[float]) -> str | None:
        return loss_trend(xs, self.plateau_rel_delta, self.band_rel)

    def apply(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> None:
        """Set each param group's LR to the schedule's latest LR times the multiplier.
        Call right after every ``scheduler.step()`` (and once after loading a checkpoint)."""
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr * self.multiplier

    def state_dict(self) -> dict[str, Any]:
        return {"multiplier": self.multiplier, "losses": list(self._losses),
                "healthy_windows": self._healthy_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multiplier = float(state["multiplier"])
        self._losses = [float(x) for x in state["losses"]]
        self._healthy_windows = int(state["healthy_windows"])
        self.last_event = None


def loss_trend(xs: list[float], plateau_rel_delta: float, band_rel: float) -> str | None:
    """The window test of the module docstring on losses ``xs`` (at least 4): "oscillation",
    "plateau" or None (still improving). Shared with the sequence-length schedule's ``auto``
    (``seq_len_schedule.py``), which passes ``band_rel = inf`` to use the plateau test alone."""
    n = len(xs)
    mean = sum(xs) / n
    scale = max(abs(mean), 1e-12)
    t_mean = (n - 1) / 2
    sxx = sum((t - t_mean) ** 2 for t in range(n))
    slope = sum((t - t_mean) * (x - mean) for t, x in enumerate(xs)) / sxx
    resid_sq = sum((x - (mean + slope * (t - t_mean))) ** 2 for t, x in enumerate(xs))
    if math.sqrt(resid_sq / (n - 2)) > band_rel * scale:
        return "oscillation"
    half = n // 2
    first, second = sum(xs[:half]) / half, sum(xs[n - half:]) / half
    if (first - second) / scale < plateau_rel_delta:
        return "plateau"
    return None


class AdaptiveLRComponent(Component):
    """The multiplier as a loop component: fed one logging window's mean training loss
    (after ``warmup_steps``; the same host values on every rank), applied after every
    scheduler step and after a checkpoint loads; a change is a metrics record."""

    name = "adaptive_lr"

    def __init__(self, adaptive: AdaptiveLR, warmup_steps: int):
        self.adaptive, self.warmup_steps = adaptive, warmup_steps

    @property
    def multiplier(self) -> float:
        return self.adaptive.multiplier

    def _apply(self, loop: Any) -> None:
        for opt, sched in zip(loop.optimizers, loop.schedulers):
            self.adaptive.apply(opt, sched)

    def after_optimizer_step(self, loop: Any) -> None:
        self._apply(loop)

    def on_load(self, loop: Any) -> None:
        self._apply(loop)

    def on_log(self, loop: Any, window: Any) -> None:
        finite = [x for x in window.losses if math.isfinite(x)]
        if window.steps[0] <= self.warmup_steps or not finite:
            return
        before = self.adaptive.multiplier
        self.adaptive.observe(sum(finite) / len(finite))
        if self.adaptive.multiplier != before:
            self._apply(loop)
            loop.metrics.write({"step": loop.step, "lr_multiplier": self.adaptive.multiplier,
                                "lr_event": self.adaptive.last_event})
            if loop.is_main:
                loop.log.info(f"step {loop.step}: adaptive LR {self.adaptive.last_event}: multiplier "
                              f"{before:.3g} -> {self.adaptive.multiplier:.3g}")

    def state_dict(self) -> dict[str, Any]:
        return self.adaptive.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adaptive.load_state_dict(state)
