"""``optimizer.weight_decay_schedule`` (a late increase of weight decay) against constant
decay: the real trainer on the built-in corpus, same flavor, steps, LR schedule and data,
over several seeds.

    OMP_NUM_THREADS=1 python -m bench.wd_schedule --flavor tiny --steps 300 --segment 100 --seeds 1234,1235

Arms (every other key equal): ``constant`` (``optimizer.weight_decay`` throughout) and
``ramp`` (``weight_decay_schedule = --schedule`` from ``--wd`` to ``--wd_final``, starting
at ``--ramp_start`` of the steps). Each (arm, seed) run trains in segments of ``--segment``
steps, each its own process continued with the trainer's exact resume; round k runs
segment k of every run as one job under ``flock /tmp/cpu.lock`` (``bench/seq_len_schedule``'s
driver), so load changes fall on every arm alike. Read back from each ``metrics.jsonl``:
the final validation loss (fixed validation set), the mean training loss of the last
``--tail`` steps, and the weight decay the last step used. Prints per seed the difference
ramp - constant, and its mean and spread over seeds.

A benchmark, not a test: it prints a table (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from bench.seq_len_schedule import run_round, run_rounds, segment, segment_ends

MODULE = "bench.wd_schedule"


def run_args(a: argparse.Namespace, arm: str, seed: int) -> list[str]:
    common = ["--model.flavor", a.flavor, "--training.steps", str(a.steps), "--training.batch_size", str(a.batch),
              "--training.seq_len", str(a.seq_len), "--training.seed", str(seed), "--training.lr", str(a.lr),
              "--training.warmup_steps", str(a.warmup), "--training.val_interval", str(a.val_interval),
              "--training.val_batches", str(a.val_batches), "--training.log_interval", str(a.log_interval),
              "--checkpoint.interval", "0", "--checkpoint.keep_last", "1", "--training.threads", str(a.threads),
              "--optimizer.weight_decay", str(a.wd)]
    if arm == "ramp":
        common += ["--optimizer.weight_decay_schedule", a.schedule, "--optimizer.weight_decay_final",
                   str(a.wd_final), "--optimizer.weight_decay_ramp_start", str(a.ramp_start)]
    return common


def read_run(run_dir: Path, tail: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"val_loss": val[-1], "train_tail": statistics.fmean(r["loss"] for r in train[-tail:]),
            "last_weight_decay": train[-1].get("weight_decay"), "steps": train[-1]["step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--segment", type=int, default=100, help="steps per locked job of one run")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--wd", type=float, default=0.1, help="optimizer.weight_decay (both arms)")
    p.add_argument("--wd_final", type=float, default=0.4, help="ramp: optimizer.weight_decay_final")
    p.add_argument("--schedule", default="linear", choices=("linear", "cosine"))
    p.add_argument("--ramp_start", type=float, default=0.5)
    p.add_argument("--seeds", default="1234,1235")
    p.add_argument("--val_interval", type=int, default=100)
    p.add_argument("--val_batches", type=int, default=16)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--tail", type=int, default=50, help="training loss: mean of the last this many steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="/tmp/bench_wd_schedule")
    p.add_argument("--lock", default="/tmp/cpu.lock", help="flock file each round runs under; '' = none")
    p.add_argument("--json", default=None)
    p.add_argument("--arm", help=argparse.SUPPRESS)  # internal: one segment of run ARM (= "arm@seed")
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run_dir", help=argparse.SUPPRESS)
    p.add_argument("--round", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        arm, seed = a.arm.split("@")
        return segment(a, run_args(a, arm, int(seed)))
    if a.round:
        return run_round(MODULE, a.round.split(","), Path(a.out))

    seeds = [int(s) for s in a.seeds.split(",")]
    runs = [f"{arm}@{seed}" for seed in seeds for arm in ("constant", "ramp")]
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    passthrough = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("json", "arm", "until", "run_dir", "round")]
    loads = run_rounds(MODULE, passthrough, runs, segment_ends(a.steps, a.segment), a.lock, a.threads)

    res = {r: read_run(out / r, a.tail) for r in runs}
    print(f"\n{a.flavor}, {a.steps} steps x {a.batch * a.seq_len} tokens (batch {a.batch} x seq_len {a.seq_len}), lr "
          f"{a.lr} cosine, weight decay {a.wd} vs {a.schedule} {a.wd} -> {a.wd_final} from {a.ramp_start:.0%} of "
          f"the steps; 1-min load average at round starts {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'seed':>6} {'val const':>9} {'val ramp':>9} {'d val':>8} {'train const':>11} {'train ramp':>10} "
          f"{'d train':>8} {'wd last':>7}")
    d_val, d_train = [], []
    for seed in seeds:
        c, r = res[f"constant@{seed}"], res[f"ramp@{seed}"]
        d_val.append(r["val_loss"] - c["val_loss"])
        d_train.append(r["train_tail"] - c["train_tail"])
        print(f"{seed:>6} {c['val_loss']:>9.4f} {r['val_loss']:>9.4f} {d_val[-1]:>+8.4f} {c['train_tail']:>11.4f} "
              f"{r['train_tail']:>10.4f} {d_train[-1]:>+8.4f} {r['last_weight_decay']:>7.3f}")
    spread = (lambda xs: max(xs) - min(xs))
    print(f"ramp - constant, mean over {len(seeds)} seeds: val {statistics.fmean(d_val):+.4f} (spread "
          f"{spread(d_val):.4f}), train tail {statistics.fmean(d_train):+.4f} (spread {spread(d_train):.4f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "load_avg": loads, "runs": res,
                                            "d_val": d_val, "d_train": d_train}, indent=1))


if __name__ == "__main__":
    main()
