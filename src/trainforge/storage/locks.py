"""File locks that die with their process (``fcntl.flock`` on an open file: the kernel
drops the lock when the holder exits or is killed, so no stale lock survives a crash).

    fh = hold_run(run_dir)           # the trainer, rank 0: "this run is training"
    run_holder(run_dir)              # advise: the pid training there, or None
    with wait_for_lock(path, wait_s, what="the machine probe", fix="..."):
        ...                          # bounded: a clear error after wait_s, a signal ends it

``wait_for_lock`` treats a lock held by this process's own ancestors as held for it: under
``flock /tmp/cpu.lock <command>`` (flock(1) keeps the lock while its command runs) taking
the same lock again inside the command would wait for itself forever. The holders come
from ``/proc/locks``; where that cannot be read (not Linux) the wait is still bounded.

Hand-written: ``filelock`` and ``portalocker`` poll with a timeout too, but neither knows
an outer ``flock(1)`` of an ancestor, and neither is a dependency.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from trainforge.errors import TrainforgeError

# Held by the trainer (rank 0) from the moment it writes into the run directory until it closes.
RUN_LOCK_FILE = ".train.lock"
POLL_S = 0.2


def hold_run(run_dir: str | Path) -> IO[str] | None:
    """Mark ``run_dir`` as training: an exclusive lock on ``RUN_DIR/.train.lock`` holding
    this pid, kept while the returned file stays open (close it to release). None when
    another open file already holds it (a second trainer in the same directory): the
    marker is advisory and training goes on."""
    path = Path(run_dir) / RUN_LOCK_FILE
    try:
        fh = open(path, "a+", encoding="utf-8")
    except OSError:
        return None  # advisory: a filesystem that refuses it does not stop training
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def run_holder(run_dir: str | Path) -> int | None:
    """The pid of the process training in ``run_dir`` (0 when it is not recorded), or None
    when nothing trains there (no marker, or its holder has exited)."""
    path = Path(run_dir) / RUN_LOCK_FILE
    try:
        fh = open(path, encoding="utf-8")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: released when fh closes
        except OSError:
            pass
        try:
            return int(fh.read().strip() or 0)
        except ValueError:
            return 0


# ------------------------------------------------------------------------ bounded waits


def lock_holders(path: str | Path) -> list[int]:
    """Pids holding a flock on ``path`` (``/proc/locks``; [] where it cannot be read)."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 6526 fe:00:2146882 0 EOF"; a waiter's line has "->" after the number
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key and parts[4].isdigit():
            pids.append(int(parts[4]))
    return pids


def ancestors(pid: int | None = None) -> list[int]:
    """``pid`` (default this process) and its parents up to init, from ``/proc/PID/stat``."""
    out, pid = [], pid or os.getpid()
    while pid > 1 and pid not in out:
        out.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent pid
    return out


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:80]})" if cmd else "")


@contextmanager
def wait_for_lock(path: str | Path, wait_s: float, what: str, fix: str) -> Iterator[str]:
    """Hold an exclusive flock on ``path`` for the block; yields how it is held: "taken",
    or "outer" when this process's ancestor holds it already (``flock PATH command``: the
    block runs under that lock). Waits at most ``wait_s`` seconds, polling, saying once on
    stderr whom it waits for; then TrainforgeError naming the file, the holder and ``fix``.
    A signal ends the wait as it would end any sleep (SIGINT raises, SIGTERM's default
    ends the process): no uninterruptible blocking call."""
    path = Path(path)
    with open(path, "a", encoding="utf-8") as fh:
        deadline = time.monotonic() + max(0.0, wait_s)
        said = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            holders = lock_holders(path)
            family = set(ancestors())
            if any(p in family for p in holders):
                yield "outer"
                return
            who = ", ".join(_describe(p) for p in holders) or "another process"
            if time.monotonic() >= deadline:
                raise TrainforgeError(f"{what}: waited {wait_s:.0f} s for the lock {path}, held by {who}; {fix}")
            if not said:
                print(f"{what}: waiting up to {wait_s:.0f} s for the lock {path}, held by {who}", file=sys.stderr,
                      flush=True)
                said = True
            time.sleep(POLL_S)
        yield "taken"  # released when fh closes
