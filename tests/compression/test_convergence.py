"""Convergence with compressed gradients: the ``tiny`` model, 2 ranks (DDP), same seed
and data, 200 steps. int4 with error feedback and the adaptive codec end within 1% of
the uncompressed validation loss. (That error feedback matters is shown where it
does measurably: ``test_error_feedback.py`` and the top-k rows of
``bench/grad_compression.py``; on this run int4 without it is not worse, see
BENCHMARKS.md.)"""

from __future__ import annotations

import pytest

from tests.parallel.test_data_parallel import run
from trainforge.train.metrics import read_jsonl

pytestmark = pytest.mark.slow


def final_val_loss(tmp_path, data, name: str, *codec: str) -> float:
    import sys

    run_dir = tmp_path / name
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainforge",
         "train", "--run_dir", str(run_dir), "--data.path", str(data), "--model.flavor", "tiny",
         "--training.seq_len", "32", "--training.batch_size", "4", "--training.steps", "200",
         "--training.warmup_steps", "20", "--training.log_interval", "50", "--training.val_interval", "0",
         "--training.val_batches", "8", "--training.threads", "1", "--sample.max_new_tokens", "0",
         "--parallel.dp_replicate", "2", "--compression.warmup_steps", "10", *codec])
    return [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r][-1]


def test_int4_with_error_feedback_and_adaptive_converge_like_fp32(tmp_path, small_data):
    base = final_val_loss(tmp_path, small_data, "none", "--compression.codec", "none")
    int4 = final_val_loss(tmp_path, small_data, "int4", "--compression.codec", "int4")
    adaptive = final_val_loss(tmp_path, small_data, "adaptive", "--compression.codec", "adaptive")
    assert base < 5.0  # it learned something: the comparison means something
    assert abs(int4 - base) / base <= 0.01, (int4, base)
    assert abs(adaptive - base) / base <= 0.01, (adaptive, base)
