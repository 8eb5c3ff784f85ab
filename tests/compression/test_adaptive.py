"""The adaptive bit-width rule on scripted measurements: the documented switches,
with hysteresis, and the warm-up handled by the compressor."""

from __future__ import annotations

import pytest

from trainforge.compression.adaptive import AdaptiveBits, qmax


def feed(ctl: AdaptiveBits, script: list[tuple[float, float]], key: str = "b") -> list[int]:
    """script: (relative error the gradient would have at 4 bits, gradient norm) per call.
    The controller is fed what it would measure at the width it chose (uniform rounding:
    error proportional to 1 / qmax). Returns the width used at each call."""
    used = []
    for err4, norm in script:
        bits = ctl.bits(key)
        used.append(bits)
        ctl.observe(key, bits, err4 * qmax(4) / qmax(bits), norm)
    return used


def test_low_error_stays_at_min_bits():
    ctl = AdaptiveBits(4, 8, target_rel_error=0.25)
    assert feed(ctl, [(0.13, 1.0)] * 20) == [4] * 20


def test_high_error_widens_and_hysteresis_narrows_only_after_calm_calls():
    ctl = AdaptiveBits(4, 8, target_rel_error=0.25, calm_steps=3)
    # 0.6 at 4 bits > target -> 8 bits next; at 8 bits the measured error is 18x smaller
    # (127 / 7) and the rule scales it back to its 4-bit estimate. Then it calms to 0.1.
    used = feed(ctl, [(0.6, 1.0)] * 3 + [(0.1, 1.0)] * 12)
    # The error EMA (weight 0.3) goes 0.6 -> 0.45, 0.35, 0.27, 0.22, then below 0.8 x 0.25
    # at the 5th calm call (0.18, 0.16, 0.14): 3 calm calls later, back to 4 bits.
    assert used[:4] == [4, 8, 8, 8]
    first4 = used.index(4, 1)
    assert first4 == 3 + 7
    assert used[first4:] == [4] * (len(used) - first4)


def test_error_near_the_threshold_does_not_flap():
    ctl = AdaptiveBits(4, 8, target_rel_error=0.25, calm_steps=3)
    used = feed(ctl, [(0.5, 1.0)])
    used += feed(ctl, [(0.23, 1.0), (0.26, 1.0)] * 10)  # hovers around the target
    switches = sum(a != b for a, b in zip(used, used[1:]))
    assert switches == 1  # up once, never back down while it is not clearly calm


def test_gradient_norm_spike_forces_max_bits():
    ctl = AdaptiveBits(4, 8, target_rel_error=0.25, spike_factor=3.0)
    used = feed(ctl, [(0.1, 1.0)] * 5 + [(0.1, 10.0)] + [(0.1, 1.0)] * 6)
    assert used[:6] == [4] * 6
    assert used[6] == 8  # the call after the spike
    assert used[-1] == 4  # and back once calm


def test_state_round_trip_continues_identically():
    script = [(0.6, 1.0), (0.05, 1.0), (0.01, 1.0), (0.01, 1.0), (0.5, 5.0), (0.01, 1.0)] * 2
    a = AdaptiveBits()
    first = feed(a, script[:5])
    b = AdaptiveBits()
    b.load_state_dict(a.state_dict())
    assert feed(a, script[5:]) == feed(b, script[5:])
    assert first  # sanity


def test_min_above_max_rejected():
    with pytest.raises(ValueError, match="min_bits"):
        AdaptiveBits(8, 4)
