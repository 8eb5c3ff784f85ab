"""Why a run ends before ``training.steps`` without being asked by the loop itself:
a signal (SIGINT, SIGTERM, SIGHUP), or a non-finite loss.

Signals are job-wide. A signal reaches one rank (``kill``, a scheduler, Ctrl-C in one
terminal), all of them (``torchrun`` forwards its SIGTERM to every worker, then SIGKILLs
them after its grace period), or only some of them. Acting on it where it arrived would
send that rank off to checkpoint while the others start the next step, each then
waiting on the other in a collective for ever. So the handler only records the signal;
the trainer asks ``agreed()`` at the end of each logging window (a step every rank
reaches, whatever the signal did) and one tiny all-reduce over all ranks gives every
rank the same answer at the same step: every rank stops there, one checkpoint is
written, and the command exits ``exit_codes.STOPPED``. A single process looks every
step (nothing to agree on, no collective).

Before the loop starts (reading and checking the data and the checkpoint, building the
model) there is nothing to save, and that work can be long (a big checkpoint, a shape
the memory check has yet to refuse): a signal there ends the command at once with
``killed_by(signum)``, by raising ``StartupInterrupted`` in the main thread, so no
start-up step has to look for it. The loop marks its start (``loop_started``).

A second signal exits at once, without a checkpoint: ``killed_by(signum)``. Once the
command knows how it ends (``outcome``: the checkpoint is written, or there is nothing
to save), a signal exits at once with that code, and a ``torchrun`` worker ignores
them while it exits: ``torchrun`` SIGTERMs the ranks still shutting down as soon as
the first one exited non-zero, and Python drops its handlers early in interpreter
shutdown (before the second or so torch takes to tear down), which would turn their
75 into a kill. ``SIG_IGN`` survives that; SIGKILL still ends a rank that hangs.

A non-finite loss is caught at the logging interval, where the window's losses are
read anyway (no extra host sync), when no ``[bad_steps]`` policy handles it: the run
ends with ``NonFiniteLoss`` before that state can be checkpointed.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist

from trainforge import exit_codes
from trainforge.errors import TrainforgeError
from trainforge.train.component import Component


class StartupInterrupted(BaseException):
    """A stop signal arrived before the training loop started: nothing to save yet, so the
    command ends at once with ``exit_code`` (128 + the signal). A ``BaseException``: start-up
    code that turns an ``Exception`` into one error line (a damaged file) must let it through."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name} before training started: nothing to save")
        self.exit_code = exit_codes.killed_by(signum)


class StopSignals:
    """The SIGINT/SIGTERM/SIGHUP handlers of one command and the signal they recorded.
    ``received`` is this rank's first signal number (0: none); ``outcome`` the exit code,
    set by the command once it is decided (nothing is left to save); ``training``: the loop
    has started (``loop_started``), so a signal is recorded, not raised."""

    def __init__(self) -> None:
        self.received = 0
        self.outcome: int | None = None
        self.training = False
        self._previous: dict[int, object] = {}

    def loop_started(self) -> None:
        """From here a signal stops the run at the end of a logging window, with a checkpoint."""
        self.training = True

    @contextlib.contextmanager
    def installed(self, ignore_after_outcome: bool = False) -> Iterator["StopSignals"]:
        """Handle the signals inside the block, then restore the previous handlers; with
        ``ignore_after_outcome`` (a torchrun worker) and a non-zero ``outcome``, ignore
        them instead, for the rest of the process's exit (see the module docstring).
        Outside the main thread (where Python cannot set handlers) nothing is installed."""
        if threading.current_thread() is threading.main_thread():
            for sig in exit_codes.SIGNALS_THAT_STOP:
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, signal.SIG_IGN if ignore_after_outcome and self.outcome else handler)
            self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.outcome is not None:  # decided and saved: nothing left to lose
            os._exit(self.outcome)
        if not self.received and not self.training:
            self.received = signum
            _say(f"trainforge: received {name} before training started: exiting now (nothing to save yet)")
            raise StartupInterrupted(signum)
        if not self.received:
            self.received = signum
            # os.write: the interrupted code may be inside sys.stderr's own write.
            _say(f"trainforge: received {name}: stopping all ranks at the end of this logging window, "
                 "with a checkpoint (a second signal exits at once)")
            return
        _say(f"trainforge: second signal ({name}): exiting now, without a checkpoint")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(exit_codes.killed_by(signum))

    def agreed(self, world_size: int, device: torch.device) -> str | None:
        """The stop reason every rank agrees on (the same on all of them), or None.
        Collective when ``world_size > 1``: call it at the same step on every rank."""
        signum = self.received
        if world_size > 1:
            flag = torch.tensor([signum], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return f"received {signal.Signals(signum).name}" if signum else None


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


class NonFiniteLoss(TrainforgeError):
    """The training loss (or the gradient norm) became NaN or infinite."""

    exit_code = exit_codes.NONFINITE_LOSS


def check_finite(steps: list[int], losses: list[float], grad_norms: list[float] | None, lr: float,
                 run_dir: object) -> None:
    """Raise ``NonFiniteLoss`` naming the first step of the window whose loss (or, when
    given, gradient norm: an infinite norm turns the weights to NaN in that very step
    while its loss is still finite) is not finite. ``losses`` are the all-reduced window
    means, the same values on every rank, so every rank raises at the same step."""
    norms = grad_norms if grad_norms is not None else [0.0] * len(losses)
    for step, loss, norm in zip(steps, losses, norms):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {norm} (loss {loss:.4g})"
            raise NonFiniteLoss(f"training diverged: {what} at step {step}; nothing from this state was saved. "
                                f"Lower training.lr (now {lr:g}), enable [bad_steps] to skip or roll back such "
                                f"steps, or resume from the last checkpoint (before step {step}) with a lower "
                                f"rate: --resume {run_dir} --training.lr ...")


class FiniteLossCheck(Component):
    """The default non-finite policy as a loop component (registered when no
    ``[bad_steps]`` guard handles such steps): after a logging window's records are
    written, ``check_finite`` on its losses (and norms, unless an fp16 loss scaler skips
    inf-gradient steps itself). ``lr`` and ``run_dir`` are for the message."""

    name = "finite_loss"

    def __init__(self, lr: float, run_dir: object, check_norms: bool):
        self.lr, self.run_dir, self.check_norms = lr, run_dir, check_norms

    def after_log(self, loop: Any, window: Any) -> None:
        # Identical on every rank (all-reduced losses, global norms): every rank raises at the same step.
        check_finite(window.steps, window.losses, window.norms if self.check_norms else None, self.lr, self.run_dir)
