"""Longer and multi-process precision checks (slow, still run in CI): bf16-mixed
converges like fp32 on ``debug``; bf16-mixed under FSDP2 (2 processes, gloo, via the
CLI) trains like the single-process bf16-mixed run; under HSDP with compressed
gradients the replicas stay bit-identical, fp32 norm units included."""

from __future__ import annotations

import json

import pytest
import torch

from tests.compression.test_compressed_training import WORKERS
from tests.parallel.test_data_parallel import losses, run, train_cmd, train_one, weights
from tests.parallel.torchrun import run_torchrun
from trainforge.config import load_config
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer

pytestmark = pytest.mark.slow
# bf16 compute even on CPUs where the probe finds it slower than fp32 (not this one).
BF16 = ["--precision.policy", "bf16-mixed", "--precision.force", "true"]


def test_bf16_mixed_ends_within_a_quarter_percent_of_fp32(tmp_path, small_data):
    """``debug`` flavor, 200 steps, seq 32 x batch 4, same seed and data: the final
    validation loss of bf16-mixed is within 0.25% of fp32's (the documented claim is 1%;
    the tighter bound also rejects a policy that loses the fp32 master weights).

    Measured (AVX2-only EPYC, seeds 1234 / 1 / 2 / 3 / 7): bf16-mixed ends 0.00-0.01% from
    fp32; bf16 weights with bf16 optimizer state (updates rounded away) end +0.52-0.63%
    worse, so the 0.25% bound sits 25x above the honest difference and 2x below that
    failure. Both drop 1.29-1.37 nats from ln(512). ``debug`` rather than ``tiny``: bf16
    matmuls are ~300x slower than fp32 on CPUs without AVX-512 bf16 (``tiny`` took 340 s
    here, ``debug`` ~12 s); the policy under test (autocast, fp32 masters, fp32 norms and
    loss) is the same code at any width. One thread: no OpenMP collapse on shared cores."""
    def final_val(name, *extra):
        cfg = load_config(None, ["--data.path", str(small_data), "--model.flavor", "debug", "--training.steps", "200",
                                 "--training.batch_size", "4", "--training.seq_len", "32",
                                 "--training.val_interval", "0",
                                 "--training.val_batches", "16", "--training.log_interval", "50",
                                 "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
                                 "--training.threads", "1", *extra])
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
    assert abs(bf16 - fp32) <= 0.0025 * fp32, (bf16, fp32)


def test_bf16_mixed_under_fsdp2_matches_the_single_process_run(tmp_path, small_data):
    """FSDP2 gathers the blocks' weights in bf16 (fp32 sharded masters, norms as fp32 units,
    gradients reduced in fp32); one process autocasts fp32 weights to bf16. Same global
    batch and seed: the same training within bf16 rounding."""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    train_one(one, small_data, "--training.batch_size", "8", *BF16)
    r = run(train_cmd(2, two, small_data, "--training.batch_size", "4", "--parallel.dp_shard", "-1", *BF16))
    assert "layout: FSDP2 over 2 ranks" in r.stderr and "compute bf16" in r.stderr
    got, want = losses(two), losses(one)
    assert sorted(got) == list(range(1, 7))
    for s in got:  # measured: <= 1.5e-5 relative (the residual stream is bf16 where embeddings are gathered bf16)
        assert abs(got[s] - want[s]) <= 1e-3 * want[s], (s, got[s], want[s])
    vals = lambda d: {r["step"]: r["val_loss"] for r in read_jsonl(d / "metrics.jsonl") if "val_loss" in r}  # noqa
    assert vals(two).keys() == vals(one).keys() == {0, 3, 6}
    assert all(abs(vals(two)[s] - vals(one)[s]) <= 1e-3 * vals(one)[s] for s in (3, 6))
    recs = [rec for rec in read_jsonl(two / "metrics.jsonl") if "loss" in rec]
    assert all(rec["precision"] == {"model": "bf16"} for rec in recs)
    assert recs[-1]["mem_params_fp32_bytes"] > 0  # this rank's fp32 shards
    a, b = weights(two / "checkpoints" / "step_0000006"), weights(one / "checkpoints" / "step_0000006")
    for k in b:
        assert a[k].dtype == torch.float32  # the sharded master weights are what is saved
        # AdamW normalises each update to ~lr, so entries with near-zero gradients may move
        # either way (up to ~2 x the summed lr); on average the weights agree closely
        # (measured: mean |diff| <= 3e-5).
        assert (a[k] - b[k]).abs().mean() <= 2e-4, k


def test_hsdp_with_compression_keeps_bf16_replicas_identical(tmp_path, small_data):
    """HSDP 2x2 with int4-compressed replicate all-reduce: the fp32 norm units FSDP2 gets
    under bf16-mixed carry the compression hook too, so every replica holds the same bits."""
    overrides = ["--data.path", str(small_data), "--model.flavor", "debug", "--training.seq_len", "32",
                 "--training.steps", "4", "--training.log_interval", "2", "--training.val_interval", "0",
                 "--training.val_batches", "2", "--sample.max_new_tokens", "0", "--training.threads", "1",
                 "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--compression.codec", "int4",
                 "--compression.warmup_steps", "1", *BF16]
    r = run_torchrun(WORKERS / "sync_check.py", 4, json.dumps([[str(tmp_path / "run"), overrides]]), timeout_s=240)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("SYNC "))
    assert "mismatched=[]" in line and "checked=0" not in line, line
    recs = [rec for rec in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in rec]
    assert recs and all(rec["precision"] == {"model": "bf16"} for rec in recs)
