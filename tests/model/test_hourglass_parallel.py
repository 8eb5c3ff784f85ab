"""An hourglass model under FSDP2 x TP (sequence parallel) and HSDP, through the real CLI
under torchrun (gloo, CPU), against single-process training at the same global batch: over
6 steps the losses and validation losses agree within 1e-4 relative, the final weights
within 1e-5 (tests/parallel/test_data_parallel.py's checks). The spec shortens twice (k = 2,
then 2) with the innermost block at half the width and the linear pool, so the TP run covers
the sequence-parallel gather/scatter of the outer level and the replicated inner one. Two
launches in all (the slow suite's budget): one per layout, 4 ranks each."""

from __future__ import annotations

import pytest

from tests.parallel.test_data_parallel import GLOBAL_BATCH, assert_same_training, run, train_cmd

HOURGLASS = ["--model.n_layers", "5", "--model.hourglass_pool", "linear", "--model.hourglass",
             "[{blocks=1}, {blocks=1, shorten=2}, {blocks=1, shorten=4, width_ratio=2}, {blocks=1, shorten=2}, "
             "{blocks=1}]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    ref = tmp_path_factory.mktemp("hourglass_ref") / "run"
    run(train_cmd(1, ref, small_data, "--training.batch_size", str(GLOBAL_BATCH), *HOURGLASS))
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("dp, layout", [
    (2, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
], ids=["fsdp2xtp2", "hsdp2x2"])
def test_hourglass_parallel_training_matches_single_process(tmp_path, small_data, reference, dp, layout):
    run_dir = tmp_path / "run"
    run(train_cmd(4, run_dir, small_data, "--training.batch_size", str(GLOBAL_BATCH // dp), *HOURGLASS, *layout))
    assert_same_training(run_dir, reference)
