"""The trainer is a loop plus registered components: a feature written only as a
``Component`` (no line of trainer.py) gets its hooks in the documented order, its
metrics into the step records, its state into every checkpoint under its name and back
on resume, and can reject an update or stop the run with a typed request."""

import pytest
import torch

from conftest import StopAt, debug_config
from tests.control.test_trainer_control import run
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.component import Component, Components, Stop, StopKind
from trainforge.train.trainer import Trainer


class AppliedSteps(Component):
    """Counts applied updates, logs the count, keeps it across resume."""

    name = "applied_steps"

    def __init__(self):
        self.count, self.events = 0, []

    def on_step_start(self, loop):
        self.events.append("start")

    def before_optimizer_step(self, loop, loss, grad_norm):
        self.events.append("judge")
        return True

    def after_optimizer_step(self, loop):
        self.events.append("applied")
        self.count += 1

    def on_step_end(self, loop, step):
        self.events.append("end")

    def on_log(self, loop, window):
        return {"applied_steps": self.count}

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def fit(cfg, run_dir, components, resume=False):
    return run(cfg, run_dir, resume=resume, callbacks=components)


def test_a_component_is_hooked_logged_checkpointed_and_resumed(tmp_path, small_data):
    cfg = lambda: debug_config(small_data, "--training.steps", "6", "--training.log_interval", "1")  # noqa: E731
    first = AppliedSteps()
    summary, _ = fit(cfg(), tmp_path / "run", [first, StopAt(3)])
    assert summary["step"] == 3 and summary["stopped_by"] == "request"
    assert first.events[:5] == ["start", "judge", "applied", "end", "start"]
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000003" / "train_state.pt", weights_only=True)
    assert state["applied_steps"] == {"count": 3}
    # The monitor is registered too (last), flushes before each checkpoint and adds its cost
    # to the summary; it has no checkpoint state, so train_state.pt has no entry for it.
    assert "monitor" not in state and summary["monitor_s"] >= 0
    again = AppliedSteps()
    fit(cfg(), tmp_path / "run", [again], resume=True)
    logged = {r["step"]: r["applied_steps"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r}
    assert logged == {k: k for k in range(1, 7)}  # counted on from the checkpoint's 3


class RejectAll(Component):
    name = "reject_all"

    def before_optimizer_step(self, loop, loss, grad_norm):
        return False

    def on_step_end(self, loop, step):
        if step == 2:
            loop.request(Stop("enough", StopKind.EARLY_STOP))


def test_a_rejected_update_changes_no_weight_and_a_typed_stop_ends_the_run(tmp_path, small_data):
    t = Trainer(debug_config(small_data, "--training.steps", "6"), tmp_path / "run", callbacks=[RejectAll()],
                progress=False)
    before = {k: v.clone() for k, v in t.raw_model.state_dict().items()}
    summary = t.fit()
    t.close()
    assert all(torch.equal(before[k], v) for k, v in t.raw_model.state_dict().items())
    assert t.scheduler.last_epoch == 0  # the LR never advanced either
    assert summary["step"] == 2 and summary["stopped_by"] is StopKind.EARLY_STOP and summary["early_stopped"]


def test_component_names_are_unique_and_nest_in_the_checkpoint():
    class A(Component):
        name = "callbacks/A"

        def state_dict(self):
            return {"x": 1}

    reg = Components([A()])
    assert reg.state(include_per_rank=True) == {"callbacks": {"A": {"x": 1}}}
    with pytest.raises(ValueError, match="unique name"):
        reg.add(A())
