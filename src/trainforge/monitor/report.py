"""``trainforge report RUN [RUN...]``: one self-contained HTML file of plots (PNG, base64
inside the page), readable in a browser without a server.

Plots, from each RUN/metrics.jsonl, the runs overlaid (one colour per run): loss and
validation loss, learning rate, tokens/s, MFU, memory, power, energy per token and memory
bandwidth (per domain or source, where recorded), communication share (and pipeline
bubble), gradient norm, step phases; per run, the gradient norm of each layer group; for
a MoE model, MaxVio and the load of every expert per MoE layer. A plot none of the runs
has data for, or whose every value is zero (communication share in a single process), is
left out and named in a list at the bottom. Above the plots: a table per run (steps,
losses, throughput, the MFU peak and its source, median energy per token, or that no
energy counter was readable, and memory bandwidth) and the config: with several runs the
keys of RUN/config.toml whose values differ, with one run all of it.

The x axis is the step, or (``x="time"``) the wall-clock time since the run's first step:
from each record's ``time_unix_s`` (the trainer's clock at the end of the logging window;
a resumed run's pause shows as a gap). Runs written before that key existed are rebuilt
from what they carry: tokens_per_s is measured over each logging window, so one step takes
tokens_per_step / tokens_per_s seconds; summed, that is the windows' wall time (checkpoint
saves left out, as the trainer's throughput leaves them out), else the monitor's per-step
``step_s`` summed.
"""

from __future__ import annotations

import bisect
import html
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from trainforge.errors import TrainforgeError
from trainforge.monitor.jsonl import is_number as _num
from trainforge.monitor.jsonl import read_jsonl
from trainforge.monitor.report_config import config_html, read_config, table
from trainforge.monitor.report_plots import Line, Plot, render

MIB = 2 ** 20
X_AXES = ("step", "time")
COMPARE_FILE = "report-compare.html"  # several runs without --out: in the first run's directory


@dataclass
class Run:
    """One run directory, read: ``name`` is the legend label (unique within a report),
    ``config`` the flattened config.toml (``section.key`` -> value as JSON text; None
    when the run has no config.toml), ``elapsed_s`` step -> training seconds."""

    name: str
    path: Path
    records: list[dict[str, Any]]
    config: dict[str, str] | None
    elapsed_s: dict[int, float] | None

    @cached_property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "loss" in r and "step" in r]

    @cached_property
    def timed_steps(self) -> list[int]:
        return sorted(self.elapsed_s or ())

    @cached_property
    def val(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "val_loss" in r and "step" in r]


# -- reading runs ------------------------------------------------------------------------

def _elapsed_s(train: list[dict[str, Any]]) -> dict[int, float] | None:
    """step -> seconds at the end of that step since the run's first step (see the module
    docstring), or None when the records carry no clock, no tokens_per_s with tokens and
    no step_s."""
    def num(v: Any) -> bool:
        return _num(v) and v > 0

    out: dict[int, float] = {}
    t, prev = 0.0, 0
    if train and all(num(r.get("tokens_per_s")) and num(r.get("tokens")) and r["step"] > 0 for r in train):
        for r in train:  # tokens = step * tokens_per_step (trainer._log_window)
            t += (r["tokens"] / r["step"]) * (r["step"] - prev) / r["tokens_per_s"]
            out[r["step"]], prev = t, r["step"]
    elif train and all(num(r.get("step_s")) for r in train):
        for r in train:
            t += r["step_s"]
            out[r["step"]] = t
    if train and all(num(r.get("time_unix_s")) for r in train):
        # The clock from the first record on; before it, that record's window as rebuilt (or 0).
        start = train[0]["time_unix_s"] - out.get(train[0]["step"], 0.0)
        return {r["step"]: r["time_unix_s"] - start for r in train}
    return out or None


def _clocked(run: Run) -> bool:
    return bool(run.train) and all("time_unix_s" in r for r in run.train)


def _names(paths: list[Path]) -> list[str]:
    """Each run's directory name; equal names get parent directories prepended until they
    differ (``a/run``, ``b/run``); the same directory twice gets ``#2``."""
    names = []
    for i, p in enumerate(paths):
        depth = 1
        while depth < len(p.parts) and any(q != p and q.parts[-depth:] == p.parts[-depth:] for q in paths):
            depth += 1
        name = "/".join(p.parts[-depth:]) or str(p)
        copies = sum(1 for q in paths[:i] if q == p)
        names.append(f"{name} #{copies + 1}" if copies else name)
    return names


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """Read each run directory; a missing directory, metrics.jsonl or a broken file is a
    TrainforgeError naming the path."""
    paths = [Path(d) for d in run_dirs]
    for p in paths:
        if not p.is_dir():
            raise TrainforgeError(f"run directory {p} does not exist (give the --run_dir of a trainforge train run)")
        if not (p / "metrics.jsonl").is_file():
            raise TrainforgeError(f"{p / 'metrics.jsonl'} does not exist: is {p} a trainforge run directory?")
    runs = []
    for p, name in zip(paths, _names([p.resolve() for p in paths])):
        try:
            records = read_jsonl(p / "metrics.jsonl")
        except ValueError as e:
            raise TrainforgeError(f"{p / 'metrics.jsonl'} is not valid JSONL: {e}") from None
        run = Run(name, p, records, read_config(p / "config.toml"), None)
        run.elapsed_s = _elapsed_s(run.train)
        runs.append(run)
    return runs


# -- what is plotted ---------------------------------------------------------------------

def _x(run: Run, step: int, x: str) -> float:
    if x == "step":
        return step
    if not run.elapsed_s:  # no training record yet (validation at step 0 only)
        return 0.0
    if step in run.elapsed_s:
        return run.elapsed_s[step]
    i = bisect.bisect_right(run.timed_steps, step)  # a validation record: the time of the last step done by then
    return run.elapsed_s[run.timed_steps[i - 1]] if i else 0.0


def _series(run: Run, records: list[dict[str, Any]], key: str, x: str, sub: str | None = None,
            scale: float = 1.0) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if sub is not None:
            v = v.get(sub) if isinstance(v, dict) else None
        if _num(v):
            xs.append(_x(run, r["step"], x))
            ys.append(float(v) * scale)
    return xs, ys


def _groups(records: list[dict[str, Any]], key: str) -> list[str]:
    names: dict[str, None] = {}
    for r in records:
        if isinstance(r.get(key), dict):
            names.update(dict.fromkeys(r[key]))
    return list(names)


def _expert_loads(train: list[dict[str, Any]]) -> list[list[tuple[str, list[int], list[float]]]]:
    """Per MoE layer, one (label, steps, tokens per step) line per expert from ``moe_load``."""
    table: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    for r in train:
        for layer, loads in enumerate(r.get("moe_load") or ()):
            for expert, v in enumerate(loads):
                if _num(v):
                    xs, ys = table.setdefault((layer, expert), ([], []))
                    xs.append(r["step"])
                    ys.append(float(v))
    n_layers = 1 + max((layer for layer, _ in table), default=-1)
    return [[(f"expert {e}", *table[(lay, e)]) for (lay, e) in sorted(table) if lay == layer]
            for layer in range(n_layers)]


# (series label, record key) of the plots with several series per run
MEMORY = (("peak (max over ranks)", "peak_memory_bytes"), ("RSS", "rss_bytes"),
          ("GPU allocated", "gpu_memory_allocated_bytes"), ("GPU reserved", "gpu_memory_reserved_bytes"))
# (title, y label, record key {label: value}, scale) of the energy and bandwidth plots (energy.py); a key
# this machine had no counter for is absent from the records, so its plot is listed as not recorded
ENERGY_PLOTS = (("Power", "watts", "power_w", 1.0), ("Energy per token", "joules per token", "energy_per_token_j", 1.0),
                ("Memory bandwidth", "GB/s (source in the legend)", "memory_bandwidth_bytes_per_s", 1e-9))
PHASES = (("step", "step_s"), ("forward", "forward_s"), ("backward", "backward_s"), ("optimizer", "optimizer_s"),
          ("data wait", "data_wait_s"))


def build_plots(runs: list[Run], x: str = "step") -> tuple[list[Plot], list[str]]:
    """The plots with something to draw, in report order, and the names of those left
    out (no run has the metric, or every value is zero), e.g. ``"Communication share:
    pipeline bubble (all zero)"``. A zero line is dropped from a plot that keeps others."""
    if x not in X_AXES:
        raise TrainforgeError(f"--x {x}: choose one of {', '.join(X_AXES)}")
    if x == "time":
        for run in runs:
            if run.train and run.elapsed_s is None:
                raise TrainforgeError(f"{run.path / 'metrics.jsonl'} has neither time_unix_s nor tokens_per_s nor "
                                      "step_s to place its steps in time; use --x step")
    plots: list[Plot] = []
    left_out: list[str] = []

    def add(title: str, ylabel: str, lines: list[Line], logy: bool = False, one_run: bool = False) -> None:
        drawn = [ln for ln in lines if ln.xs and any(y != 0 for y in ln.ys)]
        if not any(ln.xs for ln in lines):
            left_out.append(f"{title} (not recorded)")
        elif not drawn:
            left_out.append(f"{title} (all zero)")
        else:
            plots.append(Plot(title, ylabel, drawn, logy, one_run))
            zero = [ln for ln in lines if ln.xs and not any(y != 0 for y in ln.ys)]
            left_out.extend(f"{title}: {', '.join(s for s in (ln.series, ln.run if len(runs) > 1 else '') if s)} "
                            "(all zero)" for ln in zero)

    def each(specs: Sequence[tuple]) -> list[Line]:
        """Per run, a line per (series label, record key[, scale[, smooth]]) of the training records."""
        lines = []
        for run in runs:
            for series, key, *rest in specs:
                scale = rest[0] if rest else 1.0
                smooth = rest[1] if len(rest) > 1 else True
                lines.append(Line(run.name, series, *_series(run, run.train, key, x, scale=scale), smooth=smooth))
        return lines

    loss = []
    for run in runs:
        loss.append(Line(run.name, "train", *_series(run, run.train, "loss", x)))
        loss.append(Line(run.name, "validation", *_series(run, run.val, "val_loss", x), smooth=False))
    add("Loss", "loss", loss)
    add("Learning rate", "learning rate", each((("lr", "lr", 1.0, False),)))
    add("Throughput", "tokens/s", each((("tokens/s", "tokens_per_s"),)))
    add("MFU", "MFU %", each((("MFU", "mfu", 100.0),)))
    add("Memory", "MiB", each(tuple((s, k, 1 / MIB, False) for s, k in MEMORY)))
    for title, ylabel, key, scale in ENERGY_PLOTS:
        add(title, ylabel, [Line(run.name, sub, *_series(run, run.train, key, x, sub=sub, scale=scale))
                            for run in runs for sub in _groups(run.train, key)])
    add("Communication share", "share of step time",
        each((("in collectives", "comm_share"), ("pipeline bubble", "bubble_fraction"))))
    if any("seq_len" in r for run in runs for r in run.train):  # training.seq_len_schedule = linear or auto
        add("Sequence length", "tokens per sequence", each((("seq_len", "seq_len", 1.0, False),)))
    add("Gradient norm", "L2 norm", each((("global, before clipping", "grad_norm"),)), logy=True)
    for run in runs:  # one plot per run: layer groups times runs would be too many lines to read
        groups = _groups(run.train, "grad_norm_group")
        if groups:
            title = "Gradient norm per layer group" + (f": {run.name}" if len(runs) > 1 else "")
            add(title, "L2 norm (after clipping)",
                [Line(run.name, g, *_series(run, run.train, "grad_norm_group", x, sub=g)) for g in groups], logy=True,
                one_run=True)
    add("Step phases", "seconds", each(PHASES))
    if any("moe_load" in r for run in runs for r in run.train):  # MoE runs only (train/moe_balance.py)
        maxvio = []
        for run in runs:
            maxvio.append(Line(run.name, "batch, mean over layers", *_series(run, run.train, "moe_maxvio_batch", x)))
            maxvio.append(Line(run.name, "validation set, mean over layers",
                               *_series(run, run.val, "moe_maxvio_global", x), smooth=False))
        add("MoE load balance (MaxVio)", "(max - mean) / mean load", maxvio)
        for run in runs:
            for layer, experts in enumerate(_expert_loads(run.train)):
                title = f"Expert load, MoE layer {layer}" + (f": {run.name}" if len(runs) > 1 else "")
                add(title, "tokens per step",
                    [Line(run.name, label, [_x(run, s, x) for s in xs], ys) for label, xs, ys in experts],
                    one_run=True)
    return plots, left_out


# -- the page ----------------------------------------------------------------------------

def _flops(v: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v:.3g} FLOP/s"


def _summary(run: Run) -> dict[str, str]:
    train, val = run.train, run.val
    ckpts = [r for r in run.records if "checkpoint_save_s" in r]
    rows = {"directory": str(run.path), "records": str(len(run.records)),
            "steps": str(train[-1]["step"]) if train else "-"}
    if train:
        rows["final training loss"] = f"{train[-1]['loss']:.4f}" if _num(train[-1]["loss"]) else "nan"
        tps = sorted(r["tokens_per_s"] for r in train if _num(r.get("tokens_per_s")))
        if tps:
            rows["median tokens/s"] = f"{tps[len(tps) // 2]:,.0f}"
    if run.elapsed_s:
        rows["training time"] = f"{max(run.elapsed_s.values()):.1f} s"
    if val:
        rows["validation loss"] = f"{val[0]['val_loss']:.4f} -> {val[-1]['val_loss']:.4f}"
    if ckpts:
        rows["checkpoints"] = f"{len(ckpts)}, mean save {sum(r['checkpoint_save_s'] for r in ckpts) / len(ckpts):.2f} s"
    if train:
        # metrics.jsonl is rank 0's: with more ranks its GPU (and node) are a share of the job's energy
        world = math.prod((train[-1].get("parallel_degree") or {}).values() or [1])
        label = "energy per token (median)" if world == 1 else f"energy per token (median, rank 0 of {world})"
        rows[label] = _median_of(train, "energy_per_token_j", "{:.3g} J") or \
            "not recorded (no energy counter readable: NVML or RAPL powercap)"
        if bandwidth := _median_of(train, "memory_bandwidth_bytes_per_s", "{:.3g} GB/s", 1e-9):
            rows["memory bandwidth (median)"] = bandwidth
    peak = [r for r in train if _num(r.get("mfu_peak_flops"))]
    if peak:  # the last record's: the peak may be re-probed during the run
        rows["MFU peak"] = _flops(peak[-1]["mfu_peak_flops"])
        if peak[-1].get("mfu_peak_source"):
            rows["MFU peak source"] = str(peak[-1]["mfu_peak_source"])
    return rows


def _median_of(train: list[dict[str, Any]], key: str, fmt: str, scale: float = 1.0) -> str:
    """``"package 0.12 J, dram 0.01 J"``: the median of each label of a ``{label: number}``
    record key over the training records; "" when none has it."""
    parts = []
    for label in _groups(train, key):
        vals = sorted(r[key][label] for r in train if isinstance(r.get(key), dict) and _num(r[key].get(label)))
        if vals:
            parts.append(f"{label} {fmt.format(vals[len(vals) // 2] * scale)}")
    return ", ".join(parts)


STYLE = ("body{font-family:sans-serif;max-width:1600px;margin:1em auto;padding:0 1em}"
         ".plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:.5em}"
         "figure{margin:0}figure img{width:100%;height:auto}"
         "td,th{padding:2px 10px;text-align:left;vertical-align:top}table.config td{font-family:monospace}"
         ".unset{color:#999}details{margin:.5em 0}")


def write_report(run_dirs: str | Path | Sequence[str | Path], out: str | Path | None = None, smooth: float = 0.0,
                 x: str = "step") -> Path:
    """Write the report of one or several runs and return its path: ``out``, else
    RUN/report.html for one run and FIRST_RUN/report-compare.html for several.
    ``smooth``: TensorBoard's EMA weight in [0, 1) (0 = raw); ``x``: "step" or "time"."""
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise TrainforgeError("no run directory given")
    if not 0.0 <= smooth < 1.0:
        raise TrainforgeError(f"--smooth {smooth}: the EMA weight must be in [0, 1) "
                              "(0 = off; TensorBoard's default 0.6; 0.9-0.99 for a noisy loss)")
    runs = load_runs(run_dirs)
    plots, left_out = build_plots(runs, x)
    if out is None:
        out = runs[0].path / ("report.html" if len(runs) == 1 else COMPARE_FILE)
    out = Path(out)
    names = [run.name for run in runs]
    longest = max((max(run.elapsed_s.values()) for run in runs if run.elapsed_s), default=0.0)
    minutes = x == "time" and longest > 600
    xlabel = "step" if x == "step" else f"training time ({'min' if minutes else 's'})"
    e = html.escape
    title = str(runs[0].path) if len(runs) == 1 else " vs ".join(names)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>trainforge report: {e(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>trainforge {'run' if len(runs) == 1 else 'runs'} {e(title)}</h1>"]
    summaries = [_summary(run) for run in runs]
    rows = list(dict.fromkeys(k for s in summaries for k in s))
    parts.append(table(names, [(k, [s.get(k, "-") for s in summaries]) for k in rows]))
    parts.append(config_html(names, [run.config for run in runs]))
    notes = [f"smoothed: EMA weight {smooth:g} (raw values faint behind)" if smooth else "",
             f"x: wall-clock time in {'minutes' if minutes else 'seconds'} since the first step"
             + ("" if all(_clocked(run) for run in runs) else " (runs without time_unix_s: rebuilt from their "
                "tokens/s, else step_s, checkpoint saves left out)") if x == "time" else ""]
    parts.append(f"<h2>Plots</h2><p>{e('; '.join(n for n in notes if n))}</p>")
    parts.append("<div class='plots'>")
    for plot in plots:
        if minutes:
            for ln in plot.lines:
                ln.xs = [v / 60 for v in ln.xs]
        parts.append(f"<figure><img alt='{e(plot.title)}' "
                     f"src='data:image/png;base64,{render(plot, names, xlabel, smooth)}'></figure>")
    parts.append("</div>")
    if left_out:
        parts.append(f"<p class='left-out'>not recorded or all zero in {'this run' if len(runs) == 1 else 'these runs'}"
                     f": {e('; '.join(left_out))}</p>")
    parts.append("</body></html>\n")
    out.write_text("".join(parts))
    return out
