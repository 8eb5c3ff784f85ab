"""Data parallelism through the real CLI under torchrun (gloo, CPU): DDP, FSDP2 and
HSDP each match single-process training at the same global batch and seed, and a
checkpoint saved at one layout resumes at others. The runs that share a world size share a
torchrun launch (the ``runs`` fixture)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.parallel.torchrun import completed_run, resumed, run_train_many, torchrun_env, train_here
from trainforge.errors import ConfigError
from trainforge.model import FLAVORS, ModelConfig, build_model
from trainforge.parallel.dims import ParallelDims
from trainforge.train import checkpoint as ckpt
from trainforge.train import dist_checkpoint as dckpt
from trainforge.monitor.jsonl import read_jsonl

GLOBAL_BATCH = 8
COMMON = ["--model.flavor", "debug", "--training.seq_len", "32", "--training.steps", "6",
          "--training.warmup_steps", "2", "--training.log_interval", "1", "--training.val_interval", "3",
          "--training.val_batches", "2", "--checkpoint.interval", "3", "--sample.max_new_tokens", "0",
          "--training.threads", "1"]
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-5
# Tensor parallelism sums in another order (sharded matmuls, sequence- and loss-parallel
# reductions), and 6 Adam steps carry that rounding into the weights: on a Zen 4 the worst
# element after step 6 was 5.0e-6 with torch-computed rope tables and 1.04e-5 with the
# correctly rounded ones (the same layer, ``layers.1.feed_forward.w2``), where the data-parallel
# layouts stay at 3e-8. A sharding or reduction bug moves weights by orders of magnitude more.
TP_WEIGHT_ATOL = 3e-5


def train_cmd(nproc: int, run_dir, data, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m", "trainforge"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "trainforge"]
    return [*launcher, "train", "--run_dir", str(run_dir), "--data.path", str(data), *COMMON, *extra]


def run(cmd: list[str], expect_rc: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env())
    assert r.returncode == expect_rc, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def train_one(run_dir, data, *extra: str):
    """``train_cmd(1, run_dir, data, *extra)``, run in this process (torchrun.train_here: no
    interpreter and torch import to pay for); fails the test on a non-zero exit. Returns
    ``run_dir``."""
    r = train_here({"one": train_cmd(1, run_dir, data, *extra)[4:]})["one"]
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return run_dir


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def weights(ckpt_dir) -> dict[str, torch.Tensor]:
    """Full weights of any checkpoint (sharded ones resharded into one process)."""
    if (ckpt_dir / dckpt.SHARDED_DIR).is_dir():
        model = build_model(ModelConfig(**ckpt.read_meta(ckpt_dir)["model_config"]), seed=0)
        dckpt.load_sharded(ckpt_dir, model, None)
        return dict(model.state_dict())
    return ckpt.load_full_weights(ckpt_dir, tie_embeddings=False)


def assert_same_losses(run_dir, ref_dir, steps=range(1, 7)) -> set[int]:
    """Training losses at ``steps`` and every validation loss within LOSS_RTOL of the
    reference run's. Returns the validated steps."""
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == list(steps)
    for s in steps:
        assert abs(got[s] - want[s]) <= LOSS_RTOL * abs(want[s]), (s, got[s], want[s])
    vals = lambda d: {r["step"]: r["val_loss"] for r in read_jsonl(d / "metrics.jsonl") if "val_loss" in r}  # noqa
    got_v, want_v = vals(run_dir), vals(ref_dir)
    assert got_v and all(abs(got_v[s] - want_v[s]) <= LOSS_RTOL * want_v[s] for s in got_v)
    return set(got_v)


def assert_same_training(run_dir, ref_dir, steps=range(1, 7), atol: float = WEIGHT_ATOL):
    assert assert_same_losses(run_dir, ref_dir, steps) >= {3, 6}
    a = weights(run_dir / "checkpoints" / "step_0000006")
    b = weights(ref_dir / "checkpoints" / "step_0000006")
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


# (nproc, layout) of each data-parallel parity case.
DP_CASES = {
    "ddp2": (2, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"]),
    "fsdp2": (2, ["--parallel.dp_shard", "-1"]),
    "hsdp2x2": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    # DDP with the chunked loss (3 chunks per rank, the last one short) against the plain loss
    "ddp2-chunked-loss": (2, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                              "--training.loss_chunk_tokens", "48"]),
}
TP_CASES = {"tp2": (2, ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
            "fsdp2xtp2": (4, ["--parallel.tp", "2", "--parallel.dp_shard", "2"])}
RESHARD_TO = ["--parallel.dp_replicate", "1", "--parallel.dp_shard", "-1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """Every training run of this file that succeeds, in two torchrun launches and one plain
    process instead of ten launches and two processes (tests/parallel/workers/cli_many.py:
    each run through the real CLI, one after another on the same ranks; a resumed copy is
    made in the launch, after the run it copies). Returns (root: run directories by name,
    name -> that run's CompletedProcess). A launch costs more than a 6-step debug run on 2 cores."""
    root = tmp_path_factory.mktemp("dp_runs")

    def fresh(name, nproc, layout, *extra):
        dp = nproc // 2 if "--parallel.tp" in layout else nproc
        return ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON,
                "--training.batch_size", str(GLOBAL_BATCH // dp), *layout, *extra]

    cases = {**DP_CASES, **TP_CASES}
    # 4 processes: the 4-process parity cases, and the HSDP 2x2 run interrupted at step 3
    # (test_checkpoint_saved_at_one_layout_resumes_at_others).
    done = run_train_many(4, {**{n: fresh(n, *c) for n, c in cases.items() if c[0] == 4},
                              "hsdp-to-3": fresh("hsdp-to-3", *DP_CASES["hsdp2x2"], "--training.steps", "3")})
    # 2 processes: the 2-process parity cases (fsdp2 keeps every checkpoint: it is also the
    # uninterrupted run of test_distributed_resume_at_the_same_layout_is_bit_identical), the
    # HSDP checkpoint resumed as FSDP2 on 2 processes, and the FSDP2 run resumed at its own
    # layout from its step-3 checkpoint.
    done |= run_train_many(2, {**{n: fresh(n, *c, *(["--checkpoint.keep_last", "5"] if n == "fsdp2" else []))
                                  for n, c in cases.items() if c[0] == 2},
                               "resume2": resumed(root / "hsdp-to-3", root / "resume2", 3, "--training.steps", "6",
                                                  "--training.batch_size", "4", *RESHARD_TO),
                               "fsdp2-resumed": resumed(root / "fsdp2", root / "fsdp2-resumed", 3)})
    # 1 process: the reference, and the HSDP checkpoint resumed in one process.
    done |= run_train_many(1, {"reference": fresh("reference", 1, []),
                               "resume1": resumed(root / "hsdp-to-3", root / "resume1", 3, "--training.steps", "6",
                                                  "--training.batch_size", "8", *RESHARD_TO)})
    return root, done


@pytest.fixture(scope="module")
def reference(runs):
    """The single-process run every layout is compared with (same global batch and seed)."""
    return completed_run(*runs, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DP_CASES))
def test_data_parallel_matches_single_process(runs, reference, case):
    root, done = runs
    nproc, layout = DP_CASES[case]
    run_dir = root / case
    assert done[case].returncode == 0
    # The startup summary names the data-parallel kind the layout resolved to.
    kind = "HSDP over 2 x 2 ranks" if nproc == 4 else "FSDP2 over 2 ranks" if "-1" in layout else "DDP over 2 ranks"
    assert f"layout: {kind}" in done[case].stderr
    assert_same_training(run_dir, reference)
    assert (run_dir / "checkpoints" / "step_0000006" / dckpt.SHARDED_DIR).is_dir()
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert all(0 < r["comm_share"] <= 1 and r["peak_memory_bytes"] > 10 * 2**20 for r in records)


@pytest.mark.slow
def test_checkpoint_saved_at_one_layout_resumes_at_others(runs, reference):
    """HSDP 2x2 on 4 processes, interrupted at step 3; resumed on 1 process and on
    2 processes (FSDP2): both continue with the reference's losses and weights."""
    root, done = runs
    base = root / "hsdp-to-3"
    assert done["hsdp-to-3"].returncode == 0 and done["resume2"].returncode == 0
    # The saved config holds the old layout; a resume at another layout overrides it.
    assert done["resume1"].returncode == 0, done["resume1"].stderr[-3000:]
    run_dir = root / "resume1"
    # Full state at step 3 reshards identically into one process.
    w3 = weights(base / "checkpoints" / "step_0000003")
    ref3 = weights(reference / "checkpoints" / "step_0000003")
    for k in ref3:
        torch.testing.assert_close(w3[k], ref3[k], atol=WEIGHT_ATOL, rtol=0)
    assert_same_training(run_dir, reference)
    assert_same_training(root / "resume2", reference)


@pytest.mark.slow
def test_layout_not_matching_world_size_fails_before_any_work(tmp_path, small_data):
    run_dir = tmp_path / "run"
    r = run(train_cmd(2, run_dir, small_data, "--parallel.dp_replicate", "3", "--parallel.dp_shard", "1"),
            expect_rc=1)
    assert "world size is 2" in r.stderr and "parallel" in r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("kw, world, needle", [
    ({"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}, 4, "world size is 4"),
    ({"dp_replicate": 3, "dp_shard": -1, "tp": 1, "pp": 1}, 4, "dp_shard = -1 cannot fill"),
    ({"dp_replicate": 1, "dp_shard": 0, "tp": 1, "pp": 1}, 4, "parallel.dp_shard"),
])
def test_bad_layouts_name_the_setting(kw, world, needle):
    with pytest.raises(ConfigError, match=needle):
        ParallelDims.resolve(SimpleNamespace(**kw), world)


def test_layout_must_fit_the_model():
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=1, tp=8, pp=1), 8)
    with pytest.raises(ConfigError, match="parallel.tp"):
        dims.check_model(FLAVORS["debug"])  # 4 heads
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=1, tp=1, pp=4), 4)
    with pytest.raises(ConfigError, match="parallel.pp"):
        dims.check_model(FLAVORS["debug"])  # 2 layers
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=2, dp_shard=-1, tp=2, pp=1), 8)
    assert (dims.dp_shard, dims.dp) == (2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_training_matches_single_process(runs, reference, case):
    """TP through the trainer (sequence + loss parallel), alone and under FSDP2."""
    root, done = runs
    assert done[case].returncode == 0
    assert_same_training(root / case, reference, atol=TP_WEIGHT_ATOL)


@pytest.mark.slow
def test_distributed_resume_at_the_same_layout_is_bit_identical(runs):
    """FSDP2 x 2: a run resumed from its step-3 sharded checkpoint reproduces the
    uninterrupted run exactly (losses and final weights), as single-process runs do."""
    root, done = runs
    full, resumed = root / "fsdp2", root / "fsdp2-resumed"
    assert done["fsdp2-resumed"].returncode == 0
    assert "step_0000003" in done["fsdp2-resumed"].stderr  # it resumed, from step 3
    assert losses(resumed) == losses(full)
    a = weights(full / "checkpoints" / "step_0000006")
    b = weights(resumed / "checkpoints" / "step_0000006")
    assert all(torch.equal(a[k], b[k]) for k in a)
