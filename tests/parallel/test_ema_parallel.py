"""The weight average ([ema]) under data parallelism (torchrun, gloo, CPU): with FSDP2 each
rank averages its own shards, and the shards put together equal the single-process run's
average; a run resumed from its step-3 checkpoint ends with the uninterrupted run's average,
bit for bit. Under DDP rank 0 keeps the average and generate reads it. One launch for the
2-process runs."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_data_parallel import COMMON, GLOBAL_BATCH, WEIGHT_ATOL
from tests.parallel.torchrun import resumed, run_train_many
from trainforge.loading.ema_weights import read_ema_weights

EMA = ["--ema.enabled", "--ema.decay", "0.5"]  # large steps: a missed or doubled update shows


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    root = tmp_path_factory.mktemp("ema_runs")

    def fresh(name, dp, *layout):
        return ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON, "--checkpoint.keep_last", "5",
                "--training.batch_size", str(GLOBAL_BATCH // dp), *EMA, *layout]

    done = run_train_many(2, {"fsdp2": fresh("fsdp2", 2, "--parallel.dp_shard", "-1"),
                              "ddp2": fresh("ddp2", 2, "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"),
                              "fsdp2-resumed": resumed(root / "fsdp2", root / "fsdp2-resumed", 3)})
    done |= run_train_many(1, {"reference": fresh("reference", 1)})
    assert all(r.returncode == 0 for r in done.values()), {k: r.stderr[-3000:] for k, r in done.items()}
    return root


def rank_averages(run_dir, step: int) -> list[dict[str, torch.Tensor]]:
    files = sorted((run_dir / "checkpoints" / f"step_{step:07d}" / "ema").glob("rank_*.pt"))
    return [torch.load(f, weights_only=True)["weights"] for f in files]


@pytest.mark.slow
def test_fsdp2_shard_averages_equal_the_single_process_average(runs):
    ref = read_ema_weights(runs / "reference" / "checkpoints" / "step_0000006")
    shards = rank_averages(runs / "fsdp2", 6)
    assert len(shards) == 2
    for k, full in ref.items():
        # FSDP2 shards dim 0 in rank order (torch.chunk): the pieces put back together
        torch.testing.assert_close(torch.cat([s[k] for s in shards]), full, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.slow
def test_fsdp2_resumed_average_equals_the_uninterrupted_runs(runs):
    a, b = rank_averages(runs / "fsdp2", 6), rank_averages(runs / "fsdp2-resumed", 6)
    assert len(a) == len(b) == 2
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


@pytest.mark.slow
def test_ddp_average_is_kept_once_and_matches_the_single_process_one(runs):
    ref = read_ema_weights(runs / "reference" / "checkpoints" / "step_0000006")
    got = read_ema_weights(runs / "ddp2" / "checkpoints" / "step_0000006")
    assert not (runs / "ddp2" / "checkpoints" / "step_0000006" / "ema").exists()
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=WEIGHT_ATOL)
