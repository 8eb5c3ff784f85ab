"""Multi-token prediction (model/mtp.py) under tensor parallelism, through the real CLI
under torchrun: a dense debug model with 2 MTP depths at tp2 and at FSDP2 x tp2, and a
dense latent-attention (MLA) model with 1 depth at tp2, each against single-process
training at the same global batch. Over 6 steps the losses, every depth's ``mtp_loss_{k}``,
``grad_norm`` and ``val_loss`` agree within 1e-4 relative, the final weights within 1e-5.
seq_len 32 leaves depth 1 31 positions, which tp = 2 does not divide."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_data_parallel import COMMON, GLOBAL_BATCH, LOSS_RTOL, assert_same_training, train_one
from tests.parallel.torchrun import launches_by_world_size
from tests.parallel.test_mla_parallel import MLA
from trainforge.monitor.jsonl import read_jsonl

DENSE = ["--model.mtp_depth", "2"]
MLA_MTP = [*MLA, "--model.mtp_depth", "1"]


def per_step(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def assert_same_mtp_training(run_dir, ref_dir, depth: int) -> None:
    assert_same_training(run_dir, ref_dir)
    for key in ("grad_norm", *(f"mtp_loss_{k}" for k in range(1, depth + 1))):
        got, want = per_step(run_dir, key), per_step(ref_dir, key)
        assert len(got) == 6, key
        torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0, msg=key)


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_data):
    """One single-process run per model, made when a test first needs it."""
    made: dict[str, object] = {}

    def get(name: str, extra: list[str]):
        if name not in made:
            ref = tmp_path_factory.mktemp(f"mtp_tp_ref_{name}") / "run"
            train_one(ref, small_data, "--training.batch_size", str(GLOBAL_BATCH), *extra)
            made[name] = ref
        return made[name]
    return get


CASES = {  # (nproc, dp, model, layout)
    "tp2": (2, 1, "dense", ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
    "fsdp2xtp2": (4, 2, "dense", ["--parallel.tp", "2", "--parallel.dp_shard", "2"]),
    "mla-tp2": (2, 1, "mla", ["--parallel.tp", "2", "--parallel.dp_shard", "1"]),
}


def model_args(model: str) -> tuple[list[str], int]:
    return (DENSE, 2) if model == "dense" else (MLA_MTP, 1)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, small_data):
    """Runs the cases of one world size in ONE torchrun launch (tests/parallel/workers/cli_many.py),
    when a test first needs that world size. Returns (root, nproc -> {name: CompletedProcess})."""
    root = tmp_path_factory.mktemp("mtp_tp_runs")
    return root, launches_by_world_size({
        name: (n, ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON,
                   "--training.batch_size", str(GLOBAL_BATCH // dp), *model_args(model)[0], *layout])
        for name, (n, dp, model, layout) in CASES.items()})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mtp_tensor_parallel_training_matches_single_process(launches, references, case):
    root, get = launches
    nproc, _, model, _ = CASES[case]
    extra, depth = model_args(model)
    assert get(nproc)[case].returncode == 0
    assert_same_mtp_training(root / case, references(model, extra), depth)
