"""The monitor under torchrun (gloo, CPU): sampled-step statistics of sharded
parameters are full-tensor norms (FSDP2, TP), pipeline stages report their own layer
groups, and the sampled profiler coexists with the trainer's communication probe.
Each rank serves its own endpoint (prometheus_port + LOCAL_RANK) without conflict. The three
2-process runs share one torchrun launch (the ``runs`` fixture)."""

from __future__ import annotations

import math

import pytest

from tests.parallel.torchrun import run_train_many
from trainforge.monitor.sinks import free_port
from trainforge.monitor.jsonl import read_jsonl

COMMON = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.steps", "6", "--training.batch_size", "4",
          "--training.warmup_steps", "2", "--training.log_interval", "2", "--training.val_interval", "0",
          "--training.val_batches", "2", "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
          "--training.threads", "1", "--monitor.interval_steps", "2", "--monitor.activation_stats", "true",
          "--monitor.profile_every", "3"]


LAYOUTS = {"fsdp2": ["--parallel.dp_shard", "-1"], "tp2": ["--parallel.tp", "2"],
           "pp2": ["--parallel.pp", "2", "--parallel.pp_split", "even"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """The three runs in one torchrun launch (tests/parallel/workers/cli_many.py: each through
    the real CLI, one after another on the same ranks). Endpoints: the FSDP2 run on ports P and
    P+1 (one per rank), the TP run on P+2 and P+3, so neither can meet the other's sockets; the
    pipeline run without, so rank 1 there has no destination at all. Returns (root: run
    directories by name, name -> that run's CompletedProcess)."""
    root = tmp_path_factory.mktemp("monitor_runs")
    port = free_port(count=4)
    endpoint = {"fsdp2": ["--monitor.prometheus_port", str(port)],
                "tp2": ["--monitor.prometheus_port", str(port + 2)], "pp2": []}
    return root, run_train_many(2, {
        name: ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON, *layout, *endpoint[name]]
        for name, layout in LAYOUTS.items()})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_monitor_statistics_under_torchrun(runs, case):
    root, done = runs
    layout = LAYOUTS[case]
    assert done[case].returncode == 0
    train = [x for x in read_jsonl(root / case / "metrics.jsonl") if "loss" in x]
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
