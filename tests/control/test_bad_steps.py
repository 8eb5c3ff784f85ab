"""Scripted per-step (loss, grad norm) sequences produce the documented skip / stop /
rollback / spike decisions, and the policy resumes identically from its state."""

import io

import pytest
import torch

from trainforge.train.bad_steps import BadStepPolicy, StepAction

NAN, INF = float("nan"), float("inf")
OK, FLAG, SKIP, ROLLBACK, STOP = (StepAction.OK, StepAction.FLAG, StepAction.SKIP, StepAction.ROLLBACK,
                                  StepAction.STOP)


def _run(policy: BadStepPolicy, seq, start: int = 1) -> list[StepAction]:
    return [policy.observe(step, loss, norm).action for step, (loss, norm) in enumerate(seq, start)]


def test_non_finite_loss_or_grad_norm_is_skipped_and_counted():
    policy = BadStepPolicy(on_nonfinite="skip", max_consecutive_bad=3)
    seq = [(2.0, 1.0), (NAN, 1.0), (2.0, 1.0), (2.0, INF), (2.0, -INF), (1.9, 1.0)]
    assert _run(policy, seq) == [OK, SKIP, OK, SKIP, SKIP, OK]
    assert policy.counts == {"nonfinite": 3, "skipped": 3, "spikes": 0}
    assert policy.consecutive_bad == 0


def test_on_nonfinite_stop_stops_at_the_first_bad_step():
    policy = BadStepPolicy(on_nonfinite="stop")
    decisions = [policy.observe(s, loss, 1.0) for s, loss in enumerate([2.0, 2.0, NAN], 1)]
    assert [d.action for d in decisions] == [OK, OK, STOP]
    assert decisions[-1].step == 3 and "non-finite" in decisions[-1].reason


def test_consecutive_bad_steps_roll_back_then_stop_after_max_rollbacks():
    policy = BadStepPolicy(max_consecutive_bad=3, max_rollbacks=2)
    bad = [(NAN, NAN)] * 3
    # A good step in between resets the run of bad steps: no rollback here.
    assert _run(policy, [(NAN, 1.0), (NAN, 1.0), (2.0, 1.0), (NAN, 1.0), (NAN, 1.0), (2.0, 1.0)]) == \
        [SKIP, SKIP, OK, SKIP, SKIP, OK]
    assert _run(policy, bad) == [SKIP, SKIP, ROLLBACK]
    assert policy.rollbacks == 1 and policy.consecutive_bad == 0
    assert _run(policy, bad) == [SKIP, SKIP, ROLLBACK]
    # Third time the replayed data fails the same way: stop instead of looping.
    assert _run(policy, bad) == [SKIP, SKIP, STOP]


def test_max_consecutive_bad_zero_never_rolls_back():
    policy = BadStepPolicy(max_consecutive_bad=0)
    assert _run(policy, [(NAN, 1.0)] * 20) == [SKIP] * 20


def _warm(policy: BadStepPolicy, n: int = 20) -> None:
    # A slowly falling loss around 2.0 (median of the last 20 ~ 2.0).
    for i in range(n):
        assert policy.observe(i, 2.1 - 0.01 * i, 1.0).action == OK


def test_loss_spike_is_flagged_with_its_step_and_ratio():
    policy = BadStepPolicy(spike_factor=2.0, spike_window=50, spike_min_history=20)
    _warm(policy)
    median = sorted(2.1 - 0.01 * i for i in range(20))[9:11]
    d = policy.observe(20, 5.0, 1.0)
    assert d.action == FLAG and d.spike and d.step == 20
    assert d.spike_ratio == pytest.approx(5.0 / (sum(median) / 2))
    # Just under the factor is no spike.
    assert policy.observe(21, 3.9, 1.0).action == OK
    # Spikes do not hide the next ones: the running median barely moves (a mean would
    # rise past 4.5 / 2 by the third).
    assert _run(policy, [(4.5, 1.0)] * 4, start=22) == [FLAG] * 4
    assert policy.counts["spikes"] == 5


def test_a_flagged_spike_is_an_applied_step_and_ends_a_run_of_bad_steps():
    policy = BadStepPolicy(spike_factor=2.0, max_consecutive_bad=2)
    _warm(policy)
    assert _run(policy, [(NAN, 1.0), (5.0, 1.0), (NAN, 1.0), (5.0, 1.0), (NAN, 1.0)], start=20) == \
        [SKIP, FLAG, SKIP, FLAG, SKIP]


def test_no_spike_detection_before_enough_history():
    policy = BadStepPolicy(spike_factor=2.0, spike_min_history=20)
    _warm(policy, 19)
    assert policy.observe(19, 50.0, 1.0).action == OK


def test_skip_spikes_skips_and_a_lasting_shift_ends_in_rollback():
    policy = BadStepPolicy(spike_factor=2.0, skip_spikes=True, max_consecutive_bad=4)
    _warm(policy)
    d = policy.observe(20, 5.0, 1.0)
    assert d.action == SKIP and d.spike
    assert policy.observe(21, 2.0, 1.0).action == OK
    # The loss level jumps for good: skipping forever would stall the run.
    assert _run(policy, [(6.0, 1.0)] * 4, start=22) == [SKIP, SKIP, SKIP, ROLLBACK]


def test_state_dict_round_trip_continues_identically():
    seq = [(2.0 - 0.01 * i, 1.0) for i in range(25)] + [(5.0, 1.0), (NAN, 1.0), (NAN, 1.0), (1.7, 1.0),
                                                          (NAN, 1.0), (NAN, 1.0), (NAN, 1.0), (4.0, 1.0)]
    kw = dict(max_consecutive_bad=3, spike_factor=2.0, spike_min_history=20)
    full = BadStepPolicy(**kw)
    want = [full.observe(s, loss, n) for s, (loss, n) in enumerate(seq)]
    assert {d.action for d in want} == {OK, FLAG, SKIP, ROLLBACK}

    first = BadStepPolicy(**kw)
    got = [first.observe(s, loss, n) for s, (loss, n) in enumerate(seq[:27])]  # mid bad run
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = BadStepPolicy(**kw)
    second.load_state_dict(torch.load(buf, weights_only=True))
    got += [second.observe(s, loss, n) for s, (loss, n) in enumerate(seq[27:], 27)]
    assert got == want


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="on_nonfinite"):
        BadStepPolicy(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="spike_factor"):
        BadStepPolicy(spike_factor=0.5)
