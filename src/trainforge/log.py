"""One rank-aware logger. Rank 0 logs at INFO; other ranks only warnings and up,
so a 64-rank job prints one line per event, not 64."""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str = "trainforge") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        rank = int(os.environ.get("RANK", "0"))
        handler = logging.StreamHandler(sys.stderr)
        prefix = f"[rank{rank}] " if "RANK" in os.environ else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        logger.propagate = False
    return logger
