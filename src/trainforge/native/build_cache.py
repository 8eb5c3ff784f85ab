"""A build cache that a killed builder cannot wedge: the lock dies with its process, the product
appears at its final path whole or not at all, and a failed build is remembered.

torch's ``cpp_extension.load`` guards its build directory with ``FileBaton``: a ``lock`` file
that exists while a build runs. A builder killed mid-build (a closed terminal, SIGTERM,
``timeout``) leaves the file, and every later process waits on it forever, printing nothing.
Here instead:

- The lock is ``fcntl.flock`` on an open file (``<entry>.lock``, ``storage/locks.py``): the kernel
  releases it when the holder exits, however it exits. The descriptor is not inherited (Python
  opens it close-on-exec), so an orphaned compiler child does not keep it either.
- Each build runs in a private directory (``<entry>.tmp-<pid>``) that is renamed onto the entry
  when the product is complete (as Triton's cache does). Whoever holds the lock removes the
  private directories of earlier builders: they are dead, or they would hold the lock.
- A failed build writes ``<entry>.failed.json`` (the reason and the toolchain it failed with), so
  a machine without a compiler pays for one attempt and one message per cache, not a failed
  build and a screen of warnings on every run. A different toolchain (a compiler installed since,
  another ``CXX``) tries again.
- A wait longer than a build can take gives up with a message that names the lock file and its
  holder; the caller goes on without the product.

Hand-written: torch's own (FileBaton) is the problem, and Triton's atomic-rename cache is not a
library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

from trainforge.json_cache import read_json_cache, write_json_cache
from trainforge.storage.locks import wait_for_lock


class BuildCache:
    """One cache entry: the directory ``entry`` holding a finished build, and beside it its
    lock (``.lock``), failure record (``.failed.json``) and the private build directories
    (``.tmp-<pid>``)."""

    def __init__(self, entry: Path, what: str = "CPU kernels"):
        self.entry = entry
        self.what = what
        self.lock_path = entry.with_name(entry.name + ".lock")
        self.failure_path = entry.with_name(entry.name + ".failed.json")

    # -- the lock -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, timeout_s: float) -> Iterator[None]:
        """Hold the entry's lock (``storage/locks.wait_for_lock``: says once whom it waits for,
        polls, so a signal ends the wait). Raises TrainforgeError naming the lock file and its
        holder after ``timeout_s`` of waiting, OSError if the lock file cannot be made (an
        unwritable cache)."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with wait_for_lock(self.lock_path, timeout_s, what=self.what,
                           fix="if that process is not building them (hung, or on a stalled network disk), end "
                               "it, or point TRAINFORGE_KERNEL_CACHE at a local directory"):
            yield

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

