"""Atomic writes: a file or a directory is written under a temporary name in the same
directory, fsynced, and renamed into place, so a reader (or the next run, after a crash
or a kill) sees the old version or the new one, never a torn one.

The rename is atomic only within one filesystem, hence the temporary beside the target.
After the rename the parent directory is fsynced too: without that a power loss can
forget the rename itself. Hand-written because the standard library offers no atomic
write and the small packages that do (``atomicwrites``) are unmaintained.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# Directories a run shares with other users and ranks (mkdtemp makes them 0700).
DIR_MODE = 0o755


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable. Best effort: some filesystems
    (and Windows) cannot open or fsync a directory, which only weakens durability."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file another writer closed (safetensors, torch.save, DCP shards) to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data: bytes, tmp_prefix: str = ".tmp-") -> None:
    """Replace ``path`` with ``data`` atomically and durably. The temporary is named
    ``<tmp_prefix>XXXX`` in ``path``'s directory (a reader that finds one after a crash
    may delete it) and is removed if the write fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the file replaced was readable by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, tmp_prefix: str = ".tmp-") -> None:
    atomic_write_bytes(path, text.encode("utf-8"), tmp_prefix)


def atomic_write_json(path: Path, obj: Any, indent: int | None = 2, tmp_prefix: str = ".tmp-") -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent), tmp_prefix)


def _host() -> str:
    # The host in the name: a shared filesystem's temporaries of another machine's live processes
    # are never taken for dead ones (their pid means nothing here).
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's live process, or a pid this platform cannot signal: keep
    return True


def remove_stale_temp_dirs(final: Path) -> list[Path]:
    """Remove the temporaries of writers of ``final`` that died before committing
    (``.NAME.tmp-HOST-PID-XXXX`` of this host whose process is gone: a killed export, quantize or
    prepare). A live writer's, another host's and an unrecognised name are left alone. Returns
    the removed ones."""
    final = Path(final)
    prefix = f".{final.name}.tmp-{_host()}-"
    removed = []
    try:
        siblings = list(final.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        if not p.name.startswith(prefix):
            continue
        pid, _, _ = p.name[len(prefix):].partition("-")
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def make_temp_dir(final: Path) -> Path:
    """A new, uniquely named hidden directory beside ``final`` (``.NAME.tmp-HOST-PID-XXXX``)
    to write a directory's contents into before ``commit_directory``; dead writers' leftovers
    beside it are removed first (``remove_stale_temp_dirs``)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{_host()}-{os.getpid()}-", dir=final.parent))
    tmp.chmod(DIR_MODE)
    return tmp


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and make its directories ``DIR_MODE``."""
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fsync_file(p)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        d.chmod(DIR_MODE)


def commit_directory(tmp: Path, final: Path, replace: bool = False) -> Path:
    """Rename the fully written directory ``tmp`` to ``final`` (same parent), after
    fsyncing everything in it.

    ``replace=False``: plain ``os.replace``, which takes the place of a missing or empty
    ``final`` and raises ``OSError`` when ``final`` is a non-empty directory (so of two
    racing writers exactly one wins). ``replace=True``: an existing ``final`` is first
    renamed to ``.NAME.deleting``, the new one renamed in, and only then the old one
    deleted, so a kill at any point leaves one complete ``final`` (plus a hidden leftover)."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if replace and final.exists():
        trash = final.parent / f".{final.name}.deleting"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(final, trash)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def remove_directory(path: Path) -> None:
    """Delete a directory so that a kill midway never leaves it half-deleted under its own
    name: renamed to the hidden ``.NAME.deleting`` first (atomic), then removed; a leftover
    is removed by the next caller's clean-up."""
    path = Path(path)
    trash = path.parent / f".{path.name}.deleting"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def atomic_directory(final: Path, replace: bool = False) -> Iterator[Path]:
    """``with atomic_directory(out) as tmp:`` write into ``tmp``; on a clean exit it is
    committed to ``out`` (``commit_directory``), on an exception removed."""
    tmp = make_temp_dir(final)
    try:
        yield tmp
        commit_directory(tmp, final, replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
