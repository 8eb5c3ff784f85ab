"""Longer and multi-process precision checks (slow, still run in CI): bf16-mixed
converges like fp32 on ``tiny``, and bf16-mixed under FSDP2 (2 processes, gloo, via the
CLI) trains like the single-process bf16-mixed run."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_data_parallel import losses, run, train_cmd, weights
from trainforge.config import load_config
from trainforge.train.metrics import read_jsonl
from trainforge.train.trainer import Trainer

pytestmark = pytest.mark.slow
# bf16 compute even on CPUs where the probe finds it slower than fp32 (not this one).
BF16 = ["--precision.policy", "bf16-mixed", "--precision.force", "true"]


def test_bf16_mixed_ends_within_one_percent_of_fp32(tmp_path, small_data):
    """``tiny``, 200 steps, seq 32 x batch 4, same seed and data: the final validation
    loss of bf16-mixed is within 1% of fp32's (~0.1 s/step each on 2 cores)."""
    def final_val(name, *extra):
        cfg = load_config(None, ["--data.path", str(small_data), "--model.flavor", "tiny", "--training.steps", "200",
                                 "--training.batch_size", "4", "--training.seq_len", "32", "--training.lr", "2e-3",
                                 "--training.warmup_steps", "20", "--training.val_interval", "0",
                                 "--training.val_batches", "16", "--training.log_interval", "50",
                                 "--checkpoint.interval", "0", "--sample.max_new_tokens", "0", *extra])
        t = Trainer(cfg, tmp_path / name, progress=False)
        try:
            summary = t.fit()
        finally:
            t.close()
        assert t.mp.runtime.compute_dtypes["model"] == (torch.bfloat16 if extra else torch.float32)
        return summary["first_val_loss"], summary["final_val_loss"]

    first32, fp32 = final_val("fp32")
    first16, bf16 = final_val("bf16", *BF16)
    assert fp32 < first32 - 1.0 and bf16 < first16 - 1.0  # both actually trained
    assert abs(bf16 - fp32) <= 0.01 * fp32, (bf16, fp32)


def test_bf16_mixed_under_fsdp2_matches_the_single_process_run(tmp_path, small_data):
    """FSDP2 gathers the blocks' weights in bf16 (fp32 sharded masters, norms as fp32 units,
    gradients reduced in fp32); one process autocasts fp32 weights to bf16. Same global
    batch and seed: the same training within bf16 rounding."""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    run(train_cmd(1, one, small_data, "--training.batch_size", "8", *BF16))
    r = run(train_cmd(2, two, small_data, "--training.batch_size", "4", "--parallel.dp_shard", "-1", *BF16))
    assert "(fsdp)" in r.stderr and "compute bf16" in r.stderr
    got, want = losses(two), losses(one)
    assert sorted(got) == list(range(1, 7))
    for s in got:
        assert abs(got[s] - want[s]) <= 5e-3 * want[s], (s, got[s], want[s])
    recs = [rec for rec in read_jsonl(two / "metrics.jsonl") if "loss" in rec]
    assert all(rec["precision"] == {"model": "bf16"} for rec in recs)
    assert recs[-1]["mem_params_fp32_bytes"] > 0  # this rank's fp32 shards
    a, b = weights(two / "checkpoints" / "step_0000006"), weights(one / "checkpoints" / "step_0000006")
    for k in b:
        assert a[k].dtype == torch.float32  # the sharded master weights are what is saved
        torch.testing.assert_close(a[k], b[k], atol=2e-3, rtol=0, msg=k)
