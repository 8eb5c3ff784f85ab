"""The lengths a ``training.seq_len_schedule`` may use (its *ladder*) and the checks of
its keys, apart from the component (``seq_len_schedule.py``) so that validating a config
imports no torch. A row of a batch is a piece of one ``seq_len + 1``-token window, so
every length divides ``training.seq_len``; see ``seq_len_schedule.py`` for why."""

from __future__ import annotations

import math
from typing import Any

from trainforge.errors import ConfigError


def allowed_lengths(seq_len: int, multiple: int) -> list[int]:
    """Every length a row of a ``seq_len`` window can have: multiples of ``multiple`` dividing it."""
    return [n for n in range(multiple, seq_len + 1, multiple) if seq_len % n == 0]


def ladder(tcfg: Any) -> list[int]:
    """The lengths ``tcfg``'s schedule uses, ascending (``[seq_len]`` for fixed)."""
    if tcfg.seq_len_schedule == "fixed":
        return [tcfg.seq_len]
    start = start_length(tcfg)
    if tcfg.seq_len_schedule == "auto":
        out = [start]
        while out[-1] < tcfg.seq_len:
            out.append(out[-1] * 2)
        return out
    return [n for n in allowed_lengths(tcfg.seq_len, tcfg.seq_len_multiple) if n >= start]


def start_length(tcfg: Any) -> int:
    return tcfg.seq_len_start or tcfg.seq_len // 4


def check_schedule_keys(tcfg: Any) -> None:
    """The ``[training]`` keys of a non-fixed schedule (``TrainingSection.validate``):
    ``ConfigError`` naming the key and the values that work."""
    if tcfg.seq_len_schedule == "fixed":
        return
    kind, seq_len, multiple = tcfg.seq_len_schedule, tcfg.seq_len, tcfg.seq_len_multiple
    if multiple < 1 or seq_len % multiple:
        raise ConfigError(f"config key 'training.seq_len_multiple' = {multiple} is not allowed: with "
                          f"training.seq_len_schedule = {kind!r} it must be an integer >= 1 dividing "
                          f"training.seq_len ({seq_len}), e.g. 8")
    start = start_length(tcfg)
    allowed = [n for n in allowed_lengths(seq_len, multiple) if n < seq_len] or [seq_len]
    where = "training.seq_len_start" if tcfg.seq_len_start else "training.seq_len_start (unset: seq_len / 4)"
    if start not in allowed:
        raise ConfigError(f"config key '{where}' = {start} is not allowed: a shorter sequence is a piece of one "
                          f"training.seq_len window, so every length must divide training.seq_len ({seq_len}) and "
                          f"be a multiple of training.seq_len_multiple ({multiple}); use one of {allowed}")
    if kind == "auto" and (seq_len // start) & (seq_len // start - 1):
        doubles = [n for n in allowed if (seq_len // n) & (seq_len // n - 1) == 0]
        raise ConfigError(f"config key '{where}' = {start} is not allowed with training.seq_len_schedule = 'auto': "
                          f"auto doubles the length, so training.seq_len ({seq_len}) / seq_len_start must be a "
                          f"power of two; use one of {doubles or [seq_len]}, or seq_len_schedule = 'linear'")
    if kind == "linear" and tcfg.seq_len_ramp_steps < 1:
        raise ConfigError(f"config key 'training.seq_len_ramp_steps' = {tcfg.seq_len_ramp_steps} is not allowed: "
                          "an integer >= 1 (steps from seq_len_start to training.seq_len)")
    if kind == "auto":
        if tcfg.seq_len_plateau_window < 4:
            raise ConfigError(f"config key 'training.seq_len_plateau_window' = {tcfg.seq_len_plateau_window} is not "
                              "allowed: an integer >= 4 (the plateau test compares two halves of two)")
        d = tcfg.seq_len_plateau_rel_delta
        if not (math.isfinite(d) and 0 <= d < 1):
            raise ConfigError(f"config key 'training.seq_len_plateau_rel_delta' = {d} is not allowed: a number "
                              "in [0, 1)")


def check_schedule_layout(tcfg: Any, parallel: Any, transforms: list[dict]) -> str | None:
    """Refuse, naming the keys, what a changing length cannot run with (``check_run``);
    returns a note for the log (None: nothing to say)."""
    kind = tcfg.seq_len_schedule
    if kind == "fixed":
        return None
    if parallel.pp > 1:
        # The pipeline's stages and the activations between them are built for one
        # (microbatch, seq_len, dim) shape (parallel/pipeline.py, step_layout.PipelineStep).
        raise ConfigError(f"config key 'training.seq_len_schedule' = {kind!r} is not allowed with parallel.pp = "
                          f"{parallel.pp}: pipeline stages are built for one sequence length; use "
                          "seq_len_schedule = 'fixed' or parallel.pp = 1")
    for i, t in enumerate(transforms):
        if t.get("name") == "seq_curriculum":
            raise ConfigError(f"config keys 'training.seq_len_schedule' = {kind!r} and "
                              f"'data.augment.transforms[{i}]' (seq_curriculum) both change the sequence length: "
                              "pick one (the schedule keeps tokens per step constant and resumes exactly; "
                              "remove the transform, or set seq_len_schedule = 'fixed')")
    tp = parallel.tp
    if tp > 1 and parallel.sequence_parallel and getattr(parallel, "tp_mode", "1d") == "1d":  # 2d: no sequence split
        odd = [n for n in ladder(tcfg) if n % tp]
        if odd:
            raise ConfigError(f"config key 'training.seq_len_start' = {start_length(tcfg)} is not allowed with "
                              f"parallel.tp = {tp} and sequence_parallel: the lengths {odd} of the schedule do not "
                              f"divide into {tp} shards; raise seq_len_start or seq_len_multiple to a multiple of "
                              f"{tp}")
    if parallel.compile:
        return (f"parallel.compile with training.seq_len_schedule = {kind!r}: the model compiles again at each "
                f"new length ({len(ladder(tcfg))} lengths)")
    return None
