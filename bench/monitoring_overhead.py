"""Monitoring overhead: training tokens/s with the monitor off, at its defaults, and
full (activation statistics + torch.profiler sampling), in one process, interleaved.

    python bench/monitoring_overhead.py --rounds 10        # tiny, batch 4 x 128, profiler every 10 steps: ~4 min
    python bench/monitoring_overhead.py --steps_per_sample 50 --profile_every 50 --rounds 5   # ~7 min
    python bench/monitoring_overhead.py --flavor debug     # small steps: stresses per-step hook cost
    python bench/monitoring_overhead.py --json out.json    # also keep every sample

(Times on 2 cores with one other busy process; several times longer on a crowded machine.)

CPU only. Three ``Trainer``s (same model flavor, seed, data, batch; fp32) run their
real ``fit()`` loops in three processes that hand one baton round (multiprocessing
events): only the holder runs, the others wait. Processes rather than threads because
torch.profiler must run on a main thread. A sample is one holder's k consecutive steps,
timed from the moment
its ``on_step_end`` callback gets the baton back to the moment the callback at step
s+k is entered: exactly k full loop iterations, including one logging block (with
``log_interval = k``), i.e. the monitor's ``write`` path, hooks and sampled steps.
Validation runs once at step 0 and the checkpoint once after the stop, outside every
sample; the first sample of each trainer is warm-up and untimed.

    off      [monitor] enabled = false: the trainer's records go straight to metrics.jsonl
    default  [monitor] defaults: phase hooks every step, per-group norms and the
             update/weight ratio every interval_steps (10), system counters per window
    full     default + activation_stats = true + profile_every = --profile_every

Order within a round is off, default, full; pair ratio = tokens/s(X, round r) /
mean(tokens/s(off, r), tokens/s(off, r+1)), the off samples on both sides cancelling
drift. Reported: median ratio with IQR and min/max; overhead = 1 - median ratio.
Targets: <= 2% (default), <= 5% (full). A benchmark, not a test: it prints PASS/FAIL
and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import multiprocessing as mp
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.train_throughput import cpu_counters, cpu_model, load_note  # noqa: E402
from trainforge.config import load_config  # noqa: E402
from trainforge.monitor.jsonl import read_jsonl  # noqa: E402
from trainforge.train.trainer import Trainer  # noqa: E402

CONFIGS = ("off", "default", "full")
TARGETS = {"default": 0.02, "full": 0.05}


class Baton:
    """One process at a time: process i runs while events[i] is set; ``pass_on`` hands
    over to the next process that has not finished."""

    def __init__(self, events, done, i: int):
        self.events, self.done, self.i = events, done, i

    def wait_turn(self) -> None:
        self.events[self.i].wait()

    def pass_on(self) -> None:
        n = len(self.events)
        nxt = (self.i + 1) % n
        while self.done[nxt] and nxt != self.i:
            nxt = (nxt + 1) % n
        self.events[self.i].clear()
        self.events[nxt].set()


class Segment:
    """Callback: times this process's k-step samples between hand-overs."""

    def __init__(self, baton: Baton, k: int, samples_wanted: int, queue):
        self.baton, self.k, self.samples_wanted, self.queue = baton, k, samples_wanted, queue
        self.t0 = self.c0 = self.m0 = None
        self.taken = 0

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step % self.k:
            return
        t1, c1, m1 = time.perf_counter(), cpu_counters(), trainer.metrics.self_seconds()
        if self.t0 is not None:
            wall = t1 - self.t0
            note = {**load_note(self.c0, c1, wall), "monitor_s": m1 - self.m0}
            self.queue.put(("sample", self.baton.i, wall, note))
            self.taken += 1
        if self.taken >= self.samples_wanted:
            # Keep the baton: the stop's logging and checkpoint must not overlap another's
            # sample; the process passes it on when fit() has returned.
            trainer.request_stop("benchmark done")
            return
        self.baton.pass_on()
        self.baton.wait_turn()
        self.t0, self.c0, self.m0 = time.perf_counter(), cpu_counters(), trainer.metrics.self_seconds()


def step_profile(path: Path) -> dict[str, float]:
    """Median step seconds (the monitor's own per-step timing) of plain, sampled and
    profiled steps, from a monitored run's records."""
    plain, sampled, profiled = [], [], []
    for r in read_jsonl(path):
        if "step_s" not in r:
            continue
        (profiled if "top_ops" in r else sampled if "grad_norm_group" in r else plain).append(r["step_s"])
    med = lambda v: float(np.median(v)) if v else None  # noqa: E731
    return {"plain": med(plain), "sampled": med(sampled), "profiled": med(profiled)}


def child(i: int, overrides: list[str], k: int, samples_wanted: int, threads: int, events, done, queue) -> None:
    """One configuration in its own process (torch.profiler wants the main thread)."""
    torch.set_num_threads(threads)
    baton = Baton(events, done, i)
    try:
        with tempfile.TemporaryDirectory(prefix="tf-monbench-") as tmp:
            trainer = Trainer(load_config(None, overrides), Path(tmp) / "run", progress=False,
                              callbacks=[Segment(baton, k, samples_wanted, queue)])
            queue.put(("ready", i, trainer.tokens_per_step, trainer.model_config.num_params()))
            baton.wait_turn()
            try:
                trainer.fit()
            finally:
                trainer.close()
            queue.put(("steps", i, step_profile(Path(tmp) / "run" / "metrics.jsonl"), None))
    finally:
        done[i] = 1
        queue.put(("done", i, None, None))
        baton.pass_on()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--steps_per_sample", type=int, default=10,
                   help="k: steps per sample (= training.log_interval = monitor.interval_steps default)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds (off gets one more, to bracket the last)")
    p.add_argument("--profile_every", type=int, default=10,
                   help="full: monitor.profile_every; keep k a multiple so every sample holds the same number "
                        "of profiled steps (a median would otherwise hide a rare expensive step)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.steps_per_sample < 1 or a.rounds < 1 or a.profile_every < 1:
        p.error("--steps_per_sample, --rounds and --profile_every must be >= 1")
    return a


def summarize(values: list[float]) -> dict[str, float]:
    q1, q2, q3 = (float(v) for v in np.percentile(values, [25, 50, 75]))
    return {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
           "torch": torch.__version__, "python": platform.python_version(), "threads": a.threads,
           "loadavg_before": os.getloadavg()}
    print(f"date {env['date']}\ncpu {env['cpu']}\ntorch {env['torch']}, python {env['python']}, "
          f"intra-op threads {a.threads}\nload average before: {' '.join(f'{v:.2f}' for v in env['loadavg_before'])}",
          flush=True)
    k = a.steps_per_sample
    common = ["--model.flavor", a.flavor, "--training.batch_size", str(a.batch_size), "--training.seq_len",
              str(a.seq_len), "--training.device", "cpu", "--training.threads", str(a.threads),
              "--training.val_interval", "0", "--checkpoint.interval", "0", "--training.log_interval", str(k),
              "--training.steps", str(k * (a.rounds + 4))]
    extra = {"off": ["--monitor.enabled", "false"], "default": [],
             "full": ["--monitor.activation_stats", "true", "--monitor.profile_every", str(a.profile_every)]}
    ctx = mp.get_context("spawn")
    events, done, queue = [ctx.Event() for _ in CONFIGS], ctx.Array("b", len(CONFIGS)), ctx.Queue()
    counters0, wall0 = cpu_counters(), time.perf_counter()
    # off takes one sample more than the others: its samples bracket every round.
    procs = [ctx.Process(target=child, args=(i, common + extra[name], k, a.rounds + (i == 0), a.threads, events,
                                             done, queue)) for i, name in enumerate(CONFIGS)]
    for p in procs:
        p.start()
    samples: dict[int, list[tuple[float, dict]]] = {i: [] for i in range(len(CONFIGS))}
    finished, tokens_per_step, step_medians = 0, None, {}
    events[0].set()
    while finished < len(CONFIGS):
        kind, i, x, y = queue.get()
        if kind == "ready" and tokens_per_step is None:
            tokens_per_step = x
            print(f"model {a.flavor}: {y / 1e6:.2f}M params, {x} tokens/step; {k} steps per sample, {a.rounds} "
                  f"rounds; full: activation stats + profiler every {a.profile_every} steps", flush=True)
        elif kind == "sample":
            samples[i].append((x, y))
        elif kind == "steps":
            step_medians[CONFIGS[i]] = x
        elif kind == "done":
            finished += 1
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs) or any(len(samples[i]) < a.rounds for i in samples):
        print(f"a benchmark process failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    whole = load_note(counters0, cpu_counters(), time.perf_counter() - wall0)

    tps = {name: [k * tokens_per_step / wall for wall, _ in samples[i]] for i, name in enumerate(CONFIGS)}
    busy = {name: [note["other_processes_share"] for _, note in samples[i]] for i, name in enumerate(CONFIGS)}
    print(f"\n{'round':>5} " + " ".join(f"{n + ' tok/s':>14}" for n in CONFIGS) + "   others' CPU share")
    for r in range(a.rounds + 1):
        row = [f"{tps[n][r]:14,.0f}" if r < len(tps[n]) else f"{'-':>14}" for n in CONFIGS]
        print(f"{r:>5} " + " ".join(row) + "   " + " ".join(f"{busy[n][r]:.2f}" for n in CONFIGS if r < len(busy[n])))
    results = {"env": env, "k": k, "rounds": a.rounds, "tokens_per_step": tokens_per_step,
               "profile_every": a.profile_every, "tokens_per_s": tps, "others_share": busy, "machine": whole}
    print()
    for name in ("default", "full"):
        ratios = [tps[name][r] / ((tps["off"][r] + tps["off"][r + 1]) / 2) for r in range(a.rounds)]
        s = summarize(ratios)
        overhead = 1 - s["median"]
        verdict = "PASS" if overhead <= TARGETS[name] else "FAIL"
        results[name] = {"ratios": ratios, **s, "overhead": overhead, "target": TARGETS[name], "verdict": verdict}
        print(f"{name:>8}: tokens/s ratio vs off median {s['median']:.4f} (IQR {s['q1']:.4f}-{s['q3']:.4f}, "
              f"min {s['min']:.4f}, max {s['max']:.4f}) -> overhead {100 * overhead:+.2f}% "
              f"(target <= {100 * TARGETS[name]:.0f}%): {verdict}")
    # Accounting, far less sensitive to the machine's load than the ratios: the host time
    # the monitor measured around its own code, per sample, over the sample's wall time;
    # plus, for full, the profiler's slowdown of the profiled step (not in monitor_s),
    # amortised over profile_every steps.
    print("\naccounting (time inside the monitor's hooks and write path / sample wall time):")
    for i, name in enumerate(CONFIGS):
        shares = [note["monitor_s"] / wall for wall, note in samples[i]]
        results.setdefault("accounting", {})[name] = summarize(shares)
        s = summarize(shares)
        print(f"{name:>8}: median {100 * s['median']:.3f}% (min {100 * s['min']:.3f}%, max {100 * s['max']:.3f}%)")
    m = step_medians.get("full", {})
    if m.get("profiled") and m.get("plain"):
        slow = m["profiled"] / m["plain"] - 1
        results["profiled_step_slowdown"] = slow
        print(f"    full: a profiled step takes {100 * slow:+.0f}% of a plain one (median step_s "
              f"{m['profiled']:.3f} s vs {m['plain']:.3f} s): {100 * slow / a.profile_every:+.2f}% amortised over "
              f"profile_every = {a.profile_every} steps")
    m = step_medians.get("default", {})
    if m.get("sampled") and m.get("plain"):
        print(f" default: a sampled step (norms, update ratio) takes {100 * (m['sampled'] / m['plain'] - 1):+.1f}% "
              f"of a plain one (median step_s {m['sampled']:.3f} s vs {m['plain']:.3f} s)")
    results["step_medians"] = step_medians
    print(f"other processes used {100 * whole['other_processes_share']:.0f}% of the machine during the run; "
          f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
