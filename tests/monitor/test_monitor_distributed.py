"""The monitor under torchrun (gloo, CPU): sampled-step statistics of sharded
parameters are full-tensor norms (FSDP2, TP), pipeline stages report their own layer
groups, and the sampled profiler coexists with the trainer's communication probe.
Each rank serves its own endpoint (prometheus_port + LOCAL_RANK) without conflict."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.parallel.torchrun import torchrun_env
from trainforge.monitor.sinks import free_port
from trainforge.monitor.jsonl import read_jsonl

COMMON = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.steps", "6", "--training.batch_size", "4",
          "--training.warmup_steps", "2", "--training.log_interval", "2", "--training.val_interval", "0",
          "--training.val_batches", "2", "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
          "--training.threads", "1", "--monitor.interval_steps", "2", "--monitor.activation_stats", "true",
          "--monitor.profile_every", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel.dp_shard", "-1"], ["--parallel.tp", "2"],
                                    ["--parallel.pp", "2", "--parallel.pp_split", "even"]], ids=["fsdp2", "tp2", "pp2"])
def test_monitor_statistics_under_torchrun(tmp_path, small_data, layout):
    # Endpoints on ports P and P+1 (one per rank); the pipeline case runs without, so rank 1
    # there has no destination at all.
    endpoint = [] if "--parallel.pp" in layout else ["--monitor.prometheus_port", str(free_port(count=2))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainforge",
           "train", "--run_dir", str(tmp_path / "run"), "--data.path", str(small_data), *COMMON, *layout, *endpoint]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=torchrun_env())
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    train = [x for x in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3, 4, 5, 6]
    assert all(0 < x["comm_share"] <= 1 and "collective_s" in x for x in train)
    sampled = [x for x in train if "grad_norm_group" in x]
    assert [x["step"] for x in sampled] == [2, 4, 6]
    assert [x["step"] for x in train if "top_ops" in x] == [3]
    for x in sampled:
        assert x["act_std"] and all(v > 0 for v in x["act_std"].values())
        combined = math.sqrt(sum(v ** 2 for v in x["grad_norm_group"].values()))
        if "--parallel.pp" in layout:  # rank 0 holds stage 0 only
            assert set(x["grad_norm_group"]) == {"tok_embeddings", "layers.0"} and x["bubble_fraction"] > 0
            assert combined < min(x["grad_norm"], 1.0)
        else:  # all groups, full (not per-shard) norms: they combine to the clipped global norm
            assert {"tok_embeddings", "layers.0", "layers.1", "norm", "output"} <= set(x["grad_norm_group"])
            assert combined == pytest.approx(min(x["grad_norm"], 1.0), rel=1e-3)
