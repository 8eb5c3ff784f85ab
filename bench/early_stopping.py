"""Early stopping on real validation curves (``bench/curves/*.json``, written by
``bench/collect_curves.py``): the predictive rule against patience, and the learning-
curve predictor's error on the final loss.

For every curve the evaluations are replayed in order through the real
``EarlyStopping`` callback (a fake trainer records its stop request), once per setting
of a sweep. The predictor is fitted once per (curve, evaluation) and shared by all
predictive settings (its fit does not depend on min_delta or confidence); patience
settings use no predictor. Measures, pooled over curves (B = the curve's step budget,
best = its lowest validation loss and that loss's step):

- steps saved: sum(B - stop) / sum(B), against training to the budget;
- wasted steps saved: sum(B - max(stop, best step)) / sum(B - best step): of the steps
  training to the budget spends after the best point, the share not trained;
- regret: (val_loss at the stop evaluation - best) / best, in % (the model one keeps
  on stopping is the current one); median, mean, 90th percentile, max.

"Patience at equal savings" interpolates the patience sweep's lower frontier (median
regret against wasted steps saved) at the predictive setting's savings.

Prediction error: from the evaluations up to 25/50/75% of the budget, predict the
loss at the budget and compare with the curve's last validation loss (relative %),
beside the naive guess "the last value seen"; ``cover2`` is the share within 2 std
(the prediction's std and the evaluation noise combined).

    python bench/early_stopping.py [--workers 2] [--n_bootstrap 24]
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from trainforge.train.curve_predictor import CurvePredictor, Prediction
from trainforge.train.early_stopping import EarlyStopping

CURVES_DIR = Path(__file__).parent / "curves"
PREDICT_SWEEP = [(d, c) for d in (0.003, 0.01, 0.03) for c in (0.5, 0.8, 0.9, 0.95)]
PATIENCE_SWEEP = [(p, d) for p in (1, 2, 3, 4, 6, 8, 12, 16, 24) for d in (1e-4, 1e-3, 1e-2)]
HEADLINE = (0.01, 0.9)  # the [early_stop] defaults: min_delta, confidence


def load_curves() -> list[dict]:
    curves = []
    for f in sorted(CURVES_DIR.glob("*.json")):
        d = json.loads(f.read_text())
        steps, losses = zip(*d["val_curve"])
        curves.append({"name": d["name"], "budget": int(d["budget_steps"]), "steps": list(steps),
                       "losses": list(losses)})
    return curves


def predict_all(args: tuple[dict, int]) -> list[Prediction | None]:
    """The predictor's output after each evaluation of one curve (None: too few points)."""
    curve, n_bootstrap = args
    predictor = CurvePredictor(n_bootstrap=n_bootstrap)
    s, y = curve["steps"], curve["losses"]
    return [predictor.predict(s[:i + 1], y[:i + 1], curve["budget"], HEADLINE[0]) for i in range(len(s))]


class Replay:
    """Predictor stand-in: the prediction precomputed for this history length."""

    def __init__(self, predictions):
        self.predictions = predictions

    def predict(self, steps, losses, budget_step, min_delta):
        return self.predictions[len(steps) - 1]


class NoPrediction:
    def predict(self, steps, losses, budget_step, min_delta):
        return None


class FakeTrainer:
    def __init__(self):
        self.stop_reason = None

    def request_stop(self, reason):
        self.stop_reason = self.stop_reason or reason


def stop_index(curve: dict, es: EarlyStopping) -> int:
    """Index of the evaluation at which ``es`` stops the run (the last one if never)."""
    trainer = FakeTrainer()
    for i, (step, loss) in enumerate(zip(curve["steps"], curve["losses"])):
        es.on_evaluation(trainer, step, loss)
        if trainer.stop_reason is not None:
            return i
    return len(curve["steps"]) - 1


def score(curves: list[dict], stops: list[int]) -> dict:
    saved = wasted = saved_wasted = total = 0.0
    regrets = []
    for c, i in zip(curves, stops):
        B, y = c["budget"], np.asarray(c["losses"])
        b = int(np.argmin(y[1:])) + 1
        best, best_step, stop = float(y[b]), c["steps"][b], c["steps"][i]
        total += B
        saved += B - stop
        wasted += B - best_step
        saved_wasted += B - max(stop, best_step)
        regrets.append(100.0 * (y[i] - best) / best)
    r = np.asarray(regrets)
    return {"steps_saved": saved / total, "wasted_saved": saved_wasted / max(wasted, 1.0),
            "regret_median": float(np.median(r)), "regret_mean": float(r.mean()),
            "regret_p90": float(np.percentile(r, 90)), "regret_max": float(r.max()),
            "stopped": float(np.mean([i < len(c["steps"]) - 1 for c, i in zip(curves, stops)]))}


def frontier_regret(points: list[tuple[float, float]], savings: float) -> float:
    """Median regret the patience frontier (lowest regret for at least this much
    saving, linearly interpolated between sweep points) reaches at ``savings``."""
    pts = sorted(points)
    front = []  # (savings, regret), regret non-decreasing in savings
    for s, r in reversed(pts):
        if not front or r < front[-1][1]:
            front.append((s, r))
    front.reverse()
    for (s0, r0), (s1, r1) in zip(front, front[1:]):
        if s0 <= savings <= s1:
            return r0 + (r1 - r0) * (savings - s0) / max(s1 - s0, 1e-12)
    return front[0][1] if savings < front[0][0] else math.nan


def fmt(name: str, m: dict) -> str:
    return (f"| {name} | {100 * m['steps_saved']:.1f}% | {100 * m['wasted_saved']:.1f}% | {m['regret_median']:.2f}% "
            f"| {m['regret_mean']:.2f}% | {m['regret_p90']:.2f}% | {m['regret_max']:.2f}% | {100 * m['stopped']:.0f}% |")


def prediction_errors(curves: list[dict], preds: list[list]) -> list[str]:
    rows = ["| seen | curves | predictor median abs err | mean | last-value median abs err | cover2 |",
            "|---|---|---|---|---|---|"]
    for frac in (0.25, 0.5, 0.75):
        for label, keep in (("all", lambda c: True), ("converging", lambda c: not c["overfit"]),
                            ("overfitting", lambda c: c["overfit"])):
            err, naive, cover = [], [], []
            for c, p in zip(curves, preds):
                if not keep(c):
                    continue
                i = max(j for j, s in enumerate(c["steps"]) if s <= frac * c["budget"])
                final = c["losses"][-1]
                naive.append(100 * abs(c["losses"][i] - final) / final)
                if p[i] is None:
                    continue
                err.append(100 * abs(p[i].final_loss - final) / final)
                sd = math.hypot(p[i].final_loss_std, p[i].noise_std)
                cover.append(abs(p[i].final_loss - final) <= 2 * sd)
            if err:
                rows.append(f"| {int(100 * frac)}% ({label}) | {len(err)} | {np.median(err):.2f}% | {np.mean(err):.2f}% "
                            f"| {np.median(naive):.2f}% | {100 * np.mean(cover):.0f}% |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="processes fitting curves")
    p.add_argument("--n_bootstrap", type=int, default=24, help="bootstrap refits per family (the config default)")
    p.add_argument("--cache", default=None, help="pickle of the predictions: written after fitting, read "
                                                 "instead of fitting when it exists (for re-analysis)")
    a = p.parse_args()
    curves = load_curves()
    for c in curves:
        y = np.asarray(c["losses"])
        c["overfit"] = bool(y[-1] > (1 + 0.005) * y[1:].min())  # ends > 0.5% above its best
    t0 = time.perf_counter()
    if a.cache and Path(a.cache).is_file():
        preds = pickle.loads(Path(a.cache).read_bytes())
    else:
        with ProcessPoolExecutor(a.workers) as pool:
            preds = list(pool.map(predict_all, [(c, a.n_bootstrap) for c in curves]))
        if a.cache:
            Path(a.cache).write_bytes(pickle.dumps(preds))
    fit_s = time.perf_counter() - t0
    n_evals = sum(len(c["steps"]) for c in curves)
    print(f"{len(curves)} curves ({sum(c['overfit'] for c in curves)} end > 0.5% above their best), {n_evals} "
          f"evaluations; predictor fits {fit_s:.0f}s ({1e3 * fit_s * a.workers / n_evals:.0f} ms per evaluation "
          f"per process, n_bootstrap {a.n_bootstrap})\n")

    header = ["| rule | steps saved | wasted steps saved | regret median | mean | p90 | max | stopped |",
              "|---|---|---|---|---|---|---|---|"]
    pred_rows, pat_points, pat_rows, results = [], [], [], {}
    for d, conf in PREDICT_SWEEP:
        stops = [stop_index(c, EarlyStopping(c["budget"], "predict", 0, d, conf, predictor=Replay(pr)))
                 for c, pr in zip(curves, preds)]
        results[("predict", d, conf)] = m = score(curves, stops)
        pred_rows.append(fmt(f"predict min_delta={d} conf={conf}", m))
    for pat, d in PATIENCE_SWEEP:
        stops = [stop_index(c, EarlyStopping(c["budget"], "patience", 0, d, patience=pat, predictor=NoPrediction()))
                 for c in curves]
        results[("patience", pat, d)] = m = score(curves, stops)
        pat_points.append((m["wasted_saved"], m["regret_median"]))
        pat_rows.append(fmt(f"patience={pat} min_delta={d:g}", m))
    print("\n".join(["Predictive rule (sweep):", *header, *pred_rows, "", "Patience (sweep):", *header, *pat_rows]))

    print("\nAt equal wasted-steps savings (patience frontier interpolated):")
    print("| predictive setting | wasted saved | its median regret | patience median regret at that saving |")
    print("|---|---|---|---|")
    for d, conf in PREDICT_SWEEP:
        m = results[("predict", d, conf)]
        print(f"| min_delta={d} conf={conf} | {100 * m['wasted_saved']:.1f}% | {m['regret_median']:.3f}% | "
              f"{frontier_regret(pat_points, m['wasted_saved']):.3f}% |")

    print("\nPer curve, headline predictive setting vs patience=12 min_delta=1e-4 (stop step, regret %):")
    print("| curve | budget | best step | predict stop | regret | patience stop | regret |")
    print("|---|---|---|---|---|---|---|")
    for c, pr in zip(curves, preds):
        i = stop_index(c, EarlyStopping(c["budget"], "predict", 0, *HEADLINE, predictor=Replay(pr)))
        j = stop_index(c, EarlyStopping(c["budget"], "patience", 0, 1e-4, patience=12, predictor=NoPrediction()))
        y = np.asarray(c["losses"])
        b = int(np.argmin(y[1:])) + 1
        reg = lambda k: 100 * (y[k] - y[b]) / y[b]  # noqa: E731
        print(f"| {c['name']} | {c['budget']} | {c['steps'][b]} | {c['steps'][i]} | {reg(i):.2f} | {c['steps'][j]} "
              f"| {reg(j):.2f} |")

    h = results[("predict", *HEADLINE)]
    print(f"\nHeadline (config defaults min_delta={HEADLINE[0]}, confidence={HEADLINE[1]}): steps saved "
          f"{100 * h['steps_saved']:.1f}%, wasted steps saved {100 * h['wasted_saved']:.1f}% (target >= 45%), "
          f"median regret {h['regret_median']:.3f}% (target <= 0.5%), patience at that saving "
          f"{frontier_regret(pat_points, h['wasted_saved']):.3f}%")
    print("\nFinal-loss prediction error (vs the curve's last validation loss):")
    print("\n".join(prediction_errors(curves, preds)))


if __name__ == "__main__":
    main()
