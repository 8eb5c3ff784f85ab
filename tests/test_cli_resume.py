"""The real interruption: SIGTERM to a running `trainforge train`, then --resume."""

import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from trainforge import exit_codes
from trainforge.monitor.jsonl import read_jsonl

ARGS = ["--model.flavor", "debug", "--training.steps", "60", "--training.batch_size", "8",
        "--training.seq_len", "64", "--training.log_interval", "1", "--checkpoint.interval", "25",
        "--training.val_interval", "20", "--sample.max_new_tokens", "0", "--training.threads", "1"]


def train(run_dir, data, *extra):
    return [sys.executable, "-m", "trainforge", "train", "--data.path", str(data), *ARGS, *extra]


@pytest.mark.slow
def test_sigterm_then_resume_equals_uninterrupted(tmp_path, small_data):
    ref = tmp_path / "ref"
    subprocess.run(train(ref, small_data, "--run_dir", str(ref)), check=True, capture_output=True, timeout=300)

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train(run_dir, small_data, "--run_dir", str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until training is under way, then interrupt
        try:
            if metrics.exists() and any(r.get("step", 0) >= 8 and "loss" in r for r in read_jsonl(metrics)):
                break
        except ValueError:
            pass  # read a line while it was being written
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.STOPPED, err
    stopped = max(r["step"] for r in read_jsonl(metrics) if "loss" in r)
    assert 8 <= stopped < 60, "the run should have been interrupted mid-way"
    assert (run_dir / "checkpoints" / f"step_{stopped:07d}").is_dir(), "SIGTERM must checkpoint before exit"

    subprocess.run([sys.executable, "-m", "trainforge", "train", "--resume", str(run_dir)], check=True,
                   capture_output=True, timeout=300)
    series = lambda d: [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_jsonl(d / "metrics.jsonl")
                        if "loss" in r or "val_loss" in r]
    assert series(run_dir) == series(ref)
    a = load_file(ref / "checkpoints" / "step_0000060" / "model.safetensors")
    b = load_file(run_dir / "checkpoints" / "step_0000060" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
