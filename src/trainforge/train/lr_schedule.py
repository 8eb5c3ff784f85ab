"""Learning-rate schedules on ``torch.optim.lr_scheduler``.

Every schedule is a ``LambdaLR`` whose multiplier is a picklable callable object (not a
lambda): ``LambdaLR.state_dict`` stores such an object's ``__dict__`` and
``load_state_dict`` writes it back, so a resumed run rebuilds the identical schedule.
The attributes are plain ints, floats and strings, so the state loads with
``torch.load(weights_only=True)``.

``WarmupDecay`` keeps its ``kind`` among those attributes: loading a saved state into
a scheduler built with another kind restores the saved kind and parameters.
``WarmupCosine`` and ``warmup_cosine_scheduler`` are the original cosine-only API,
kept unchanged for the trainer and older checkpoints.

Step convention (all kinds): the multiplier at scheduler step ``k`` (0 = before the
first update) ramps linearly as ``(k+1)/warmup_steps``, reaching 1 at
``k = warmup_steps - 1``, and a decay reaches its floor ``min_lr_ratio`` at
``k = total_steps`` and stays there.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULE_KINDS = ("cosine", "wsd", "linear", "constant")
DECAY_SHAPES = ("linear", "sqrt", "cosine")


class WarmupCosine:
    """Multiplier of the peak LR at scheduler step k (0 = before the first update):
    linear ramp (k+1)/warmup_steps, then half-cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        progress = min(1.0, (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                            min_lr_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


def _decay(shape: str, progress: float) -> float:
    """Fraction of the (peak - floor) gap left at ``progress`` in [0, 1]: 1 -> 0."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


class WarmupDecay:
    """Multiplier of the peak LR at scheduler step ``k``; linear warmup, then by ``kind``:

    - ``cosine``: half-cosine from 1 to ``min_lr_ratio`` at ``total_steps`` (= ``WarmupCosine``);
    - ``linear``: straight line from 1 to ``min_lr_ratio`` at ``total_steps``;
    - ``constant``: 1 (``min_lr_ratio`` unused);
    - ``wsd`` (warmup-stable-decay): 1 until ``total_steps - decay_steps``, then
      ``decay_shape`` (linear, sqrt or cosine) down to ``min_lr_ratio`` at ``total_steps``.
    """

    def __init__(self, kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                 decay_steps: int = 0, decay_shape: str = "linear"):
        self.kind, self.warmup_steps, self.total_steps = kind, warmup_steps, total_steps
        self.min_lr_ratio, self.decay_steps, self.decay_shape = min_lr_ratio, decay_steps, decay_shape

    def __call__(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            decay_start = self.total_steps - self.decay_steps
            if k < decay_start:
                return 1.0
            progress, shape = min(1.0, (k - decay_start) / max(1, self.decay_steps)), self.decay_shape
        else:
            progress = min(1.0, (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            shape = "cosine" if self.kind == "cosine" else "linear"
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * _decay(shape, progress)


def warmup_decay(kind: str = "cosine", warmup_steps: int = 0, total_steps: int = 1, min_lr_ratio: float = 0.0,
                 decay_ratio: float = 0.1, decay_shape: str = "linear") -> WarmupDecay:
    """The validated multiplier ``build_scheduler`` installs (also what a resumed run
    compares its saved schedule against). ``decay_ratio`` (wsd only) is the fraction
    of ``total_steps`` spent decaying: ``decay_steps = round(decay_ratio * total_steps)``,
    at least 1. Raises ``ValueError`` naming the argument when a value is out of range."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"lr schedule kind {kind!r} is unknown: use one of {list(SCHEDULE_KINDS)}")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"lr decay_shape {decay_shape!r} is unknown: use one of {list(DECAY_SHAPES)}")
    if total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"lr schedule needs total_steps >= 1 and warmup_steps >= 0, got total_steps="
                         f"{total_steps}, warmup_steps={warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr schedule min_lr_ratio = {min_lr_ratio} must be in [0, 1]")
    decay_steps = 0
    if kind == "wsd":
        if not 0.0 < decay_ratio <= 1.0:
            raise ValueError(f"wsd schedule decay_ratio = {decay_ratio} must be in (0, 1]")
        decay_steps = max(1, round(decay_ratio * total_steps))
        if warmup_steps + decay_steps > total_steps:
            raise ValueError(f"wsd schedule: warmup_steps ({warmup_steps}) + decay steps ({decay_steps} = "
                             f"decay_ratio {decay_ratio} x total_steps {total_steps}) exceed total_steps; "
                             "lower warmup_steps or decay_ratio")
    return WarmupDecay(kind, warmup_steps, total_steps, min_lr_ratio, decay_steps, decay_shape)


def _short_e(x: float) -> str:
    """``1.0e-4`` (not Python's ``1.0e-04``)."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


# The multiplier's attributes by the config key that sets them ([training]); an old WarmupCosine lacks the last three.
_SCHEDULE_KEYS = (("total_steps", "steps"), ("warmup_steps", "warmup_steps"), ("kind", "lr_schedule"),
                  ("min_lr_ratio", "min_lr_ratio"), ("decay_steps", "decay steps"), ("decay_shape", "decay_shape"))
_OLD_DEFAULTS = {"kind": "cosine", "decay_steps": 0, "decay_shape": "linear"}


def describe_change(old, old_lr: float, new: WarmupDecay, new_lr: float, step: int) -> str:
    """A resumed run's schedule change in words, e.g. ``steps 50 -> 100: cosine follows the new
    schedule from step 50, lr 1.0e-4 -> 8.3e-4`` (the LR at ``step`` under each schedule)."""
    changed = [f"{name} {getattr(old, attr, _OLD_DEFAULTS.get(attr))} -> {getattr(new, attr)}"
               for attr, name in _SCHEDULE_KEYS if getattr(old, attr, _OLD_DEFAULTS.get(attr)) != getattr(new, attr)]
    if old_lr != new_lr:
        changed.append(f"peak lr {_short_e(old_lr)} -> {_short_e(new_lr)}")
    return (f"{', '.join(changed)}: {new.kind} follows the new schedule from step {step}, "
            f"lr {_short_e(old_lr * old(step))} -> {_short_e(new_lr * new(step))}")


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str = "cosine", warmup_steps: int = 0,
                    total_steps: int = 1, min_lr_ratio: float = 0.0, decay_ratio: float = 0.1,
                    decay_shape: str = "linear") -> LambdaLR:
    """A ``LambdaLR`` over every param group of ``optimizer`` with the multiplier
    ``warmup_decay(...)`` (same arguments, same ``ValueError``s)."""
    return LambdaLR(optimizer, warmup_decay(kind, warmup_steps, total_steps, min_lr_ratio, decay_ratio, decay_shape))


def follow_schedule(scheduler: LambdaLR, optimizer: torch.optim.Optimizer, multiplier: WarmupDecay,
                    lr: float) -> LambdaLR:
    """A ``LambdaLR`` continuing ``scheduler``'s step count with another ``multiplier``
    and peak ``lr`` (a resumed run whose schedule the user changed). Built through the
    public constructor (``initial_lr`` per group, ``last_epoch``), so no scheduler
    internals are written; its constructor's first step lands on the current step and
    sets every group's LR to ``lr * multiplier(step)``."""
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    return LambdaLR(optimizer, multiplier, last_epoch=scheduler.last_epoch - 1)
