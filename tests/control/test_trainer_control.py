"""Training control through the real trainer (single process): early stopping fed a
scripted validation sequence stops via request_stop at the documented step, checkpoints,
logs its prediction, and keeps its state across resume; schedules and the adaptive LR
drive the logged LR; the bad-step guard skips a non-finite step without touching the
weights or the LR, flags spikes with their sample ids, and changes nothing otherwise."""

import math

import pytest
import torch

from conftest import StopAt, debug_config
from trainforge.cli import main as cli_main
from trainforge.train.lr_schedule import warmup_decay
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer


def power_law(step: int) -> float:
    """Scripted validation loss: L = 2 + 8 t^-0.5 (9.0 for the untrained model at step 0)."""
    return 9.0 if step == 0 else 2.0 + 8.0 * step ** -0.5


def run(cfg, run_dir, resume=False, callbacks=None):
    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    try:
        return t.fit(), t
    finally:
        t.close()


def records(run_dir, key):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]


PREDICT = ["--training.steps", "200", "--training.val_interval", "10", "--checkpoint.interval", "0",
           "--early_stop.mode", "predict", "--early_stop.min_delta", "0.1", "--early_stop.confidence", "0.9",
           "--early_stop.n_bootstrap", "4"]


@pytest.fixture
def scripted_validation(monkeypatch):
    monkeypatch.setattr(Trainer, "evaluate", lambda self: power_law(self.step))


def test_predictive_early_stop_stops_at_the_documented_step(tmp_path, small_data, scripted_validation):
    # Budget 200, min_delta 0.1: the improvement left after t, 8 (t^-0.5 - 200^-0.5), is
    # below 0.1 once t > 144.4, so the predicted stop step is 145 and the first
    # evaluation (every 10 steps) allowed to stop is step 150.
    summary, _ = run(debug_config(small_data, *PREDICT), tmp_path / "run")
    assert summary["step"] == 150 and summary["early_stopped"]
    assert summary["stop_reason"].startswith("early stop (predicted)")
    assert (tmp_path / "run" / "checkpoints" / "step_0000150").is_dir()
    vals = records(tmp_path / "run", "val_loss")
    assert [r["step"] for r in vals] == list(range(0, 151, 10))
    assert [r["early_stop"] for r in vals] == [False] * 15 + [True]
    # From the 6th evaluation after step 0 on, every line carries the prediction, and it is right.
    assert all(r["predicted_stop_step"] is None for r in vals[:6])
    assert all(r["predicted_stop_step"] == 145 for r in vals[6:])
    assert all(r["predicted_final_loss"] == pytest.approx(power_law(200), abs=1e-3) for r in vals[6:])
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000150" / "train_state.pt", weights_only=True)
    assert state["callbacks"]["EarlyStopping"]["steps"] == list(range(0, 151, 10))


def test_resume_keeps_the_early_stopping_state(tmp_path, small_data, scripted_validation):
    cfg = lambda *x: debug_config(small_data, *PREDICT, "--checkpoint.interval", "75", *x)  # noqa: E731
    run(cfg(), tmp_path / "a")
    part, _ = run(cfg(), tmp_path / "b", callbacks=[StopAt(75)])
    assert part["step"] == 75 and not part["early_stopped"]
    summary, _ = run(cfg(), tmp_path / "b", resume=True)
    assert summary["step"] == 150 and summary["early_stopped"]
    # The resumed callback fits the whole history, so every line equals the uninterrupted run's.
    clock = lambda rs: [{k: v for k, v in r.items() if k != "time_unix_s"} for r in rs]  # noqa: E731
    assert clock(records(tmp_path / "b", "val_loss")) == clock(records(tmp_path / "a", "val_loss"))


def test_patience_early_stop_through_the_cli_is_a_successful_run(tmp_path, small_data, monkeypatch, capsys):
    script = {10: 5.0, 20: 4.0, 30: 3.0, 40: 3.005, 50: 2.999, 60: 3.2, 70: 2.0}
    monkeypatch.setattr(Trainer, "evaluate", lambda self: script.get(self.step, 9.0))
    rc = cli_main(["train", "--run_dir", str(tmp_path / "run"), "--data.path", str(small_data), "--model.flavor",
                   "debug", "--training.seq_len", "64", "--training.steps", "100", "--training.val_interval", "10",
                   "--early_stop.mode", "patience", "--early_stop.patience", "3", "--early_stop.min_delta", "0.01",
                   "--early_stop.n_bootstrap", "0", "--sample.max_new_tokens", "0", "--training.threads", "1"])
    # 40, 50 and 60 do not beat 3.0 by more than 0.01: stopped at 60, exit status 0.
    assert rc == 0 and "stopped early at step 60" in capsys.readouterr().out
    last = records(tmp_path / "run", "val_loss")[-1]
    assert last["step"] == 60 and last["early_stop"] and last["best_step"] == 30
    assert (tmp_path / "run" / "checkpoints" / "step_0000060").is_dir()


def test_wsd_schedule_drives_the_logged_lr_and_is_checkpointed(tmp_path, small_data):
    extra = ["--training.steps", "20", "--training.warmup_steps", "4", "--training.lr_schedule", "wsd",
             "--training.decay_ratio", "0.25", "--training.decay_shape", "sqrt", "--training.lr", "2e-3"]
    run(debug_config(small_data, *extra), tmp_path / "run")
    want = warmup_decay("wsd", 4, 20, 0.1, 0.25, "sqrt")
    lrs = [r["lr"] for r in records(tmp_path / "run", "loss")]
    assert lrs == pytest.approx([2e-3 * want(k) for k in range(20)], rel=1e-12, abs=0)
    assert lrs[5] == lrs[15] == 2e-3 and lrs[19] < lrs[16] < lrs[15]  # stable to k = 20 - 5, then the decay
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000020" / "train_state.pt", weights_only=True)
    assert state["scheduler"]["lr_lambdas"][0]["kind"] == "wsd"


def test_adaptive_lr_lowers_on_a_plateau_and_resume_keeps_the_multiplier(tmp_path, small_data):
    # At a negligible LR the loss cannot improve by 5% (plateau_rel_delta): each full
    # window of 4 logging intervals is a plateau, and the multiplier halves.
    extra = ["--training.steps", "24", "--training.warmup_steps", "2", "--training.lr_schedule", "constant",
             "--training.lr", "1e-7", "--training.log_interval", "2", "--checkpoint.interval", "12",
             "--adaptive_lr.enabled", "true", "--adaptive_lr.window", "4", "--adaptive_lr.plateau_rel_delta", "0.05",
             "--adaptive_lr.restore_patience", "99"]
    run(debug_config(small_data, *extra), tmp_path / "a")
    events = records(tmp_path / "a", "lr_multiplier")
    # Windows close at logging steps 10 (steps 4-10: 4 windows after warmup), 18 (4 more).
    assert [(e["step"], e["lr_multiplier"]) for e in events] == [(10, 0.5), (18, 0.25)]
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "a", "loss")}
    assert lrs[10] == 1e-7 and lrs[11] == 0.5e-7 and lrs[19] == 0.25e-7 and lrs[24] == 0.25e-7
    # Stopped at 12 and resumed: the multiplier and its half-filled window come back.
    run(debug_config(small_data, *extra), tmp_path / "b", callbacks=[StopAt(12)])
    _, t = run(debug_config(small_data, *extra), tmp_path / "b", resume=True)
    assert t.components["adaptive_lr"].multiplier == 0.25
    steps = lambda d: [(r["step"], r["loss"], r["lr"]) for r in records(d, "loss")]  # noqa: E731
    assert steps(tmp_path / "b") == steps(tmp_path / "a")


def _inject(monkeypatch, bad_steps: dict[int, float]):
    """Multiply (or offset, for nan) the training loss at the given steps."""
    original = Trainer._loss

    def loss(self, inputs, targets):
        value = original(self, inputs, targets)
        k = bad_steps.get(self.step + 1) if self.model.training else None
        if k is None:
            return value
        return value + k if math.isnan(k) else value * k

    monkeypatch.setattr(Trainer, "_loss", loss)


def test_non_finite_step_is_skipped_weights_and_lr_untouched(tmp_path, small_data, monkeypatch):
    _inject(monkeypatch, {4: float("nan")})
    t = Trainer(debug_config(small_data, "--training.steps", "6", "--bad_steps.enabled", "true"), tmp_path / "run",
                progress=False)
    for _ in range(3):
        t.train_step()
        t.step += 1
    before = {k: v.clone() for k, v in t.raw_model.state_dict().items()}
    lr, k = t.optimizer.param_groups[0]["lr"], t.scheduler.last_epoch
    loss, _ = t.train_step()
    assert math.isnan(loss.item()) and t.components["bad_steps"].decision.action.value == "skip"
    assert all(torch.equal(before[n], v) for n, v in t.raw_model.state_dict().items())
    assert t.scheduler.last_epoch == k and t.optimizer.param_groups[0]["lr"] == lr  # LR not advanced
    assert all(p.grad is None for p in t.raw_model.parameters())
    t.step += 1
    t.train_step()  # the next good step applies
    assert not torch.equal(before["tok_embeddings.weight"], t.raw_model.state_dict()["tok_embeddings.weight"])
    assert t.scheduler.last_epoch == k + 1 and t.components["bad_steps"].policy.counts["skipped"] == 1
    t.close()
    (rec,) = records(tmp_path / "run", "bad_step")
    assert rec["step"] == 4 and rec["bad_step"] == "skip" and rec["step_loss"] is None
    # The samples are the 8 sequences of global batch 3 (the 4th read).
    assert rec["data_batches"] == [[0, 3]] and rec["samples"] == t.train_batches.global_batch_windows(0, 3).tolist()


def test_loss_spike_is_flagged_with_its_sample_ids_and_applied(tmp_path, small_data, monkeypatch):
    _inject(monkeypatch, {12: 10.0})
    summary, _ = run(debug_config(small_data, "--training.steps", "14", "--training.grad_accum_steps", "2",
                                  "--bad_steps.enabled", "true", "--bad_steps.spike_min_history", "5",
                                  "--bad_steps.spike_window", "8"), tmp_path / "run")
    (rec,) = records(tmp_path / "run", "bad_step")
    assert rec["bad_step"] == "flag" and rec["step"] == 12 and rec["spike"] and rec["spike_ratio"] > 5
    assert rec["data_batches"] == [[0, 22], [0, 23]] and len(rec["samples"]) == 16  # 2 micro-batches of 8
    assert summary["bad_steps"] == {"nonfinite": 0, "skipped": 0, "spikes": 1, "rollbacks": 0}


def test_guard_without_bad_steps_changes_nothing(tmp_path, small_data):
    extra = ["--training.steps", "10", "--checkpoint.interval", "5"]
    run(debug_config(small_data, *extra), tmp_path / "off")
    run(debug_config(small_data, *extra, "--bad_steps.enabled", "true"), tmp_path / "on")
    strip = lambda rs: [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "lr", "val_loss")}  # noqa
                        for r in rs]
    assert strip(records(tmp_path / "on", "loss")) == strip(records(tmp_path / "off", "loss"))
    assert records(tmp_path / "on", "bad_step") == []
    load = lambda d: torch.load(d / "checkpoints" / "step_0000010" / "train_state.pt", weights_only=True)  # noqa
    assert set(load(tmp_path / "off")) == {"step", "optimizer", "scheduler", "data", "rng"}  # default: as before
    from safetensors.torch import load_file

    a, b = (load_file(d / "checkpoints" / "step_0000010" / "model.safetensors") for d in (tmp_path / "off",
                                                                                         tmp_path / "on"))
    assert all(torch.equal(a[k], b[k]) for k in a)
