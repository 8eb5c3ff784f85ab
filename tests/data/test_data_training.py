"""The data pipeline through the real trainer and CLI: training from an http:// URL
works end to end, and a run resumed mid-epoch reads exactly the batches (tokens) of an
uninterrupted one, with the cache, prefetch and augmentation on."""

from __future__ import annotations

import subprocess
import sys

import torch

from conftest import StopAt, debug_config
from tests.data.helpers import serve
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer

AUGMENT = '[{name = "doc_shuffle", p = 0.5}, {name = "token_replace", p = 0.5, rate = 0.05}]'


def train_recording(cfg, run_dir, resume=False, callbacks=None):
    """Run the trainer; return the (inputs, targets) of every micro-batch it trained on."""
    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    seen, take = [], t.train_batches.next

    def record():
        batch = take()
        seen.append(batch)
        return batch

    t.train_batches.next = record
    try:
        t.fit()
    finally:
        t.close()
    return seen


def test_resumed_run_reads_the_batches_of_an_uninterrupted_one(tmp_path, epoch_data):
    # 10 batches per epoch: the run crosses into epoch 2, the interruption is mid-epoch.
    cfg = lambda cache: debug_config(epoch_data.as_uri(), "--training.steps", "16", "--data.cache.dir", str(cache),
                                     "--data.cache.memory_mb", "0", "--data.augment.transforms", AUGMENT)
    ref = train_recording(cfg(tmp_path / "c1"), tmp_path / "a")
    part = train_recording(cfg(tmp_path / "c2"), tmp_path / "b", callbacks=[StopAt(7)])
    rest = train_recording(cfg(tmp_path / "c2"), tmp_path / "b", resume=True)
    assert len(part) == 7 and len(ref) == 16
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(ref, part + rest, strict=True))
    losses = lambda d: [(r["step"], r["loss"]) for r in read_jsonl(d / "metrics.jsonl") if "loss" in r]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    last = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r][-1]
    assert last["data_hit_rate_disk"] == 1.0  # epoch 2 from the disk tier (memory tier 0 MiB)
    first = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r][0]
    assert first["data_bytes_source"] > 0 and 0 <= first["data_io_wait_frac"] <= 1


def test_cli_trains_from_http_and_resumes_exactly(tmp_path, epoch_data):
    # Constant LR (no warmup, no decay): a run stopped at step 7 and extended to 16 on
    # resume follows the same schedule as one run of 16 steps.
    args = ["--model.flavor", "debug", "--training.batch_size", "8", "--training.seq_len", "64",
            "--training.log_interval", "1", "--training.warmup_steps", "0", "--training.min_lr_ratio", "1.0",
            "--training.val_batches", "2", "--training.val_interval", "0", "--sample.max_new_tokens", "0",
            "--training.threads", "1"]
    cli = [sys.executable, "-m", "trainforge", "train"]
    with serve(epoch_data) as url:
        data = ["--data.path", url + "/", "--data.cache.dir", str(tmp_path / "cache")]
        a = subprocess.run([*cli, "--run_dir", str(tmp_path / "a"), *data, *args, "--training.steps", "16"],
                           capture_output=True, text=True, timeout=300)
        assert a.returncode == 0, a.stderr
        b = subprocess.run([*cli, "--run_dir", str(tmp_path / "b"), *data, *args, "--training.steps", "7"],
                           capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stderr
        r = subprocess.run([*cli, "--resume", str(tmp_path / "b"), "--training.steps", "16"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    records = lambda d: [x for x in read_jsonl(d / "metrics.jsonl") if "loss" in x]
    assert [(x["step"], x["loss"]) for x in records(tmp_path / "a")] == \
        [(x["step"], x["loss"]) for x in records(tmp_path / "b")]
    assert (tmp_path / "b" / "checkpoints" / "step_0000016").is_dir()
    first = records(tmp_path / "a")[0]
    assert first["data_hit_rate_source"] > 0 and first["data_bytes_source"] > 0
    assert records(tmp_path / "a")[-1]["data_bytes_source"] == 0  # epoch 2: all cached
