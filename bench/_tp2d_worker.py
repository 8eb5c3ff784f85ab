"""`trainforge train` with the collectives of one step recorded on every rank, for
``bench/tp2d.py``. The step is ``TP2D_COUNT_STEP`` (1-based, counted by this process); every
collective dispatched during it (forward, backward, clipping, optimizer) is recorded by
``bench.tp2d.CollectiveCounter`` and the summary goes to ``TP2D_COUNT_OUT/rank<r>.json``.
Run under torchrun as ``-m bench._tp2d_worker train ...`` (the repository root on PYTHONPATH)."""

import contextlib
import json
import os
import sys
from pathlib import Path

from bench.tp2d import CollectiveCounter, summarize
from trainforge.train import step_stats

STEP = int(os.environ.get("TP2D_COUNT_STEP", "3"))
OUT = Path(os.environ["TP2D_COUNT_OUT"])
_seen = [0]


@contextlib.contextmanager
def _one_step_counted(self, enabled: bool):
    _seen[0] += 1
    if _seen[0] != STEP:
        yield
        return
    counter = CollectiveCounter()
    with counter:
        yield
    OUT.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (OUT / f"rank{rank}.json").write_text(json.dumps({**summarize(counter.records), "records": counter.records}))


step_stats.CommShareProbe.measure = _one_step_counted

from trainforge.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
