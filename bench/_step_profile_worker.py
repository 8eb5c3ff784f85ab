"""`trainforge train` with one step profiled by ``torch.profiler`` on every rank, for
``bench/step_profile.py``. The step to profile is ``STEP_PROFILE_STEP`` (1-based, counted by
this process); the per-rank summary goes to ``STEP_PROFILE_OUT/rank<r>.json``: the step's
wall time, and per event name (collectives, waits, matmuls) its count and total time. The
trainer's own per-window profiler and memory tracking are off, so nothing else is profiled.
Run under torchrun in place of ``-m trainforge``."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from trainforge.train import step_stats, trainer

STEP = int(os.environ.get("STEP_PROFILE_STEP", "6"))
OUT = Path(os.environ["STEP_PROFILE_OUT"])
_seen = [0]


@contextlib.contextmanager
def _one_step_profiled(self, enabled: bool):
    _seen[0] += 1
    if _seen[0] != STEP:
        yield
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
    events: dict[str, list[float]] = {}
    for e in prof.events():
        entry = events.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.cpu_time_total / 1e6
    rank = int(os.environ.get("RANK", "0"))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank{rank}.json").write_text(json.dumps({"step_wall_s": wall, "events": events}))


step_stats.CommShareProbe.measure = _one_step_profiled
trainer.Trainer.measure_memory = property(lambda self: False, lambda self, value: None)

from trainforge.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
