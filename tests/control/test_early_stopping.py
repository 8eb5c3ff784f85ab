"""Early stopping fed scripted validation losses through a fake trainer: stops at the
documented step in both modes, never before min_steps, logs a prediction every
evaluation, and continues identically after a state_dict round trip."""

import io

import numpy as np
import pytest
import torch

from trainforge.train.curve_predictor import CurvePredictor, rise_since_best
from trainforge.train.early_stopping import EarlyStopping


class FakeTrainer:
    """The part of Trainer a callback may touch: ``request_stop`` (first reason wins)."""

    def __init__(self):
        self.stop_reason = None
        self.requests = []

    def request_stop(self, reason: str) -> None:
        self.requests.append(reason)
        if self.stop_reason is None:
            self.stop_reason = reason


def _run(es: EarlyStopping, history, trainer=None):
    """Evaluate until the callback asks to stop, as the trainer loop does."""
    trainer = trainer or FakeTrainer()
    records = []
    for step, loss in history:
        records.append(es.on_evaluation(trainer, step, loss))
        if trainer.stop_reason is not None:
            break
    return trainer, records


def _power_law(steps, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [(s, 2 + 8 * s ** -0.5 + noise * rng.standard_normal()) for s in steps]


FAST = CurvePredictor(n_bootstrap=4)


def test_predict_mode_stops_at_the_documented_step():
    # L = 2 + 8 t^-0.5, budget 10000, min_delta 0.05: the improvement left after t is
    # 8 (t^-0.5 - 0.01) < 0.05 once t > 3786.98, so the first evaluation (every 200
    # steps) allowed to stop is step 3800. The untrained step-0 loss is ignored.
    history = [(0, 9.0)] + _power_law(range(200, 10001, 200))
    es = EarlyStopping(10000, mode="predict", min_delta=0.05, confidence=0.9, predictor=FAST)
    trainer, records = _run(es, history)
    assert records[-1]["step"] == 3800 and records[-1]["early_stop"]
    assert trainer.requests == [trainer.stop_reason] and "predicted" in trainer.stop_reason
    assert not any(r["early_stop"] for r in records[:-1])
    assert len({tuple(sorted(r)) for r in records}) == 1  # same keys every time: one JSONL schema
    # Every evaluation with enough history logs the prediction, and it is right.
    assert [r["predicted_stop_step"] is None for r in records[:7]] == [True] * 6 + [False]
    assert all(r["predicted_stop_step"] == 3787 for r in records[6:])
    assert all(r["predicted_final_loss"] == pytest.approx(2.08, abs=1e-4) for r in records[6:])


def test_predict_mode_with_noisy_losses_stops_near_the_documented_step():
    history = _power_law(range(200, 10001, 200), noise=0.003, seed=2)
    es = EarlyStopping(10000, mode="predict", min_delta=0.05, confidence=0.9,
                       predictor=CurvePredictor(n_bootstrap=8))
    _, records = _run(es, history)
    assert 3600 <= records[-1]["step"] <= 4400 and records[-1]["early_stop"]
    # It stopped at the first evaluation sure enough (>= confidence), not merely likely.
    probs = [r["prob_improvement_below_min_delta"] or 0.0 for r in records]
    assert probs[-1] >= 0.9 and max(probs[:-1]) < 0.9
    assert max(probs[:-1]) > 0.5, "a likely-but-unsure evaluation must come first, or confidence is untested"


def test_predict_mode_stops_on_overfitting_at_the_documented_step():
    history = [(s, 2 + 8 * s ** -0.5 + 1e-4 * max(0, s - 1500)) for s in range(100, 5001, 100)]
    es = EarlyStopping(10000, mode="predict", min_delta=1e-4, confidence=0.9, predictor=FAST)
    trainer, records = _run(es, history)
    # After 1500 the rise (1e-4 per step) beats the fall (4 t^-1.5 < 7e-5 per step). The
    # lowest mean of 5 evaluations is that of 1400-1800 (the rise is steeper than the
    # fall); the first window entirely after it is 1900-2300, and its mean is far above
    # (the curve has no noise). The stop step reported is the best evaluation's, 1500.
    assert records[-1]["step"] == 2300 and records[-1]["overfitting"]
    assert not any(r["overfitting"] for r in records[:-1])
    assert records[-1]["predicted_stop_step"] == 1500 and "risen" in trainer.stop_reason


def _ar1(n, rho, sd, seed):
    """Autocorrelated evaluation noise, as on the real curves (lag-1 correlation 0.1-0.45)."""
    rng = np.random.default_rng(seed)
    e = np.empty(n)
    e[0] = rng.standard_normal()
    for i in range(1, n):
        e[i] = rho * e[i - 1] + (1 - rho * rho) ** 0.5 * rng.standard_normal()
    return sd * e


def test_overfitting_test_ignores_autocorrelated_noise_and_catches_a_real_rise():
    # 20 converging curves with noise 0.03 whose lag-1 correlation is 0.7. Measured
    # against single evaluations (white-noise standard error) about half of them show a
    # "rise" somewhere; at the window scale none does. With a rise of 0.01 per
    # evaluation from evaluation 30 on, every curve is flagged, and not before the turn.
    steps = np.arange(10, 601, 10)
    base = 3 + 2 * (steps / 10.0) ** -0.5
    predictor = CurvePredictor()
    flagged = lambda y: [n for n in range(6, len(y) + 1)  # noqa: E731
                         if (lambda r: r[0] > predictor.overfit_sigmas * r[1])(
                             rise_since_best(y[:n], predictor.overfit_window))]
    detected = []
    for seed in range(20):
        noise = _ar1(len(steps), 0.7, 0.03, seed)
        assert flagged(base + noise) == [], f"seed {seed}: noise taken for overfitting"
        hits = flagged(base + noise + 0.01 * np.maximum(0, np.arange(len(steps)) - 30))
        assert hits, f"seed {seed}: a rise of 0.3 (10 noise sd) went unnoticed"
        detected.append(hits[0])
    assert min(detected) > 30 + predictor.overfit_window
    # The predictor itself reports it: the first flagged history of seed 0 is overfitting.
    y = base + _ar1(len(steps), 0.7, 0.03, 0) + 0.01 * np.maximum(0, np.arange(len(steps)) - 30)
    n = detected[0]
    pred = CurvePredictor(n_bootstrap=0).predict(steps[:n], y[:n], 1000, 0.01)
    assert pred.overfitting and pred.stop_step == steps[int(np.argmin(y[:n]))]
    assert not CurvePredictor(n_bootstrap=0).predict(steps[:n - 1], y[:n - 1], 1000, 0.01).overfitting
    # overfit_prediction (used by bench/early_stopping.py to replay one set of fits) is
    # that branch of predict, without fitting.
    assert CurvePredictor().overfit_prediction(steps[:n], y[:n], 1000, 0.01) == pred
    assert CurvePredictor().overfit_prediction(steps[:n - 1], y[:n - 1], 1000, 0.01) is None


PATIENCE_LOSSES = [5.0, 4.0, 3.0, 3.0005, 2.9995, 3.1, 2.5, 2.6, 2.7, 2.8, 2.9]


def test_patience_mode_stops_at_the_documented_step():
    # min_delta 0.001: 3.0005 and 2.9995 do not beat 3.0 by more than 0.001, nor does
    # 3.1 -> 3 evaluations without improvement at step 60. Then 2.5 resets.
    history = list(zip(range(10, 120, 10), PATIENCE_LOSSES))
    es = EarlyStopping(1000, mode="patience", min_delta=1e-3, patience=3, predictor=FAST)
    trainer, records = _run(es, history)
    assert records[-1]["step"] == 60 and "patience" in trainer.stop_reason
    assert [r["evals_without_improvement"] for r in records] == [0, 0, 0, 1, 2, 3]
    assert records[-1]["best_val_loss"] == 3.0 and records[-1]["best_step"] == 30
    # Predictions are logged in patience mode too (6 points: the first prediction).
    assert records[-1]["predicted_stop_step"] is not None


@pytest.mark.parametrize("mode", ["patience", "predict"])
def test_never_stops_before_min_steps(mode):
    # A flat curve: both rules want to stop as early as they can.
    history = [(s, 3.0 + 1e-4 * ((s // 10) % 2)) for s in range(10, 501, 10)]
    es = EarlyStopping(1000, mode=mode, min_steps=250, min_delta=1e-3, patience=2, predictor=FAST)
    trainer, records = _run(es, history)
    assert records[-1]["step"] == 250 and records[-1]["early_stop"]
    free = EarlyStopping(1000, mode=mode, min_delta=1e-3, patience=2, predictor=FAST)
    _, early = _run(free, history)
    assert early[-1]["step"] < 250, "without min_steps it stops earlier, or this test proves nothing"


@pytest.mark.parametrize("mode, cut", [("patience", 4), ("predict", 12)])
def test_state_dict_round_trip_continues_identically(mode, cut):
    if mode == "patience":
        history = list(zip(range(10, 120, 10), PATIENCE_LOSSES))
    else:
        history = _power_law(range(200, 10001, 200), noise=0.003, seed=2)
    make = lambda: EarlyStopping(10000, mode=mode, min_delta=0.05 if mode == "predict" else 1e-3,  # noqa: E731
                                 patience=3, predictor=CurvePredictor(n_bootstrap=4))
    _, want = _run(make(), history)
    assert want[-1]["early_stop"] and len(want) > cut

    first = make()
    _, got = _run(first, history[:cut])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = make()
    second.load_state_dict(torch.load(buf, weights_only=True))
    _, rest = _run(second, history[cut:])
    assert got + rest == want


def test_rollback_drops_the_history_after_the_restored_step():
    es = EarlyStopping(1000, mode="patience", min_delta=1e-3, patience=2, predictor=FAST)
    trainer = FakeTrainer()
    for step, loss in [(10, 5.0), (20, 4.0), (30, 4.5), (40, 4.6)]:
        es.on_evaluation(trainer, step, loss)
    assert trainer.stop_reason is not None  # 2 evaluations without improvement
    # The run rolled back to step 20 and sees a better loss at step 30 this time.
    again = FakeTrainer()
    record = es.on_evaluation(again, 30, 3.0)
    assert es.steps == [10, 20, 30] and record["evals_without_improvement"] == 0
    assert again.stop_reason is None


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(100, mode="best")
    with pytest.raises(ValueError, match="confidence"):
        EarlyStopping(100, confidence=0.0)
    with pytest.raises(ValueError, match="min_delta"):
        EarlyStopping(100, min_delta=0.0)
    with pytest.raises(ValueError, match="overfit_window"):
        CurvePredictor(overfit_window=1)
