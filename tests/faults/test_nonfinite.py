"""A diverging run without a [bad_steps] policy: the CLI stops it at the logging
interval with one line naming the step, the value and the fixes, exits
``exit_codes.NONFINITE_LOSS``, and leaves no checkpoint of the non-finite state."""

from __future__ import annotations

import re

from tests.faults.conftest import one_error_line, run_cli, train_args
from trainforge import exit_codes


def test_nan_loss_stops_with_exit_3_and_no_checkpoint_of_it(tmp_path, small_data):
    run_dir = tmp_path / "run"
    # LR rising to 300 over 20 warmup steps, no clipping: finite for the first checkpoints
    # (every 5 steps), then NaN.
    res = run_cli(train_args(small_data, "--training.steps", "200", "--training.lr", "300", "--training.warmup_steps",
                             "20", "--training.grad_clip", "0", "--checkpoint.interval", "5", "--run_dir", str(run_dir)))
    assert res.returncode == exit_codes.NONFINITE_LOSS, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    bad = int(re.search(r"at step (\d+)", line).group(1))
    assert re.search(r"(loss|norm) (nan|inf)", line), line
    assert "training.lr" in line and "[bad_steps]" in line and f"--resume {run_dir}" in line
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert all(s < bad for s in saved), (bad, saved)
