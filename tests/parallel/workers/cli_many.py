"""Worker: several ``trainforge train`` command lines, one after another, in ONE torchrun
launch. Each run goes through the real CLI (``trainforge.cli.main``: config, layout
checks, Trainer, exit code, printed summary); only the process-group teardown at the end
of each run is skipped, so the next run joins the same group (``init_distributed`` is
idempotent) instead of a new launch. A launch costs ~6 s on 2 cores (the launcher and
every rank import torch, and torch.optim imports torch._dynamo in every rank), often more
than a 6-step debug run itself.

    torchrun --nproc_per_node=N tests/parallel/workers/cli_many.py RUNS_JSON

RUNS_JSON: a JSON list of ``[name, [train argv...]]`` or ``[name, [train argv...],
["module:function", [args...], every_rank]]``: for the latter, rank 0 (or every rank) first
calls the function (a step the run needs, such as copying an earlier run of the launch;
torchrun.Prepared), and the other ranks wait for it at the run's begin mark. Rank 0 writes ``MARK`` lines
(tests/parallel/torchrun.py splits the output on them): ``begin NAME`` on stdout and
stderr before a run, ``end NAME RC`` after it, each after a barrier so every rank's lines
of a run fall between its two marks. A run that fails on any rank ends the launch (the
other ranks would wait on it), so the later runs report no ``end``."""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch.distributed as dist

from trainforge import cli
from trainforge.parallel import distributed

MARK = "@@cli_many"


def mark(text: str) -> None:
    if dist.is_initialized():  # the first run's Trainer makes the group (with its distributed.timeout_s)
        dist.barrier()
    if os.environ.get("RANK", "0") == "0":
        for stream in (sys.stdout, sys.stderr):
            print(f"{MARK} {text}", file=stream, flush=True)


def prepare(name: str, step: list) -> None:
    """Rank 0 (every rank if ``every_rank``) calls ``step`` = ["module:function", [args],
    every_rank] before run ``name``."""
    fn_name, args, every_rank = step
    if not every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        raise SystemExit(f"cli_many: run {name!r} has a prepare step but no run before it made the process "
                         "group, so the other ranks could not wait for it; put a plain run first")
    if every_rank or os.environ.get("RANK", "0") == "0":
        module, _, qualname = fn_name.partition(":")
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        fn(*args)


def main() -> None:
    runs = json.loads(sys.argv[1])
    teardown = distributed.destroy_distributed
    distributed.destroy_distributed = lambda: None  # the CLI's end-of-run teardown: kept for the last run
    try:
        for name, argv, *step in runs:
            if step:
                prepare(name, step[0])
            mark(f"begin {name}")  # its barrier: every rank starts after rank 0's prepare step
            rc = cli.main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
            mark(f"end {name} {rc}")
    finally:
        distributed.destroy_distributed = teardown
    teardown()


if __name__ == "__main__":
    main()
