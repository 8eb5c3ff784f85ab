"""Process exit codes of ``trainforge`` commands, one per outcome, so a scheduler or a
wrapper script can tell them apart (the README's "Exit codes" table lists them).

``torchrun --max-restarts`` restarts a job on any non-zero exit, so the outcomes that
mean "done" (completed, early-stopped) are 0 and the summary line says which.
"""

from __future__ import annotations

import signal

COMPLETED = 0          # reached training.steps, or early stopping ended the run (a complete run)
FAILED = 1             # an unexpected error (a bug, an out-of-memory kill): traceback printed
BAD_INPUT = 2          # config, data, checkpoint or request refused: one line naming the key/file and the fix
NONFINITE_LOSS = 3     # the loss became NaN/inf; the run stopped without saving the bad state
PEER_FAILED = 4        # another rank died or hung past distributed.timeout_s
STOPPED = 75           # stopped by a signal (SIGTERM/SIGINT/SIGHUP) after saving a checkpoint; resume it
                       # (75 is EX_TEMPFAIL: "try again later")


def killed_by(signum: int) -> int:
    """The shell's code for a process ended by ``signum`` without saving (a second signal)."""
    return 128 + int(signum)


SIGNALS_THAT_STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
