"""Elastic restarts: one torchrun command line (``--max-restarts 1 --run_dir D --resume
auto``) survives a worker killed mid-run. The restarted job resumes from the newest
complete checkpoint and finishes exactly as an uninterrupted 2-process run: the same
loss at every step (floats compared with ==) and the same final weights and optimizer
state."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.faults.conftest import cli_env, torchrun_cmd, train_args
from trainforge.train import checkpoint as ckpt
from trainforge.monitor.jsonl import read_jsonl

STEPS, INTERVAL = 20, 5


def _cmd(data: Path, run_dir: Path) -> list[str]:
    return torchrun_cmd(2, *train_args(data, "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
                                       "--run_dir", str(run_dir), "--resume", "auto"), max_restarts=1)


def series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_jsonl(run_dir / "metrics.jsonl")
            if "loss" in r or "val_loss" in r]


def final_state(run_dir: Path, tmp: Path) -> dict:
    """Model and optimizer state of the last (DCP-sharded) checkpoint, gathered into one file."""
    out = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / ckpt.step_dir_name(STEPS) / "sharded", out)
    return torch.load(out, weights_only=False)  # our own test output


def _workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun agent's worker processes (its children)."""
    found = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # exited meanwhile
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
    return found


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        flat.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return flat


@pytest.fixture(scope="module")
def ref(tmp_path_factory, small_data) -> Path:
    """Uninterrupted 2-process run, launched with --resume auto on an empty directory."""
    run_dir = tmp_path_factory.mktemp("elastic") / "ref"
    run_dir.mkdir()
    r = subprocess.run(_cmd(small_data, run_dir), capture_output=True, text=True, timeout=300, env=cli_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_resume_auto_on_an_empty_dir_starts_fresh(ref):
    steps = [s for s, loss, _ in series(ref) if loss is not None]
    assert steps == list(range(1, STEPS + 1))  # from step 1, once each
    assert [ckpt.checkpoint_step(d) for d in ckpt.list_checkpoints(ref / "checkpoints")] == [10, 15, 20]


def test_killed_worker_is_restarted_and_resumes_bit_exact(tmp_path, small_data, ref):
    run_dir = tmp_path / "run"
    agent = subprocess.Popen(_cmd(small_data, run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=cli_env(), start_new_session=True)
    killed = None
    try:
        deadline = time.time() + 180
        while time.time() < deadline and agent.poll() is None:
            done = ckpt.list_checkpoints(run_dir / "checkpoints")
            if done and ckpt.checkpoint_step(done[-1]) < STEPS:
                killed = _workers(agent.pid).get(1)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
                    break
            time.sleep(0.02)
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
    assert killed is not None, "no checkpoint appeared while the job ran"
    assert agent.returncode == 0, out[-4000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in out  # the restarted attempt, not a fresh start
    assert series(run_dir) == series(ref)
    a, b = _flatten(final_state(ref, tmp_path)), _flatten(final_state(run_dir, tmp_path))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
