"""The training-control config keys: off by default, out-of-range values refused naming the key."""

import pytest

from trainforge.config import load_config
from trainforge.errors import ConfigError


def test_everything_is_off_by_default():
    cfg = load_config()
    assert cfg.training.lr_schedule == "cosine"
    assert cfg.adaptive_lr.build() is None and cfg.bad_steps.build() is None and cfg.early_stop.build(100) is None


@pytest.mark.parametrize("overrides, needle", [
    (["--training.lr_schedule", "step"], "training.lr_schedule"),
    (["--training.decay_shape", "exp"], "training.decay_shape"),
    (["--training.lr_schedule", "wsd", "--training.steps", "100", "--training.decay_ratio", "0.9"],
     "training.decay_ratio"),
    (["--training.decay_ratio", "0"], "training.decay_ratio"),
    (["--adaptive_lr.window", "3"], "adaptive_lr.window"),
    (["--adaptive_lr.restore_factor", "1"], "adaptive_lr.restore_factor"),
    (["--early_stop.mode", "best"], "early_stop.mode"),
    (["--early_stop.confidence", "0"], "early_stop.confidence"),
    (["--early_stop.min_delta", "-1"], "early_stop.min_delta"),
    (["--bad_steps.on_nonfinite", "ignore"], "bad_steps.on_nonfinite"),
    (["--bad_steps.spike_factor", "1"], "bad_steps.spike_factor"),
    (["--bad_steps.spike_window", "10", "--bad_steps.spike_min_history", "20"], "bad_steps.spike_min_history"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, overrides)


def test_sections_build_their_components():
    cfg = load_config(None, ["--adaptive_lr.enabled", "true", "--adaptive_lr.window", "6", "--early_stop.mode",
                             "patience", "--early_stop.patience", "7", "--bad_steps.enabled", "true",
                             "--bad_steps.on_nonfinite", "stop"])
    assert cfg.adaptive_lr.build().window == 6
    es = cfg.early_stop.build(500)
    assert (es.mode, es.patience, es.budget_steps) == ("patience", 7, 500)
    assert cfg.bad_steps.build().on_nonfinite == "stop"
