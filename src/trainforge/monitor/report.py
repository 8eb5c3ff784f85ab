"""``trainforge report RUN_DIR``: one self-contained HTML file of plots (PNG, base64
inside the page), readable in a browser without a server.

Plots, from RUN_DIR/metrics.jsonl: loss and validation loss, learning rate,
throughput (tokens/s and MFU), memory, communication share (and pipeline bubble),
gradient norm (global and per layer group), step phases; for a MoE model, MaxVio and the
load of every expert per MoE layer over training. A plot whose metrics the run does not
have says so instead of being left out silently (MoE plots appear only for MoE runs).
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

from trainforge.errors import TrainforgeError
from trainforge.monitor.jsonl import read_jsonl

MIB = 2 ** 20


def _series(records: list[dict[str, Any]], key: str, sub: str | None = None) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if sub is not None:
            v = v.get(sub) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _groups(records: list[dict[str, Any]], key: str) -> list[str]:
    names: dict[str, None] = {}
    for r in records:
        if isinstance(r.get(key), dict):
            names.update(dict.fromkeys(r[key]))
    return list(names)


def _plot(title: str, lines: list[tuple[str, list[int], list[float]]], ylabel: str, logy: bool = False,
          twin: tuple[str, list[int], list[float], str] | None = None) -> str | None:
    """PNG of the lines as base64, or None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(xs for _, xs, _ in lines):
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    for label, xs, ys in lines:
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy and all(y > 0 for _, _, ys in lines for y in ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None and twin[1]:
        ax2 = ax.twinx()
        ax2.plot(twin[1], twin[2], color="tab:red", linestyle="--", label=twin[0])
        ax2.set_ylabel(twin[3])
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if len(handles) > 1:
        ax.legend(handles, labels, fontsize=7, loc="best", ncol=2 if len(handles) > 6 else 1)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def build_plots(records: list[dict[str, Any]]) -> list[tuple[str, str | None, str]]:
    """(title, base64 PNG or None, what is missing) per plot, in report order."""
    train = [r for r in records if "loss" in r and "step" in r]
    val = [r for r in records if "val_loss" in r and "step" in r]
    plots = []

    def add(title, lines, ylabel, missing, **kw):
        plots.append((title, _plot(title, lines, ylabel, **kw), missing))

    add("Loss", [("train", *_series(train, "loss")), ("validation", *_series(val, "val_loss"))], "loss",
        "no loss records")
    add("Learning rate", [("lr", *_series(train, "lr"))], "learning rate", "no lr in the records")
    mfu = _series(train, "mfu")
    add("Throughput", [("tokens/s", *_series(train, "tokens_per_s"))], "tokens/s", "no tokens_per_s",
        twin=("MFU", mfu[0], [100 * v for v in mfu[1]], "MFU %"))
    mem = [(label, xs, [y / MIB for y in ys]) for label, (xs, ys) in (
        ("peak (max over ranks)", _series(train, "peak_memory_bytes")), ("RSS", _series(train, "rss_bytes")),
        ("GPU allocated", _series(train, "gpu_memory_allocated_bytes")),
        ("GPU reserved", _series(train, "gpu_memory_reserved_bytes")))]
    add("Memory", mem, "MiB", "no memory metrics")
    add("Communication share", [("in collectives", *_series(train, "comm_share")),
                                ("pipeline bubble", *_series(train, "bubble_fraction"))],
        "share of step time", "no comm_share (a single process has no collectives; runs before the monitor "
        "recorded it only for distributed runs)")
    norms = [("global, before clipping", *_series(train, "grad_norm"))]
    norms += [(f"{g} (after clipping)", *_series(train, "grad_norm_group", g)) for g in _groups(train, "grad_norm_group")]
    add("Gradient norm", norms, "L2 norm", "no grad_norm", logy=True)
    phases = [(name, *_series(train, key)) for name, key in (("step", "step_s"), ("forward", "forward_s"),
                                                             ("backward", "backward_s"), ("optimizer", "optimizer_s"),
                                                             ("data wait", "data_wait_s"))]
    add("Step phases", phases, "seconds", "no step timings (monitor.enabled = false?)")
    if any("moe_load" in r for r in train):  # MoE runs only (train/moe_balance.py)
        add("MoE load balance (MaxVio)", [("batch, mean over layers", *_series(train, "moe_maxvio_batch")),
                                          ("validation set, mean over layers", *_series(val, "moe_maxvio_global"))],
            "(max - mean) / mean load", "no moe_maxvio_batch")
        for layer, lines in enumerate(_expert_loads(train)):
            add(f"Expert load, MoE layer {layer}", lines, "tokens per step", "no moe_load")
    return plots


def _expert_loads(train: list[dict[str, Any]]) -> list[list[tuple[str, list[int], list[float]]]]:
    """Per MoE layer, one (label, steps, tokens per step) line per expert from ``moe_load``."""
    table: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    for r in train:
        for layer, loads in enumerate(r.get("moe_load") or ()):
            for expert, v in enumerate(loads):
                if isinstance(v, (int, float)) and math.isfinite(v):
                    xs, ys = table.setdefault((layer, expert), ([], []))
                    xs.append(r["step"])
                    ys.append(float(v))
    n_layers = 1 + max((layer for layer, _ in table), default=-1)
    return [[(f"expert {e}", *table[(layer, e)]) for (lay, e) in sorted(table) if lay == layer]
            for layer in range(n_layers)]


def _summary(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    ckpts = [r for r in records if "checkpoint_save_s" in r]
    rows = [("records", str(len(records))), ("steps", str(train[-1]["step"]) if train else "-")]
    if train:
        rows.append(("final training loss", f"{train[-1]['loss']:.4f}" if train[-1]["loss"] is not None else "nan"))
        tps = sorted(r["tokens_per_s"] for r in train if r.get("tokens_per_s"))
        if tps:
            rows.append(("median tokens/s", f"{tps[len(tps) // 2]:,.0f}"))
    if val:
        rows.append(("validation loss", f"{val[0]['val_loss']:.4f} -> {val[-1]['val_loss']:.4f}"))
    if ckpts:
        rows.append(("checkpoints", f"{len(ckpts)}, mean save {sum(r['checkpoint_save_s'] for r in ckpts) / len(ckpts):.2f} s"))
    return rows


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report; returns its path (default RUN_DIR/report.html)."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise TrainforgeError(f"{metrics} does not exist: is {run_dir} a trainforge run directory?")
    try:
        records = read_jsonl(metrics)
    except ValueError as e:
        raise TrainforgeError(f"{metrics} is not valid JSONL: {e}") from None
    out = Path(out) if out is not None else run_dir / "report.html"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>trainforge report: {html.escape(run_dir.name)}"
             "</title><style>body{font-family:sans-serif;max-width:1600px;margin:1em auto}"
             "figure{display:inline-block;margin:.5em}td,th{padding:2px 10px;text-align:left}</style></head><body>",
             f"<h1>trainforge run {html.escape(str(run_dir))}</h1><table>"]
    parts += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary(records)]
    parts.append("</table>")
    for title, png, missing in build_plots(records):
        if png is None:
            parts.append(f"<figure><figcaption>{html.escape(title)}: {html.escape(missing)}</figcaption></figure>")
        else:
            parts.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'></figure>")
    parts.append("</body></html>\n")
    out.write_text("".join(parts))
    return out
