"""Loss-free balancing across processes (gloo, CPU, the real CLI under torchrun): the
loads every rank uses are the global batch's (one all-reduce), so DDP, FSDP2 and a
2-stage pipeline (with and without gradient accumulation) move the expert bias exactly
as one process does, and a sharded (DCP)
checkpoint holds the bias: resuming one continues the same run. The 2-process runs share
one torchrun launch (the ``runs`` fixture)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_data_parallel import LOSS_RTOL, WEIGHT_ATOL, losses, train_cmd, weights
from tests.parallel.torchrun import resumed, run_train_many
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train import dist_checkpoint as dckpt

GLOBAL_BATCH = 4
MOE = ["--model.flavor", "moe-debug", "--model.bias_update_rate", "0.01"]


def routing(run_dir) -> dict[int, list]:
    return {r["step"]: r["moe_load"] for r in read_jsonl(run_dir / "metrics.jsonl") if "moe_load" in r}


def maxvio_global(run_dir) -> dict[int, list]:
    return {r["step"]: r["moe_maxvio_global_layers"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if "moe_maxvio_global_layers" in r}


def assert_same_balancing(run_dir, ref_dir, same_val_set=True):
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert all(abs(got[s] - want[s]) <= LOSS_RTOL * abs(want[s]) for s in want), (got, want)
    assert routing(run_dir) == routing(ref_dir)  # token counts of the global batch, every step
    assert len(maxvio_global(run_dir)) == 3  # steps 0, 3, 6
    if same_val_set:  # the validation set is val_batches x the global micro-batch
        assert maxvio_global(run_dir) == maxvio_global(ref_dir)
    a, b = weights(run_dir / "checkpoints" / "step_0000006"), weights(ref_dir / "checkpoints" / "step_0000006")
    biases = [k for k in b if k.endswith("expert_bias")]
    assert len(biases) == 2 and all(b[k].abs().max() > 0 for k in biases)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=0 if k in biases else WEIGHT_ATOL, rtol=0, msg=k)


# The 2-process layouts of test_two_processes_balance_like_one.
LAYOUTS = {
    "ddp2": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--training.batch_size", "2"],
    # FSDP2 (dp_shard 2) is covered by tests/parallel/test_expert_parallel.py's ep 2 run, whose
    # non-expert parameters are FSDP2-sharded and whose biases must equal one process's.
    "pp2": ["--parallel.pp", "2", "--parallel.dp_shard", "1", "--parallel.microbatches", "2",
            "--training.batch_size", "4"],
    # Accumulation through a pipeline: torch's scale_grads would divide the first micro-batch's
    # gradients twice (parallel/pipeline.py); the validation set is then 2-row micro-batches.
    "pp2-accum2": ["--parallel.pp", "2", "--parallel.dp_shard", "1", "--parallel.microbatches", "2",
                   "--training.batch_size", "2", "--training.grad_accum_steps", "2"],
}
# DDP broadcasts rank 0's buffers at every forward: with 2 micro-batches the routers'
# token counts of the first would be lost unless DDP leaves them out.
DDP_ACCUM = ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--training.batch_size", "1",
             "--training.grad_accum_steps", "2"]
# The batch-wise balance loss (alpha 0.1), 2 steps.
AUX = [*MOE, "--model.aux_loss_alpha", "0.1", "--training.steps", "2"]


def train_args(run_dir, data, *extra: str) -> list[str]:
    """The arguments after ``train`` of train_cmd (for run_train_many)."""
    cmd = train_cmd(1, run_dir, data, *extra)
    return cmd[cmd.index("train") + 1:]


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_data):
    """The single-process runs, in one process (cli_many without torchrun): the reference of
    the balancing tests, and the balance-loss run accumulating 2 micro-batches of 2 rows."""
    root = tmp_path_factory.mktemp("moe_ref")
    done = run_train_many(1, {
        "run": train_args(root / "run", small_data, "--training.batch_size", str(GLOBAL_BATCH), *MOE),
        "aux": train_args(root / "aux", small_data, *AUX, "--training.batch_size", "2",
                          "--training.grad_accum_steps", "2")})
    assert all(r.returncode == 0 for r in done.values()), {n: r.stderr[-3000:] for n, r in done.items()}
    return root


@pytest.fixture(scope="module")
def reference(references):
    return references / "run"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """Every 2-process run of this file, in ONE torchrun launch instead of six
    (tests/parallel/workers/cli_many.py: each run through the real CLI, one after another on
    the same ranks): the parity layouts, the DDP-with-accumulation run to resume, the
    pipelined balance-loss run, and a copy of the DDP run as interrupted after step 3
    (made in the launch) resumed. Returns (root: run directories by name, name -> that
    run's CompletedProcess)."""
    root = tmp_path_factory.mktemp("moe_runs")
    return root, run_train_many(2, {
        **{name: train_args(root / name, small_data, *MOE, *layout) for name, layout in LAYOUTS.items()},
        "resume": train_args(root / "resume", small_data, *MOE, *DDP_ACCUM, "--checkpoint.keep_last", "5"),
        "aux-pp": train_args(root / "aux-pp", small_data, *AUX, "--parallel.pp", "2", "--parallel.dp_shard", "1",
                             "--parallel.microbatches", "2", "--training.batch_size", "4"),
        "resumed": resumed(root / "resume", root / "resumed", 3),
    })


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_two_processes_balance_like_one(runs, reference, case):
    root, done = runs
    run_dir = root / case
    assert done[case].returncode == 0
    assert (run_dir / "checkpoints" / "step_0000006" / dckpt.SHARDED_DIR).is_dir()
    assert_same_balancing(run_dir, reference, same_val_set="--training.grad_accum_steps" not in LAYOUTS[case])


@pytest.mark.slow
def test_sharded_checkpoint_resumes_the_bias_with_accumulation(runs, reference):
    """DDP with 2 accumulated micro-batches, its step-6 checkpoint removed, resumed from step 3
    (the ``runs`` fixture): the resumed run balances like one process."""
    root, done = runs
    assert done["resume"].returncode == 0 and done["resumed"].returncode == 0
    assert "step_0000003" in done["resumed"].stderr  # it resumed, from step 3
    assert_same_balancing(root / "resumed", reference, same_val_set=False)  # val set: val_batches x the micro-batch


@pytest.mark.slow
def test_balance_loss_gradient_through_a_pipeline_is_scaled_as_the_main_loss(references, runs):
    """The batch-wise balance loss (alpha 0.1) adds its gradient inside backward, scaled by
    1 / (accumulated micro-batches x pipeline microbatches), as the main loss is: pp2 with 2
    microbatches of 2 rows gives the gradient norm of one process accumulating 2 micro-batches
    of 2 rows (the loss is computed on the same 2-row pieces, so the two runs are the same sum)."""
    root, done = runs
    ref, pp = references / "aux", root / "aux-pp"
    assert done["aux-pp"].returncode == 0
    got, want = ({r["step"]: r for r in read_jsonl(d / "metrics.jsonl") if "grad_norm" in r} for d in (pp, ref))
    assert sorted(got) == sorted(want) == [1, 2]
    for step in want:
        assert got[step]["moe_aux_loss"] > 0
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
