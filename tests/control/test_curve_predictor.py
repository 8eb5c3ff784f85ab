"""The learning-curve ensemble recovers the parameters of noisy synthetic curves from
each family, predicts better the more of the curve it has seen, and never raises on
odd histories (too short, flat, noisy, rising, with NaNs)."""

import math

import numpy as np
import pytest

from trainforge.train.curve_predictor import CurvePredictor, predict


def _curve(name: str, t: np.ndarray, p: tuple) -> np.ndarray:
    """The families, written out in raw steps independently of the module under test."""
    a = p[0]
    if name == "pow3":
        return a + p[1] * t ** -p[2]
    if name == "exp3":
        return a + p[1] * np.exp(-p[2] * t)
    if name == "logpow4":
        return a + p[1] / (1 + (t / p[2]) ** p[3])
    return a + p[1] * np.exp(-(t / p[2]) ** p[3])  # weibull4


TRUTH = {
    "pow3": {"a": 2.0, "b": 8.0, "c": 0.5},
    "exp3": {"a": 2.0, "b": 3.0, "c": 0.004},
    "logpow4": {"a": 2.0, "b": 4.0, "s": 200.0, "c": 1.2},
    "weibull4": {"a": 2.0, "b": 3.0, "s": 300.0, "c": 0.6},
}
FAST = dict(n_bootstrap=4)


@pytest.mark.parametrize("family", sorted(TRUTH))
def test_recovers_parameters_of_each_family_with_noise(family):
    truth = TRUTH[family]
    t = np.arange(20, 2001, 20)
    rng = np.random.default_rng(1)
    y = _curve(family, t, tuple(truth.values())) * (1 + 0.003 * rng.standard_normal(len(t)))
    pred = predict(t.tolist(), y.tolist(), budget_step=4000, min_delta=0.01, **FAST)
    fit = {f.name: f for f in pred.fits}[family]
    assert fit.params["a"] == pytest.approx(truth["a"], abs=0.02)
    for name in truth.keys() - {"a"}:
        assert fit.params[name] == pytest.approx(truth[name], rel=0.1), name
    # The ensemble trusts the generating family (another family may tie when it can
    # express the same curve, e.g. weibull4 with c = 1 is exp3).
    assert fit.weight >= 0.4
    assert pred.final_loss == pytest.approx(_curve(family, np.array(4000.0), tuple(truth.values())), abs=0.02)


def test_prediction_error_and_uncertainty_shrink_as_more_of_the_curve_is_seen():
    budget, fractions = 5000, (0.1, 0.3, 0.8)
    errors = {f: [] for f in fractions}
    stds = {f: [] for f in fractions}
    t = np.arange(25, budget + 1, 25)
    for family, truth in TRUTH.items():
        p = tuple(truth.values())
        final = float(_curve(family, np.array(float(budget)), p))
        for seed in range(2):
            y = _curve(family, t, p) + 0.01 * np.random.default_rng(seed).standard_normal(len(t))
            for frac in fractions:
                m = int(frac * len(t))
                pred = predict(t[:m].tolist(), y[:m].tolist(), budget, 0.01, n_bootstrap=4)
                errors[frac].append(abs(pred.final_loss - final))
                stds[frac].append(pred.final_loss_std)
    mean_err = [float(np.mean(errors[f])) for f in fractions]
    assert mean_err[0] > mean_err[1] > mean_err[2], mean_err
    assert mean_err[2] < 0.01
    mean_std = [float(np.mean(stds[f])) for f in fractions]
    assert mean_std[0] > mean_std[2], mean_std


def test_stop_step_of_a_noiseless_power_law_matches_the_formula():
    # L = 2 + 8 t^-0.5; remaining improvement from t to B=10000 is 8 (t^-0.5 - 0.01),
    # below 0.05 once t > (1 / 0.01625)^2 = 3786.98...
    t = np.arange(100, 2001, 100)
    pred = predict(t.tolist(), (2 + 8 * t ** -0.5).tolist(), 10000, 0.05, **FAST)
    assert pred.stop_step == 3787
    assert pred.final_loss == pytest.approx(2.08, abs=1e-4)
    assert pred.remaining_improvement == pytest.approx(8 * (2000 ** -0.5 - 0.01), rel=1e-3)
    assert pred.prob_improvement_below(0.05) == 0.0
    assert pred.prob_improvement_below(1.0) == 1.0


def test_overfitting_curve_predicts_the_best_point_in_the_past():
    t = np.arange(100, 3001, 100)
    y = 2 + 8 * t ** -0.5 + 1e-4 * np.maximum(0, t - 1500)  # turns up after step 1500
    pred = predict(t.tolist(), y.tolist(), 10000, 0.01, **FAST)
    assert pred.overfitting
    assert pred.best_step == int(t[np.argmin(y)]) and pred.stop_step == pred.best_step
    assert pred.final_loss == pytest.approx(float(y.min()))
    assert pred.prob_improvement_below(0.01) == 1.0


def test_a_still_falling_noisy_curve_is_not_called_overfitting():
    t = np.arange(100, 3001, 100)
    y = 2 + 8 * t ** -0.5 + 0.005 * np.random.default_rng(0).standard_normal(len(t))
    pred = predict(t.tolist(), y.tolist(), 10000, 0.01, **FAST)
    assert not pred.overfitting and pred.fits


def test_too_few_points_give_no_prediction():
    assert predict([10, 20, 30, 40, 50], [5, 4, 3.5, 3.2, 3.0], 100, 0.01) is None
    # Step 0 (the untrained model) and non-finite losses do not count.
    assert predict([0, 10, 20, 30, 40, 50], [9, 5, 4, 3.5, 3.2, 3.0], 100, 0.01) is None
    assert predict([10, 20, 30, 40, 50, 60], [5, 4, float("nan"), 3.2, 3.0, 2.9], 100, 0.01) is None


@pytest.mark.parametrize("shape", ["flat", "constant", "noise", "rising", "nan", "negative", "huge", "step"])
def test_odd_curves_never_raise(shape):
    rng = np.random.default_rng(3)
    t = np.arange(10, 401, 10)
    y = {
        "flat": 3.0 + 1e-3 * rng.standard_normal(len(t)),
        "constant": np.full(len(t), 3.0),
        "noise": 3.0 + rng.standard_normal(len(t)),
        "rising": 3.0 + 0.01 * t,
        "nan": np.where(np.arange(len(t)) % 3 == 0, np.nan, 2 + 8 * t ** -0.5),
        "negative": -5.0 + 8 * t ** -0.5,
        "huge": 1e12 * (1 + 8 * t ** -0.5),
        "step": np.where(t < 200, 5.0, 2.0),
    }[shape]
    pred = CurvePredictor(loss_floor=None, **FAST).predict(t.tolist(), y.tolist(), 1000, 0.01)
    assert pred is not None
    assert math.isfinite(pred.final_loss) and math.isfinite(pred.final_loss_std)
    assert 10 <= pred.stop_step <= 1000
    assert 0.0 <= pred.prob_improvement_below(0.01) <= 1.0 + 1e-12
    if shape in ("flat", "constant"):  # nothing left to gain: stop
        assert pred.prob_improvement_below(0.01) > 0.9
    if shape == "rising":
        assert pred.overfitting and pred.stop_step == 10


def test_invalid_input_raises_value_error():
    with pytest.raises(ValueError, match="length"):
        predict([1, 2, 3], [1.0, 2.0], 10, 0.01)
    with pytest.raises(ValueError, match="increasing"):
        predict([1, 3, 2, 4, 5, 6], [1.0] * 6, 10, 0.01)
    with pytest.raises(ValueError, match="min_delta"):
        predict([1, 2, 3, 4, 5, 6], [1.0] * 6, 10, 0.0)
    with pytest.raises(ValueError, match="families"):
        CurvePredictor(families=("spline",))


def test_deterministic_given_the_history():
    t = np.arange(50, 1501, 50)
    y = 2 + 8 * t ** -0.5 + 0.01 * np.random.default_rng(5).standard_normal(len(t))
    a = predict(t.tolist(), y.tolist(), 5000, 0.02, n_bootstrap=8)
    b = predict(t.tolist(), y.tolist(), 5000, 0.02, n_bootstrap=8)
    assert a == b
    assert a.final_loss_std > 0


def test_bootstrap_std_matches_the_spread_of_predictions_over_noise_draws():
    # One family, so the reported std is the residual bootstrap's alone. Over 20 noise
    # draws it must be the right size (the bootstrap runs ~0.7x the true spread here:
    # few points, a nonlinear model; the ensemble's family spread adds the rest).
    t = np.arange(100, 2001, 100)
    truth = 2 + 8 * 10000 ** -0.5
    preds, stds = [], []
    for seed in range(20):
        y = 2 + 8 * t ** -0.5 + 0.01 * np.random.default_rng(100 + seed).standard_normal(len(t))
        pred = CurvePredictor(families=("pow3",), n_bootstrap=16).predict(t.tolist(), y.tolist(), 10000, 0.05)
        preds.append(pred.final_loss)
        stds.append(pred.final_loss_std)
    spread = float(np.sqrt(np.mean((np.array(preds) - truth) ** 2)))
    assert 0.4 < float(np.mean(stds)) / spread < 1.6, (np.mean(stds), spread)
