"""Latent attention (MLA, model/mla.py) under the parallel layouts, through the real CLI
under torchrun: tensor parallel (alone and under FSDP2) and a 2-stage pipeline match
single-process training of the same dense MLA model (losses within 1e-4 relative over 6
steps, final weights within 1e-5). One single-process reference serves every layout."""

from __future__ import annotations

import pytest

from tests.parallel.test_data_parallel import COMMON, GLOBAL_BATCH, assert_same_training, train_one
from tests.parallel.torchrun import launches_by_world_size

# The debug flavor with latent attention (dense feed-forwards: MoE + TP is refused).
MLA = ["--model.q_lora_rank", "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
       "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16"]


@pytest.fixture(scope="module")
def mla_reference(tmp_path_factory, small_data):
    ref = tmp_path_factory.mktemp("mla_ref") / "run"
    train_one(ref, small_data, "--training.batch_size", str(GLOBAL_BATCH), *MLA)
    return ref


LAYOUTS = {  # (nproc, dp, layout)
    "tp2": (2, 1, ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
    "fsdp2xtp2": (4, 2, ["--parallel.tp", "2", "--parallel.dp_shard", "2"]),
    "pp2": (2, 1, ["--parallel.pp", "2", "--parallel.dp_shard", "1", "--parallel.microbatches", "2"]),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, small_data):
    """Runs the layouts of one world size in ONE torchrun launch (tests/parallel/workers/cli_many.py),
    when a test first needs that world size. Returns (root, nproc -> {name: CompletedProcess})."""
    root = tmp_path_factory.mktemp("mla_runs")
    return root, launches_by_world_size({
        name: (n, ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON,
                   "--training.batch_size", str(GLOBAL_BATCH // dp), *MLA, *layout])
        for name, (n, dp, layout) in LAYOUTS.items()})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_mla_parallel_training_matches_single_process(launches, mla_reference, case):
    root, get = launches
    assert get(LAYOUTS[case][0])[case].returncode == 0
    assert_same_training(root / case, mla_reference)
