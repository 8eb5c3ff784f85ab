"""An hourglass model under every parallel layout, through the real CLI under torchrun (gloo,
CPU), against single-process training at the same global batch: over 6 steps the losses and
validation losses agree within 1e-4 relative, the final weights within 1e-5
(tests/parallel/test_data_parallel.py's checks). The spec shortens twice (k = 2, then 2) with
the innermost block at half the width and the linear pool, so the TP runs cover the
sequence-parallel gather/scatter of the outer level and the replicated inner one.

Layouts: FSDP2 x TP2; HSDP 2x2; a 2-stage pipeline x TP2 cut at the full-rate boundary after
block 0, so the first stage holds no shortening and the second receives its activations as a
sequence shard and runs both; and the MTP heads (``model.mtp_depth`` 1: shared embedding and
output head) under FSDP2 x TP2, on the spec with its last stage empty, so the trunk ends at
the outermost upsampling rather than at a full-rate block (``mtp_loss_1`` and ``grad_norm``
must match too). A pipeline cut inside a shortening is refused through the CLI (exit 2,
naming the keys). Every run has 4 ranks, so all share ONE torchrun launch
(tests/parallel/workers/cli_many.py); the two single-process references share one process."""

from __future__ import annotations

import pytest

from tests.parallel.test_data_parallel import COMMON, GLOBAL_BATCH, assert_same_training
from tests.parallel.test_mtp_tensor_parallel import assert_same_mtp_training
from tests.parallel.torchrun import launches_by_world_size, run_train_many
from trainforge.monitor.jsonl import read_jsonl


def hourglass(last_blocks: int) -> list[str]:
    return ["--model.n_layers", str(4 + last_blocks), "--model.hourglass_pool", "linear", "--model.hourglass",
            "[{blocks=1}, {blocks=1, shorten=2}, {blocks=1, shorten=4, width_ratio=2}, {blocks=1, shorten=2}, "
            f"{{blocks={last_blocks}}}]"]


HOURGLASS = hourglass(1)  # level spans: blocks [1, 4) and [2, 3); full-rate stage starts: 1 and 4
MODELS = {"plain": HOURGLASS, "mtp": [*hourglass(0), "--model.mtp_depth", "1"]}
FSDP_TP = ["--parallel.dp_shard", "2", "--parallel.tp", "2"]
PP = ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1", "--parallel.microbatches", "2"]

CASES = {  # name: (dp, model, layout); 4 ranks each
    "fsdp2xtp2": (2, "plain", FSDP_TP),
    "hsdp2x2": (4, "plain", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
    "pp2xtp2": (1, "plain", [*PP, "--parallel.pp_split", "0,1"]),
    "mtp-fsdp2xtp2": (2, "mtp", FSDP_TP),
}
CUT_INSIDE = [*PP, "--parallel.pp_split", "0,2"]  # block 2 is inside the outer level's span


def train_args(root, name: str, data, batch_size: int, *extra: str) -> list[str]:
    return ["--run_dir", str(root / name), "--data.path", str(data), *COMMON, "--training.batch_size",
            str(batch_size), *extra]


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_data):
    """One single-process run per model, both in one process. Returns the run directories."""
    root = tmp_path_factory.mktemp("hourglass_ref")
    done = run_train_many(1, {m: train_args(root, m, small_data, GLOBAL_BATCH, *args) for m, args in MODELS.items()})
    assert all(r.returncode == 0 for r in done.values()), {m: r.stderr[-2000:] for m, r in done.items()}
    return {m: root / m for m in MODELS}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, small_data):
    """Every 4-rank run of this file, the refused one included, in ONE torchrun launch, made
    when a test first needs it. Returns (root, nproc -> {name: CompletedProcess})."""
    root = tmp_path_factory.mktemp("hourglass_runs")
    runs = {name: (4, train_args(root, name, small_data, GLOBAL_BATCH // dp, *MODELS[model], *layout))
            for name, (dp, model, layout) in CASES.items()}
    # First: it fails before the mesh on every rank alike, so the launch goes on.
    runs = {"pp-cut-inside": (4, train_args(root, "pp-cut-inside", small_data, GLOBAL_BATCH, *HOURGLASS, *CUT_INSIDE)),
            **runs}
    return root, launches_by_world_size(runs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hourglass_parallel_training_matches_single_process(launches, references, case):
    root, get = launches
    model = CASES[case][1]
    assert get(4)[case].returncode == 0
    if model == "mtp":
        assert_same_mtp_training(root / case, references[model], depth=1)
    else:
        assert_same_training(root / case, references[model])
    if case.startswith("pp"):  # it ran as a pipeline
        assert all(0 <= r["bubble_fraction"] < 1 for r in read_jsonl(root / case / "metrics.jsonl") if "loss" in r)


@pytest.mark.slow
def test_a_pipeline_cut_inside_a_shortening_is_refused_naming_the_keys(launches):
    root, get = launches
    r = get(4)["pp-cut-inside"]
    assert r.returncode == 2, r.stderr[-3000:]
    for words in ("parallel.pp_split", "parallel.pp = 2", "model.hourglass", "block(s) [2]",
                  "start stages only at 0 and [1, 4]"):
        assert words in r.stderr, (words, r.stderr[-3000:])
    assert not (root / "pp-cut-inside" / "checkpoints").exists()
