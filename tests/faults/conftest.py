"""The fault suite: each test injects one fault a real user meets (a signal, a kill, a
hostile or corrupt file, a full disk, a dropped client) and asserts what the user sees:
the exit code, one error line naming the file or key, nothing lost or half-written.

Every test here is marked ``slow`` (most start processes); CI runs them. Shapes are the
``debug`` flavor on the small prepared set, so the whole folder stays within minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEBUG_TRAIN


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.slow)


def cli_env(**extra: str) -> dict[str, str]:
    """One thread per process (several share 2 cores), unbuffered output, the test's cache."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def train_args(data: Path, *extra: str) -> list[str]:
    """``trainforge train`` arguments for a debug-flavor run on ``data``."""
    return ["train", *DEBUG_TRAIN, "--data.path", str(data), "--training.threads", "1", "--no_sample", *extra]


def run_cli(args: list[str], timeout_s: float = 120.0, **kw) -> subprocess.CompletedProcess:
    """Run ``python -m trainforge ARGS`` to completion; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "trainforge", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=kw.pop("env", cli_env()), **kw)


def start_cli(args: list[str], **kw) -> subprocess.Popen:
    """Start ``python -m trainforge ARGS`` in its own process group (so a test can signal it)."""
    return subprocess.Popen([sys.executable, "-m", "trainforge", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=kw.pop("env", cli_env()),
                            start_new_session=True, **kw)


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    """``torchrun --standalone`` running ``python -m trainforge ARGS`` on ``nproc`` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "trainforge", *args]


def one_error_line(stderr: str) -> str:
    """The CLI's error line; fails the test if a traceback was printed instead."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ": error: " in ln]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]
