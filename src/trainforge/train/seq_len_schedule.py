"""``training.seq_len_schedule``: the sequence length as a choice of the trainer, at a
constant number of tokens per step (sequence length warmup: Li et al. 2022, "The
Stability-Efficiency Dilemma"; short sequences early are cheaper per token and stabler).

* ``fixed`` (default): every step at ``training.seq_len``; no component is registered,
  so the run is the one it was before this existed, bit for bit.
* ``linear``: from ``training.seq_len_start`` to ``training.seq_len`` over
  ``training.seq_len_ramp_steps`` steps.
* ``auto``: start at ``seq_len_start`` and double the length each time the training loss
  plateaus (``adaptive_lr.loss_trend``'s plateau test, the adaptive LR's: one detector),
  up to ``training.seq_len``.

The lengths a schedule may use (its *ladder*) are the multiples of
``training.seq_len_multiple`` that divide ``training.seq_len`` (``auto``: start x 2^k).
The loader keeps reading the same windows of ``seq_len + 1`` tokens in the same order and
serves each one as ``seq_len / n`` rows of ``n`` tokens (``ShardLoader.serve_seq_len``):
the batch becomes ``batch_size x seq_len / n`` sequences, every (input, target) pair is the
one the full-length batch holds, the data position (global batches of full windows) and the
tokens per step never change, and nothing is skipped or read twice. A row never spans two
windows, which is why a length must divide ``seq_len``: a linear ramp's value in between
two lengths is rounded down to the ladder (the ladder is logged at the start), and a start
length off the ladder is refused naming the keys. Validation always runs at full length
(the fixed validation set), so ``val_loss`` stays comparable across lengths and runs.

The length of each step is decided before it runs: ``linear`` from the step number alone,
``auto`` at the end of a logging window (on the window's mean loss at the current length,
the same host values on every rank) for the steps after it. Its state (the length and the
plateau window) is checkpointed, so a run resumed anywhere, also right at a change,
serves every later step at the length the uninterrupted run did: bit-identical losses.
"""

from __future__ import annotations

import math
from typing import Any

from trainforge.train.adaptive_lr import loss_trend
from trainforge.train.component import Component
from trainforge.train.seq_len_ladder import ladder


class SeqLenSchedule(Component):
    """The length each step is served at (see the module docstring). Sets it on
    ``loop.train_batches`` before every step; adds ``seq_len`` to every training record."""

    name = "seq_len_schedule"

    def __init__(self, tcfg: Any):
        self.kind, self.seq_len, self.batch_size = tcfg.seq_len_schedule, tcfg.seq_len, tcfg.batch_size
        self.lengths = ladder(tcfg)
        self.ramp_steps, self.warmup_steps = tcfg.seq_len_ramp_steps, tcfg.warmup_steps
        self.window, self.rel_delta = tcfg.seq_len_plateau_window, tcfg.seq_len_plateau_rel_delta
        self.current = self.lengths[0]  # auto: the live length; linear: recomputed from the step
        self._losses: list[float] = []  # auto: mean loss of each logging window at the current length
        self._served: dict[int, int] = {}  # step (as recorded) -> its length, until its window is logged
        self._last_served: int | None = None  # what the loader serves now (None: not set since start or load)

    def length_at(self, step: int) -> int:
        """The length of the step after ``step`` steps (linear: the ramp rounded down to the ladder)."""
        if self.kind != "linear":
            return self.current
        start = self.lengths[0]
        want = start + (self.seq_len - start) * min(1.0, step / self.ramp_steps)
        return max(n for n in self.lengths if n <= want)

    def rows(self, n: int) -> int:
        return self.batch_size * self.seq_len // n

    def on_step_start(self, loop: Any) -> None:
        n = self.current = self.length_at(loop.step)
        self._served[loop.step + 1] = n
        if n == self._last_served:
            return
        loop.train_batches.serve_seq_len(n)
        if loop.is_main:
            if self._last_served is None:
                ladder_text = ", ".join(f"{m} (batch {self.rows(m)})" for m in self.lengths)
                loop.log.info(f"seq_len schedule {self.kind}: step {loop.step + 1} at seq_len {n}; lengths "
                              f"{ladder_text}; tokens per step unchanged")
            else:
                why = "linear ramp" if self.kind == "linear" else "the training loss plateaued"
                loop.log.info(f"step {loop.step + 1}: seq_len {self._last_served} -> {n} ({why}; batch "
                              f"{self.rows(self._last_served)} -> {self.rows(n)} sequences, same tokens per step)")
        self._last_served = n

    def on_log(self, loop: Any, window: Any) -> None:
        lengths = [self._served.pop(s, self.current) for s in window.steps]
        window.per_step["seq_len"] = lengths
        if self.kind != "auto" or self.current >= self.seq_len or window.steps[0] <= self.warmup_steps:
            return
        # Only steps at the current length: a longer context lowers the loss, so windows are never mixed.
        at = [x for x, n in zip(window.losses, lengths) if n == self.current and math.isfinite(x)]
        if not at:
            return
        self._losses.append(sum(at) / len(at))
        if len(self._losses) > self.window:
            self._losses.pop(0)
        if len(self._losses) == self.window and loss_trend(self._losses, self.rel_delta, math.inf) == "plateau":
            self.current, self._losses = self.current * 2, []

    def on_load(self, loop: Any) -> None:
        self._served.clear()
        self._last_served = None  # the next step sets the loader again and logs where the run stands

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "seq_len": self.current, "losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = int(state["seq_len"])
        if self.kind == "auto" and n not in self.lengths:
            raise ValueError(f"its seq_len {n} is not on this run's ladder {self.lengths} (training.seq_len_start, "
                             "training.seq_len)")
        self.current = n if self.kind == "auto" else self.lengths[0]
        self._losses = [float(x) for x in state["losses"]] if self.kind == "auto" else []
