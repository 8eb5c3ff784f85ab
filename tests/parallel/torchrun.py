"""Launch a worker script under torchrun (our distributed engine) for multi-process tests.

One thread per process: two threads per process collapse when several share 2 cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def torchrun_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def with_worker(cmd: list[str], script: Path) -> list[str]:
    """A torchrun command line of ``-m trainforge`` with ``script`` run instead (the same
    CLI arguments; the script patches something, then calls the CLI)."""
    i = cmd.index("-m", next(j for j, a in enumerate(cmd) if a.startswith("--nproc_per_node=")))
    return [*cmd[:i], str(script), *cmd[i + 2:]]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout_s: float = 240.0,
                 check: bool = True) -> subprocess.CompletedProcess:
    env = torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed (rc {r.returncode}):\n"
                             f"--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-6000:]}")
    return r
