"""One rank-aware logger. Rank 0 logs at INFO; other ranks only warnings and up,
so a 64-rank job prints one line per event, not 64.

Lines go to whatever ``sys.stderr`` is when they are written, not when the logger was
made: while the console's live progress bar redirects stderr (``train/metrics.py``),
a log line prints above the bar instead of through it.

The logger also keeps the PyTorch profiler's C++ logger (kineto) quiet: without that, every
profiled step (the communication-share probe, ``monitor.profile_every``) printed
``USDT: ... profiler_start`` / ``profiler_stop`` lines of its own into the training log.
Kineto reads ``KINETO_LOG_LEVEL`` once, when the process first starts a profiler, and has no
level that keeps its errors but drops those lines (they rank above errors), so all of it goes;
set ``KINETO_LOG_LEVEL`` yourself (e.g. 0) to see it again.
"""

from __future__ import annotations

import logging
import os
import sys

# Above every level kineto has (VERBOSE 0 ... USDT 5): its logger prints nothing.
KINETO_SILENT = "99"


class _Stderr(logging.StreamHandler):
    """A StreamHandler on the current ``sys.stderr`` (looked up at each line)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def quiet_profiler() -> None:
    """Silence kineto's own lines for this process (and the processes it starts), unless the
    user set ``KINETO_LOG_LEVEL``. Effective only before the process's first profiler."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)


def get_logger(name: str = "trainforge") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        quiet_profiler()
        rank = int(os.environ.get("RANK", "0"))
        handler = _Stderr()
        prefix = f"[rank{rank}] " if "RANK" in os.environ else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        logger.propagate = False
    return logger
