"""Collect real validation-loss curves from trainforge's own trainer: the evaluation set
of ``bench/early_stopping.py``.

Prepares four small datasets from different parts of the Python standard library
(vocab 512; the smallest overfit within the step budget), then trains a grid of small
models through the real CLI (``python -m trainforge train``) with frequent
validation, varying width/depth, learning rate, LR schedule, dataset and seed. Each
finished run becomes ``bench/curves/<name>.json``: the run's CLI overrides, its step
budget, the validation curve [[step, val_loss], ...] (step 0 included) and the
training loss every log interval. Existing files are kept, so an interrupted
collection continues where it stopped.

    python bench/collect_curves.py                 # the whole grid, 2 runs at a time
    python bench/collect_curves.py --workers 1 --only tiny

Runs single-threaded processes (``--training.threads 1``, OMP_NUM_THREADS=1); about
12-15 minutes of CPU for the whole grid on a laptop core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CURVES_DIR = Path(__file__).parent / "curves"

# name -> stdlib paths (files or directories of .py files); a document is one file.
DATASETS = {
    "email": ["email", "email/mime"],
    "asyncio": ["asyncio"],
    "mix": ["json", "concurrent/futures", "http", "importlib", "csv.py", "textwrap.py", "shlex.py", "glob.py"],
    "tiny": ["xml/dom", "fnmatch.py", "bisect.py", "heapq.py", "colorsys.py", "getopt.py"],
}

# (dim, n_layers, ffn_hidden_dim): the debug flavor's 64 x 2 and two larger variants.
SHAPES = {"s": (64, 2, 176), "m": (96, 3, 256), "l": (128, 4, 344)}


def grid() -> list[dict]:
    """The runs: name, dataset, shape, lr, schedule, seed, steps. Chosen to cover
    converging curves (big datasets, low LR), overfitting ones (tiny data, big model)
    and every schedule; 36 runs."""
    runs = []
    combos = [
        # dataset, shape, lr, schedule, steps
        ("email", "s", 1e-3, "cosine", 800), ("email", "m", 3e-3, "wsd", 800), ("email", "l", 3e-4, "linear", 800),
        ("email", "m", 1e-3, "constant", 800), ("email", "l", 3e-3, "cosine", 1000), ("email", "s", 3e-3, "linear", 600),
        ("asyncio", "s", 3e-3, "cosine", 800), ("asyncio", "m", 1e-3, "wsd", 1000), ("asyncio", "l", 1e-3, "linear", 800),
        ("asyncio", "m", 3e-4, "constant", 600), ("asyncio", "l", 3e-3, "constant", 600), ("asyncio", "s", 1e-3, "linear", 1200),
        ("mix", "m", 3e-3, "cosine", 1000), ("mix", "l", 1e-3, "wsd", 1000), ("mix", "s", 3e-3, "constant", 800),
        ("mix", "l", 3e-4, "cosine", 600), ("mix", "m", 1e-3, "linear", 1200), ("mix", "s", 1e-3, "wsd", 600),
        ("tiny", "l", 3e-3, "cosine", 800), ("tiny", "m", 3e-3, "constant", 600), ("tiny", "l", 1e-3, "wsd", 1000),
        ("tiny", "s", 3e-3, "linear", 800), ("tiny", "m", 1e-3, "cosine", 1200), ("tiny", "l", 3e-4, "constant", 800),
    ]
    for i, (data, shape, lr, sched, steps) in enumerate(combos):
        seeds = (1, 2) if i % 2 == 0 else (1,)  # every other config twice: seed-to-seed spread
        for seed in seeds:
            runs.append({"name": f"{data}-{shape}-lr{lr:g}-{sched}-s{seed}", "dataset": data, "shape": shape,
                         "lr": lr, "schedule": sched, "seed": seed, "steps": steps})
    return runs


def prepare_datasets(work: Path) -> dict[str, Path]:
    from trainforge.data.prepare import PrepareOptions, prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for name, parts in DATASETS.items():
        dest = work / "data" / name
        if not (dest / "manifest.json").is_file():
            files = []
            for part in parts:
                p = stdlib / part
                files += sorted(str(f) for f in p.glob("*.py")) if p.is_dir() else [str(p)]
            prepare(files, dest, PrepareOptions(vocab_size=512, val_fraction=0.2), log=lambda *_: None)
        out[name] = dest
    return out


def overrides(run: dict, data: Path) -> list[str]:
    dim, layers, ffn = SHAPES[run["shape"]]
    steps = run["steps"]
    return ["--data.path", str(data), "--model.flavor", "debug", "--model.dim", str(dim),
            "--model.n_layers", str(layers), "--model.ffn_hidden_dim", str(ffn),
            "--training.steps", str(steps), "--training.lr", str(run["lr"]),
            "--training.lr_schedule", run["schedule"], "--training.warmup_steps", str(steps // 20),
            "--training.decay_ratio", "0.2", "--training.seed", str(run["seed"]),
            "--training.batch_size", "8", "--training.seq_len", "64",
            "--training.val_interval", str(max(10, steps // 60)), "--training.val_batches", "4",
            "--training.log_interval", "20", "--training.threads", "1",
            "--checkpoint.interval", "0", "--checkpoint.keep_last", "1", "--sample.max_new_tokens", "0"]


def collect(run: dict, data: Path, work: Path) -> str:
    dest = CURVES_DIR / f"{run['name']}.json"
    if dest.is_file():
        return f"{run['name']}: kept"
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=run["name"] + "-"))
    args = overrides(run, data)
    cmd = [sys.executable, "-m", "trainforge", "train", "--run_dir", str(run_dir / "run"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return f"{run['name']}: FAILED rc {r.returncode}\n{r.stderr[-2000:]}"
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    train = [[r["step"], r["loss"]] for r in records if "loss" in r and r["step"] % 20 == 0]
    manifest = json.loads((data / "manifest.json").read_text())
    tokens = {s: sum(e["tokens"] for e in manifest["splits"][s]) for s in ("train", "val")}
    CURVES_DIR.mkdir(exist_ok=True)
    dest.write_text(json.dumps({
        "name": run["name"], "run": run, "overrides": args[2:], "budget_steps": run["steps"],
        "dataset_tokens": tokens, "wall_s": round(time.perf_counter() - t0, 1),
        "val_curve": val, "train_curve": train}, separators=(",", ":")) + "\n")
    return f"{run['name']}: {len(val)} points, best {min(v for _, v in val):.4f}, last {val[-1][1]:.4f}, " \
           f"{time.perf_counter() - t0:.0f}s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="training processes at once")
    p.add_argument("--work", default=None, help="scratch directory for datasets and runs (default: a temp dir)")
    p.add_argument("--only", default=None, help="only runs whose name contains this")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="trainforge-curves-"))
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_datasets(work)
    runs = [r for r in grid() if a.only is None or a.only in r["name"]]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.workers) as pool:
        for line in pool.map(lambda r: collect(r, data[r["dataset"]], work), runs):
            print(line, flush=True)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f}s; curves in {CURVES_DIR}")


if __name__ == "__main__":
    main()
