"""``training.seq_len_schedule`` as a user meets it: the keys are checked naming the key and
the fix, and listed by ``train --help``; a shorter length serves the same (input, target)
pairs as more, shorter rows (same tokens per step, same data position); linear and auto
schedules change the length where documented, log each change once and record it in
every training record; a run stopped after a change, or right at one, resumes to the
uninterrupted run's losses bit for bit; combinations that cannot work are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import StopAt, debug_config
from trainforge.cli import main as cli_main
from trainforge.config import load_config
from trainforge.data.loader import MmapShards, ShardLoader
from trainforge.data.sampler import BatchPlan
from trainforge.errors import ConfigError
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.seq_len_ladder import check_schedule_layout, ladder
from trainforge.train.trainer import Trainer

# 4 x 64 = 256 tokens per step; linear 16 -> 64 over 6 steps: lengths 16, 32, 64.
BASE = ["--training.batch_size", "4", "--training.seq_len", "64", "--training.warmup_steps", "2",
        "--training.val_interval", "0", "--training.val_batches", "2", "--checkpoint.interval", "0",
        "--training.threads", "1"]
LINEAR = [*BASE, "--training.steps", "10", "--training.log_interval", "2", "--training.seq_len_schedule", "linear",
          "--training.seq_len_start", "16", "--training.seq_len_ramp_steps", "6"]
# At lr 1e-7 the loss cannot improve by 5%: every full window of 4 logging intervals is a plateau.
AUTO = [*BASE, "--training.steps", "13", "--training.log_interval", "1", "--training.lr", "1e-7",
        "--training.lr_schedule", "constant", "--training.seq_len_schedule", "auto", "--training.seq_len_start", "16",
        "--training.seq_len_plateau_window", "4", "--training.seq_len_plateau_rel_delta", "0.05"]


def run(cfg, run_dir, resume=False, callbacks=None, spy=None):
    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    if spy is not None:  # the shape of every micro-batch the model is trained on (not validation's)
        loss = t._loss

        def spied(x, y):
            if t.raw_model.training:
                spy.append(tuple(x.shape))
            return loss(x, y)
        t._loss = spied
    try:
        return t.fit(), t
    finally:
        t.close()


def train_records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(run_dir)]


# -- the loader ------------------------------------------------------------------------------

def _loader(tokens: np.ndarray) -> ShardLoader:
    plan = BatchPlan([len(tokens)], 64, 4, seed=7)
    return ShardLoader(plan, MmapShards([tokens]), ready_batches=0)


def test_a_shorter_length_serves_the_same_pairs_as_more_rows_from_the_same_position():
    tokens = np.random.default_rng(0).integers(0, 500, 64 * 40 + 1)
    plain, short = _loader(tokens), _loader(tokens)
    for i in range(6):
        if i == 2:
            short.serve_seq_len(16)
        if i == 4:
            short.serve_seq_len(32)
        x, y = plain.next()
        sx, sy = short.next()
        n = sx.shape[1]
        assert sx.shape == (4 * 64 // n, n) and sy.shape == sx.shape  # same tokens per batch
        assert torch.equal(sx, x.reshape(-1, n)) and torch.equal(sy, y.reshape(-1, n))
        assert torch.equal(sy[:, :-1], sx[:, 1:])  # each row's targets are its inputs shifted: no row spans windows
    assert short.state_dict() == plain.state_dict()  # the data position did not move
    with pytest.raises(ValueError, match="must divide the window's 64 tokens"):
        short.serve_seq_len(24)


# -- keys ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    (["--training.seq_len_schedule", "auto", "--training.seq_len_start", "48"],
     ["'training.seq_len_start' = 48", "divide training.seq_len (256)", "use one of [8, 16, 32, 64, 128]"]),
    (["--training.seq_len_schedule", "auto", "--training.seq_len", "384", "--training.seq_len_start", "128"],
     ["'training.seq_len_start' = 128", "power of two", "seq_len_schedule = 'linear'"]),
    (["--training.seq_len_schedule", "linear", "--training.seq_len", "100"],
     ["'training.seq_len_multiple' = 8", "dividing training.seq_len (100)"]),
    (["--training.seq_len_schedule", "linear", "--training.seq_len", "96", "--training.seq_len_multiple", "16"],
     ["'training.seq_len_start (unset: seq_len / 4)' = 24", "use one of [16, 32, 48]"]),
    (["--training.seq_len_schedule", "linear", "--training.seq_len_ramp_steps", "0"],
     ["'training.seq_len_ramp_steps' = 0", ">= 1"]),
    (["--training.seq_len_schedule", "auto", "--training.seq_len_plateau_window", "3"],
     ["'training.seq_len_plateau_window' = 3", ">= 4"]),
    (["--training.seq_len_schedule", "cyclic"], ["'training.seq_len_schedule'", "'fixed', 'linear', 'auto'"]),
])
def test_bad_schedule_keys_are_refused_naming_the_key_and_the_fix(argv, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, argv)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_ladders_as_documented():
    cfg = lambda *a: load_config(None, list(a)).training  # noqa: E731
    assert ladder(cfg()) == [256]
    assert ladder(cfg("--training.seq_len_schedule", "auto")) == [64, 128, 256]  # start unset: seq_len / 4
    assert ladder(cfg("--training.seq_len_schedule", "linear", "--training.seq_len", "384",
                      "--training.seq_len_start", "32")) == [32, 48, 64, 96, 128, 192, 384]
    assert ladder(cfg("--training.seq_len_schedule", "linear", "--training.seq_len", "256",
                      "--training.seq_len_multiple", "64", "--training.seq_len_start", "64")) == [64, 128, 256]


def test_train_help_lists_the_schedule_keys(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    for key in ("--training.seq_len_schedule", "--training.seq_len_start", "--training.seq_len_multiple",
                "--training.seq_len_ramp_steps", "--training.seq_len_plateau_window",
                "--training.seq_len_plateau_rel_delta"):
        assert key in out, key
    assert "{fixed,linear,auto}" in out or "fixed, linear, auto" in out


def test_what_cannot_change_length_is_refused_naming_the_keys(tmp_path, small_data):
    def refused(*argv):
        cfg = load_config(None, ["--training.seq_len_schedule", "auto", *argv])
        with pytest.raises(ConfigError) as e:
            check_schedule_layout(cfg.training, cfg.parallel, cfg.data.augment.transforms)
        return str(e.value)

    msg = refused("--parallel.pp", "2")
    assert "training.seq_len_schedule" in msg and "parallel.pp = 2" in msg
    msg = refused("--parallel.tp", "128")
    assert "parallel.tp = 128" in msg and "[64]" in msg and "seq_len_start" in msg
    # Through the trainer (check_run): the curriculum transform and the schedule, pick one.
    cfg = debug_config(small_data, *LINEAR, "--data.augment.transforms", '[{name = "seq_curriculum"}]')
    with pytest.raises(ConfigError, match=r"'data.augment.transforms\[0\]' \(seq_curriculum\).*pick one"):
        Trainer(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# -- through the trainer ------------------------------------------------------------------------

def test_linear_ramp_reshapes_the_batch_logs_each_change_and_records_seq_len(tmp_path, small_data, capsys):
    shapes: list[tuple[int, int]] = []
    _, t = run(debug_config(small_data, *LINEAR), tmp_path / "run", spy=shapes)
    # Steps 1-2 at 16 (the ramp reaches 32 at step index 2), 3-6 at 32, from step 7 (index 6) at 64.
    want = [16, 16, 32, 32, 32, 32, 64, 64, 64, 64]
    records = train_records(tmp_path / "run")
    assert [r["seq_len"] for r in records] == want
    assert shapes == [(256 // n, n) for n in want]  # 256 tokens every step
    assert [r["tokens"] for r in records] == [256 * s for s in range(1, 11)]
    err = capsys.readouterr().err
    assert err.count("seq_len schedule linear: step 1 at seq_len 16; lengths 16 (batch 16), 32 (batch 8), "
                     "64 (batch 4)") == 1
    assert err.count("step 3: seq_len 16 -> 32 (linear ramp; batch 16 -> 8 sequences") == 1
    assert err.count("step 7: seq_len 32 -> 64 (linear ramp") == 1
    assert t.train_batches.state_dict()["position"] == 10  # one global batch of full windows per step
    # MFU counts each step's FLOPs at the length it ran at (the window's mean), not at seq_len 64.
    for r in records:
        window = [q["seq_len"] for q in records if q["time_unix_s"] == r["time_unix_s"]]
        flops = sum(t.model_config.flops_per_token(n) for n in window) / len(window)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / r["mfu_peak_flops"], rel=1e-9)
    assert records[0]["mfu"] < records[0]["tokens_per_s"] * t.model_config.flops_per_token(64) / \
        records[0]["mfu_peak_flops"]


def test_fixed_registers_nothing_and_records_no_seq_len(tmp_path, small_data):
    _, t = run(debug_config(small_data, *BASE, "--training.steps", "2"), tmp_path / "run")
    assert t.components.get("seq_len_schedule") is None
    assert all("seq_len" not in r for r in train_records(tmp_path / "run"))


@pytest.mark.parametrize("stop", [2, 4])  # 2: right before the first step at 32; 4: mid-way through 32
def test_linear_resume_across_a_length_change_equals_the_uninterrupted_run(tmp_path, small_data, stop):
    cfg = lambda: debug_config(small_data, *LINEAR)  # noqa: E731
    run(cfg(), tmp_path / "a")
    part, _ = run(cfg(), tmp_path / "b", callbacks=[StopAt(stop)])
    assert part["step"] == stop
    run(cfg(), tmp_path / "b", resume=True)
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert [r["seq_len"] for r in train_records(tmp_path / "b")] == [16, 16, 32, 32, 32, 32, 64, 64, 64, 64]


def test_auto_doubles_on_each_plateau_and_resumes_exactly_at_and_after_a_change(tmp_path, small_data, capsys):
    cfg = lambda: debug_config(small_data, *AUTO)  # noqa: E731
    _, t = run(cfg(), tmp_path / "a")
    # Observed from step 3 (after warmup 2), one loss per logging interval: the window of 4 is
    # full at step 6 (a plateau: 32 from step 7) and again at step 10 (64 from step 11).
    assert [r["seq_len"] for r in train_records(tmp_path / "a")] == [16] * 6 + [32] * 4 + [64] * 3
    err = capsys.readouterr().err
    assert "step 7: seq_len 16 -> 32 (the training loss plateaued; batch 16 -> 8 sequences" in err
    assert "step 11: seq_len 32 -> 64 (the training loss plateaued" in err
    assert t.components["seq_len_schedule"].current == 64
    # Stopped at step 6, where the doubling was decided (the checkpoint holds it, the window
    # empty), and at step 8 (two losses into the window at 32): both resume to the same run.
    for stop in (6, 8):
        run_dir = tmp_path / f"b{stop}"
        run(cfg(), run_dir, callbacks=[StopAt(stop)])
        state = torch.load(run_dir / "checkpoints" / f"step_{stop:07d}" / "train_state.pt", weights_only=True)
        assert state["seq_len_schedule"]["seq_len"] == 32
        assert len(state["seq_len_schedule"]["losses"]) == stop - 6
        run(cfg(), run_dir, resume=True)
        assert losses(run_dir) == losses(tmp_path / "a"), stop
