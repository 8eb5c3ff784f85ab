"""Drawing for ``trainforge report``: one PNG per plot (matplotlib, Agg), runs overlaid.

A plot holds lines, each one series of one run. Colour tells the runs apart (one colour
per run, the same in every plot), line style the series within a run (train/validation,
the memory kinds, the step phases). With a single run colour goes to the series instead,
since there is no run to tell apart, and so does a plot of one run's many series (the
layer groups' gradient norms, the experts' loads), whose title names the run.

Smoothing is TensorBoard's: a debiased exponential moving average over the points in
order (``ema``); the raw line stays behind the smoothed one, faint, so a spike is never
hidden. Hand-written because matplotlib has none and pandas' ``ewm`` would be a
dependency for six lines.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass, field

RAW_ALPHA = 0.25  # the unsmoothed line drawn behind a smoothed one
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


@dataclass
class Line:
    """One series of one run: ``xs`` (steps or seconds) and ``ys`` of equal length."""

    run: str
    series: str
    xs: list[float]
    ys: list[float]
    smooth: bool = True  # False: deterministic or sparse series (learning rate, validation loss)


@dataclass
class Plot:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    logy: bool = False
    one_run: bool = False  # a plot of one run's many series (layer groups, experts): colour per series

    def labels(self, n_runs: int) -> list[str]:
        """The legend entries, one per line: the run's name (several runs), the series'
        (one run), or both when several runs each draw several series."""
        series = {ln.series for ln in self.lines}
        if n_runs == 1 or self.one_run:
            return [ln.series or ln.run for ln in self.lines]
        if len(series) == 1:
            return [ln.run for ln in self.lines]
        return [f"{ln.run}: {ln.series}" if ln.series else ln.run for ln in self.lines]


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: ``last = weight * last + (1 - weight) * v``, from 0, divided
    by ``1 - weight ** n`` (the debias: without it the first points are pulled to 0).
    ``weight`` in [0, 1); 0 returns the values unchanged. Non-finite values pass through
    and do not enter the average (TensorBoard does the same)."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} must be in [0, 1)")
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = weight * last + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight ** n))
    return out


def render(plot: Plot, runs: list[str], xlabel: str, smooth: float = 0.0) -> str:
    """``plot`` as a base64 PNG. ``runs``: every run of the report in order, so a run keeps
    its colour in plots it is missing from; ``smooth``: the EMA weight for lines that
    allow it (0 = off)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    series = list(dict.fromkeys(ln.series for ln in plot.lines))
    for line, label in zip(plot.lines, plot.labels(len(runs))):
        if len(runs) == 1 or plot.one_run:
            colour, style = f"C{series.index(line.series) % 10}", "-"
        else:
            colour = f"C{runs.index(line.run) % 10}"
            style = LINESTYLES[series.index(line.series) % len(LINESTYLES)]
        marker = "o" if len(line.xs) < 30 else None
        if smooth and line.smooth and len(line.xs) > 1:
            ax.plot(line.xs, line.ys, color=colour, linestyle=style, alpha=RAW_ALPHA, linewidth=1)
            ax.plot(line.xs, ema(line.ys, smooth), color=colour, linestyle=style, label=label)
        else:
            ax.plot(line.xs, line.ys, color=colour, linestyle=style, label=label, marker=marker, markersize=3)
    ax.set(title=plot.title, xlabel=xlabel, ylabel=plot.ylabel)
    if plot.logy and all(y > 0 for ln in plot.lines for y in ln.ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(plot.lines) > 1 or len(runs) > 1:
        ax.legend(fontsize=7, loc="best", ncol=2 if len(plot.lines) > 6 else 1)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()
