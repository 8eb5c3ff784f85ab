"""``optimizer.lr_scaling`` as a user meets it: the peak LR follows the global batch (batch_size x
grad_accum_steps x data-parallel ranks) by the linear or square-root rule from the reference
batch, is said in words at the start, is the LR every record shows, and is the same for every
split of one global batch; ``none`` (the default) leaves training.lr as given; a rule without
its reference batch is refused naming the key."""

from __future__ import annotations

import math

import pytest

from conftest import debug_config
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.monitor.jsonl import read_jsonl
from trainforge.plan.lr_scaling import batch_change_lr, describe_scaling, lr_factor
from trainforge.train.trainer import Trainer

BASE = ["--training.seq_len", "32", "--training.warmup_steps", "0", "--training.lr_schedule", "constant",
        "--training.lr", "1e-3", "--training.val_interval", "0", "--training.val_batches", "1",
        "--checkpoint.interval", "0", "--training.threads", "1", "--training.steps", "2",
        "--training.log_interval", "1"]


def lrs(cfg, run_dir):
    t = Trainer(cfg, run_dir, progress=False)
    try:
        t.fit()
    finally:
        t.close()
    return [r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_rules_as_documented():
    assert lr_factor("none", 64, 8) == 1.0
    assert lr_factor("linear", 64, 8) == 8.0 and lr_factor("linear", 4, 8) == 0.5
    assert lr_factor("sqrt", 32, 8) == 2.0 and lr_factor("sqrt", 8, 32) == 0.5
    assert describe_scaling(1e-3, "linear", 32, 8) == ("lr scaling linear: global batch 32 sequences / reference 8 "
                                                        "= x4: peak lr 1e-3 -> 4e-3")


@pytest.mark.parametrize("argv, needles", [
    (["--optimizer.lr_scaling", "linear"], ["optimizer.lr_reference_batch", "global batch", ">= 1"]),
    (["--optimizer.lr_scaling", "cubic"], ["optimizer.lr_scaling"]),
    (["--optimizer.lr_reference_batch", "-4"], ["optimizer.lr_reference_batch", ">= 0"]),
])
def test_bad_keys_are_refused_naming_the_key(argv, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, argv)
    for needle in needles:
        assert needle in str(e.value)


def test_the_peak_lr_follows_the_global_batch_and_is_said_at_start(tmp_path, small_data, capsys):
    rule = ["--optimizer.lr_scaling", "linear", "--optimizer.lr_reference_batch", "2"]
    # Global batch 8 sequences, once as 8 x 1 and once as 4 x 2 accumulation steps: x4 both times.
    assert lrs(debug_config(small_data, *BASE, *rule, "--training.batch_size", "8"),
               tmp_path / "a") == pytest.approx([4e-3, 4e-3])
    assert ("lr scaling linear: global batch 8 sequences / reference 2 = x4: peak lr 1e-3 -> 4e-3"
            in capsys.readouterr().err)
    assert lrs(debug_config(small_data, *BASE, *rule, "--training.batch_size", "4", "--training.grad_accum_steps",
                            "2"), tmp_path / "b") == pytest.approx([4e-3, 4e-3])
    sqrt = ["--optimizer.lr_scaling", "sqrt", "--optimizer.lr_reference_batch", "32"]
    assert lrs(debug_config(small_data, *BASE, *sqrt, "--training.batch_size", "8"),
               tmp_path / "c") == pytest.approx([1e-3 * math.sqrt(8 / 32)] * 2)
    # none (the default) ignores the batch and says nothing about it.
    capsys.readouterr()
    assert lrs(debug_config(small_data, *BASE, "--training.batch_size", "8"), tmp_path / "d") == [1e-3, 1e-3]
    assert "lr scaling" not in capsys.readouterr().err


def test_batch_changes_say_the_lr_they_set():
    text, follows = batch_change_lr(1e-3, "linear", 8, 16, 64)
    assert follows and text == "peak lr 2e-3 -> 8e-3 (optimizer.lr_scaling = linear, reference 8 sequences)"
    text, follows = batch_change_lr(1e-3, "none", 0, 16, 64)
    assert not follows and "linear rule gives 4e-3, sqrt 2e-3" in text and "lr_reference_batch = 16" in text
    assert batch_change_lr(1e-3, "sqrt", 8, 16, 16) == ("peak lr 1.41e-3 unchanged (same global batch)", True)
