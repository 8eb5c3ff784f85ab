"""Faults around checkpoints: a kill mid-training or mid-save, a deleted meta.json, a
corrupt newest checkpoint, resuming from an earlier step. Each resumed run must
reproduce the uninterrupted reference run bit for bit (losses compared as floats with
==, final weights with torch.equal).

One reference run per module; every damaged variant is a copy of it (shutil.copytree).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults.conftest import one_error_line, run_cli, start_cli, train_args
from trainforge import cli
from trainforge.train import checkpoint as ckpt
from trainforge.monitor.jsonl import read_jsonl

STEPS, INTERVAL = 30, 10  # checkpoints at 10, 20, 30; keep_last 5 keeps them all


def _args(data: Path, run_dir: Path) -> list[str]:
    return train_args(data, "--training.steps", str(STEPS), "--checkpoint.interval", str(INTERVAL),
                      "--checkpoint.keep_last", "5", "--run_dir", str(run_dir))


def _resume(run_dir: Path, *extra: str):
    return run_cli(["train", "--resume", str(run_dir), "--no_sample", *extra])


def series(run_dir: Path) -> list[tuple]:
    """(step, loss, val_loss) of every training and validation record, floats as written."""
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_jsonl(run_dir / "metrics.jsonl")
            if "loss" in r or "val_loss" in r]


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / ckpt.step_dir_name(step) / "model.safetensors")


def assert_same_run(run_dir: Path, ref: Path) -> None:
    assert series(run_dir) == series(ref)
    a, b = weights(ref), weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hidden(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def ref(tmp_path_factory, small_data) -> Path:
    """The uninterrupted run: 30 steps, checkpoints at 10, 20, 30."""
    run_dir = tmp_path_factory.mktemp("ckfaults") / "ref"
    r = run_cli(_args(small_data, run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")] == \
        ["step_0000010", "step_0000020", "step_0000030"]
    assert [s for s, loss, _ in series(run_dir) if loss is not None] == list(range(1, STEPS + 1))
    return run_dir


def test_sigkill_mid_training_and_mid_save_then_resume_is_bit_exact(tmp_path, small_data, ref):
    run_dir = tmp_path / "run"
    proc = start_cli(_args(small_data, run_dir))
    deadline = time.time() + 120
    try:  # kill once a checkpoint exists and training has gone on past it
        while time.time() < deadline and proc.poll() is None:
            done = ckpt.list_checkpoints(run_dir / "checkpoints")
            try:
                trained = max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r), default=0)
            except (ValueError, FileNotFoundError):
                trained = 0  # a line being written
            if done and trained > ckpt.checkpoint_step(done[-1]):
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    newest = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.checkpoint_step(newest) < STEPS
    # What a kill during a save leaves (the next checkpoint half-written, no meta.json) and
    # during the rotation of an old one (renamed, half-deleted, its meta.json still there).
    nxt = run_dir / "checkpoints" / f".{ckpt.step_dir_name(ckpt.checkpoint_step(newest) + INTERVAL)}.tmp"
    shutil.copytree(newest, nxt, dirs_exist_ok=True)  # the kill may have left a real one too
    (nxt / "meta.json").unlink(missing_ok=True)
    gone = run_dir / "checkpoints" / ".step_0000000.deleting"
    shutil.copytree(newest, gone)
    (gone / "model.safetensors").unlink()

    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {newest}" in r.stderr
    assert_same_run(run_dir, ref)
    assert hidden(run_dir) == [], "leftovers of the killed save must go at the next save"


def test_deleted_meta_json_skips_that_checkpoint_with_a_warning(tmp_path, ref):
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    (run_dir / "checkpoints" / "step_0000030" / "meta.json").unlink()
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    warning = next(ln for ln in r.stderr.splitlines() if "incomplete" in ln)
    assert "step_0000030" in warning and "meta.json is missing" in warning and "step_0000020" in warning
    assert_same_run(run_dir, ref)  # continued from 20, re-saved 30
    kept = list((run_dir / "checkpoints" / "superseded").glob("*/step_0000030"))
    assert len(kept) == 1 and not (kept[0] / "meta.json").exists()  # the damaged one, set aside, not deleted


def _flip_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))


def test_corrupt_newest_checkpoint_is_refused_or_skipped_with_fallback(tmp_path, ref, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    bad = run_dir / "checkpoints" / "step_0000030" / "model.safetensors"
    _flip_byte(bad)
    metrics_before = (run_dir / "metrics.jsonl").read_text()

    # The refusal in-process (the real CLI code, without a second interpreter start-up).
    assert cli.main(["train", "--resume", str(run_dir), "--no_sample"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(bad) in line and "corrupt" in line
    assert "--from_step N (available: 10, 20)" in line and "checkpoint.fallback = true" in line
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before  # refused before touching anything

    r = _resume(run_dir, "--checkpoint.fallback", "true")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = next(ln for ln in r.stderr.splitlines() if "falling back" in ln)
    assert str(bad) in warning and "sha256" in warning and "step_0000020" in warning
    assert_same_run(run_dir, ref)
    assert len(list((run_dir / "checkpoints" / "superseded").glob("*/step_0000030/model.safetensors"))) == 1


def test_from_step_resumes_an_earlier_checkpoint(tmp_path, ref, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    # A step without a checkpoint: one line listing those there are (in-process: the real CLI, no startup).
    assert cli.main(["train", "--resume", str(run_dir), "--from_step", "15", "--no_sample"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--from_step 15" in line and "available steps: 10, 20, 30" in line

    r = _resume(run_dir, "--from_step", "10")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step_0000010 at step 10" in r.stderr
    assert_same_run(run_dir, ref)  # metrics cut after step 10, then steps 11..30 again: one timeline
    # The abandoned continuation is set aside, not deleted, with the metrics it had.
    (aside,) = (run_dir / "checkpoints" / "superseded").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_0000020", "step_0000030"]
    assert (aside / "metrics.jsonl").read_text() == (ref / "metrics.jsonl").read_text()


def test_resume_argument_errors_name_the_fix(tmp_path, capsys):
    for argv, expect in [(["--resume", "auto"], "--resume auto needs --run_dir"),
                         (["--from_step", "3"], "--from_step N needs --resume RUN_DIR"),
                         (["--run_dir", str(tmp_path), "--resume", "auto", "--from_step", "3"],
                          "--resume auto continues from the newest")]:
        assert cli.main(["train", *argv]) == 2
        assert expect in one_error_line(capsys.readouterr().err)


def test_kill_mid_rotation_never_leaves_a_half_deleted_checkpoint(tmp_path, ref, monkeypatch):
    """keep_last deletes old checkpoints; a kill during that delete must not leave a
    step_* directory that still has meta.json but lost its weights."""
    root = tmp_path / "checkpoints"
    shutil.copytree(ref / "checkpoints", root)
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, *a, **kw):  # deletes the weights, then the process "dies"
        Path(path, "model.safetensors").unlink(missing_ok=True)
        raise KeyboardInterrupt("killed mid-delete")

    tmp = ckpt.begin_checkpoint(root, 40)
    shutil.copyfile(root / "step_0000030" / "model.safetensors", tmp / "model.safetensors")
    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        ckpt.finalize_checkpoint(root, tmp, 40, {"step": 40}, {}, {}, None, keep_last=1)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert not (root / "step_0000010").exists()
    steps = [ckpt.checkpoint_step(d) for d in ckpt.list_checkpoints(root)]
    assert steps == [20, 30, 40]  # all intact: rotation stopped before them
    assert all((d / "model.safetensors").is_file() for d in ckpt.list_checkpoints(root))
    ckpt.begin_checkpoint(root, 50)  # the next save removes the leftover
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [".step_0000050.tmp"]
