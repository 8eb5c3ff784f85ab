"""2-D tensor parallelism through the real CLI under torchrun (gloo, CPU, one thread per
process): tp 4 as a 2 x 2 grid (``--parallel.tp 4 --parallel.tp_mode 2d``) trains as one
process does and as tp 4 1-D does; with activation checkpointing; with FSDP2 on dp_shard 2
around it (8 processes); as 2 pipeline stages (1F1B) of 2 x 2 grids (8 processes); and its
DCP checkpoints load at 1-D, under FSDP2 and in one process (and a 1-D checkpoint at 2-D).

The model is ``debug`` with 8 query and 4 KV heads (1-D tp 4 needs tp to divide them; 2-D
needs only q = 2). With debug's 4 query heads instead, one tok_embeddings element of the
one-process run ends 2.1e-5 from every tensor-parallel run's, 1-D and 2-D alike (an AdamW
step divides a gradient that nearly cancels by its own magnitude, so its rounding shows),
while the tensor-parallel runs agree with each other within 5e-6. The runs that share a
world size share one launch (the ``runs`` fixture).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from tests.parallel.test_data_parallel import COMMON, LOSS_RTOL, WEIGHT_ATOL, assert_same_losses, losses, weights
from tests.parallel.torchrun import completed_run, copy_until, resumed, run_train_many
from trainforge.data.prepare import PrepareOptions, prepare
from trainforge.monitor.jsonl import read_jsonl

GLOBAL_BATCH = 8
SHAPE = ["--model.n_heads", "8", "--model.n_kv_heads", "4"]
TP2D = ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.dp_shard", "1"]
TP1D = ["--parallel.tp", "4", "--parallel.tp_mode", "1d", "--parallel.dp_shard", "1"]
FSDP_TP2D = ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.dp_shard", "2"]
HSDP_TP2D = ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"]
# 2 stages of one block each, 2 microbatches of 4 sequences: each grid row takes 2 of them.
PP_TP2D = ["--parallel.pp", "2", "--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.dp_shard", "1",
           "--parallel.pp_schedule", "1f1b", "--parallel.microbatches", "2"]
ONE = ["--parallel.tp", "1", "--parallel.tp_mode", "1d"]
# For 2 x 2 and 3 x 3 grids: heads, KV heads, dim, ffn, vocab (GRID_VOCAB) and batch rows divide by 2 and 3.
GRID_SHAPE = ["--model.dim", "96", "--model.n_heads", "6", "--model.n_kv_heads", "6", "--model.ffn_hidden_dim", "192"]
GRID_VOCAB, GRID_BATCH = 504, 6
TP2D_3X3 = ["--parallel.tp", "9", "--parallel.tp_mode", "2d", "--parallel.dp_shard", "1"]


@pytest.fixture(scope="module")
def grid_data(tmp_path_factory) -> Path:
    """The small stdlib set at vocab GRID_VOCAB (504: both 2 and 3 divide it)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path_factory.mktemp("tp2d_grid_data") / "data"
    prepare([str(stdlib / n) for n in ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py",
                                       "inspect.py", "json/encoder.py", "json/decoder.py", "pathlib.py",
                                       "random.py", "shutil.py", "textwrap.py", "typing.py")],
            data, PrepareOptions(vocab_size=GRID_VOCAB, val_fraction=0.1), log=lambda *_: None)
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data, grid_data):
    """(root, name -> CompletedProcess) of every run but the 3 x 3 one: one 4-process launch
    (2-D, 1-D, 2-D with activation checkpointing, 2-D and 1-D each resumed at the other mode
    from its step-3 checkpoint, and ``grid_runs``' 2 x 2 run), one 8-process launch (FSDP2 x
    2-D, HSDP (replicated dp) x 2-D, pipeline x 2-D, and the 2-D checkpoint resumed under it),
    one process (the reference, and the 2-D and pipeline x 2-D checkpoints resumed in one
    process)."""
    root = tmp_path_factory.mktemp("tp2d_runs")

    def fresh(name, layout, dp=1):
        return ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON, *SHAPE,
                "--training.batch_size", str(GLOBAL_BATCH // dp), "--checkpoint.keep_last", "5", *layout]

    done = run_train_many(4, {
        "tp2d": fresh("tp2d", TP2D), "tp1d": fresh("tp1d", TP1D),
        "tp2d-ac": fresh("tp2d-ac", [*TP2D, "--parallel.activation_checkpointing", "full"]),
        "tp2d-to-1d": resumed(root / "tp2d", root / "tp2d-to-1d", 3, *TP1D),
        "tp1d-to-2d": resumed(root / "tp1d", root / "tp1d-to-2d", 3, *TP2D),
        "2x2": ["--run_dir", str(root / "2x2"), "--data.path", str(grid_data), *COMMON, *GRID_SHAPE,
                "--training.batch_size", str(GRID_BATCH), "--checkpoint.keep_last", "5", *TP2D]})
    done |= run_train_many(8, {
        "fsdp-tp2d": fresh("fsdp-tp2d", FSDP_TP2D, dp=2), "hsdp-tp2d": fresh("hsdp-tp2d", HSDP_TP2D, dp=2),
        "pp-tp2d": fresh("pp-tp2d", PP_TP2D),
        "tp2d-to-fsdp": resumed(root / "tp2d", root / "tp2d-to-fsdp", 3, *FSDP_TP2D, "--training.batch_size", "4")})
    done |= run_train_many(1, {"reference": fresh("reference", ONE),
                               "tp2d-to-one": resumed(root / "tp2d", root / "tp2d-to-one", 3, *ONE),
                               "pp-tp2d-to-one": resumed(root / "pp-tp2d", root / "pp-tp2d-to-one", 3, *ONE,
                                                         "--parallel.pp", "1")})
    return root, done


def assert_same_weights(run_dir, ref_dir) -> None:
    got = weights(run_dir / "checkpoints" / "step_0000006")
    want = weights(ref_dir / "checkpoints" / "step_0000006")
    start = weights(ref_dir / "checkpoints" / "step_0000003")
    assert got.keys() == want.keys()
    # The optimizer moved the weights far beyond the tolerance between steps 3 and 6.
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 100 * WEIGHT_ATOL
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=WEIGHT_ATOL, rtol=0, msg=k)


def grad_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_jsonl(run_dir / "metrics.jsonl") if "grad_norm" in r}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2d", "tp1d", "fsdp-tp2d", "hsdp-tp2d", "tp2d-ac", "pp-tp2d"])
def test_training_matches_one_process(runs, name):
    """6 steps (AdamW, clipping, 2 validations): losses within 1e-4 relative, the gradient
    norm (each DTensor shard counted once) as one process's, final weights within 1e-5."""
    run_dir, ref = completed_run(*runs, name), completed_run(*runs, "reference")
    assert assert_same_losses(run_dir, ref) >= {3, 6}
    got, want = grad_norms(run_dir), grad_norms(ref)
    assert sorted(got) == list(range(1, 7))
    for s in want:
        assert abs(got[s] - want[s]) <= LOSS_RTOL * want[s], (s, got[s], want[s])
    assert_same_weights(run_dir, ref)


@pytest.mark.slow
def test_2d_matches_1d(runs):
    run_dir, other = completed_run(*runs, "tp2d"), completed_run(*runs, "tp1d")
    assert "2-D" not in runs[1]["tp1d"].stdout  # the 1-D run is not the 2-D one under another name
    assert_same_losses(run_dir, other)
    assert_same_weights(run_dir, other)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "uninterrupted"), [("tp2d-to-1d", "tp2d"), ("tp1d-to-2d", "tp1d"),
                                                     ("tp2d-to-fsdp", "tp2d"), ("tp2d-to-one", "tp2d"),
                                                     ("pp-tp2d-to-one", "pp-tp2d")])
def test_checkpoint_resumes_at_another_layout(runs, name, uninterrupted):
    """A DCP checkpoint written at step 3 by 2-D (1-D) resumes at 1-D (2-D), under FSDP2 x 2-D
    and in one process (also one written by 2 pipeline stages of 2-D): steps 4-6 as the
    uninterrupted run's."""
    run_dir, ref = completed_run(*runs, name), completed_run(*runs, uninterrupted)
    assert sorted(losses(run_dir)) == list(range(1, 7))  # steps 1-3 copied, 4-6 trained after the resume
    assert "resumed from" in runs[1][name].stdout + runs[1][name].stderr
    assert_same_losses(run_dir, ref)
    assert_same_weights(run_dir, ref)


@pytest.fixture(scope="module")
def grid_runs(runs):
    """(root, name -> CompletedProcess): a 2 x 2 run of a shape both grids split (vocab 504,
    6 heads, dim 96, 6 sequences; made in ``runs``' 4-process launch), and its step-3
    checkpoint resumed on a 3 x 3 grid (9 processes, 3 steps: the only 9-process launch, kept
    short for CI's 2 cores)."""
    root, done = runs
    # Copied here, not as a Prepared step: the launch's first run has no process group to wait on.
    copy_until(str(root / "2x2"), str(root / "2x2-to-3x3"), 3)
    return root, {**done, **run_train_many(9, {"2x2-to-3x3": ["--resume", str(root / "2x2-to-3x3"), *TP2D_3X3]})}


@pytest.mark.slow
def test_checkpoint_resumes_on_another_grid(grid_runs):
    """A DCP checkpoint written at step 3 on a 2 x 2 grid resumes on a 3 x 3 grid (each
    parameter resharded from halves to thirds on both dims): steps 4-6 as the uninterrupted
    2 x 2 run's (losses within 1e-4 relative, weights within 1e-5)."""
    root, done = grid_runs
    run_dir, ref = completed_run(root, done, "2x2-to-3x3"), completed_run(root, done, "2x2")
    out = done["2x2-to-3x3"].stdout + done["2x2-to-3x3"].stderr
    assert "resumed from" in out
    assert sorted(losses(run_dir)) == list(range(1, 7))
    assert assert_same_losses(run_dir, ref) >= {6}
    assert_same_weights(run_dir, ref)
