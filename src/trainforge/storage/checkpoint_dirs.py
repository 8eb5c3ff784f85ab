"""A run's checkpoints on disk: ``RUN_DIR/checkpoints/step_NNNNNNN/`` directories.

A checkpoint is written into the hidden ``.step_NNNNNNN.tmp`` and renamed into place only
when complete (``atomic.commit_directory``), so a crash mid-save never leaves a directory
that looks like a checkpoint. Old checkpoints are renamed to a hidden name before they are
deleted, so a kill mid-delete never leaves a half-deleted ``step_*`` directory either;
hidden leftovers go at the next save. A ``step_*`` directory without a valid
``meta.json`` is incomplete: listed as such, never loaded.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

from trainforge.errors import CheckpointError
from trainforge.log import get_logger
from trainforge.storage.atomic import commit_directory, remove_directory
from trainforge.storage.checkpoint_format import META, meta_problem

_STEP_DIR = re.compile(r"^step_(\d{7,})$")
# Hidden dirs of our own: ``.step_N.tmp`` (being written), ``.step_N.deleting`` (being removed).
_LEFTOVER = re.compile(r"^\.step_\d{7,}\.")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoint_step(ckpt: Path) -> int:
    """The step in a ``step_NNNNNNN`` directory's name."""
    m = _STEP_DIR.match(ckpt.name)
    if m is None:
        raise CheckpointError(f"{ckpt} is not a step_NNNNNNN checkpoint directory")
    return int(m.group(1))


def scan_checkpoints(ckpt_root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """``(complete, incomplete)`` ``step_*`` directories under ``ckpt_root``, oldest first;
    each incomplete one with the reason. Hidden directories (being written or deleted)
    are neither."""
    if not ckpt_root.is_dir():
        return [], []
    found = sorted((int(m.group(1)), d) for d in ckpt_root.iterdir()
                   if (m := _STEP_DIR.match(d.name)) and d.is_dir())
    complete, incomplete = [], []
    for step, d in found:
        problem = meta_problem(d, step)
        if problem is None:
            complete.append(d)
        else:
            incomplete.append((d, problem))
    return complete, incomplete


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (those with a valid meta.json) under ``ckpt_root``, oldest first."""
    return scan_checkpoints(ckpt_root)[0]


def remove_checkpoint(ckpt: Path) -> None:
    """Delete a checkpoint directory: first renamed to a hidden name (atomic), so a kill
    mid-delete leaves a leftover the next save removes, never a half-deleted ``step_*``."""
    remove_directory(ckpt)


def remove_leftovers(ckpt_root: Path) -> None:
    """Remove hidden ``.step_*`` directories left by a kill mid-save or mid-delete (rank 0,
    only while no save is in progress)."""
    if ckpt_root.is_dir():
        for d in ckpt_root.iterdir():
            if _LEFTOVER.match(d.name) and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


def begin_step_dir(ckpt_root: Path, step: int) -> Path:
    """Create the hidden temporary directory a checkpoint is written into (rank 0 only;
    its name is deterministic so every rank of a job writes its shards into the same one)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(ckpt_root)  # a crash mid-save or mid-delete: never a valid checkpoint
    tmp = ckpt_root / f".{step_dir_name(step)}.tmp"
    tmp.mkdir()
    return tmp


def commit_step_dir(ckpt_root: Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Rename the complete ``tmp`` (meta.json written last) to ``step_NNNNNNN``, replacing a
    checkpoint of the same step (re-saving after a resume), then delete all but the newest
    ``keep_last``. ``tmp`` is removed if anything fails (rank 0 only)."""
    final = ckpt_root / step_dir_name(step)
    try:
        commit_directory(tmp, final, replace=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        remove_checkpoint(old)
    return final


def warn_incomplete(incomplete: list[tuple[Path, str]], chosen: Path | None, warn: Callable[[str], None]) -> None:
    for d, why in incomplete:
        newer = chosen is not None and checkpoint_step(d) > checkpoint_step(chosen)
        warn(f"checkpoint {d} is incomplete ({why}): skipped"
             + (f"; using the newest complete one, {chosen.name}, instead" if newer else ""))


def steps_text(ckpts: list[Path]) -> str:
    return ", ".join(str(checkpoint_step(d)) for d in ckpts) or "none"


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (``config.json``, no ``meta.json``)
    rather than a trainforge checkpoint: how ``load_model`` and the QAT grid lookup tell them apart."""
    return (path / "config.json").is_file() and not (path / META).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory, a ``checkpoints/`` directory or a run directory;
    return the newest complete checkpoint directory (incomplete ones are skipped with a
    warning naming them)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        found, incomplete = scan_checkpoints(root)
        if found:
            warn_incomplete(incomplete, found[-1], get_logger().warning)
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    raise CheckpointError(f"{path}: no complete checkpoint (a step_NNNNNNN directory with {META}) found")
