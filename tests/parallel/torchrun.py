"""Launch a worker script under torchrun (our distributed engine) for multi-process tests.

One thread per process: two threads per process collapse when several share 2 cores."""

from __future__ import annotations

import json
import os
import re
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


def run_train_many(nproc: int, runs: dict[str, list[str]], timeout_s: float = 600.0
                   ) -> dict[str, subprocess.CompletedProcess]:
    """Several ``trainforge train`` argument lists (``runs``: name -> the arguments after
    ``train``) in ONE torchrun launch of ``nproc`` ranks (workers/cli_many.py), one after
    another through the real CLI. Returns, per name, that run's exit code and its part of
    the launch's stdout and stderr, as if it had been launched alone. Fails (showing the
    launch's output) if the launch fails or a run did not finish. ``nproc`` 1: one plain
    process, no torchrun (as ``python -m trainforge train`` runs, no process group)."""
    order = [[name, ["train", *args]] for name, args in runs.items()]
    if nproc == 1:
        r = subprocess.run([sys.executable, str(WORKERS / "cli_many.py"), json.dumps(order)], capture_output=True,
                           text=True, timeout=timeout_s, env=torchrun_env())
    else:
        r = run_torchrun(WORKERS / "cli_many.py", nproc, json.dumps(order), timeout_s=timeout_s, check=False)
    out, err = _split_runs(r.stdout), _split_runs(r.stderr)
    missing = [name for name in runs if name not in out or out[name][1] is None]
    if r.returncode != 0 or missing:
        raise AssertionError(f"cli_many x{nproc} failed (rc {r.returncode}; unfinished: {missing}):\n"
                             f"--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-8000:]}")
    return {name: subprocess.CompletedProcess(["train", *args], out[name][1], out[name][0], err[name][0])
            for name, args in runs.items()}


def launches_by_world_size(runs: dict[str, tuple[int, list[str]]]):
    """``get(nproc)``: every run of ``runs`` (name -> (world size, train args)) with that world
    size, made in ONE launch (``run_train_many``) the first time a test asks for it, then kept.
    A module fixture returns it so each parametrized test checks its own run."""
    made: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in made:
            made[nproc] = run_train_many(nproc, {name: args for name, (n, args) in runs.items() if n == nproc})
        return made[nproc]
    return get


def _split_runs(text: str) -> dict[str, tuple[str, int | None]]:
    """cli_many's output, cut at its marks: name -> (the run's text, exit code or None)."""
    parts: dict[str, tuple[str, int | None]] = {}
    name, lines = None, []
    for line in text.splitlines(keepends=True):
        m = re.match(r"@@cli_many (begin|end) (\S+)(?: (-?\d+))?$", line.strip())
        if m is None:
            lines.append(line)
        elif m[1] == "begin":
            name, lines = m[2], []
            parts[name] = ("", None)
        else:
            parts[m[2]] = ("".join(lines), int(m[3]))
            name, lines = None, []
    if name is not None:  # a run that did not end: keep what it printed
        parts[name] = ("".join(lines), None)
    return parts
