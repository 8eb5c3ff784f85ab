"""Signals, hangs, dead peers and a diverging loss, as a user meets them: a real
``trainforge train`` (one process, two ranks started by hand, or ``torchrun``) gets a
signal, loses a peer or diverges, and the test checks how the job ended: every rank at
the same step, one checkpoint (none of a NaN state), the exit code of each outcome
(``trainforge.exit_codes``), one error line, no hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.conftest import cli_env, one_error_line, run_cli, torchrun_cmd, train_args
from trainforge import exit_codes
from trainforge.monitor.jsonl import read_jsonl
from trainforge.monitor.sinks import free_port

# Long enough never to finish on its own; no periodic validation or checkpoint, so the
# only checkpoint is the one the stop writes.
LONG = ("--training.steps", "100000", "--training.val_interval", "0", "--checkpoint.interval", "0")


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr into ``log`` (a file: never a
    full pipe while the test waits)."""
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=cli_env(**env),
                            start_new_session=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainforge", *args]


def _start_ranks(args: list[str], tmp: Path, n: int = 2) -> list[subprocess.Popen]:
    """``n`` ranks started as torchrun would (RANK, WORLD_SIZE, MASTER_*), without it:
    the test then sees each rank's own exit code, and nothing else signals them."""
    port = str(free_port())
    return [_start(_cli(*args), tmp / f"rank{r}.log", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(n)]


def _workers(launcher: int, n: int, timeout_s: float = 60) -> dict[int, int]:
    """{rank: pid} of the worker processes ``torchrun`` (pid ``launcher``) started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        for p in Path("/proc").iterdir():
            try:
                if not p.name.isdigit() or int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
                env = dict(e.split(b"=", 1) for e in (p / "environ").read_bytes().split(b"\0") if b"=" in e)
                found[int(env[b"RANK"])] = int(p.name)
            except (OSError, KeyError, ValueError, IndexError):
                continue
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError(f"torchrun did not start {n} workers")


def _wait_for(cond, procs: list[subprocess.Popen], what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert all(p.poll() is None for p in procs), f"a process ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _trained(run_dir: Path) -> int:
    """The last step with a training-loss record (0 before the first logging window)."""
    try:
        return max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r), default=0)
    except (OSError, ValueError):  # not there yet, or a line half-written
        return 0


def _checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")) if root.is_dir() else []


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _finish(procs: list[subprocess.Popen], timeout_s: float = 90) -> list[int]:
    """Their exit codes; whatever is still running after ``timeout_s`` is killed (and fails the test)."""
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        _kill(procs)


def _assert_stopped_once(run_dir: Path, ranks: int) -> int:
    """One checkpoint, at the last trained step, holding every rank's state: the ranks
    stopped together (a rank elsewhere would have left the collective save hanging)."""
    step = _trained(run_dir)
    assert step > 0 and _checkpoints(run_dir) == [step]
    if ranks > 1:
        rng = sorted(p.name for p in (run_dir / "checkpoints" / f"step_{step:07d}" / "rng").iterdir())
        assert rng == [f"rank_{r:05d}.pt" for r in range(ranks)]
    return step


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_to_one_torchrun_rank_stops_every_rank_at_one_step(tmp_path, small_data, rank):
    run_dir = tmp_path / "run"
    proc = _start(torchrun_cmd(2, *train_args(small_data, *LONG, "--run_dir", str(run_dir))), tmp_path / "log")
    workers = _workers(proc.pid, 2)
    _wait_for(lambda: _trained(run_dir) >= 5, [proc], "the first logging window")
    os.kill(workers[rank], signal.SIGTERM)
    _finish([proc])
    out = (tmp_path / "log").read_text()
    step = _assert_stopped_once(run_dir, ranks=2)
    assert f"stopped at step {step}: received SIGTERM" in out, out[-3000:]
    # torchrun reports each rank that exited non-zero with its exit code; a rank it had
    # to signal itself would show up as "Signal 15" instead.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {str(exit_codes.STOPPED)}, out[-3000:]
    if rank == 0:  # the checkpoint continues, here in one process (the same global batch of 16)
        res = run_cli(["train", "--resume", str(run_dir), "--training.steps", str(step + 5), "--training.batch_size",
                       "16", "--training.threads", "1", "--no_sample"])
        assert res.returncode == exit_codes.COMPLETED, res.stderr[-3000:]
        assert _trained(run_dir) == step + 5 and _checkpoints(run_dir) == [step, step + 5]


def test_sigterm_to_torchrun_saves_a_checkpoint(tmp_path, small_data):
    """torchrun forwards its SIGTERM to every worker and SIGKILLs them 30 s later."""
    run_dir = tmp_path / "run"
    proc = _start(torchrun_cmd(2, *train_args(small_data, *LONG, "--run_dir", str(run_dir))), tmp_path / "log")
    _wait_for(lambda: _trained(run_dir) >= 5, [proc], "the first logging window")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _finish([proc])
    assert time.monotonic() - t0 < 30, "the workers should stop within torchrun's grace period"
    out = (tmp_path / "log").read_text()
    step = _assert_stopped_once(run_dir, ranks=2)
    assert f"stopped at step {step}: received SIGTERM" in out, out[-3000:]
    assert "forcefully exiting" not in out, out[-3000:]  # torchrun did not need SIGKILL


def test_sighup_to_one_process_saves_a_checkpoint_and_exits_75(tmp_path, small_data):
    """A dropped SSH session (SIGHUP) stops like SIGTERM: checkpoint, exit STOPPED."""
    run_dir = tmp_path / "run"
    proc = _start(_cli(*train_args(small_data, *LONG, "--run_dir", str(run_dir))), tmp_path / "log")
    _wait_for(lambda: _trained(run_dir) >= 5, [proc], "the first logging window")
    proc.send_signal(signal.SIGHUP)
    assert _finish([proc]) == [exit_codes.STOPPED], (tmp_path / "log").read_text()[-3000:]
    step = _assert_stopped_once(run_dir, ranks=1)
    assert f"stopped at step {step}: received SIGHUP" in (tmp_path / "log").read_text()


def test_second_sigint_exits_at_once_and_the_peer_fails_with_4(tmp_path, small_data):
    """Two ranks, a logging window far away (so the first SIGINT is still pending): the
    second SIGINT ends rank 0 at once with 130 and no checkpoint; rank 1, left alone in
    its collective, ends with exit 4 and one line, instead of waiting."""
    run_dir = tmp_path / "run"
    ranks = _start_ranks(train_args(small_data, *LONG, "--training.log_interval", "100000", "--run_dir",
                                    str(run_dir)), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and "val_loss" in metrics.read_text(), ranks, "training to start")
    ranks[0].send_signal(signal.SIGINT)
    log0 = tmp_path / "rank0.log"
    _wait_for(lambda: "received SIGINT" in log0.read_text(), ranks, "the first SIGINT to be seen")
    t0 = time.monotonic()
    ranks[0].send_signal(signal.SIGINT)
    assert _finish(ranks[:1], timeout_s=10) == [exit_codes.killed_by(signal.SIGINT)], log0.read_text()[-3000:]
    assert time.monotonic() - t0 < 5, "a second signal must exit at once"
    assert _finish(ranks[1:], timeout_s=60) == [exit_codes.PEER_FAILED]
    line = one_error_line((tmp_path / "rank1.log").read_text())
    assert "peer rank failed" in line and "distributed.timeout_s" in line
    assert _checkpoints(run_dir) == []


def test_hung_rank_fails_the_other_within_distributed_timeout(tmp_path, small_data):
    timeout_s = 10
    run_dir = tmp_path / "run"
    ranks = _start_ranks(train_args(small_data, *LONG, "--distributed.timeout_s", str(timeout_s), "--run_dir",
                                    str(run_dir)), tmp_path)
    try:
        _wait_for(lambda: _trained(run_dir) >= 5, ranks, "the first logging window")
        ranks[1].send_signal(signal.SIGSTOP)  # hung: alive, connections open, never answers
        t0 = time.monotonic()
        assert _finish(ranks[:1], timeout_s=timeout_s + 60) == [exit_codes.PEER_FAILED]
        elapsed = time.monotonic() - t0
    finally:
        _kill(ranks)
    assert elapsed < timeout_s + 10, f"rank 0 waited {elapsed:.0f} s for a hung peer"
    line = one_error_line((tmp_path / "rank0.log").read_text())
    assert "peer rank failed or timed out" in line and f"distributed.timeout_s = {timeout_s}" in line


def test_nan_loss_stops_every_rank_with_exit_3_and_no_checkpoint_of_it(tmp_path, small_data):
    """No [bad_steps]: the window's (all-reduced) losses are the same on both ranks, so
    both stop at the same step, say so in one line, and save nothing from there on."""
    run_dir = tmp_path / "run"
    # LR rising to 300 over 20 warmup steps, no clipping: finite for the first checkpoints
    # (every 5 steps), then NaN.
    ranks = _start_ranks(train_args(small_data, "--training.steps", "200", "--training.lr", "300",
                                    "--training.warmup_steps", "20", "--training.grad_clip", "0",
                                    "--checkpoint.interval", "5", "--run_dir", str(run_dir)), tmp_path)
    assert _finish(ranks) == [exit_codes.NONFINITE_LOSS] * 2
    lines = [one_error_line((tmp_path / f"rank{r}.log").read_text()) for r in range(2)]
    assert lines[0] == lines[1], lines
    bad = int(re.search(r"at step (\d+)", lines[0]).group(1))
    assert re.search(r"(loss|norm) (nan|inf)", lines[0]), lines[0]
    assert "training.lr" in lines[0] and "[bad_steps]" in lines[0] and f"--resume {run_dir}" in lines[0]
    assert all(step < bad for step in _checkpoints(run_dir)), (bad, _checkpoints(run_dir))
