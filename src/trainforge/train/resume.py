"""Where a ``trainforge train`` run starts and how it runs to its end: ``--resume RUN_DIR`` /
``--resume auto`` / ``--from_step N`` resolved to a run directory and whether to resume
(``resolve``), the pipeline re-balance restart loop (``fit``) and the process exit code of a
run's outcome (``exit_code``). Errors a user can fix raise ``ConfigError`` in one line."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainforge import exit_codes
from trainforge.errors import ConfigError


@dataclass(frozen=True)
class RunStart:
    run_dir: Path
    resume: bool                # continue run_dir from a checkpoint
    saved_config: Path | None   # the run's config.toml, the base of the config when resuming
    from_step: int | None


def resolve(run_dir: str | None, resume: str | None, from_step: int | None) -> RunStart:
    """``--run_dir``, ``--resume`` and ``--from_step`` as given -> where the run starts.
    ``--resume auto`` (one command line for ``torchrun --max-restarts``) continues ``run_dir``
    when it holds a complete checkpoint, else starts it."""
    resuming = bool(resume)
    if resume == "auto":
        if not run_dir:
            raise ConfigError("--resume auto needs --run_dir DIR (for a directory named auto, write --resume ./auto)")
        if from_step is not None:
            raise ConfigError("--from_step needs --resume RUN_DIR; --resume auto continues from the newest checkpoint")
        from trainforge.log import get_logger
        from trainforge.train.checkpoint import scan_checkpoints

        # Complete checkpoints only (valid meta.json): what every rank of a restarted job
        # sees alike, whatever the previous attempt was doing when it was killed.
        complete, incomplete = scan_checkpoints(Path(run_dir) / "checkpoints")
        resuming = bool(complete)
        resume = run_dir if resuming else None
        if incomplete and not resuming and os.environ.get("RANK", "0") == "0":
            get_logger().warning(f"--resume auto: {run_dir} has no complete checkpoint ("
                                 + ", ".join(f"{d.name}: {why}" for d, why in incomplete) + "); starting fresh")
    elif from_step is not None and not resume:
        raise ConfigError("--from_step N needs --resume RUN_DIR")
    if not resuming:
        where = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        return RunStart(where, False, None, None)
    where = Path(resume)
    if run_dir and Path(run_dir) != where:
        raise ConfigError("--run_dir and --resume name different directories; --resume DIR continues DIR")
    saved = where / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"--resume {where}: no config.toml there; is it a trainforge run directory?")
    return RunStart(where, True, saved, from_step)


def fit(cfg, run_dir: Path, resume: bool, from_step: int | None, signals) -> tuple:
    """Build the trainer and train, re-splitting the pipeline when it asks to: ``(trainer, summary)``.
    The process group is torn down (a barrier) when every rank ends at the same step: completed,
    stopped, or a non-finite loss; never after a peer failed (the barrier would wait on it)."""
    from trainforge.parallel.distributed import destroy_distributed
    from trainforge.train.component import StopKind
    from trainforge.train.stop_signals import NonFiniteLoss
    from trainforge.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir, resume=resume, from_step=from_step)
    while True:
        failed = True
        try:
            summary = trainer.fit(signals)
            failed = False
        except NonFiniteLoss:
            destroy_distributed()  # every rank raised at the same step (all-reduced losses)
            signals.outcome = exit_codes.NONFINITE_LOSS
            raise
        finally:
            trainer.close(failed)
        if summary.get("stopped_by") is not StopKind.REBALANCE:
            break
        # Pipeline re-balance: the checkpoint just written is reloaded into a fresh split
        # measured now (pp_split = auto); resume is exact, so training is unchanged.
        trainer = Trainer(cfg, run_dir, resume=True)
    destroy_distributed()
    return trainer, summary


def exit_code(summary: dict) -> int:
    """Early stopping ends a run as complete as reaching training.steps (0: torchrun restarts
    any other code); a [bad_steps] stop is a diverged run; any other stop saved a checkpoint."""
    from trainforge.train.component import StopKind

    if summary.get("stopped_by") is None or summary.get("stopped_by") is StopKind.EARLY_STOP:
        return exit_codes.COMPLETED
    if summary.get("stopped_by") is StopKind.BAD_STEPS:
        return exit_codes.NONFINITE_LOSS
    return exit_codes.STOPPED
