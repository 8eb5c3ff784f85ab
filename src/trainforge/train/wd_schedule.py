"""``optimizer.weight_decay_schedule``: a weight decay that changes over training (the
late increase of weight decay; constant is the default and registers nothing, so a
constant-decay run is the run it was before this existed, bit for bit).

``linear`` and ``cosine`` hold ``optimizer.weight_decay`` until the ramp starts at
``weight_decay_ramp_start x training.steps``, then move to ``optimizer.weight_decay_final``
at ``training.steps`` (a straight line, or a half-cosine that leaves and arrives flat) and
stay there. The value is written into the decayed param groups' ``weight_decay`` (the
matrices: ``optimizer.is_decayed``; norms and biases stay at 0) before every step, where
AdamW and any optimizer reading its groups (a host-side one included) pick it up.

It composes with the LR schedule the way the LR schedule's objects do: the value is a
picklable multiplier-like object (``WeightDecaySchedule``, plain attributes) evaluated at
the LR scheduler's step count ``k`` (``last_epoch``: optimizer steps applied; 0 before the
first update), so a step the bad-step guard rejects moves neither. The value of a step is
a function of ``k`` alone and ``k`` is checkpointed with the scheduler: a resumed run, or
one rolled back, sets exactly the value the uninterrupted run did. The schedule's
parameters are saved too, only to say so when a resumed run asks for another one (it then
follows the config from the current step). A checkpoint without this state (a constant-
decay run, or one older than this) resumes on the configured schedule from its step.
"""

from __future__ import annotations

import math
from typing import Any

from trainforge.train.component import Component
from trainforge.train.optimizer import decayed_groups

WD_SCHEDULES = ("constant", "linear", "cosine")


class WeightDecaySchedule:
    """The weight decay at LR-scheduler step ``k`` (see the module docstring)."""

    def __init__(self, kind: str, start: float, final: float, ramp_start_step: int, total_steps: int):
        self.kind, self.start, self.final = kind, start, final
        self.ramp_start_step, self.total_steps = ramp_start_step, total_steps

    def __call__(self, k: int) -> float:
        if self.kind == "constant" or k <= self.ramp_start_step:
            return self.start
        progress = min(1.0, (k - self.ramp_start_step) / max(1, self.total_steps - self.ramp_start_step))
        shape = progress if self.kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.start + (self.final - self.start) * shape


def weight_decay_schedule(section: Any, total_steps: int) -> WeightDecaySchedule:
    """The schedule of an ``[optimizer]`` section (validated there) over ``total_steps``."""
    if section.weight_decay_schedule not in WD_SCHEDULES:
        raise ValueError(f"weight decay schedule {section.weight_decay_schedule!r} is unknown: use one of "
                         f"{list(WD_SCHEDULES)}")
    final = section.weight_decay if section.weight_decay_final is None else section.weight_decay_final
    return WeightDecaySchedule(section.weight_decay_schedule, section.weight_decay, final,
                               round(section.weight_decay_ramp_start * total_steps), total_steps)


def _describe(s: WeightDecaySchedule | dict[str, Any]) -> str:
    v = s if isinstance(s, dict) else vars(s)
    return (f"{v['kind']} {v['start']:g} -> {v['final']:g} from step {v['ramp_start_step']} to "
            f"{v['total_steps']}")


class WeightDecayComponent(Component):
    """Sets the decayed groups' ``weight_decay`` before every step; adds ``weight_decay``
    to every training record (the value the step's update used)."""

    name = "weight_decay_schedule"

    def __init__(self, section: Any, total_steps: int):
        self.schedule = weight_decay_schedule(section, total_steps)
        self._used: dict[int, float] = {}  # step (as recorded) -> its weight decay, until its window is logged
        self._saved: dict[str, Any] | None = None  # the loaded checkpoint's schedule, until on_load compares
        self._missing_at: Any = None  # a checkpoint without this state: said once on load

    def value(self, loop: Any) -> float:
        return self.schedule(loop.schedulers[0].last_epoch)

    def on_step_start(self, loop: Any) -> None:
        wd = self.value(loop)
        for opt in loop.optimizers:
            for group in decayed_groups(opt):
                group["weight_decay"] = wd
        self._used[loop.step + 1] = wd

    def on_log(self, loop: Any, window: Any) -> None:
        current = self.value(loop)
        window.per_step["weight_decay"] = [self._used.pop(s, current) for s in window.steps]

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self.schedule))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = {k: state[k] for k in ("kind", "start", "final", "ramp_start_step", "total_steps")}

    def on_missing_state(self, loop: Any, path: Any) -> None:
        self._missing_at = path

    def on_load(self, loop: Any) -> None:
        self._used.clear()
        saved, missing = self._saved, self._missing_at
        self._saved = self._missing_at = None
        if not loop.is_main:
            return
        k = loop.schedulers[0].last_epoch
        if missing is not None:
            loop.log.info(f"weight decay schedule: {missing} has none (a constant-decay run): "
                          f"{_describe(self.schedule)} from step {k}, weight decay {self.schedule(k):g}")
        elif saved is not None and saved != vars(self.schedule):
            old = WeightDecaySchedule(**saved)
            loop.log.info(f"weight decay schedule changed on resume: {_describe(saved)} -> "
                          f"{_describe(self.schedule)}; from step {k}, weight decay {old(k):g} -> "
                          f"{self.schedule(k):g}")
