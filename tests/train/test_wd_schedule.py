"""``optimizer.weight_decay_schedule`` as a user meets it: the keys are checked naming the key
and the fix; linear and cosine move the decay where documented and every training record says
the value its step used; only the matrices' groups are decayed; a run with a ramp trains like
the constant-decay run until the ramp starts and differently after; a run stopped mid-ramp
resumes to the uninterrupted run's losses bit for bit; a constant-decay checkpoint resumes on
the schedule, saying so; constant registers nothing."""

from __future__ import annotations

import math

import pytest

from conftest import StopAt, debug_config, fit_run as run
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.optimizer import decayed_groups
from trainforge.train.wd_schedule import WeightDecaySchedule

BASE = ["--training.batch_size", "2", "--training.seq_len", "32", "--training.warmup_steps", "2",
        "--training.val_interval", "0", "--training.val_batches", "1", "--checkpoint.interval", "0",
        "--training.threads", "1", "--training.steps", "8", "--training.log_interval", "4",
        "--optimizer.weight_decay", "0.1"]
# Ramp from step index 4 (0.5 x 8) to 8: the value of step index k is 0.1 + 0.8 x (k - 4) / 4 after 4.
RAMP = [*BASE, "--optimizer.weight_decay_schedule", "linear", "--optimizer.weight_decay_final", "0.9",
        "--optimizer.weight_decay_ramp_start", "0.5"]


def records(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_schedule_values_as_documented():
    linear = WeightDecaySchedule("linear", 0.1, 0.5, ramp_start_step=50, total_steps=100)
    cosine = WeightDecaySchedule("cosine", 0.1, 0.5, ramp_start_step=50, total_steps=100)
    for s in (linear, cosine):
        assert s(0) == s(50) == 0.1 and s(100) == s(150) == pytest.approx(0.5)
    assert linear(75) == pytest.approx(0.3) and cosine(75) == pytest.approx(0.3)  # both halfway at the middle
    assert linear(60) == pytest.approx(0.18)
    assert cosine(60) == pytest.approx(0.1 + 0.4 * 0.5 * (1 - math.cos(math.pi * 0.2)))  # leaves flat
    assert WeightDecaySchedule("linear", 0.3, 0.0, 0, 10)(5) == pytest.approx(0.15)  # a decrease works too


@pytest.mark.parametrize("argv, needles", [
    (["--optimizer.weight_decay_schedule", "linear"], ["optimizer.weight_decay_final", "both or neither"]),
    (["--optimizer.weight_decay_final", "0.3"], ["optimizer.weight_decay_final", "weight_decay_schedule"]),
    (["--optimizer.weight_decay_schedule", "cosine", "--optimizer.weight_decay_final", "-1"],
     ["optimizer.weight_decay_final", ">= 0"]),
    (["--optimizer.weight_decay_schedule", "cosine", "--optimizer.weight_decay_final", "0.3",
      "--optimizer.weight_decay_ramp_start", "1"], ["optimizer.weight_decay_ramp_start", "[0, 1)"]),
    (["--optimizer.weight_decay_schedule", "step"], ["optimizer.weight_decay_schedule"]),
])
def test_bad_keys_are_refused_naming_the_key_and_the_fix(argv, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, argv)
    for needle in needles:
        assert needle in str(e.value)


def test_linear_ramp_is_recorded_per_step_and_decays_only_the_matrices(tmp_path, small_data):
    _, t = run(debug_config(small_data, *RAMP), tmp_path / "run")
    want = [0.1] * 5 + [0.3, 0.5, 0.7]  # steps 1..8 = scheduler steps 0..7
    assert [r["weight_decay"] for r in records(tmp_path / "run")] == pytest.approx(want)
    opt = t.optimizer
    decayed = decayed_groups(opt)
    assert decayed and all(g["weight_decay"] == pytest.approx(0.7) for g in decayed)
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if g not in decayed)  # norms, biases
    assert all(p.dim() >= 2 for g in decayed for p in g["params"])


def test_the_ramp_changes_training_only_from_where_it_starts(tmp_path, small_data):
    run(debug_config(small_data, *BASE), tmp_path / "const")
    run(debug_config(small_data, *RAMP), tmp_path / "ramp")
    const, ramp = records(tmp_path / "const"), records(tmp_path / "ramp")
    # Step 6 is the first update with another decay; its weights first show in step 7's loss.
    assert [r["loss"] for r in ramp[:6]] == [r["loss"] for r in const[:6]]
    assert all(a["loss"] != b["loss"] for a, b in zip(ramp[6:], const[6:]))
    assert all("weight_decay" not in r for r in const)  # constant: nothing registered, nothing recorded


@pytest.mark.parametrize("stop", [3, 6])  # before the ramp, and in it
def test_resume_mid_ramp_equals_the_uninterrupted_run(tmp_path, small_data, stop):
    run(debug_config(small_data, *RAMP), tmp_path / "a")
    part, _ = run(debug_config(small_data, *RAMP), tmp_path / "b", callbacks=[StopAt(stop)])
    assert part["step"] == stop
    run(debug_config(small_data, *RAMP), tmp_path / "b", resume=True)
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [(r["step"], r["loss"], r["weight_decay"]) for r in b] == [(r["step"], r["loss"], r["weight_decay"])
                                                                     for r in a]


def test_a_constant_decay_checkpoint_resumes_on_the_schedule_and_says_so(tmp_path, small_data, capsys):
    run(debug_config(small_data, *BASE), tmp_path / "run", callbacks=[StopAt(6)])
    capsys.readouterr()
    _, t = run(debug_config(small_data, *RAMP), tmp_path / "run", resume=True)
    assert "weight decay schedule:" in capsys.readouterr().err
    assert [r["weight_decay"] for r in records(tmp_path / "run") if r["step"] > 6] == pytest.approx([0.5, 0.7])
    assert t.components.get("weight_decay_schedule") is not None
