"""``training.seq_len_schedule`` = ``linear`` and ``auto`` against ``fixed``: the real trainer
on the built-in corpus, same flavor, steps, seed and tokens per step (batch x seq_len).

    OMP_NUM_THREADS=1 python -m bench.seq_len_schedule --flavor tiny --steps 240 --segment 40

Each arm trains in segments of ``--segment`` steps, each its own process continued with the
trainer's exact resume (bit-identical to one uninterrupted run). The segments are
interleaved: round k runs segment k of every arm, one after the other (the arms' order
rotating each round), as one job under ``flock /tmp/cpu.lock`` (``--lock``), so a change of
machine load falls on every arm alike and no locked job runs long (size ``--segment`` so a
round stays under 5 minutes). Read back from each run's ``metrics.jsonl``:

- validation loss (the fixed validation set, always at full training.seq_len) at equal steps;
- validation loss at equal training wall time: each arm's curve against its cumulative
  training seconds (per step: tokens per step / the window's tokens_per_s; validation,
  checkpoints and process starts excluded), interpolated at the shortest arm's total;
- tokens/s over the whole run, and the lengths each arm trained at;
- host CPU use during training (``host_cpu_util``, all processes): the load.

A benchmark, not a test: it prints a table (and ``--json``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "fixed": [],
    "linear": ["--training.seq_len_schedule", "linear", "--training.seq_len_start", "{start}",
               "--training.seq_len_ramp_steps", "{ramp}"],
    "auto": ["--training.seq_len_schedule", "auto", "--training.seq_len_start", "{start}",
             "--training.seq_len_plateau_window", "{window}", "--training.seq_len_plateau_rel_delta", "{delta}"],
}


def arm_args(a: argparse.Namespace, arm: str) -> list[str]:
    common = ["--model.flavor", a.flavor, "--training.steps", str(a.steps), "--training.batch_size", str(a.batch),
              "--training.seq_len", str(a.seq_len), "--training.seed", str(a.seed), "--training.lr", str(a.lr),
              "--training.warmup_steps", str(a.warmup), "--training.val_interval", str(a.val_interval),
              "--training.val_batches", str(a.val_batches), "--training.log_interval", str(a.log_interval),
              "--checkpoint.interval", "0", "--checkpoint.keep_last", "1", "--training.threads", str(a.threads)]
    fill = {"start": a.start, "ramp": a.ramp or a.steps // 2, "window": a.window, "delta": a.delta}
    return common + [x.format(**fill) for x in ARMS[arm]]


def segment(a: argparse.Namespace, args: list[str] | None = None) -> None:
    """One locked job: continue ``a.arm`` (or the run of trainer ``args``, e.g. another
    bench's arm) in ``a.run_dir`` up to step ``a.until``."""
    from trainforge.config import load_config
    from trainforge.train.trainer import Trainer

    class StopAt:
        def on_step_end(self, trainer, step):
            if step == a.until and step < a.steps:
                trainer.request_stop("bench segment")

    run_dir = Path(a.run_dir)
    cfg = load_config(None, args if args is not None else arm_args(a, a.arm))
    t = Trainer(cfg, run_dir, resume=(run_dir / "checkpoints").is_dir(), callbacks=[StopAt()], progress=False)
    try:
        t.fit()
    finally:
        t.close()


def read_run(run_dir: Path, tokens_per_step: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    clock, t = {0: 0.0}, 0.0
    for r in train:
        t += tokens_per_step / r["tokens_per_s"]
        clock[r["step"]] = t
    val = [(r["step"], clock[r["step"]], r["val_loss"]) for r in records if "val_loss" in r]
    lengths = sorted({r.get("seq_len") for r in train if r.get("seq_len")})
    changes = [(r["step"], r["seq_len"]) for prev, r in zip(train, train[1:])
               if r.get("seq_len") != prev.get("seq_len")]
    cpu = [r["host_cpu_util"] for r in train if isinstance(r.get("host_cpu_util"), (int, float))]
    return {"train_s": t, "tokens_per_s": len(train) * tokens_per_step / t, "val": val,
            "lengths": lengths, "changes": changes, "host_cpu_util": sum(cpu) / len(cpu) if cpu else None,
            "clock": clock}


def at_time(val: list[tuple[int, float, float]], t: float) -> float:
    """Validation loss at training time ``t``, linear between the evaluations around it."""
    for (s0, t0, v0), (s1, t1, v1) in zip(val, val[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / max(t1 - t0, 1e-12)
    return val[-1][2]


def segment_ends(steps: int, segment: int) -> list[int]:
    """The step each round ends at: every ``segment`` steps, and ``steps``."""
    return [min(u, steps) for u in range(segment, steps + segment, segment)]


def run_round(module: str, arms: list[str], out: Path) -> None:
    """Inside the lock: this round's segment of each arm, one ``python -m module`` process
    each (this process's arguments plus ``--arm ARM --run_dir out/ARM``), in turn."""
    times = []
    for arm in arms:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", module, *sys.argv[1:], "--arm", arm, "--run_dir", str(out / arm)],
                       check=True)
        times.append(f"{arm} {time.perf_counter() - t0:.0f} s")
    print("; ".join(times))


def run_rounds(module: str, passthrough: list[str], arms: list[str], ends: list[int], lock: str,
               threads: int) -> list[float]:
    """Round k = one job (under ``flock lock`` unless it is ''): ``python -m module
    *passthrough --round ARMS --until ends[k]``, the arms' order rotating each round.
    Exits naming the round if one fails; returns the 1-min load average at each round's start."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    loads = []
    for k, until in enumerate(ends):
        order = arms[k % len(arms):] + arms[:k % len(arms)]
        cmd = [sys.executable, "-m", module, *passthrough, "--round", ",".join(order), "--until", str(until)]
        if lock:
            cmd = ["flock", lock, *cmd]
        loads.append(os.getloadavg()[0])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"round to step {until} failed:\n{r.stderr[-3000:]}")
        print(f"round {k + 1}/{len(ends)} ({', '.join(order)}) to step {until}: {time.perf_counter() - t0:.0f} s "
              f"(waiting for the lock included); {r.stdout.strip()}", flush=True)
    return loads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--segment", type=int, default=40, help="steps per locked job of one arm")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--start", type=int, default=64, help="linear, auto: training.seq_len_start")
    p.add_argument("--ramp", type=int, default=0, help="linear: ramp steps; 0 = steps / 2")
    p.add_argument("--window", type=int, default=4, help="auto: plateau window (logging intervals)")
    p.add_argument("--delta", type=float, default=0.01, help="auto: plateau_rel_delta")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val_interval", type=int, default=20)
    p.add_argument("--val_batches", type=int, default=8)
    p.add_argument("--log_interval", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="fixed,linear,auto")
    p.add_argument("--out", default="/tmp/bench_seq_len_schedule")
    p.add_argument("--lock", default="/tmp/cpu.lock", help="flock file each segment runs under; '' = none")
    p.add_argument("--json", default=None)
    p.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one segment
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run_dir", help=argparse.SUPPRESS)
    p.add_argument("--round", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:
        return segment(a)
    if a.round:
        return run_round("bench.seq_len_schedule", a.round.split(","), Path(a.out))

    arms = a.arms.split(",")
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    passthrough = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("json", "arm", "until", "run_dir", "round")]
    loads = run_rounds("bench.seq_len_schedule", passthrough, arms, segment_ends(a.steps, a.segment), a.lock,
                       a.threads)

    tokens_per_step = a.batch * a.seq_len
    runs = {arm: read_run(out / arm, tokens_per_step) for arm in arms}
    t_eq = min(r["train_s"] for r in runs.values())
    base = runs.get("fixed")
    print(f"\n{a.flavor}, {a.steps} steps x {tokens_per_step} tokens (batch {a.batch} x seq_len {a.seq_len}), "
          f"seed {a.seed}; 1-min load average at segment starts {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'arm':>6} {'lengths':>14} {'val@steps':>9} {'val@' + format(t_eq, '.0f') + 's':>9} {'train s':>8} "
          f"{'tok/s':>7} {'vs fixed':>8} {'host cpu':>8}  changes (step: seq_len)")
    for arm, r in runs.items():
        r["val_at_equal_steps"] = r["val"][-1][2]
        r["val_at_equal_time"] = at_time(r["val"], t_eq)
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        cpu = f"{r['host_cpu_util']:.0%}" if r["host_cpu_util"] is not None else "-"
        lengths = "/".join(map(str, r["lengths"])) or str(a.seq_len)
        print(f"{arm:>6} {lengths:>14} {r['val_at_equal_steps']:>9.4f} {r['val_at_equal_time']:>9.4f} "
              f"{r['train_s']:>8.1f} {r['tokens_per_s']:>7.0f} {speed:>7.3f}x {cpu:>8}  "
              f"{', '.join(f'{s}: {n}' for s, n in r['changes']) or '-'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "equal_time_s": t_eq, "load_avg": loads,
                                            "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
