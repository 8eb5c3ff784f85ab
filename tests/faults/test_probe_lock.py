"""`trainforge plan --gpu measured` and the probe lock (``/tmp/cpu.lock``, here a test file):
under an outer `flock` of the same file it runs instead of waiting for itself; a lock held
by another job is waited for a bounded time, saying so, then one error line names the file,
its holder and the fix; a signal ends the wait."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.faults.conftest import cli_env, one_error_line, run_cli, start_cli

# The planner's measured machine: a fresh cache, so the probe (and its lock) runs.
PLAN = ["plan", "--model", "debug", "--gpus", "2", "--gpu", "measured", "--seq_len", "32", "--global_batch", "4",
        "--precision", "fp32"]


def test_probe_lock_under_an_outer_flock_of_the_same_file_does_not_wait_for_itself(tmp_path):
    lock = tmp_path / "cpu.lock"
    code = "from trainforge.plan.probe import probe_lock\nwith probe_lock() as how:\n    print('held', how)"
    start = time.monotonic()
    r = subprocess.run(["flock", str(lock), sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=cli_env(TRAINFORGE_PROBE_LOCK=str(lock)))
    assert r.returncode == 0 and "held outer" in r.stdout, r.stderr[-2000:]
    assert time.monotonic() - start < 30


def test_a_lock_held_elsewhere_is_waited_for_a_bounded_time_and_a_signal_ends_the_wait(tmp_path):
    lock = tmp_path / "cpu.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "120"])  # another job: not this command's ancestor
    try:
        deadline = time.monotonic() + 10
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        env = cli_env(TRAINFORGE_PROBE_LOCK=str(lock), TRAINFORGE_PROBE_LOCK_WAIT_S="2",
                      TRAINFORGE_CACHE=str(tmp_path / "cache"))
        r = run_cli(PLAN, timeout_s=120, env=env)
        line = one_error_line(r.stderr)
        assert r.returncode == 2, r.stderr[-2000:]
        assert str(lock) in line and f"pid {holder.pid}" in line and "TRAINFORGE_PROBE_LOCK" in line, line
        assert "waiting up to 2 s" in r.stderr  # said before it waited

        # A long wait: SIGTERM ends it (no uninterruptible flock call).
        p = start_cli(PLAN, env={**env, "TRAINFORGE_PROBE_LOCK_WAIT_S": "600"})
        try:
            seen = ""
            deadline = time.monotonic() + 90
            while "waiting up to" not in seen and time.monotonic() < deadline:
                seen += p.stderr.readline()
            assert "waiting up to 600 s" in seen, seen[-2000:]
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode != 0
    finally:
        holder.kill()
        holder.wait()
