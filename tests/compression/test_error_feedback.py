"""Error feedback keeps the sum of what was sent close to the sum of the true
gradients; without it, what the codec always drops is lost for good."""

from __future__ import annotations

import torch

from trainforge.compression.codecs import BlockQuantCodec, TopKCodec, decode, encode
from trainforge.compression.error_feedback import ErrorFeedback


def drift(codec, enabled: bool, steps: int = 200) -> list[float]:
    """|sum of decoded - sum of true| (max over elements) after each step, on gradients
    with a persistent small component next to a large one in the same block."""
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(enabled)
    true_sum = torch.zeros(512)
    sent_sum = torch.zeros(512)
    out = []
    for _ in range(steps):
        g = 0.01 * torch.ones(512) + 0.001 * torch.randn(512, generator=gen)
        g[::64] = 1.0  # one large value per block: the small ones sit below half an int4 step
        comp = ef.compensate("b", g)
        dec = decode(codec, encode(codec, comp), 512)
        ef.update("b", comp, dec)
        true_sum += g
        sent_sum += dec
        out.append(float((true_sum - sent_sum).abs().max()))
    return out


def test_error_feedback_bounds_the_drift_of_int4():
    codec = BlockQuantCodec(4, 64)
    with_ef, without = drift(codec, True), drift(codec, False)
    step = 1.0 / 7  # one int4 step at absmax 1
    assert max(with_ef) <= step  # bounded: never more than one step's error outstanding
    assert without[-1] > 1.5  # 0.01 per step, always rounded to 0: 200 x 0.01 lost
    assert without[-1] > 10 * with_ef[-1]
    assert without[99] < without[-1]  # and it keeps growing


def test_error_feedback_bounds_the_drift_of_topk():
    codec = TopKCodec(0.05)
    with_ef, without = drift(codec, True), drift(codec, False)
    assert without[-1] > 1.5
    assert with_ef[-1] < 0.2 * without[-1]


def test_residual_state_round_trips_and_ignores_other_shapes():
    ef = ErrorFeedback(True)
    x = torch.randn(10)
    ef.update("k", x, torch.zeros(10))
    state = ef.state_dict()
    other = ErrorFeedback(True)
    other.load_state_dict(state)
    torch.testing.assert_close(other.compensate("k", torch.zeros(10)), x)
    # A bucket whose size changed (another layout) starts from zero instead of failing.
    torch.testing.assert_close(other.compensate("k", torch.ones(4)), torch.ones(4))


def test_non_finite_step_does_not_poison_the_residual():
    ef = ErrorFeedback(True)
    comp = torch.tensor([1.0, float("nan"), float("inf")])
    ef.update("k", comp, torch.zeros(3))
    assert torch.isfinite(ef.compensate("k", torch.zeros(3))).all()
