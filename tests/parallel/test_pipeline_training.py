"""Pipeline parallelism through the real trainer and CLI under torchrun: every schedule,
and the full dp2 x tp2 x pp2 layout on 8 processes, match single-process training;
a pipelined checkpoint resumes in one process. Three launches in all: the 8-process run,
its 4-process resume, and every 2-process run (cli_many); the single-process runs (the
reference, the resumed copies) run in the test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.parallel.test_data_parallel import COMMON, assert_same_training, run, train_cmd
from tests.parallel.torchrun import Prepared, completed_run, copy_until, resumed, run_train_many, torchrun_env
from tests.parallel.workers.pp_rebalance import predict_even_balance
from trainforge.monitor.jsonl import read_jsonl

LAYERS = ["--model.n_layers", "4"]  # interleaved / V schedules need 2 stages per rank
SCHEDULES = [("gpipe", 2), ("1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 4), ("dualpipev", 4)]
PP2 = [*LAYERS, "--parallel.pp", "2", "--parallel.dp_shard", "1"]
# The full 3D layout, and the two layouts its step-3 checkpoint then resumes at.
DP2_TP2_PP2 = ["--training.batch_size", "4", *LAYERS, "--parallel.pp", "2", "--parallel.tp", "2",
               "--parallel.dp_shard", "2", "--parallel.microbatches", "2", "--checkpoint.keep_last", "5"]
RESHARD_TO = {4: ["--parallel.pp", "2", "--parallel.tp", "1", "--parallel.dp_shard", "2", "--training.batch_size", "4"],
              1: ["--parallel.pp", "1", "--parallel.tp", "1", "--parallel.dp_shard", "1", "--training.batch_size", "8"]}


@pytest.fixture(scope="module")
def run3d(tmp_path_factory, small_data):
    """The dp2 x tp2 x pp2 run on 8 processes, its own launch (no other run here has 8 ranks);
    its one-process resume joins the single-process runs below. Returns (run directory,
    CompletedProcess): the test asserts the exit code, so that a failure here fails that
    test alone."""
    run_dir = tmp_path_factory.mktemp("run3d") / "run"
    r = subprocess.run(train_cmd(8, run_dir, small_data, *DP2_TP2_PP2), capture_output=True, text=True,
                       timeout=240, env=torchrun_env())
    return run_dir, r


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory, small_data):
    """Every 2-process run of this file, in ONE torchrun launch (tests/parallel/workers/cli_many.py:
    one after another on the same 2 ranks): one per schedule, the run
    test_pipelined_checkpoint_resumes_in_one_process resumes, the refused layout and the
    forced re-balance. Returns (root: run directories by name, name -> CompletedProcess)."""
    root = tmp_path_factory.mktemp("pp2_runs")
    common = ["--data.path", str(small_data), *COMMON, "--training.batch_size", "8", *PP2]
    runs = {s: ["--run_dir", str(root / s), *common, "--parallel.pp_schedule", s, "--parallel.microbatches", str(m),
                "--parallel.pp_split", "even"] for s, m in SCHEDULES}
    runs["pp-resumable"] = ["--run_dir", str(root / "pp-resumable"), *common, "--parallel.microbatches", "2",
                            "--training.steps", "6", "--checkpoint.interval", "3", "--checkpoint.keep_last", "5"]
    # 4 V stages, debug has 2 layers: refused on both ranks before any work (exit 2 each).
    runs["bad-layout"] = ["--run_dir", str(root / "bad-layout"), "--data.path", str(small_data), *COMMON,
                          "--parallel.pp", "2", "--parallel.dp_shard", "1", "--parallel.pp_schedule", "zbv"]
    # Last: its plan patch (workers/pp_rebalance.py, on every rank) holds for the rest of the launch.
    runs["rebalance"] = Prepared(["--run_dir", str(root / "rebalance"), *common, "--parallel.microbatches", "2",
                                  "--parallel.rebalance_threshold", "1e-6", "--parallel.rebalance_min_steps", "2",
                                  "--checkpoint.keep_last", "10"], predict_even_balance, every_rank=True)
    return root, run_train_many(2, runs)


@pytest.fixture(scope="module")
def singles(pp2_runs, run3d, small_data):
    """The single-process runs, in this process (run_train_many(1, ...)): the reference, and
    the step-3 checkpoints of the pipelined run and of the 3D run resumed at pp 1. Returns
    (root, name -> CompletedProcess)."""
    root, done = pp2_runs
    runs = {"reference": ["--run_dir", str(root / "reference"), "--data.path", str(small_data), *COMMON,
                          "--training.batch_size", "8", *LAYERS]}
    if done["pp-resumable"].returncode == 0:
        runs["pp-at-1"] = resumed(root / "pp-resumable", root / "pp-at-1", 3, "--parallel.pp", "1")
    if run3d[1].returncode == 0:
        runs["3d-at-1"] = resumed(run3d[0], root / "3d-at-1", 3, *RESHARD_TO[1])
    return root, run_train_many(1, runs)


@pytest.fixture(scope="module")
def reference4(singles):
    return completed_run(*singles, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_pipeline_schedule_matches_single_process(pp2_runs, reference4, schedule):
    root, done = pp2_runs
    run_dir = root / schedule
    assert done[schedule].returncode == 0
    assert_same_training(run_dir, reference4)
    records = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "loss" in x]
    assert all(0 <= x["bubble_fraction"] < 1 for x in records)


@pytest.mark.slow
def test_dp2_tp2_pp2_on_8_processes_matches_single_process_and_reshards(tmp_path, run3d, singles, reference4):
    """The full 3D layout matches single-process training; its step-3 checkpoint then
    resumes at two other layouts (pp2 x dp2 on 4 processes, and 1 process)."""
    run_dir, r = run3d
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert_same_training(run_dir, reference4)
    at4 = tmp_path / "3d-at-4"
    copy_until(run_dir, at4, 3)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "trainforge",
         "train", "--resume", str(at4), *RESHARD_TO[4]])
    assert_same_training(at4, reference4)
    root, done = singles
    assert done["3d-at-1"].returncode == 0, done["3d-at-1"].stderr[-3000:]
    assert "step_0000003" in done["3d-at-1"].stderr  # it resumed, from step 3
    assert_same_training(root / "3d-at-1", reference4)


@pytest.mark.slow
def test_pipelined_checkpoint_resumes_in_one_process(pp2_runs, singles, reference4):
    assert pp2_runs[1]["pp-resumable"].returncode == 0
    root, done = singles
    assert done["pp-at-1"].returncode == 0, done["pp-at-1"].stderr[-3000:]
    assert_same_training(root / "pp-at-1", reference4)


@pytest.mark.slow
def test_drifted_pipeline_rebalances_and_training_is_unchanged(pp2_runs, reference4):
    """Drift forced (the plan predicts perfect balance, so measured stage times always
    drift): checkpoint, re-measure, re-split and continue every 2 steps; exact resume keeps
    training equal to the reference."""
    root, done = pp2_runs
    r = done["rebalance"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("rebalance: measured stage ms") == 2  # at steps 2 and 4
    assert r.stderr.count("pipeline split auto") == 3  # measured at start and after each re-balance
    assert_same_training(root / "rebalance", reference4)
    records = [x for x in read_jsonl(root / "rebalance" / "metrics.jsonl") if "loss" in x]
    assert all(len(x["stage_compute_s"]) == 2 for x in records)


@pytest.mark.slow
def test_bad_pipeline_layout_fails_before_any_work(pp2_runs):
    root, done = pp2_runs
    r = done["bad-layout"]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "parallel.pp_schedule" in r.stderr and "model.n_layers = 2" in r.stderr
    assert not (root / "bad-layout").exists()
