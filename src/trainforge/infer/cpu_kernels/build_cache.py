"""A build cache that a killed builder cannot wedge: the lock dies with its process, the product
appears at its final path whole or not at all, and a failed build is remembered.

torch's ``cpp_extension.load`` guards its build directory with ``FileBaton``: a ``lock`` file
that exists while a build runs. A builder killed mid-build (a closed terminal, SIGTERM,
``timeout``) leaves the file, and every later process waits on it forever, printing nothing.
Here instead:

- The lock is ``fcntl.flock`` on an open file (``<entry>.lock``): the kernel releases it when the
  holder exits, however it exits, and the file holds the holder's pid for the waiting message.
  The descriptor is not inherited (Python opens it close-on-exec), so an orphaned compiler
  child does not keep it either.
- Each build runs in a private directory (``<entry>.tmp-<pid>``) that is renamed onto the entry
  when the product is complete (as Triton's cache does). Whoever holds the lock removes the
  private directories of earlier builders: they are dead, or they would hold the lock.
- A failed build writes ``<entry>.failed.json`` (the reason and the toolchain it failed with), so
  a machine without a compiler pays for one attempt and one message per cache, not a failed
  build and a screen of warnings on every run. A different toolchain (a compiler installed since,
  another ``CXX``) tries again.
- A wait longer than a build can take gives up with a message that names the lock file and its
  holder; the caller goes on without the product.

Hand-written: neither torch (FileBaton) nor the stdlib has a process-robust build lock, and
``filelock`` (the usual package) polls a file whose removal after a crash is up to the caller.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

from trainforge.json_cache import read_json_cache, write_json_cache


class LockTimeout(Exception):
    """The lock stayed held past the wait limit; the message names the file and its holder."""


class BuildCache:
    """One cache entry: the directory ``entry`` holding a finished build, and beside it its
    lock (``.lock``), failure record (``.failed.json``) and the private build directories
    (``.tmp-<pid>``)."""

    def __init__(self, entry: Path):
        self.entry = entry
        self.lock_path = entry.with_name(entry.name + ".lock")
        self.failure_path = entry.with_name(entry.name + ".failed.json")

    # -- the lock -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, timeout_s: float, on_wait: Callable[[str], None] = lambda _: None,
               poll_s: float = 0.2) -> Iterator[None]:
        """Hold the entry's lock. ``on_wait(holder)`` is called once if another process holds it;
        raises ``LockTimeout`` after ``timeout_s`` of waiting, OSError if the lock file cannot be
        made (an unwritable cache). A signal's handler runs during the wait (it sleeps in short
        steps), so a SIGTERM with the default handler ends it."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                holder = _holder(self.lock_path)
                on_wait(holder)
                deadline = time.monotonic() + timeout_s
                while not _try_lock(fd):
                    if time.monotonic() >= deadline:
                        raise LockTimeout(
                            f"waited {timeout_s:.0f} s for {self.lock_path}, held by {holder}: if that process "
                            "is not building (hung, or on a stalled network disk), end it, or point "
                            "TRAINFORGE_KERNEL_CACHE at a local directory")
                    time.sleep(poll_s)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- private build directories -----------------------------------------------------------------

    def fresh_build_dir(self) -> Path:
        """An empty private directory for this process's build; call with the lock held. The
        directories of earlier builders (all dead: they would hold the lock) are removed first."""
        for stale in self.entry.parent.glob(self.entry.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.entry.with_name(f"{self.entry.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, build_dir: Path) -> None:
        """Move a finished build onto the entry (an old entry, e.g. one left by a build of
        another layout, is replaced). Call with the lock held."""
        if self.entry.exists():
            shutil.rmtree(self.entry)
        os.replace(build_dir, self.entry)
        self.failure_path.unlink(missing_ok=True)

    # -- the failure record ---------------------------------------------------------------------

    def failure(self, toolchain: dict) -> str | None:
        """The reason of a recorded failure with this very toolchain, else None."""
        rec = read_json_cache(self.failure_path)
        if rec.get("toolchain") == toolchain and isinstance(rec.get("reason"), str):
            return rec["reason"]
        return None

    def record_failure(self, toolchain: dict, reason: str) -> None:
        write_json_cache(self.failure_path, {"toolchain": toolchain, "reason": reason,
                                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _holder(lock_path: Path) -> str:
    try:
        pid = int(lock_path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "another process"
    return f"process {pid}"
