"""``trainforge advise --output / --apply``: the refusal to write into (or restart) a run that is
still training, and the next run started from the advised config (``advise.next_run`` decides
resume or fresh; this runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainforge.errors import TrainforgeError
from trainforge.plan.advise import Advice, newest_checkpoint, next_run, prepare_next_run


def refuse_live_run(run_dir: Path, advised_file: Path, apply: bool) -> None:
    """A live run keeps writing its directory and would be resumed from under itself: refuse
    before anything is measured or written (the trainer holds RUN_DIR/.train.lock)."""
    from trainforge.storage.locks import RUN_LOCK_FILE, run_holder

    holder = run_holder(run_dir)
    inside = advised_file.resolve().is_relative_to(run_dir.resolve())
    if holder is not None and (apply or inside):
        who = f"pid {holder}" if holder else "a trainer"
        raise TrainforgeError(
            f"{run_dir} is still training ({who} holds {run_dir / RUN_LOCK_FILE}): "
            + ("--apply starts the next run once it has finished or been stopped (SIGTERM saves a checkpoint)"
               if apply else f"--output {advised_file} would write into it; write outside it or wait "
                             "for the run to finish"))


def start_next_run(advice: Advice, run_dir: Path, advised_file: Path, advised_text: str, json_stdout: bool) -> int:
    """Prepare the next run's directory and run it (``trainforge train`` in a child process, or
    torchrun for a multi-process run); its exit code. ``json_stdout``: stdout carries one JSON
    document, so the run's own output goes to stderr."""
    ckpt = newest_checkpoint(run_dir)
    nxt = next_run(advice, advised_file, ckpt)
    prepare_next_run(nxt, advised_text, ckpt)
    print(f"next run: {nxt.run_dir} ({nxt.why})", file=sys.stderr)
    print("running: " + " ".join(nxt.argv), file=sys.stderr, flush=True)
    out = None
    if json_stdout:
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = subprocess.DEVNULL
    return subprocess.run(nxt.argv, stdout=out).returncode
