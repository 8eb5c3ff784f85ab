"""Latent attention (MLA, model/mla.py) under the parallel layouts, through the real CLI
under torchrun: tensor parallel (alone and under FSDP2) and a 2-stage pipeline match
single-process training of the same dense MLA model (losses within 1e-4 relative over 6
steps, final weights within 1e-5). One single-process reference serves every layout."""

from __future__ import annotations

import pytest

from tests.parallel.test_data_parallel import GLOBAL_BATCH, assert_same_training, run, train_cmd

# The debug flavor with latent attention (dense feed-forwards: MoE + TP is refused).
MLA = ["--model.q_lora_rank", "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
       "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "16"]


@pytest.fixture(scope="module")
def mla_reference(tmp_path_factory, small_data):
    ref = tmp_path_factory.mktemp("mla_ref") / "run"
    run(train_cmd(1, ref, small_data, "--training.batch_size", str(GLOBAL_BATCH), *MLA))
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("nproc, dp, layout", [
    (2, 1, ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
    (4, 2, ["--parallel.tp", "2", "--parallel.dp_shard", "2"]),
    (2, 1, ["--parallel.pp", "2", "--parallel.dp_shard", "1", "--parallel.microbatches", "2"]),
], ids=["tp2", "fsdp2xtp2", "pp2"])
def test_mla_parallel_training_matches_single_process(tmp_path, small_data, mla_reference, nproc, dp, layout):
    run_dir = tmp_path / "run"
    run(train_cmd(nproc, run_dir, small_data, "--training.batch_size", str(GLOBAL_BATCH // dp), *MLA, *layout))
    assert_same_training(run_dir, mla_reference)
