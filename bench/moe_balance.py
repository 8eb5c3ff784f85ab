"""Expert load balance: four balancing methods trained the same way, through the real CLI.

    python bench/moe_balance.py                         # moe-tiny, 4 ways x 2 seeds, 2 at a time: ~40-60 min
    python bench/moe_balance.py --flavor moe-debug --steps 6 --seeds 1 --val_interval 3   # dry run, ~1 min
    python bench/moe_balance.py --summarize_only        # re-read the run directories, print the table

Each run is ``python -m trainforge train --model.flavor F ...`` on the built-in corpus (no
``--data.path``), the same seed, steps, batch and schedule for every way; only the
balancing keys differ:

==============  =====================  ===================  =======================
way             model.bias_update_rate  model.aux_loss_alpha  model.seq_aux_loss_alpha
==============  =====================  ===================  =======================
none            0                      0                    0
aux             0                      1e-3                 0
lossfree        1e-3                   0                    0
lossfree+seq    1e-3                   0                    1e-4
==============  =====================  ===================  =======================

What is read back from each run's ``metrics.jsonl`` (keys written by the balance component,
``train/moe_balance.py``):

* ``moe_maxvio_global`` (validation records): per MoE layer, (max load - mean load) / mean
  load over the whole fixed validation set, mean over layers (Wang et al. 2024, eq. 5). The
  headline is the value at the last validation (end of training).
* ``moe_maxvio_batch`` (training records): the same per training step's batch; reported as
  the mean over all steps and over the second half of training (after the router has
  had time to settle).
* ``val_loss`` at the end of training.

Seeds change the weights and the data order (``training.seed``); the seed-to-seed spread
of a way is |seed A - seed B| of its final ``val_loss``. Goals (issue 17): loss-free
MaxVio_global <= 0.15 and at most a third of the aux-loss run's, with its validation loss no
worse than the aux-loss run's beyond the seed-to-seed spread (the larger of the two ways'
spreads). Anchor, Wang et al. 2024 Table 2 (1B): aux loss MaxVio_global 0.72, loss-free 0.04.

``--parallel 2`` runs two trainings at once (one thread each): the two seeds of a way, so
they share the machine's load. A benchmark, not a test: it prints PASS/FAIL and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WAYS: dict[str, dict[str, float]] = {
    "none": {"bias_update_rate": 0.0, "aux_loss_alpha": 0.0, "seq_aux_loss_alpha": 0.0},
    "aux": {"bias_update_rate": 0.0, "aux_loss_alpha": 1e-3, "seq_aux_loss_alpha": 0.0},
    "lossfree": {"bias_update_rate": 1e-3, "aux_loss_alpha": 0.0, "seq_aux_loss_alpha": 0.0},
    "lossfree+seq": {"bias_update_rate": 1e-3, "aux_loss_alpha": 0.0, "seq_aux_loss_alpha": 1e-4},
    # Not in the default set: a faster bias for short runs (the bias moves at most gamma per step).
    "lossfree-gamma1e-2": {"bias_update_rate": 1e-2, "aux_loss_alpha": 0.0, "seq_aux_loss_alpha": 0.0},
}
DEFAULT_WAYS = ["none", "aux", "lossfree", "lossfree+seq"]
GOAL_MAXVIO = 0.15
GOAL_FRACTION_OF_AUX = 1 / 3
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="moe-tiny")
    p.add_argument("--ways", nargs="+", default=DEFAULT_WAYS, choices=list(WAYS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--val_interval", type=int, default=40)
    p.add_argument("--val_batches", type=int, default=16)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training run")
    p.add_argument("--parallel", type=int, default=2, help="trainings run at once")
    p.add_argument("--out_dir", default="/tmp/moe_balance")
    p.add_argument("--summarize_only", action="store_true", help="only read existing run directories")
    p.add_argument("--json", help="also write the summary here")
    return p.parse_args(argv)


def run_dir(args: argparse.Namespace, way: str, seed: int) -> Path:
    return Path(args.out_dir) / f"{way.replace('+', '_')}-seed{seed}"


def command(args: argparse.Namespace, way: str, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "trainforge", "train", "--model.flavor", args.flavor,
           "--training.steps", str(args.steps), "--training.batch_size", str(args.batch_size),
           "--training.seq_len", str(args.seq_len), "--training.seed", str(seed),
           "--training.val_interval", str(args.val_interval), "--training.val_batches", str(args.val_batches),
           "--training.log_interval", str(args.log_interval), "--training.threads", str(args.threads),
           "--training.device", "cpu", "--run_dir", str(run_dir(args, way, seed)), "--no_sample"]
    for key, value in WAYS[way].items():
        cmd += [f"--model.{key}", repr(value)]
    return cmd


def run_all(args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    jobs = [(w, s) for w in args.ways for s in args.seeds]
    running: list[tuple[str, int, subprocess.Popen, float, object]] = []
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    while jobs or running:
        while jobs and len(running) < args.parallel:
            way, seed = jobs.pop(0)
            d = run_dir(args, way, seed)
            if (d / "metrics.jsonl").exists():
                raise SystemExit(f"{d} exists: remove it, or pass --summarize_only to read it")
            d.parent.mkdir(parents=True, exist_ok=True)
            log = open(Path(args.out_dir) / f"{d.name}.log", "w")
            print(f"{time.strftime('%H:%M:%S')} start {way} seed {seed}: {' '.join(command(args, way, seed)[1:])}",
                  flush=True)
            running.append((way, seed, subprocess.Popen(command(args, way, seed), env=env, stdout=log,
                                                        stderr=subprocess.STDOUT), time.time(), log))
        time.sleep(2)
        for item in list(running):
            way, seed, proc, t0, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                print(f"{time.strftime('%H:%M:%S')} done  {way} seed {seed}: exit {proc.returncode}, "
                      f"{time.time() - t0:.0f} s", flush=True)


def read_run(d: Path) -> dict:
    """The balance figures of one run directory's metrics.jsonl."""
    train, val = [], []
    for line in (d / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            val.append(rec)
        elif "loss" in rec:
            train.append(rec)
    batch = [(r["step"], r["moe_maxvio_batch"]) for r in train if r.get("moe_maxvio_batch") is not None]
    glob = [(r["step"], r["moe_maxvio_global"]) for r in val if r.get("moe_maxvio_global") is not None]
    last_step = train[-1]["step"] if train else 0
    second_half = [v for s, v in batch if s > last_step / 2]
    return {
        "steps": last_step,
        "val_loss": val[-1]["val_loss"] if val else float("nan"),
        "maxvio_global": glob[-1][1] if glob else float("nan"),
        "maxvio_global_curve": glob,
        "maxvio_global_layers": next((r.get("moe_maxvio_global_layers") for r in reversed(val)
                                      if r.get("moe_maxvio_global_layers") is not None), None),
        "maxvio_batch_mean": statistics.fmean(v for _, v in batch) if batch else float("nan"),
        "maxvio_batch_2nd_half": statistics.fmean(second_half) if second_half else float("nan"),
        "maxvio_batch_last": batch[-1][1] if batch else float("nan"),
        "aux_loss_last": next((r["moe_aux_loss"] for r in reversed(train) if "moe_aux_loss" in r), None),
        "bias_spread_last": next((r["moe_bias_spread"] for r in reversed(train) if "moe_bias_spread" in r), None),
        "train_loss_last": train[-1]["loss"] if train else float("nan"),
    }


def summarize(args: argparse.Namespace) -> dict:
    runs = {w: {s: read_run(run_dir(args, w, s)) for s in args.seeds
                if (run_dir(args, w, s) / "metrics.jsonl").exists()} for w in args.ways}
    rows = {}
    for w, by_seed in runs.items():
        if not by_seed:
            continue
        vals = list(by_seed.values())

        def mean(key: str) -> float:
            return statistics.fmean(r[key] for r in vals)
        losses = [r["val_loss"] for r in vals]
        rows[w] = {"seeds": list(by_seed), "maxvio_global": mean("maxvio_global"),
                   "maxvio_batch_mean": mean("maxvio_batch_mean"),
                   "maxvio_batch_2nd_half": mean("maxvio_batch_2nd_half"),
                   "val_loss": mean("val_loss"), "val_loss_spread": max(losses) - min(losses), "per_seed": by_seed}
    return rows


def verdict(rows: dict) -> dict:
    if "lossfree" not in rows or "aux" not in rows:
        return {"verdict": "n/a (needs the aux and lossfree ways)"}
    lf, aux = rows["lossfree"], rows["aux"]
    spread = max(lf["val_loss_spread"], aux["val_loss_spread"])
    checks = {
        f"lossfree MaxVio_global <= {GOAL_MAXVIO}": lf["maxvio_global"] <= GOAL_MAXVIO,
        "lossfree MaxVio_global <= aux / 3": lf["maxvio_global"] <= aux["maxvio_global"] * GOAL_FRACTION_OF_AUX,
        "lossfree val_loss <= aux val_loss + seed spread": lf["val_loss"] <= aux["val_loss"] + spread,
    }
    return {"checks": checks, "seed_spread": spread,
            "verdict": "PASS" if all(checks.values()) else "FAIL"}


def print_report(args: argparse.Namespace, rows: dict, v: dict) -> None:
    print(f"\n{args.flavor}, {args.steps} steps of {args.batch_size}x{args.seq_len} tokens, seeds {args.seeds}, "
          f"validation every {args.val_interval} steps ({args.val_batches} batches)")
    print("\n| way | MaxVio_global (end) | MaxVio_batch mean (all steps) | MaxVio_batch mean (2nd half) "
          "| val loss (end) | seed spread |")
    print("|---|---:|---:|---:|---:|---:|")
    for w, r in rows.items():
        print(f"| {w} | {r['maxvio_global']:.3f} | {r['maxvio_batch_mean']:.3f} | {r['maxvio_batch_2nd_half']:.3f} "
              f"| {r['val_loss']:.4f} | {r['val_loss_spread']:.4f} |")
    print("\nper seed (MaxVio_global at each validation step):")
    for w, r in rows.items():
        for s, one in r["per_seed"].items():
            curve = ", ".join(f"{st}: {g:.3f}" for st, g in one["maxvio_global_curve"])
            print(f"  {w} seed {s}: val_loss {one['val_loss']:.4f}, MaxVio_global {one['maxvio_global']:.3f}, "
                  f"MaxVio_batch mean {one['maxvio_batch_mean']:.3f} / 2nd half {one['maxvio_batch_2nd_half']:.3f} "
                  f"/ last {one['maxvio_batch_last']:.3f}; global curve [{curve}]")
    for name, ok in v.get("checks", {}).items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"verdict: {v['verdict']}" + (f" (seed spread {v['seed_spread']:.4f})" if "seed_spread" in v else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    if not args.summarize_only:
        print(f"load average before: {os.getloadavg()}", flush=True)
        run_all(args)
        print(f"load average after: {os.getloadavg()}; {(time.time() - t0) / 60:.1f} min", flush=True)
    rows = summarize(args)
    v = verdict(rows)
    print_report(args, rows, v)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "verdict": v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
