"""Adaptive bit width per bucket: 4 bits while they are enough, 8 when they are not.

Inputs per bucket and step, identical on every rank of the compression group (the
collective shares each rank's error figures inside its all-gather payload, so no
extra collective is needed and every rank reaches the same decision):

- the measured relative compression error ``||x - decode(encode(x))|| / ||x||`` of
  the quantised reduce-scatter input, summed over ranks, at the bits just used;
- the norm of the averaged gradient.

Rules, applied for the *next* call of that bucket (the current one is already sent):

1. Warm-up (``warmup_steps``): full precision. Early gradients are large and change
   fast; an error there is not corrected by later steps the way a late one is.
2. A gradient-norm spike (norm > ``spike_factor`` x its running mean) -> max_bits:
   the rare large updates are the ones whose direction matters most.
3. The error expected at ``min_bits`` exceeds ``target_rel_error`` -> max_bits.
   The error of uniform rounding scales with the step ``absmax / qmax``, so the error
   at b bits is estimated from the measured one as ``err * qmax(used) / qmax(b)``.
4. Back to min_bits only after ``calm_steps`` consecutive calls whose estimate is below
   ``0.8 * target_rel_error`` and with no spike: hysteresis, so a bucket near the
   threshold does not flap between widths every step.

Defaults (compression section): target 0.25 and 3 calm steps. Per-block int4
rounding of Gaussian-like gradients measures ~0.13 relative error (absmax is about
2.9 sigma in a 256-block, the step 1/7 of it); buckets with heavy tails or outlier
blocks (embeddings, the output head early on) measure 0.3 and more, and those are
the ones that get 8 bits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EMA = 0.3  # weight of the newest error measurement: smooths one noisy step
NORM_EMA = 0.1


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


@dataclass
class BucketBits:
    bits: int
    calm: int = 0
    err_ema: float | None = None
    norm_ema: float | None = None
    reason: str = "start"


class AdaptiveBits:
    """Per-bucket bit-width decisions. ``bits(key)`` is what to use now; ``observe``
    feeds the step's measurements and returns a reason string when the width changed."""

    def __init__(self, min_bits: int = 4, max_bits: int = 8, target_rel_error: float = 0.25,
                 calm_steps: int = 3, spike_factor: float = 3.0):
        if min_bits > max_bits:
            raise ValueError(f"min_bits {min_bits} > max_bits {max_bits}")
        self.min_bits, self.max_bits = min_bits, max_bits
        self.target, self.calm_steps, self.spike_factor = target_rel_error, calm_steps, spike_factor
        self.buckets: dict[str, BucketBits] = {}

    def bits(self, key: str) -> int:
        state = self.buckets.get(key)
        return self.min_bits if state is None else state.bits

    def expected_error(self, measured: float, used_bits: int, bits: int) -> float:
        return measured * qmax(used_bits) / qmax(bits)

    def observe(self, key: str, used_bits: int, rel_error: float, grad_norm: float) -> str | None:
        """Record one call's measurements; returns why the width changed, or None."""
        s = self.buckets.setdefault(key, BucketBits(bits=self.min_bits))
        est = self.expected_error(rel_error, used_bits, self.min_bits)
        s.err_ema = est if s.err_ema is None else (1 - EMA) * s.err_ema + EMA * est
        spike = s.norm_ema is not None and grad_norm > self.spike_factor * s.norm_ema
        if s.norm_ema is None:
            s.norm_ema = grad_norm
        elif not spike:  # a spike must not inflate the mean it is measured against
            s.norm_ema = (1 - NORM_EMA) * s.norm_ema + NORM_EMA * grad_norm
        before = s.bits
        if spike:
            s.bits, s.calm = self.max_bits, 0
            s.reason = f"gradient norm {grad_norm:.3g} > {self.spike_factor:g} x running {s.norm_ema:.3g}"
        elif s.err_ema > self.target:
            s.bits, s.calm = self.max_bits, 0
            s.reason = f"error at {self.min_bits} bits ~{s.err_ema:.3f} > target {self.target:g}"
        elif s.err_ema < 0.8 * self.target:
            s.calm += 1
            if s.bits != self.min_bits and s.calm >= self.calm_steps:
                s.bits = self.min_bits
                s.reason = f"error at {self.min_bits} bits ~{s.err_ema:.3f} for {s.calm} calls"
        else:
            s.calm = 0
        return s.reason if s.bits != before else None

    def state_dict(self) -> dict:
        return {k: asdict(v) for k, v in self.buckets.items()}

    def load_state_dict(self, state: dict) -> None:
        self.buckets = {k: BucketBits(**v) for k, v in state.items()}
