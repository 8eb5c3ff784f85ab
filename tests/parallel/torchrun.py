"""Launch a worker script under torchrun (our distributed engine) for multi-process tests.

One thread per process: two threads per process collapse when several share 2 cores."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).resolve().parents[2]  # the repository: a launch imports prepare steps from tests.*


@dataclass(frozen=True)
class Prepared:
    """A run of ``run_train_many`` that needs a step first: rank 0 calls
    ``prepare(*prepare_args)`` once the runs before it in the launch have ended, then every
    rank starts ``args`` (the arguments after ``train``). ``prepare`` is a module-level
    function (the launch imports it by name) taking JSON-able arguments (paths as strings);
    not allowed on a multi-process launch's first run (no process group yet to wait on).
    ``every_rank``: every rank calls it instead (a patch, such as
    workers/pp_embedding_copies.py's; it then holds for the launch's later runs too)."""

    args: list[str]
    prepare: Callable
    prepare_args: tuple = ()
    every_rank: bool = False


def copy_until(src: str, dst: str, step: int) -> None:
    """``dst``: run directory ``src`` as an interruption after its step-``step`` checkpoint
    would have left it (the later checkpoints gone; the resumed trainer drops the later
    metrics records itself)."""
    shutil.copytree(src, dst)
    for ck in (Path(dst) / "checkpoints").glob("step_*"):
        if int(ck.name.split("_")[1]) > step:
            shutil.rmtree(ck)


def resumed(src, dst, step: int, *args: str) -> Prepared:
    """A ``run_train_many`` run: a copy of the run in ``src`` resumed (``--resume dst``, then
    ``args``) from its step-``step`` checkpoint, made in the launch after ``src``'s run."""
    return Prepared(["--resume", str(dst), *args], copy_until, (str(src), str(dst), step))


def torchrun_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def with_worker(cmd: list[str], script: Path) -> list[str]:
    """A torchrun command line of ``-m trainforge`` with ``script`` run instead (the same
    CLI arguments; the script patches something, then calls the CLI)."""
    i = cmd.index("-m", next(j for j, a in enumerate(cmd) if a.startswith("--nproc_per_node=")))
    return [*cmd[:i], str(script), *cmd[i + 2:]]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout_s: float = 240.0,
                 check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env or torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if check:
        _check(script, nproc, r)
    return r


def _check(script: str | Path, nproc: int, r: subprocess.CompletedProcess) -> None:
    if r.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed (rc {r.returncode}):\n"
                             f"--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-6000:]}")


def rank_results(script: str | Path, nproc: int, out: Path, timeout_s: float = 240.0) -> list[dict]:
    """Run a worker that writes ``OUT/rank{r}.json`` on every rank; returns those dicts by rank.
    A launch that gloo aborted (a rank killed by std::terminate, "terminate called without an
    active exception", no Python error: seen once in ~20 launches of tp_parity.py on a 2-vCPU
    guest, never reproduced in isolation) is launched once more; any other failure fails."""
    r = run_torchrun(script, nproc, str(out), timeout_s=timeout_s, check=False)
    if r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        r = run_torchrun(script, nproc, str(out), timeout_s=timeout_s, check=False)
    _check(script, nproc, r)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def completed_run(root: Path, done: dict[str, subprocess.CompletedProcess], name: str) -> Path:
    """``root / name`` after checking that run ``name`` of a ``run_train_many`` result succeeded."""
    assert done[name].returncode == 0, done[name].stderr[-3000:]
    return root / name


def run_train_many(nproc: int, runs: dict[str, list[str] | Prepared], timeout_s: float = 600.0
                   ) -> dict[str, subprocess.CompletedProcess]:
    """Several ``trainforge train`` argument lists (``runs``: name -> the arguments after
    ``train``, or a ``Prepared`` run) in ONE torchrun launch of ``nproc`` ranks
    (workers/cli_many.py), one after another through the real CLI, in ``runs``' order.
    Returns, per name, that run's exit code and its part of the launch's stdout and stderr,
    as if it had been launched alone. Fails (showing the launch's output) if the launch fails
    or a run did not finish. ``nproc`` 1: in this process (``train_here``)."""
    if nproc == 1:
        return train_here(runs)
    order = []
    for name, run in runs.items():
        if isinstance(run, Prepared):
            fn = f"{_module_name(run.prepare)}:{run.prepare.__qualname__}"
            order.append([name, ["train", *run.args], [fn, list(run.prepare_args), run.every_rank]])
        else:
            order.append([name, ["train", *run]])
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = run_torchrun(WORKERS / "cli_many.py", nproc, json.dumps(order), timeout_s=timeout_s, check=False, env=env)
    out, err = _split_runs(r.stdout), _split_runs(r.stderr)
    missing = [name for name in runs if name not in out or out[name][1] is None]
    if r.returncode != 0 or missing:
        raise AssertionError(f"cli_many x{nproc} failed (rc {r.returncode}; unfinished: {missing}):\n"
                             f"--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-8000:]}")
    return {name: subprocess.CompletedProcess(order[i][1], out[name][1], out[name][0], err[name][0])
            for i, name in enumerate(runs)}


def _module_name(fn: Callable) -> str:
    """``fn``'s module as the launch imports it, from the repository root: pytest imports a
    test file under a name rooted at its first folder without __init__.py (tests/ has none:
    ``compression.test_compressed_training``), which the launch's sys.path lacks."""
    path = Path(inspect.getfile(fn)).resolve()
    if path.is_relative_to(ROOT):
        return ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return fn.__module__


def train_here(runs: dict[str, list[str] | Prepared]) -> dict[str, subprocess.CompletedProcess]:
    """``runs`` as ``run_train_many`` takes them, through the real CLI (``trainforge.cli.main``)
    in THIS process, one after another, as ``python -m trainforge train`` would run each with
    OMP_NUM_THREADS=1: the test process has imported torch already, which a new process
    pays ~2-4 s of CPU for (torch, then torch._dynamo at the first optimizer). Each run's
    stdout and stderr are captured (Python-level: the CLI's prints, its logger, warnings) and
    returned with its exit code. The thread count is restored after each run."""
    from trainforge import cli

    done = {}
    for name, run in runs.items():
        args = ["train", *(run.args if isinstance(run, Prepared) else run)]
        if isinstance(run, Prepared):
            if run.every_rank:  # here it would patch the test session itself
                raise ValueError(f"run {name!r}: an every_rank prepare step (a patch) needs a launch, nproc >= 2")
            run.prepare(*run.prepare_args)
        threads = torch.get_num_threads()
        out, err = io.StringIO(), io.StringIO()
        torch.set_num_threads(1)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(args)
                except SystemExit as e:  # as the process would have exited
                    rc = e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)
        done[name] = subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())
    return done


def launches_by_world_size(runs: dict[str, tuple[int, list[str]]]):
    """``get(nproc)``: every run of ``runs`` (name -> (world size, train args)) with that world
    size, made in ONE launch (``run_train_many``) the first time a test asks for it, then kept.
    A module fixture returns it so each parametrized test checks its own run."""
    made: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in made:
            made[nproc] = run_train_many(nproc, {name: run for name, (n, run) in runs.items() if n == nproc})
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
