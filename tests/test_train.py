"""Trainer behaviour a user notices: loss goes down, resume is exact, bad
checkpoints and runs are refused with the file named."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import StopAt, debug_config, needs_cpu_compile
from trainforge.config import load_config
from trainforge.errors import CheckpointError
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer


def run(cfg, run_dir, resume=False, callbacks=None):
    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    try:
        return t.fit()
    finally:
        t.close()


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def final_weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step:07d}" / "model.safetensors")


def test_training_on_builtin_corpus_lowers_validation_loss(tmp_path, builtin_data):
    cfg = load_config(None, ["--model.flavor", "debug", "--training.steps", "150", "--training.lr", "3e-3",
                             "--training.batch_size", "8", "--training.seq_len", "64", "--training.warmup_steps", "10",
                             "--training.val_interval", "50", "--sample.max_new_tokens", "0"])
    assert cfg.data.path is None  # the built-in corpus
    summary = run(cfg, tmp_path / "run")
    vals = [r["val_loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert len(vals) == 4  # step 0, 50, 100, 150
    assert summary["first_val_loss"] > 8.5  # ~ln(8192) at init
    assert vals[-1] < vals[0] - 2.0, vals
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 151))
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in records)  # no upper bound: the peak is measured, noisily


@pytest.mark.parametrize("stop_at", [7, 10])  # between checkpoints, and exactly on one
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, small_data, stop_at):
    extra = ["--training.steps", "20", "--checkpoint.interval", "10", "--training.val_interval", "10",
             "--training.grad_accum_steps", "2"]
    run(debug_config(small_data, *extra), tmp_path / "a")
    part = run(debug_config(small_data, *extra), tmp_path / "b", callbacks=[StopAt(stop_at)])
    assert part["step"] == stop_at and part["stop_reason"] == "test interruption"
    run(debug_config(small_data, *extra), tmp_path / "b", resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # exact float equality, every step
    a, b = final_weights(tmp_path / "a", 20), final_weights(tmp_path / "b", 20)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    vals = lambda d: [(r["step"], r["val_loss"]) for r in read_jsonl(d / "metrics.jsonl") if "val_loss" in r]
    assert vals(tmp_path / "a") == vals(tmp_path / "b")


def test_grad_accumulation_matches_one_big_batch(tmp_path, small_data):
    one = Trainer(debug_config(small_data, "--training.batch_size", "8"), tmp_path / "one", progress=False)
    two = Trainer(debug_config(small_data, "--training.batch_size", "4", "--training.grad_accum_steps", "2"),
                  tmp_path / "two", progress=False)
    l1, _ = one.train_step()
    l2, _ = two.train_step()
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-6)
    for p, q in zip(one.model.parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    one.close(), two.close()


def test_keep_last_and_half_written_checkpoints(tmp_path, small_data):
    run_dir = tmp_path / "run"
    run(debug_config(small_data, "--training.steps", "12", "--checkpoint.interval", "3",
                     "--checkpoint.keep_last", "2"), run_dir)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_0000009", "step_0000012"]
    # A crash mid-save leaves only a hidden temp dir, never taken for a checkpoint.
    (run_dir / "checkpoints" / ".step_0000015.tmp-x").mkdir()
    t = Trainer(debug_config(small_data, "--training.steps", "14"), run_dir, resume=True, progress=False)
    assert t.step == 12
    t.close()


def test_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, small_data):
    run_dir = tmp_path / "run"
    run(debug_config(small_data, "--training.steps", "4"), run_dir)
    weights = run_dir / "checkpoints" / "step_0000004" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x01
    weights.write_bytes(bytes(raw))
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        Trainer(debug_config(small_data, "--training.steps", "8"), run_dir, resume=True, progress=False)
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before  # nothing lost or rewritten


def test_incompatible_resume_and_reused_run_dir_are_refused(tmp_path, small_data):
    run_dir = tmp_path / "run"
    run(debug_config(small_data, "--training.steps", "2"), run_dir)
    with pytest.raises(CheckpointError, match="n_layers"):
        Trainer(debug_config(small_data, "--model.n_layers", "3"), run_dir, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="--resume"):
        Trainer(debug_config(small_data), run_dir, progress=False)
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Trainer(debug_config(small_data), run_dir, resume=True, progress=False)


def test_checkpoint_holds_no_pickled_code(tmp_path, small_data):
    run(debug_config(small_data, "--training.steps", "2"), tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000002" / "train_state.pt", weights_only=True)
    assert state["step"] == 2 and set(state) == {"step", "optimizer", "scheduler", "data", "rng"}


def test_extending_a_run_on_resume_follows_the_new_schedule(tmp_path, small_data, capsys):
    run_dir = tmp_path / "run"
    run(debug_config(small_data, "--training.steps", "10", "--training.warmup_steps", "2"), run_dir)
    capsys.readouterr()
    t = Trainer(debug_config(small_data, "--training.steps", "20", "--training.warmup_steps", "2"), run_dir,
                resume=True, progress=False)
    # Said in words (it printed the two schedules' attribute dicts): what changed and the LR now.
    # Cosine 2 -> 10 has reached its floor (0.1 x 1e-3) at step 10; over 20 steps it is at 6.3e-4.
    said = [line for line in capsys.readouterr().err.splitlines() if "LR schedule changed" in line]
    assert len(said) == 1 and said[0].endswith(
        "LR schedule changed on resume: steps 10 -> 20: cosine follows the new schedule from step 10, "
        "lr 1.0e-4 -> 6.3e-4"), said
    assert len({g["lr"] for g in t.optimizer.param_groups}) == 1  # decayed and non-decayed groups alike
    t.fit()
    assert len({g["lr"] for g in t.optimizer.param_groups}) == 1
    t.close()
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(lrs) == list(range(1, 21))
    # Cosine over 20 steps, not stuck at the floor the 10-step schedule had reached.
    from trainforge.train.lr_schedule import WarmupCosine

    want = WarmupCosine(2, 20, 0.1)
    assert abs(lrs[11] - 1e-3 * want(10)) < 1e-12 and lrs[11] > 2e-4


def test_activation_checkpointing_matches_plain_training(tmp_path, small_data):
    run(debug_config(small_data, "--training.steps", "4"), tmp_path / "plain")
    run(debug_config(small_data, "--training.steps", "4", "--parallel.activation_checkpointing", "full"),
        tmp_path / "ac")
    a, b = dict(losses(tmp_path / "plain")), dict(losses(tmp_path / "ac"))
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 1e-6 * abs(a[s]) for s in a)
    wa, wb = final_weights(tmp_path / "plain", 4), final_weights(tmp_path / "ac", 4)
    assert wa.keys() == wb.keys()  # same FQNs: checkpoints move between runs with and without it
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


@pytest.mark.slow
@needs_cpu_compile
def test_compiled_blocks_match_eager_training(tmp_path, small_data):
    """parallel.compile: same losses and weights as eager within float tolerance (compiled
    kernels may fuse and reorder float ops). Slow: compiling costs tens of seconds on CPU."""
    run(debug_config(small_data, "--training.steps", "3"), tmp_path / "eager")
    run(debug_config(small_data, "--training.steps", "3", "--parallel.compile", "true"), tmp_path / "compiled")
    a, b = dict(losses(tmp_path / "eager")), dict(losses(tmp_path / "compiled"))
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in a)
    wa, wb = final_weights(tmp_path / "eager", 3), final_weights(tmp_path / "compiled", 3)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("state", [{"step": 3}, {"step": "3", "scheduler": {}, "data": {}}, [1, 2]])
def test_a_train_state_that_unpickles_but_lacks_fields_is_refused_naming_the_file(tmp_path, state):
    from trainforge.train import checkpoint as ckpt

    torch.save(state, tmp_path / ckpt.STATE_FILE)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.load_train_state(tmp_path)
    assert str(tmp_path / ckpt.STATE_FILE) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: train_state.pt is mapped to the GPU there")
def test_rng_state_mapped_to_the_gpu_restores(tmp_path):
    # A CUDA run loads train_state.pt with map_location=cuda; the generators take CPU tensors only
    # (this broke every CUDA resume until the H200 check of 2026-11-30).
    from trainforge.train import checkpoint as ckpt

    torch.save({"rng": ckpt.capture_rng_state()}, tmp_path / "s.pt")
    expected = torch.rand(4)
    state = torch.load(tmp_path / "s.pt", map_location="cuda", weights_only=True)
    ckpt.restore_rng_state(state["rng"])
    assert torch.equal(torch.rand(4), expected)
