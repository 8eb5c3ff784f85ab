"""The switching controller: scripted signal sequences produce the documented switches,
with hysteresis (dwell, calm streaks, backoff), per group, across a checkpoint."""

from __future__ import annotations

import io
import logging

import torch

from trainforge.precision.dynamic import DynamicThresholds, PrecisionController, StepSignals, build_controller
from trainforge.precision.policy import build_policy
from trainforge.precision.section import PrecisionSection

T = DynamicThresholds(calm_steps=20, min_dwell_steps=5, max_overflows=2, overflow_window_steps=10)
CALM = StepSignals(loss=2.0, grad_norm=1.0)
SPIKE = StepSignals(loss=2.0, grad_norm=50.0)


def run(controller, script, first_step=1):
    """Feed ``script`` (StepSignals per step); return the switches as tuples."""
    switches = []
    for i, item in enumerate(script):
        step = first_step + i
        switches += controller.observe(step, item)
    return [(s.step, s.group, s.old, s.new) for s in switches]


def test_grad_norm_spikes_switch_up_at_once_and_down_after_calm_steps():
    c = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    script = [CALM] * 15 + [SPIKE] + [CALM] * 29 + [SPIKE] + [CALM] * 45
    assert run(c, script) == [
        (16, "model", "bf16", "fp32"),  # spike: up at once
        (36, "model", "fp32", "bf16"),  # 20 calm steps later: back down
        (46, "model", "bf16", "fp32"),  # bf16 failed again
        (86, "model", "fp32", "bf16"),  # second failure of bf16: 2 x 20 calm steps needed
    ]
    assert "gradient norm spike" in c.history[0].reason and "calm steps" in c.history[1].reason


def test_dwell_prevents_double_escalation_but_not_a_non_finite_loss():
    c = PrecisionController(["model"], ["fp16", "bf16", "fp32"], "fp16", T)
    script = [CALM] * 15 + [SPIKE, CALM, SPIKE, CALM, CALM, CALM, SPIKE]
    # step 18's spike falls within the 5-step dwell after step 16's switch; step 22's does not.
    assert run(c, script) == [(16, "model", "fp16", "bf16"), (22, "model", "bf16", "fp32")]

    c = PrecisionController(["model"], ["fp16", "bf16", "fp32"], "fp16", T)
    script = [CALM] * 15 + [SPIKE, StepSignals(loss=float("nan"), grad_norm=1.0)]
    assert run(c, script) == [(16, "model", "fp16", "bf16"), (17, "model", "bf16", "fp32")]
    assert "non-finite loss" in c.history[-1].reason


def test_overflows_switch_only_when_frequent():
    overflow = StepSignals(loss=2.0, grad_norm=float("inf"), overflow=True)
    # Occasional overflows are the loss scaler doing its job: never a switch.
    c = PrecisionController(["model"], ["fp16", "bf16"], "fp16", T)
    assert run(c, ([CALM] * 19 + [overflow]) * 5) == []
    # Three within ten steps (limit two): leave fp16.
    c = PrecisionController(["model"], ["fp16", "bf16"], "fp16", T)
    script = [CALM] * 19 + [overflow] + [CALM] * 4 + [overflow, CALM, CALM, overflow]
    assert run(c, script) == [(28, "model", "fp16", "bf16")]
    assert "3 overflows in the last 10 steps" in c.history[0].reason


def test_loss_spike_and_loss_scale_collapse():
    c = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    assert run(c, [CALM] * 12 + [StepSignals(loss=3.5, grad_norm=1.0)]) == [(13, "model", "bf16", "fp32")]
    assert "loss spike 3.5 > 1.5 x average 2" in c.history[0].reason
    c = PrecisionController(["model"], ["fp16", "bf16"], "fp16", T)
    low_scale = StepSignals(loss=2.0, grad_norm=1.0, loss_scale=0.5)
    assert run(c, [CALM] * 5 + [low_scale]) == [(6, "model", "fp16", "bf16")]


def test_repeatedly_failing_level_is_retried_ever_more_rarely():
    """A group whose bf16 runs always spike 8 steps in: the time spent in fp32 before
    each retry doubles (20, 40, 80, 160 steps): hysteresis, not flapping."""
    c = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    since_down = 0
    downs = []
    for step in range(1, 400):
        since_down += 1
        bad = c.current["model"] == "bf16" and step > 15 and since_down >= 8
        for sw in c.observe(step, SPIKE if bad else CALM):
            if sw.new == "bf16":
                downs.append(step)
                since_down = 0
    ups = [s.step for s in c.history if s.new == "fp32"]
    assert [d - u for u, d in zip(ups, downs)] == [20, 40, 80, 160]


def test_groups_switch_independently_on_their_own_norms():
    c = PrecisionController(["model", "attn"], ["bf16", "fp32"], "bf16", T)
    calm = StepSignals(loss=2.0, grad_norm=1.0, group_grad_norms={"model": 1.0, "attn": 1.0})
    attn_spike = StepSignals(loss=2.0, grad_norm=50.0, group_grad_norms={"model": 1.0, "attn": 50.0})
    assert run(c, [calm] * 15 + [attn_spike]) == [(16, "attn", "bf16", "fp32")]
    assert c.current == {"model": "bf16", "attn": "fp32"}


def test_state_round_trips_and_the_run_continues_identically():
    script = [CALM] * 15 + [SPIKE] + [CALM] * 29 + [SPIKE] + [CALM] * 45
    whole = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    expected = run(whole, script)
    first = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    run(first, script[:30])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = PrecisionController(["model"], ["bf16", "fp32"], "bf16", T)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.current == {"model": "fp32"}
    assert run(resumed, script[30:], first_step=31) == [s for s in expected if s[0] > 30]
    assert resumed.state_dict() == whole.state_dict()


def test_controller_from_policy_logs_switches(capability):
    section = PrecisionSection(policy="dynamic", dynamic_groups="attn:layers.*.attention", dynamic_calm_steps=20,
                               dynamic_min_dwell_steps=5)
    section.validate()
    policy = build_policy(section, "cpu", capability=capability(True, False))
    messages = []
    log = logging.getLogger("trainforge.test.precision.dynamic")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log.addHandler(handler)
    try:
        c = build_controller(policy, section, log)
        assert c.current == {"model": "bf16", "attn": "bf16"} and c.levels == ["bf16", "fp32"]
        run(c, [CALM] * 15 + [SPIKE])
    finally:
        log.removeHandler(handler)
    assert len(messages) == 2 and all("step 16" in m and "bf16 -> fp32" in m and "spike" in m for m in messages)
    assert build_controller(build_policy(PrecisionSection(), "cpu", capability=capability(True, False)),
                            PrecisionSection()) is None
