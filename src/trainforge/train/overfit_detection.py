"""Overfitting detection on a noisy validation-loss history: has the loss risen past
its best by more than the noise explains?

The curve families in ``curve_predictor`` are non-increasing and cannot describe a
curve that turns up, so the predictor asks this test first. It works on window means
with a standard error measured at the window's own scale, because real evaluation
noise is autocorrelated from one evaluation to the next (lag-1 up to 0.46 on
``bench/curves``): a white-noise estimate from single evaluations is too small, and
the single lowest evaluation is a low outlier, so a test against them fires on noise.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def noise_std(y: np.ndarray) -> float:
    """Robust noise level from second differences (a locally linear trend cancels)."""
    if len(y) < 4:
        return float(np.std(y))
    d2 = np.diff(y, 2)
    return float(1.4826 * np.median(np.abs(d2 - np.median(d2))) / math.sqrt(6.0))


def rise_since_best(losses: Sequence[float] | np.ndarray, window: int) -> tuple[float, float]:
    """(rise, standard error): how far the mean of the last ``window`` losses lies above
    the lowest mean of ``window`` consecutive losses, and the standard error of that
    difference. ``(0.0, inf)`` while the history is too short or the latest window
    still overlaps the lowest one (no rise can be shown yet).

    The standard error is measured on the history at the window's scale: with window
    means m, D = m[i] - 2 m[i-w] + m[i-2w] cancels a locally linear trend and, for
    independent window means, has variance 6 var(m), so se(m[a] - m[b]) =
    sqrt(2 var(m)) = sd(D) / sqrt(3), with sd(D) from the median absolute deviation.
    Autocorrelated evaluation noise inflates var(m) beyond sigma^2 / w and this
    estimate follows it. It never goes below the white-noise value
    ``noise_std * sqrt(2 / window)`` and needs 5 values of D, else it is that value."""
    y = np.asarray(losses, dtype=float)
    w = int(window)
    if len(y) < 2 * w:
        return 0.0, math.inf
    m = np.convolve(y, np.ones(w) / w, mode="valid")  # (n - w + 1,): mean of y[i:i + w]
    j = int(np.argmin(m))
    if len(m) - 1 - j < w:
        return 0.0, math.inf
    se = noise_std(y) * math.sqrt(2.0 / w)
    if len(m) >= 2 * w + 5:
        d = m[2 * w:] - 2 * m[w:-w] + m[:-2 * w]
        se = max(se, 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(3.0))
    return float(m[-1] - m[j]), se
