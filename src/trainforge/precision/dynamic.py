"""Dynamic precision: move module groups between fp16 / bf16 / fp32 as training demands.

Hand-written: no library watches training signals to pick a compute dtype. The
controller is pure Python over per-step numbers; it never touches tensors, so it is
deterministic, checkpointable (``state_dict``) and identical on every rank *provided
every rank feeds it the same numbers*: the trainer passes globally reduced statistics
(the data-parallel mean loss, the global gradient norm, the scaler's overflow flag,
which DTensor already reduces over the mesh). Feeding it costs one host sync, so the
trainer buffers device tensors and calls ``observe`` for each buffered step every
``precision.dynamic_interval_steps`` steps; a switch takes effect from the next step.
Meanwhile fp16 overflows are still skipped step by step by the loss scaler.

Rules, per group (``levels`` ordered cheapest first, e.g. fp16, bf16, fp32):

- *Up* one level (more range) on trouble: a non-finite loss or gradient norm that the
  loss scaler did not catch (at once, ignoring dwell); more than ``max_overflows``
  skipped steps within ``overflow_window_steps`` (fp16's range is too small: a
  healthy scale overflows about once per growth interval, and calibrating down from
  65536 costs at most ~6); the loss scale below ``min_loss_scale`` (the scaler is
  fighting overflows with a scale < 1, where fp16 also loses small gradients); an
  underflowed gradient fraction above ``max_underflow_fraction``; a loss spike
  (loss > ``loss_spike_ratio`` x its moving average: 1.5 is far outside step-to-step
  noise of an LM loss, and a precision failure shows as a jump, not a drift); a
  gradient-norm spike (> ``grad_spike_ratio`` x its moving average: healthy norms
  vary within ~3x, precision blow-ups by orders of magnitude) or a norm above
  ``grad_norm_max``.
- Soft triggers move only after ``min_dwell_steps`` since the group's last switch, so
  one burst (a spike seen over two steps) moves one level, not two.
- *Down* one level only after ``calm_steps`` consecutive calm steps (200: long enough
  for a loss spike caused by the level to recur if it was the level's fault) and the
  dwell; the requirement doubles with each further failure of the target level
  (calm_steps after its first failure, 2x after its second, ... capped at 16x), so a
  level that keeps failing is retried ever more rarely: no flapping.
- Moving averages (beta 0.9, about the last 10 steps) skip spike and non-finite steps,
  so one bad step does not raise the baseline; spike checks start after 10 samples.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from trainforge.precision.hardware import DTYPE_NAMES
from trainforge.precision.policy import DEFAULT_GROUP, PrecisionPolicy
from trainforge.precision.section import LADDER

EMA_BETA = 0.9
EMA_WARMUP_SAMPLES = 10
MAX_BACKOFF = 16


@dataclass(frozen=True)
class DynamicThresholds:
    loss_spike_ratio: float = 1.5
    grad_spike_ratio: float = 10.0
    grad_norm_max: float = 0.0  # 0 = off
    max_overflows: int = 8
    overflow_window_steps: int = 100
    min_loss_scale: float = 1.0
    max_underflow_fraction: float = 0.0  # 0 = off
    calm_steps: int = 200
    min_dwell_steps: int = 20

    @classmethod
    def from_section(cls, section) -> "DynamicThresholds":
        """``section`` is ``[precision]``: its ``dynamic_*`` keys."""
        return cls(**{k: getattr(section, f"dynamic_{k}") for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class StepSignals:
    """One optimizer step, globally reduced. ``overflow``: the loss scaler skipped it.
    ``group_grad_norms`` (optional): per-group norms; without them every group sees
    ``grad_norm`` and the groups move together."""

    loss: float
    grad_norm: float
    overflow: bool = False
    loss_scale: float | None = None
    underflow_fraction: float | None = None
    group_grad_norms: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Switch:
    step: int
    group: str
    old: str
    new: str
    reason: str


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _ema(old: float | None, x: float) -> float:
    return x if old is None else EMA_BETA * old + (1 - EMA_BETA) * x


class _Group:
    def __init__(self, level: int):
        self.level = level
        self.since_switch = 0
        self.calm = 0
        self.failures: dict[str, int] = {}  # level name -> times it was left on trouble
        self.overflows: deque[int] = deque()  # steps of recent overflows
        self.grad_ema: float | None = None
        self.grad_samples = 0


class PrecisionController:
    """``levels``: dtype names, cheapest first (``[n for n in LADDER if allowed]``);
    ``start``: the starting level of every group. ``observe`` returns the switches
    decided at that step (also logged); ``current`` is the level per group."""

    def __init__(self, groups: Sequence[str], levels: Sequence[str], start: str,
                 thresholds: DynamicThresholds | None = None, log: logging.Logger | None = None):
        levels = list(levels)
        if not levels or levels != sorted(levels, key=LADDER.index) or start not in levels:
            raise ValueError(f"levels {levels} must be ordered as {LADDER} and contain start {start!r}")
        self.levels, self.t, self.log = levels, thresholds or DynamicThresholds(), log
        self.groups = {g: _Group(levels.index(start)) for g in groups}
        self.loss_ema: float | None = None
        self.loss_samples = 0
        self.history: list[Switch] = []

    @property
    def current(self) -> dict[str, str]:
        return {g: self.levels[s.level] for g, s in self.groups.items()}

    def observe(self, step: int, signals: StepSignals) -> list[Switch]:
        t = self.t
        loss_spike = (_finite(signals.loss) and self.loss_samples >= EMA_WARMUP_SAMPLES
                      and signals.loss > t.loss_spike_ratio * self.loss_ema)
        switches = []
        for name, g in self.groups.items():
            g.since_switch += 1
            level = self.levels[g.level]
            norm = signals.grad_norm
            if signals.group_grad_norms is not None and name in signals.group_grad_norms:
                norm = signals.group_grad_norms[name]
            overflow = signals.overflow and (signals.group_grad_norms is None or not _finite(norm))
            if overflow:
                g.overflows.append(step)
            while g.overflows and g.overflows[0] <= step - t.overflow_window_steps:
                g.overflows.popleft()
            severe, soft = self._triggers(signals, g, level, norm, overflow, loss_spike)
            if severe or soft:
                g.calm = 0
                if g.level + 1 < len(self.levels) and (severe or g.since_switch >= t.min_dwell_steps):
                    g.failures[level] = g.failures.get(level, 0) + 1
                    switches.append(self._move(step, name, g, +1, "; ".join(severe or soft)))
            else:
                g.calm += 1
                if g.level > 0:
                    target = self.levels[g.level - 1]
                    need = t.calm_steps * min(MAX_BACKOFF, 2 ** max(0, g.failures.get(target, 0) - 1))
                    if g.calm >= need and g.since_switch >= t.min_dwell_steps:
                        switches.append(self._move(step, name, g, -1, f"{g.calm} calm steps (needed {need})"))
            if _finite(norm) and not overflow and not (g.grad_samples >= EMA_WARMUP_SAMPLES
                                                       and norm > t.grad_spike_ratio * g.grad_ema):
                g.grad_ema = _ema(g.grad_ema, norm)
                g.grad_samples += 1
        if _finite(signals.loss) and not loss_spike:
            self.loss_ema = _ema(self.loss_ema, signals.loss)
            self.loss_samples += 1
        return switches

    def _triggers(self, s: StepSignals, g: _Group, level: str, norm: float, overflow: bool,
                  loss_spike: bool) -> tuple[list[str], list[str]]:
        t = self.t
        severe, soft = [], []
        if not _finite(s.loss):
            severe.append(f"non-finite loss {s.loss}")
        if not overflow and not _finite(norm):
            severe.append(f"non-finite gradient norm {norm} not caught by loss scaling")
        if len(g.overflows) > t.max_overflows:
            soft.append(f"{len(g.overflows)} overflows in the last {t.overflow_window_steps} steps "
                        f"(limit {t.max_overflows})")
        if level == "fp16" and s.loss_scale is not None and s.loss_scale < t.min_loss_scale:
            soft.append(f"loss scale {s.loss_scale:g} below {t.min_loss_scale:g}")
        if (level == "fp16" and t.max_underflow_fraction > 0 and s.underflow_fraction is not None
                and s.underflow_fraction > t.max_underflow_fraction):
            soft.append(f"{s.underflow_fraction:.1%} of gradients underflowed (limit {t.max_underflow_fraction:.1%})")
        if loss_spike:
            soft.append(f"loss spike {s.loss:.4g} > {t.loss_spike_ratio:g} x average {self.loss_ema:.4g}")
        if _finite(norm) and g.grad_samples >= EMA_WARMUP_SAMPLES and norm > t.grad_spike_ratio * g.grad_ema:
            soft.append(f"gradient norm spike {norm:.4g} > {t.grad_spike_ratio:g} x average {g.grad_ema:.4g}")
        if t.grad_norm_max > 0 and _finite(norm) and norm > t.grad_norm_max:
            soft.append(f"gradient norm {norm:.4g} above {t.grad_norm_max:g}")
        return severe, soft

    def _move(self, step: int, name: str, g: _Group, direction: int, reason: str) -> Switch:
        old = self.levels[g.level]
        g.level += direction
        g.since_switch = 0
        g.calm = 0
        g.overflows.clear()  # counted against the old precision
        sw = Switch(step, name, old, self.levels[g.level], reason)
        self.history.append(sw)
        del self.history[:-100]
        if self.log:
            self.log.info(f"precision switch at step {step}: {name} {old} -> {sw.new} ({reason})")
        return sw

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (``torch.load(weights_only=True)`` accepts them)."""
        return {
            "levels": list(self.levels), "loss_ema": self.loss_ema, "loss_samples": self.loss_samples,
            "groups": {n: {"level": self.levels[g.level], "since_switch": g.since_switch, "calm": g.calm,
                           "failures": dict(g.failures), "overflows": list(g.overflows), "grad_ema": g.grad_ema,
                           "grad_samples": g.grad_samples} for n, g in self.groups.items()},
            "history": [asdict(s) for s in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Groups or levels missing from this run's config start afresh."""
        self.loss_ema, self.loss_samples = state["loss_ema"], int(state["loss_samples"])
        for name, gs in state["groups"].items():
            if name not in self.groups or gs["level"] not in self.levels:
                continue
            g = self.groups[name]
            g.level = self.levels.index(gs["level"])
            g.since_switch, g.calm = int(gs["since_switch"]), int(gs["calm"])
            g.failures = {k: int(v) for k, v in gs["failures"].items()}
            g.overflows = deque(int(s) for s in gs["overflows"])
            g.grad_ema, g.grad_samples = gs["grad_ema"], int(gs["grad_samples"])
        self.history = [Switch(**s) for s in state["history"]]


def build_controller(policy: PrecisionPolicy, section, log: logging.Logger | None = None) -> PrecisionController | None:
    """The controller for a resolved ``PrecisionPolicy`` (None unless ``policy.dynamic``);
    ``section`` is ``[precision]``. Group names match ``PrecisionRuntime.compute_dtypes``."""
    if not policy.dynamic:
        return None
    groups = [DEFAULT_GROUP] + [name for name, _ in policy.groups]
    return PrecisionController(groups, [DTYPE_NAMES[d] for d in policy.levels], DTYPE_NAMES[policy.compute_dtype],
                               DynamicThresholds.from_section(section), log)
