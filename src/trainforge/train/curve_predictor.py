"""Learning-curve prediction: fit an ensemble of parametric curve families to a
validation-loss history and predict the loss at the step budget and the step after
which further improvement is below a threshold.

Input is two plain lists (steps, losses) from any trainer; output a ``Prediction``,
so it can be evaluated offline on logged runs. Fitting uses
``scipy.optimize.curve_fit``; the ensemble weighting and bootstrap around it are
hand-written: we found no maintained library that extrapolates learning curves from
plain lists (Domhan et al. 2015 is the reference for the families and the ensemble).

Method, for one call (deterministic given the inputs and ``seed``):

1. Keep finite points with step > 0 (the untrained model at step 0 is not on the
   curve). Fewer than ``min_points`` -> ``None``.
2. Overfitting (``overfit_detection.rise_since_best``): smooth the losses with a moving mean over
   ``overfit_window`` evaluations; when the latest window lies entirely after the
   lowest one and its mean is more than ``overfit_sigmas`` standard errors above it,
   the best point is in the past: predict it, with ``stop_step`` = the best
   evaluation's step and no remaining improvement. The families below are all
   non-increasing and cannot describe a curve that turns up. The standard error is
   measured at the window's own scale (trend-free second differences of window
   means), because real evaluation noise is autocorrelated from one evaluation to
   the next: a white-noise estimate from single evaluations is too small and the
   single lowest evaluation is a low outlier, so a test against them fires on noise.
3. Fit each family (steps scaled by the last step, for conditioning). Failed or
   non-finite fits are dropped.
4. Weight: refit each family on the history minus its last ``holdout_fraction`` and
   score how well it extrapolates the held-out tail: weight ~ exp(-mse_tail / (2 s^2)),
   s^2 the smallest full-fit residual variance (the noise level). With too few
   points to hold any out, weight by AIC.
5. Uncertainty: residual bootstrap (``n_bootstrap`` refits per family) -> a weighted
   sample of curves; the final loss's std, the stop step (weighted median) and the
   probability that the remaining improvement L(last) - L(budget) is below a delta
   come from that sample. It is the uncertainty of the expected curve: a single
   observed loss also carries the evaluation noise (``noise_std``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from trainforge.train.overfit_detection import noise_std, rise_since_best

# ---------------------------------------------------------------------------
# Families: loss(x) with x = step / x_scale, all non-increasing for b >= 0, c > 0.


def _pow3(x, a, b, c):
    return a + b * np.power(x, -c)


def _pow3_jac(x, a, b, c):
    u = np.power(x, -c)
    return np.stack([np.ones_like(x), u, -b * u * np.log(x)], axis=-1)


def _exp3(x, a, b, c):
    return a + b * np.exp(-np.minimum(c * x, 700.0))


def _exp3_jac(x, a, b, c):
    e = np.exp(-np.minimum(c * x, 700.0))
    return np.stack([np.ones_like(x), e, -b * x * e], axis=-1)


def _logpow4(x, a, b, s, c):
    return a + b / (1.0 + np.power(x / s, c))


def _logpow4_jac(x, a, b, s, c):
    u = np.power(x / s, c)
    g = 1.0 / (1.0 + u)
    dfdu = -b * g * g
    return np.stack([np.ones_like(x), g, dfdu * (-c * u / s), dfdu * u * np.log(x / s)], axis=-1)


def _weibull4(x, a, b, s, c):
    return a + b * np.exp(-np.minimum(np.power(x / s, c), 700.0))


def _weibull4_jac(x, a, b, s, c):
    u = np.minimum(np.power(x / s, c), 700.0)
    e = np.exp(-u)
    return np.stack([np.ones_like(x), e, b * e * c * u / s, -b * e * u * np.log(x / s)], axis=-1)


@dataclass(frozen=True)
class Family:
    """One curve family: ``fn(x, *params)`` on scaled steps, and how to express its
    params in raw step units (``to_steps(params, x_scale)``)."""
    name: str
    param_names: tuple[str, ...]
    fn: Callable[..., Any]
    jac: Callable[..., Any]                    # (n,) -> (n, n_params)
    p0: Callable[[float, float], list[float]]  # (asymptote guess, drop guess) -> start params
    lo: tuple[float, ...]                      # bounds after the asymptote and the drop b >= 0
    hi: tuple[float, ...]
    to_steps: Callable[[np.ndarray, float], tuple[float, ...]]


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("pow3", ("a", "b", "c"), _pow3, _pow3_jac,  # a + b * t^-c
           lambda a, d: [a, d, 0.5], (1e-3,), (10.0,),
           lambda p, T: (p[0], p[1] * T ** p[2], p[2])),
    Family("exp3", ("a", "b", "c"), _exp3, _exp3_jac,  # a + b * exp(-c * t)
           lambda a, d: [a, 2 * d, 3.0], (1e-3,), (1e3,),
           lambda p, T: (p[0], p[1], p[2] / T)),
    Family("logpow4", ("a", "b", "s", "c"), _logpow4, _logpow4_jac,  # a + b / (1 + (t / s)^c)
           lambda a, d: [a, 2 * d, 0.3, 1.0], (1e-4, 0.05), (1e3, 10.0),
           lambda p, T: (p[0], p[1], p[2] * T, p[3])),
    Family("weibull4", ("a", "b", "s", "c"), _weibull4, _weibull4_jac,  # a + b * exp(-(t / s)^c)
           lambda a, d: [a, 2 * d, 0.3, 0.7], (1e-4, 0.05), (1e3, 5.0),
           lambda p, T: (p[0], p[1], p[2] * T, p[3])),
)}


@dataclass(frozen=True)
class FamilyFit:
    name: str
    params: dict[str, float]   # in raw step units (t, not the scaled x)
    weight: float
    rmse: float                # full-history fit
    tail_rmse: float | None    # extrapolation error on the held-out tail; None = weighted by AIC


@dataclass(frozen=True)
class Prediction:
    """Prediction at ``budget_step`` from the history up to ``last_step``.

    ``final_loss``: the families' fitted losses at the budget, weighted;
    ``final_loss_std``: the root-mean-square spread of the bootstrap curves around it
    (between-family spread included). ``stop_step``: weighted median of the first step after which the
    predicted remaining improvement (to the budget) is below ``min_delta``; may lie
    in the past. ``overfitting``: the loss turned up, the best point is in the past."""
    final_loss: float
    final_loss_std: float
    stop_step: int
    min_delta: float
    budget_step: int
    last_step: int
    best_step: int
    best_loss: float
    noise_std: float
    overfitting: bool
    fits: tuple[FamilyFit, ...]
    remaining: tuple[float, ...] = field(repr=False)  # per-sample L(last) - L(budget)
    weights: tuple[float, ...] = field(repr=False)    # per-sample weights, sum 1

    @property
    def remaining_improvement(self) -> float:
        return float(np.dot(self.weights, self.remaining))

    def prob_improvement_below(self, min_delta: float) -> float:
        """Probability that training on to the budget improves the loss by less than ``min_delta``."""
        r = np.asarray(self.remaining)
        return float(np.sum(np.asarray(self.weights)[r < min_delta]))

    def to_record(self) -> dict[str, Any]:
        """JSON-friendly summary for the metrics log."""
        return {"predicted_final_loss": self.final_loss, "predicted_final_loss_std": self.final_loss_std,
                "predicted_stop_step": self.stop_step, "predicted_remaining_improvement": self.remaining_improvement,
                "overfitting": self.overfitting,
                "curve_weights": {f.name: round(f.weight, 4) for f in self.fits}}


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])


@dataclass
class CurvePredictor:
    families: tuple[str, ...] = ("pow3", "exp3", "logpow4", "weibull4")
    min_points: int = 6
    holdout_fraction: float = 0.25
    n_bootstrap: int = 24
    seed: int = 0
    loss_floor: float | None = 0.0   # losses cannot go below this (0 for cross-entropy); None = no floor
    overfit_window: int = 5          # evaluations per moving mean in the overfitting test
    overfit_sigmas: float = 3.0      # standard errors the latest window must sit above the lowest; inf = never
    max_evals: int = 2000            # per curve_fit call

    def __post_init__(self) -> None:
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"curve families {unknown or '()'} unknown: use some of {sorted(FAMILIES)}")
        if self.min_points < 4 or not 0.0 < self.holdout_fraction < 0.5 or self.n_bootstrap < 0:
            raise ValueError("CurvePredictor needs min_points >= 4, holdout_fraction in (0, 0.5), n_bootstrap >= 0")
        if self.overfit_window < 2 or not self.overfit_sigmas > 0:
            raise ValueError(f"CurvePredictor needs overfit_window >= 2 and overfit_sigmas > 0, got "
                             f"{self.overfit_window}, {self.overfit_sigmas}")

    # -- fitting -------------------------------------------------------------------

    def _fit(self, fam: Family, x: np.ndarray, y: np.ndarray, p0: list[float] | np.ndarray,
             lo: list[float], hi: list[float]) -> np.ndarray | None:
        """Least-squares fit; None on failure or a non-finite result. Never raises."""
        p0 = np.clip(np.asarray(p0, float), np.asarray(lo) + 1e-12, np.asarray(hi) - 1e-12)
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", OptimizeWarning)
                warnings.simplefilter("ignore", RuntimeWarning)
                p, _ = curve_fit(fam.fn, x, y, p0=p0, bounds=(lo, hi), method="trf", jac=fam.jac,
                                 max_nfev=self.max_evals)
        except (RuntimeError, ValueError, FloatingPointError, np.linalg.LinAlgError):
            return None
        with np.errstate(all="ignore"):
            ok = np.all(np.isfinite(p)) and np.all(np.isfinite(fam.fn(x, *p)))
        return p if ok else None

    def _bounds(self, fam: Family, x: np.ndarray, y: np.ndarray) -> tuple[list[float], list[float], list[float]]:
        y_min, y_max = float(np.min(y)), float(np.max(y))
        span = max(y_max - y_min, 1e-6 * max(abs(y_max), 1.0))
        a_lo = y_min - 3 * span
        if self.loss_floor is not None:
            a_lo = max(a_lo, self.loss_floor)
        a_lo = min(a_lo, y_min)
        a0 = max(a_lo, y_min - 0.1 * span)
        drop = max(float(y[0]) - a0, 1e-3 * span)
        p0 = fam.p0(a0, drop)
        lo = [a_lo, 0.0, *fam.lo]
        if "s" in fam.param_names:
            # A knee before the first point is not identifiable, and letting s run to 0
            # (where the 4-parameter families mimic pow3) makes the fit crawl.
            i = fam.param_names.index("s")
            lo[i] = max(lo[i], 0.5 * float(x[0]))
        return p0, lo, [y_max + span, np.inf, *fam.hi]

    # -- prediction ----------------------------------------------------------------

    def _history(self, steps: Sequence[int], losses: Sequence[float],
                 min_delta: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The usable (steps, losses) of ``predict``'s input, or None when too few."""
        if len(steps) != len(losses):
            raise ValueError(f"steps ({len(steps)}) and losses ({len(losses)}) differ in length")
        if min_delta <= 0:
            raise ValueError(f"min_delta = {min_delta} must be > 0")
        t_all = np.asarray(steps, dtype=float)
        if np.any(np.diff(t_all) <= 0):
            raise ValueError("steps must be strictly increasing")
        y_all = np.asarray(losses, dtype=float)
        keep = np.isfinite(y_all) & (t_all > 0)
        t, y = t_all[keep], y_all[keep]
        return (t, y) if len(t) >= self.min_points else None

    def _overfit(self, t: np.ndarray, y: np.ndarray, budget_step: int, min_delta: float) -> Prediction | None:
        rise, se = rise_since_best(y, self.overfit_window)
        if not rise > self.overfit_sigmas * se:
            return None
        noise = noise_std(y)
        i_best = int(np.argmin(y))
        best_step, best_loss, last_step = int(t[i_best]), float(y[i_best]), int(t[-1])
        return Prediction(best_loss, noise, best_step, min_delta, max(int(budget_step), last_step), last_step,
                          best_step, best_loss, noise, True, (), (0.0,), (1.0,))

    def overfit_prediction(self, steps: Sequence[int], losses: Sequence[float], budget_step: int,
                           min_delta: float) -> Prediction | None:
        """Step 2 of ``predict`` alone, without fitting: the ``Prediction`` that
        ``predict`` returns when the loss has turned up, else None. Lets an offline
        evaluation try several overfitting settings on one set of fits."""
        h = self._history(steps, losses, min_delta)
        return None if h is None else self._overfit(*h, budget_step, min_delta)

    def predict(self, steps: Sequence[int], losses: Sequence[float], budget_step: int,
                min_delta: float) -> Prediction | None:
        """Predict from the history. ``steps`` must be strictly increasing and as long
        as ``losses`` (ValueError otherwise); non-finite losses are dropped. Returns None
        when fewer than ``min_points`` usable points or no family fits. Never raises on
        the shape of the curve (flat, noisy, increasing)."""
        h = self._history(steps, losses, min_delta)
        if h is None:
            return None
        t, y = h
        over = self._overfit(t, y, budget_step, min_delta)
        if over is not None:
            return over
        last_step = int(t[-1])
        budget_step = max(int(budget_step), last_step)
        noise = noise_std(y)
        i_best = int(np.argmin(y))
        best_step, best_loss = int(t[i_best]), float(y[i_best])

        T = float(t[-1])
        x, x_budget = t / T, budget_step / T
        n = len(y)
        fitted: list[tuple[Family, np.ndarray, float, list[float], list[float]]] = []
        for name in self.families:
            fam = FAMILIES[name]
            k = len(fam.param_names)
            if n < k + 2:
                continue
            p0, lo, hi = self._bounds(fam, x, y)
            p = self._fit(fam, x, y, p0, lo, hi)
            if p is None:
                continue
            mse = float(np.sum((y - fam.fn(x, *p)) ** 2) / (n - k))
            fitted.append((fam, p, mse, lo, hi))
        if not fitted:
            return None

        # Weights from extrapolation of the held-out tail, else AIC.
        sigma2 = max(min(m for _, _, m, _, _ in fitted), (1e-6 * max(abs(best_loss), 1e-3)) ** 2)
        n_hold = max(2, int(round(self.holdout_fraction * n)))
        tail_mse: list[float | None] = []
        for fam, p, _, lo, hi in fitted:
            k = len(fam.param_names)
            if n - n_hold < k + 2:
                tail_mse.append(None)
                continue
            ph = self._fit(fam, x[:-n_hold], y[:-n_hold], p, lo, hi)
            with np.errstate(all="ignore"):
                err = float(np.mean((y[-n_hold:] - fam.fn(x[-n_hold:], *ph)) ** 2)) if ph is not None else math.inf
            tail_mse.append(err if math.isfinite(err) else math.inf)
        if all(m is not None for m in tail_mse):
            logw = np.array([-0.5 * m / sigma2 for m in tail_mse])
        else:
            tail_mse = [None] * len(fitted)
            logw = np.array([-0.5 * (n * math.log(max(m * (n - len(f.param_names)) / n, 1e-300))
                                     + 2 * len(f.param_names)) for f, _, m, _, _ in fitted])
        if not np.any(np.isfinite(logw)):
            logw = np.zeros(len(fitted))
        w_fam = np.exp(logw - np.max(logw))
        w_fam /= w_fam.sum()

        # Residual bootstrap: a weighted sample of curves.
        rng = np.random.default_rng(self.seed)
        finals, remaining, stops, weights = [], [], [], []
        fits, point_finals, point_weights = [], [], []
        for (fam, p, mse, lo, hi), w, tm in zip(fitted, w_fam, tail_mse):
            fits.append(FamilyFit(fam.name, dict(zip(fam.param_names, map(float, fam.to_steps(p, T))))
                                  , float(w), math.sqrt(mse * (n - len(p)) / n),
                                  None if tm is None else math.sqrt(tm)))
            if w < 1e-6:
                continue
            with np.errstate(all="ignore"):
                point_finals.append(float(fam.fn(x_budget, *p)))
            point_weights.append(w)
            samples = [p]
            if self.n_bootstrap:
                curve = fam.fn(x, *p)
                resid = (y - curve) * math.sqrt(n / (n - len(p)))
                resid -= resid.mean()
                samples = []
                for _ in range(self.n_bootstrap):
                    pb = self._fit(fam, x, curve + rng.choice(resid, size=n, replace=True), p, lo, hi)
                    if pb is not None:
                        samples.append(pb)
                samples = samples or [p]
            for pb in samples:
                with np.errstate(all="ignore"):
                    f_last, f_budget = float(fam.fn(1.0, *pb)), float(fam.fn(x_budget, *pb))
                finals.append(f_budget)
                remaining.append(f_last - f_budget)
                stops.append(self._stop_step(fam, pb, T, int(t[0]), budget_step, f_budget, min_delta))
                weights.append(w / len(samples))
        finals_a, weights_a = np.array(finals), np.array(weights)
        weights_a /= weights_a.sum()
        # The point fits' prediction; the bootstrap only spreads around it (a mean of
        # bootstrap refits would carry their nonlinearity bias into the estimate).
        mean = float(np.dot(point_weights, point_finals) / np.sum(point_weights))
        std = float(math.sqrt(max(np.dot(weights_a, (finals_a - mean) ** 2), 0.0)))
        stop = int(round(_weighted_median(np.array(stops, float), weights_a)))
        return Prediction(mean, std, stop, min_delta, budget_step, last_step, best_step, best_loss, noise, False,
                          tuple(fits), tuple(float(r) for r in remaining), tuple(float(w) for w in weights_a))

    @staticmethod
    def _stop_step(fam: Family, p: np.ndarray, T: float, first: int, budget: int, f_budget: float,
                   min_delta: float) -> int:
        """First integer step s in [first, budget] with L(s) - L(budget) < min_delta
        (bisection: the families are non-increasing)."""
        def below(s: int) -> bool:
            with np.errstate(all="ignore"):
                return bool(fam.fn(s / T, *p) - f_budget < min_delta)

        if below(first):
            return first
        lo, hi = first, budget  # below(lo) is False, below(hi) is True (L(budget) - L(budget) = 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if below(mid):
                hi = mid
            else:
                lo = mid
        return hi


def predict(steps: Sequence[int], losses: Sequence[float], budget_step: int, min_delta: float,
            **settings: Any) -> Prediction | None:
    """``CurvePredictor(**settings).predict(steps, losses, budget_step, min_delta)``."""
    return CurvePredictor(**settings).predict(steps, losses, budget_step, min_delta)
