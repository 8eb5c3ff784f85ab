"""Pipeline parallelism through the real trainer and CLI under torchrun: every schedule,
and the full dp2 x tp2 x pp2 layout on 8 processes, match single-process training;
a pipelined checkpoint resumes in one process."""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.parallel.test_data_parallel import COMMON, assert_same_training, run, train_cmd
from tests.parallel.torchrun import WORKERS, run_train_many, with_worker
from trainforge.monitor.jsonl import read_jsonl

LAYERS = ["--model.n_layers", "4"]  # interleaved / V schedules need 2 stages per rank


@pytest.fixture(scope="module")
def reference4(tmp_path_factory, small_data):
    ref = tmp_path_factory.mktemp("ref4") / "run"
    run(train_cmd(1, ref, small_data, "--training.batch_size", "8", *LAYERS))
    return ref


SCHEDULES = [("gpipe", 2), ("1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 4), ("dualpipev", 4)]
PP2 = [*LAYERS, "--parallel.pp", "2", "--parallel.dp_shard", "1"]


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory, small_data):
    """Every 2-process pipelined run of this file that starts from scratch through the
    plain CLI, in ONE torchrun launch (tests/parallel/workers/cli_many.py: one after another
    on the same 2 ranks): one per schedule, and the run test_pipelined_checkpoint_resumes_in_one_process
    resumes. Returns (root: run directories by name, name -> CompletedProcess)."""
    root = tmp_path_factory.mktemp("pp2_runs")
    common = ["--data.path", str(small_data), *COMMON, "--training.batch_size", "8", *PP2]
    runs = {s: ["--run_dir", str(root / s), *common, "--parallel.pp_schedule", s, "--parallel.microbatches", str(m),
                "--parallel.pp_split", "even"] for s, m in SCHEDULES}
    runs["pp-resumable"] = ["--run_dir", str(root / "pp-resumable"), *common, "--parallel.microbatches", "2",
                            "--training.steps", "6", "--checkpoint.interval", "3", "--checkpoint.keep_last", "5"]
    return root, run_train_many(2, runs)


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
def test_dp2_tp2_pp2_on_8_processes_matches_single_process_and_reshards(tmp_path, small_data, reference4):
    """The full 3D layout matches single-process training; its step-3 checkpoint then
    resumes at two other layouts (pp2 x dp2 on 4 processes, and 1 process)."""
    run_dir = tmp_path / "run"
    run(train_cmd(8, run_dir, small_data, "--training.batch_size", "4", *LAYERS, "--parallel.pp", "2",
                  "--parallel.tp", "2", "--parallel.dp_shard", "2", "--parallel.microbatches", "2",
                  "--checkpoint.keep_last", "5"))
    assert_same_training(run_dir, reference4)
    for nproc, layout in ((4, ["--parallel.pp", "2", "--parallel.tp", "1", "--parallel.dp_shard", "2",
                               "--training.batch_size", "4"]),
                          (1, ["--parallel.pp", "1", "--parallel.tp", "1", "--parallel.dp_shard", "1",
                               "--training.batch_size", "8"])):
        resumed = tmp_path / f"resume{nproc}"
        shutil.copytree(run_dir, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_0000006")
        launcher = [sys.executable, "-m", "trainforge"] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainforge"]
        run([*launcher, "train", "--resume", str(resumed), *layout])
        assert_same_training(resumed, reference4)


@pytest.mark.slow
def test_pipelined_checkpoint_resumes_in_one_process(tmp_path, pp2_runs, reference4):
    root, done = pp2_runs
    assert done["pp-resumable"].returncode == 0
    base = tmp_path / "pp"
    shutil.copytree(root / "pp-resumable", base)
    shutil.rmtree(base / "checkpoints" / "step_0000006")  # as if interrupted after step 3
    run([sys.executable, "-m", "trainforge", "train", "--resume", str(base), "--parallel.pp", "1"])
    assert_same_training(base, reference4)


@pytest.mark.slow
def test_drifted_pipeline_rebalances_and_training_is_unchanged(tmp_path, small_data, reference4):
    """Drift forced (the worker's plan predicts perfect balance, so measured stage times
    always drift): checkpoint, re-measure, re-split and continue every 2 steps; exact
    resume keeps training equal to the reference."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(2, run_dir, small_data, "--training.batch_size", "8", *LAYERS, "--parallel.pp", "2",
                    "--parallel.dp_shard", "1", "--parallel.microbatches", "2",
                    "--parallel.rebalance_threshold", "1e-6", "--parallel.rebalance_min_steps", "2",
                    "--checkpoint.keep_last", "10")
    r = run(with_worker(cmd, WORKERS / "pp_rebalance.py"))  # same CLI, patched plan
    assert r.stderr.count("rebalance: measured stage ms") == 2  # at steps 2 and 4
    assert r.stderr.count("pipeline split auto") == 3  # measured at start and after each re-balance
    assert_same_training(run_dir, reference4)
    records = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "loss" in x]
    assert all(len(x["stage_compute_s"]) == 2 for x in records)


@pytest.mark.slow
def test_bad_pipeline_layout_fails_before_any_work(tmp_path, small_data):
    run_dir = tmp_path / "run"
    r = run(train_cmd(2, run_dir, small_data, "--parallel.pp", "2", "--parallel.dp_shard", "1",
                      "--parallel.pp_schedule", "zbv"), expect_rc=1)  # 4 V stages, debug has 2 layers
    assert "parallel.pp_schedule" in r.stderr and "model.n_layers = 2" in r.stderr
    assert not run_dir.exists()
