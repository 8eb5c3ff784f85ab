"""Optimizer offload under DDP and FSDP2 on 2 ranks (gloo): ``delay = 0`` trains as AdamW on
the device does, within 1e-6 in losses and weights over 20 steps (the host runs the same
AdamW kernel the device optimizer picks, so the bits agree here); FSDP2's own
``CPUOffloadPolicy`` (``offload.mode = fsdp``) trains too. One torchrun launch for all runs."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_data_parallel import losses, weights
from tests.parallel.torchrun import completed_run, run_train_many

STEPS = 20
TOL = 1e-6  # the requirement; the runs agree to the bit on a Zen 4
COMMON = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.steps", str(STEPS),
          "--training.batch_size", "4", "--training.grad_accum_steps", "2", "--training.grad_clip", "0.5",
          "--training.warmup_steps", "2", "--training.log_interval", "5", "--training.val_interval", "0",
          "--training.val_batches", "2", "--checkpoint.interval", "0", "--sample.max_new_tokens", "0",
          "--training.threads", "1"]
LAYOUTS = {"ddp": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"],
           "fsdp": ["--parallel.dp_shard", "-1"]}
OFFLOAD = ["--offload.optimizer", "true", "--offload.bucket_mb", "0.05", "--offload.threads", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    root = tmp_path_factory.mktemp("offload_runs")

    def args(name, *extra):
        return ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON, *extra]

    done = run_train_many(2, {
        **{f"{k}-device": args(f"{k}-device", *v) for k, v in LAYOUTS.items()},
        **{f"{k}-offload": args(f"{k}-offload", *v, *OFFLOAD) for k, v in LAYOUTS.items()},
        "fsdp-cpu-policy": args("fsdp-cpu-policy", *LAYOUTS["fsdp"], "--offload.optimizer", "true",
                                "--offload.mode", "fsdp"),
    })
    return root, done


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_delay_0_matches_adamw_on_the_device(runs, layout):
    got, want = completed_run(*runs, f"{layout}-offload"), completed_run(*runs, f"{layout}-device")
    a, b = losses(got), losses(want)
    assert sorted(a) == list(range(1, STEPS + 1))
    torch.testing.assert_close([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], atol=TOL, rtol=0)
    wa, wb = (weights(d / "checkpoints" / f"step_{STEPS:07d}") for d in (got, want))
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], atol=TOL, rtol=0, msg=k)


@pytest.mark.slow
def test_fsdp_cpu_offload_policy_trains_like_fsdp(runs):
    """FSDP2 keeps its sharded parameters and state on the host and steps them there: the
    same arithmetic on the same shards, so the same losses as FSDP2 on the device."""
    got, want = completed_run(*runs, "fsdp-cpu-policy"), completed_run(*runs, "fsdp-device")
    a, b = losses(got), losses(want)
    torch.testing.assert_close([a[s] for s in sorted(a)], [b[s] for s in sorted(b)], atol=TOL, rtol=0)
    assert a[STEPS] < a[1]
