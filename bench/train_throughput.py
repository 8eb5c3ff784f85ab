"""Training throughput: trainforge's real loop (``Trainer.fit``) against a minimal
hand-written PyTorch loop, measured in the same process, alternating A and B.

    python bench/train_throughput.py                  # tiny flavor, ~2.5 min on 2 cores
    python bench/train_throughput.py --flavor debug   # small steps: stresses per-step overhead
    python bench/train_throughput.py --json out.json  # also keep every sample

CPU only (``training.device = cpu``), where every op is synchronous.

What is compared (same model flavor and seed, same data shards, batch, seq_len, fp32,
fused AdamW with the same two param groups, same clipping and LR schedule):

A  trainforge: a ``Trainer`` built from ``load_config(None, overrides)`` and driven
   through one uninterrupted ``Trainer.fit()``: ``ShardLoader`` batching (assembled ahead
   in a background thread), the loss accumulator, JSONL metrics every step, the host
   sync + console log line once per ``log_interval``, callbacks dispatch.
B  plain: ``build_model`` + ``torch.optim.AdamW(fused=True)`` + ``LambdaLR``; batches
   cut from ``np.memmap`` shards by plain numpy indexing; forward, cross_entropy,
   backward, clip_grad_norm_, step, zero_grad, scheduler step; one ``.item()`` per sample.

How A is timed, and why this way. ``fit()`` validates and checkpoints at its last step
and on any stop, so calling it in short chunks would run a validation pass and a
checkpoint per chunk; they would have to be cut out of the timing anyway, and the
loop users actually run is one long ``fit()``. So the benchmark calls ``fit()`` once
and times A between ``on_step_end`` callbacks: from the moment the callback at step s
returns to the moment the callback at step s+k is entered. That window holds exactly
k full loop iterations (k ``train_step`` calls plus the bookkeeping of k iterations,
including exactly one logging block because ``log_interval = k``: any k consecutive
steps hold one multiple of k). On CPU every op is synchronous, so no device sync is
needed at the window edges. The B sample runs inside that callback, between two A
windows, so A and B strictly alternate (B0 A0 B1 A1 ... A(n-1) Bn) and share the
process, the page cache and the machine's load at nearly the same moments. The
callback touches no trainer state; it calls ``request_stop`` after the last pair, so
the end-of-run checkpoint happens once and outside every timed window (validation runs
once, at step 0, before the first window, and not at the end because the run stops by
``request_stop`` before reaching ``training.steps``).

Side effect to ignore: trainforge's own ``tok/s`` / ``mfu`` log lines printed during
the run include the plain loop's time (its window clock cannot know about B).

Pair i's ratio is tokens/s(A_i) / mean(tokens/s(B_i), tokens/s(B_(i+1))): comparing A
with the plain samples on both sides cancels slow drift (thermal, a neighbour ramping
up). The headline is the median of the n ratios, with IQR and min/max. Around every
sample the script reads /proc/stat and its own CPU time, so each pair also carries the
share of the machine other processes used meanwhile; pairs where that stays under 5%
are "clean" and summarised separately, and the processes that used the most CPU are
named. The issue's goal is ratio >= 0.97 (framework overhead <= 3%). A benchmark, not
a test: it prints PASS or FAIL and exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainforge.config import load_config
from trainforge.model import build_model
from trainforge.train.mfu import matmul_peak_flops
from trainforge.train.trainer import Trainer

GOAL_RATIO = 0.97
CLEAN_SHARE = 0.05  # a pair is "clean" when other processes used < 5% of the machine in both samples
TARGET_SAMPLE_S = 6.0  # --steps_per_sample 0 picks k so one sample takes about this long


# -- machine description ------------------------------------------------------------------

def cpu_model() -> str:
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        return platform.processor() or "unknown"
    name = fields.get("model name", "unknown")
    return f"{name} (family {fields.get('cpu family')}, model {fields.get('model')}, " \
           f"stepping {fields.get('stepping')}), {os.cpu_count()} logical CPUs"


def cpu_counters() -> dict[str, float]:
    """Machine-wide busy/steal CPU-seconds (/proc/stat) and this process's CPU-seconds,
    so the report can say how much CPU *other* processes used during the run."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"self_s": sum(os.times()[:2]), "busy_s": math.nan, "steal_s": math.nan}
    try:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = vals[:8]
        out["busy_s"] = (user + nice + system + irq + softirq) / tick
        out["steal_s"] = steal / tick
    except (OSError, ValueError, IndexError):
        pass
    return out


def others_share(before: dict, after: dict, wall_s: float) -> float:
    """Fraction of the machine's CPU time that other processes used between two ``cpu_counters``."""
    others_s = (after["busy_s"] - before["busy_s"]) - (after["self_s"] - before["self_s"])
    return max(0.0, others_s) / (wall_s * (os.cpu_count() or 1))


def process_cpu_s() -> dict[int, tuple[float, str]]:
    """{pid: (CPU-seconds so far, command line)} for every other process we can read."""
    tick, me, out = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / tick, cmd[:100] or stat.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def load_note(before: dict, after: dict, wall_s: float) -> dict:
    ncpu = os.cpu_count() or 1
    share = others_share(before, after, wall_s)
    steal_share = (after["steal_s"] - before["steal_s"]) / (wall_s * ncpu)
    return {"other_processes_cpu_s": round(share * wall_s * ncpu, 1), "other_processes_share": round(share, 3),
            "steal_share": round(steal_share, 3), "busy": share >= CLEAN_SHARE or steal_share >= CLEAN_SHARE}


# -- B: the plain loop -------------------------------------------------------------------

class PlainLoop:
    """The minimal loop a PyTorch user would write for the same model and data."""

    def __init__(self, model_config, data_dir: Path, tcfg, ocfg):
        self.seq_len, self.batch_size = tcfg.seq_len, tcfg.batch_size
        self.model = build_model(model_config, "cpu", seed=tcfg.seed)
        self.model.train()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": ocfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tcfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=True)
        warmup, total, floor = tcfg.warmup_steps, tcfg.steps, tcfg.min_lr_ratio

        def lr_factor(k: int) -> float:  # the same warmup + cosine shape as trainforge's
            if k < warmup:
                return (k + 1) / warmup
            progress = min(1.0, (k - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.grad_clip = tcfg.grad_clip if tcfg.grad_clip > 0 else math.inf
        manifest = json.loads((data_dir / "manifest.json").read_text())
        self.shards = [np.memmap(data_dir / e["file"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<"), mode="r")
                       for e in manifest["splits"]["train"]]
        sizes = np.array([len(s) - self.seq_len - 1 for s in self.shards], dtype=np.float64)
        self.shard_p = sizes / sizes.sum()
        self.rng = np.random.default_rng(tcfg.seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.shards[self.rng.choice(len(self.shards), p=self.shard_p)] if len(self.shards) > 1 \
            else self.shards[0]
        starts = self.rng.integers(0, len(shard) - self.seq_len - 1, size=self.batch_size)
        rows = np.stack([shard[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)  # (B, T+1)
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def step(self) -> torch.Tensor:
        x, y = self.batch()
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss

    def run(self, steps: int) -> float:
        """Seconds for ``steps`` steps, including one host read of the loss at the end."""
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        loss.item()
        return time.perf_counter() - t0


# -- A: trainforge, timed from a callback ---------------------------------------------------

class AlternatingBench:
    """``on_step_end`` callback: once the trainer has done ``warmup_steps`` steps, runs one
    B sample of ``k`` steps, opens an A window, closes it ``k`` trainer steps later, and
    repeats, ending with a B sample: B0 A0 B1 A1 ... A(n-1) Bn. Pair i compares A_i with
    its two neighbours B_i and B_(i+1).

    Around every sample it also reads the machine's CPU counters, so each pair carries the
    share of the machine other processes used meanwhile (the "clean" pairs are those where
    it stayed under ``CLEAN_SHARE`` in both samples), and between samples (outside every
    timed window) it notes which other processes gained CPU time."""

    def __init__(self, plain: PlainLoop, warmup_steps: int, k: int, pairs: int, tokens_per_step: int):
        self.plain, self.warmup_steps, self.k, self.pairs = plain, warmup_steps, k, pairs
        self.tokens_per_step = tokens_per_step
        self.a_s: list[float] = []
        self.b_s: list[float] = []
        self.a_others: list[float] = []  # share of the machine used by other processes, per sample
        self.b_others: list[float] = []
        self.t_open: float | None = None
        self.c_open: dict | None = None
        self.procs = process_cpu_s()
        self.proc_cpu_s: dict[tuple[int, str], float] = {}

    def _note_processes(self) -> None:
        now = process_cpu_s()
        for pid, (cpu, cmd) in now.items():
            d = cpu - self.procs.get(pid, (0.0, ""))[0]
            if d > 0:
                self.proc_cpu_s[(pid, cmd)] = self.proc_cpu_s.get((pid, cmd), 0.0) + d
        self.procs = now

    def busiest_others(self, top: int = 3, min_s: float = 1.0) -> list[str]:
        ranked = sorted(((d, pid, cmd) for (pid, cmd), d in self.proc_cpu_s.items()), reverse=True)[:top]
        return [f"pid {pid} {d:.0f} CPU-s: {cmd}" for d, pid, cmd in ranked if d >= min_s]

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        now = time.perf_counter()
        if step < self.warmup_steps:
            return
        if self.t_open is not None:
            if (step - self.warmup_steps) % self.k:
                return
            self.a_s.append(now - self.t_open)
            self.a_others.append(others_share(self.c_open, cpu_counters(), self.a_s[-1]))
        self._note_processes()
        c0 = cpu_counters()
        self.b_s.append(self.plain.run(self.k))
        self.b_others.append(others_share(c0, cpu_counters(), self.b_s[-1]))
        if self.a_s:
            self._print_pair(len(self.a_s) - 1)
        if len(self.a_s) >= self.pairs:
            trainer.request_stop("benchmark done")
            return
        self.c_open = cpu_counters()
        self.t_open = time.perf_counter()

    def pair(self, i: int) -> tuple[float, float, float]:
        """(trainforge tok/s, plain tok/s, others' share) of pair i: A_i against the mean
        tokens/s of the B samples just before and just after it, which cancels slow drift."""
        a_tps = self.k * self.tokens_per_step / self.a_s[i]
        b_tps = 0.5 * self.k * self.tokens_per_step * (1 / self.b_s[i] + 1 / self.b_s[i + 1])
        return a_tps, b_tps, max(self.a_others[i], self.b_others[i], self.b_others[i + 1])

    def _print_pair(self, i: int) -> None:
        a_tps, b_tps, others = self.pair(i)
        print(f"  pair {i + 1:2d}: trainforge {a_tps:7.0f} tok/s, plain (before/after mean) {b_tps:7.0f} tok/s, "
              f"ratio {a_tps / b_tps:.3f}; others used {100 * others:2.0f}% of the machine"
              + ("" if others < CLEAN_SHARE else "  (busy)"), flush=True)


# -- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny", help="model flavor (default tiny)")
    p.add_argument("--batch_size", type=int, default=16, help="sequences per step (trainforge default 16)")
    p.add_argument("--seq_len", type=int, default=256, help="tokens per sequence (trainforge default 256)")
    p.add_argument("--pairs", type=int, default=12, help="timed A/B sample pairs after warm-up")
    p.add_argument("--steps_per_sample", type=int, default=0,
                   help=f"optimizer steps per sample; 0 = auto (about {TARGET_SAMPLE_S:.0f} s per sample, >= 2)")
    p.add_argument("--warmup_steps", type=int, default=2, help="untimed steps of each loop before the first pair")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = torch's default")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "pairs", "warmup_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.steps_per_sample < 0 or args.threads < 0:
        p.error("--steps_per_sample and --threads must be >= 0")
    return args


def summarize(values: list[float]) -> dict[str, float]:
    q1, q2, q3 = (float(v) for v in np.percentile(values, [25, 50, 75]))
    return {"median": q2, "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
           "torch": torch.__version__, "python": platform.python_version(), "threads": threads,
           "interop_threads": torch.get_num_interop_threads(), "loadavg_before": os.getloadavg()}
    print(f"date {env['date']}\ncpu {env['cpu']}\ntorch {env['torch']}, python {env['python']}, "
          f"intra-op threads {threads}, inter-op threads {env['interop_threads']}\n"
          f"load average before (1/5/15 min): {' '.join(f'{v:.2f}' for v in env['loadavg_before'])}", flush=True)

    counters0, wall0 = cpu_counters(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tf-bench-") as tmp:
        overrides = ["--model.flavor", args.flavor, "--training.batch_size", str(args.batch_size),
                     "--training.seq_len", str(args.seq_len), "--training.device", "cpu",
                     "--training.threads", str(args.threads), "--training.val_interval", "0",
                     "--checkpoint.interval", "0"]
        cfg = load_config(None, overrides)
        trainer = Trainer(cfg, Path(tmp) / "run", progress=False)
        tcfg = trainer.cfg.training
        plain = PlainLoop(trainer.model_config, trainer.data.path, tcfg, trainer.cfg.optimizer)

        # B warm-up (first steps allocate and pick kernels); its last step sizes k.
        for _ in range(args.warmup_steps - 1):
            plain.run(1)
        step_s = plain.run(1)
        k = args.steps_per_sample or max(2, round(TARGET_SAMPLE_S / step_s))
        tokens_per_step = args.batch_size * args.seq_len
        print(f"model {args.flavor}: {sum(p.numel() for p in plain.model.parameters()) / 1e6:.2f}M params, "
              f"batch {args.batch_size} x seq_len {args.seq_len} = {tokens_per_step} tokens/step, fp32; "
              f"plain warm-up step {step_s:.3f} s -> {k} steps per sample, {args.pairs} pairs "
              f"(trainforge log_interval = {k})", flush=True)

        # The LR schedule (and the plain copy of it) spans cfg.training.steps as built; only the
        # loop's stopping point moves, so the run ends by request_stop, not by reaching `last`.
        bench = AlternatingBench(plain, args.warmup_steps, k, args.pairs, tokens_per_step)
        trainer.components.add(bench)
        tcfg.log_interval = k
        tcfg.steps = max(tcfg.steps, args.warmup_steps + args.pairs * k + 1)
        trainer.fit()
        trainer.close()
        flops_per_token = trainer.flops_per_token
    wall_s = time.perf_counter() - wall0
    env["loadavg_after"] = os.getloadavg()
    env["load"] = load_note(counters0, cpu_counters(), wall_s)
    bench._note_processes()
    env["load"]["busiest_other_processes"] = bench.busiest_others()

    peak = matmul_peak_flops(torch.device("cpu"))
    pairs = [bench.pair(i) for i in range(len(bench.a_s))]
    a_tps, b_tps, others = (list(col) for col in zip(*pairs))
    ratios = [a / b for a, b in zip(a_tps, b_tps)]
    clean = [r for r, o in zip(ratios, others) if o < CLEAN_SHARE]
    # tokens/s of each loop: its own samples; the ratio: the drift-cancelling pairs.
    a_samples = [k * tokens_per_step / t for t in bench.a_s]
    b_samples = [k * tokens_per_step / t for t in bench.b_s]
    res = {"trainforge_tokens_per_s": summarize(a_samples), "plain_tokens_per_s": summarize(b_samples),
           "ratio": summarize(ratios), "clean_pairs": len(clean),
           "ratio_clean_pairs": summarize(clean) if clean else None}
    res["trainforge_mfu"] = res["trainforge_tokens_per_s"]["median"] * flops_per_token / peak
    res["plain_mfu"] = res["plain_tokens_per_s"]["median"] * flops_per_token / peak
    verdict = "PASS" if res["ratio"]["median"] >= GOAL_RATIO else "FAIL"

    ld = env["load"]
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in env['loadavg_after'])}; over the {wall_s:.0f} s run "
          f"other processes used {ld['other_processes_cpu_s']} CPU-s ({100 * ld['other_processes_share']:.1f}% of "
          f"the machine), steal {100 * ld['steal_share']:.1f}%"
          + ("  <- the machine was busy: trust the paired ratios, not the absolute tokens/s" if ld["busy"] else ""))
    for line in ld["busiest_other_processes"]:
        print(f"  busy meanwhile: {line}")
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s ({threads} threads), {flops_per_token / 1e6:.1f} MFLOP/token\n")
    print(f"| loop ({len(a_samples)} / {len(b_samples)} samples of {k} steps) | tokens/s median [min, max] "
          "| MFU (at median) |")
    print("|---|---|---|")
    for name, key in (("trainforge `Trainer.fit`", "trainforge"), ("plain PyTorch loop", "plain")):
        t = res[f"{key}_tokens_per_s"]
        print(f"| {name} | {t['median']:,.0f} [{t['min']:,.0f}, {t['max']:,.0f}] | {100 * res[f'{key}_mfu']:.1f}% |")

    def fmt(r: dict) -> str:
        return f"median {r['median']:.3f} (IQR {r['q1']:.3f}-{r['q3']:.3f}, min {r['min']:.3f}, max {r['max']:.3f})"

    print(f"\nratio trainforge/plain, all {len(ratios)} pairs: {fmt(res['ratio'])}")
    print(f"ratio trainforge/plain, {len(clean)} clean pairs (others < {100 * CLEAN_SHARE:.0f}% of the machine): "
          + (fmt(res["ratio_clean_pairs"]) if clean else "none"))
    print(f"goal >= {GOAL_RATIO} (framework overhead <= {100 * (1 - GOAL_RATIO):.0f}%), median of all pairs: {verdict}")

    if args.json:
        out = {"args": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items()},
               "steps_per_sample": k, "tokens_per_step": tokens_per_step, "env": env,
               "peak_flops": peak, "flops_per_token": flops_per_token, "wall_s": wall_s,
               "samples": {"trainforge_s": bench.a_s, "plain_s": bench.b_s,
                           "trainforge_others_share": bench.a_others, "plain_others_share": bench.b_others},
               "pairs": {"trainforge_tokens_per_s": a_tps, "plain_tokens_per_s": b_tps, "ratio": ratios,
                         "others_share": others},
               "results": res, "goal_ratio": GOAL_RATIO, "verdict": verdict}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
