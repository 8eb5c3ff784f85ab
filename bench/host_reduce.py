"""Gradient aggregation on the host (``compression.host_reduce``) against the on-device
compressed all-reduce, on the shaped link of ``bench/grad_compression.py``.

    python bench/host_reduce.py                     # 100mbit, 3 rounds, step time only (~6 min on 2 cores)
    python bench/host_reduce.py --rates 100mbit,1gbit --rounds 5
    python bench/host_reduce.py --convergence       # + final validation loss over 3 seeds (~4 min more)
    python bench/host_reduce.py --convergence --skip-timing
    python bench/host_reduce.py --json out.json

The setup is grad_compression.py's (the real CLI under ``torchrun``, gloo, 2 ranks,
``parallel.dp_replicate = 2``: DDP, ``tiny`` on the 13-module stdlib corpus, batch 4 x 32
tokens per rank, one thread per rank), and so is the link: every rank inside a network
namespace of the run's own making whose loopback is shaped with ``tc tbf`` (one shared
medium; ``bench/shaped_link.py``), or a labelled simulation where no namespace can be made.

Variants (all int4 + error feedback, compression warm-up 0):

- ``device``: the on-device compressed all-reduce (the DDP hook) -- the baseline;
- ``host, delay 1``: ``compression.host_reduce = true``: the host thread reduces step t's
  gradients while step t+1 computes; the update applies the previous step's mean;
- ``host, delay 0``: the host thread reduces while the rest of the backward runs; same
  update as the baseline.

Each round runs every variant once, the order rotating; a run's step time is the median
of its per-window times (log_interval 4: windows of 4 steps) after the first window (DDP's
bucket rebuild, and delay 1's first step, which applies no update). The headline per
variant is the median over rounds of the paired ratio t(device) / t(variant) of the same
round, with min-max. ``--convergence`` adds the final validation loss of delay 1 beside
the baseline and fp32 over seeds (grad_compression.py's convergence setup): a one-step-
stale gradient is not free, and this is where its cost shows.

A benchmark, not a test: prints the tables and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import grad_compression as gc  # noqa: E402
from bench.shaped_link import open_link  # noqa: E402
from trainforge.monitor.jsonl import read_jsonl  # noqa: E402

INT4 = ["--compression.codec", "int4", "--compression.warmup_steps", "0"]
HOST = ["--compression.host_reduce", "true"]
VARIANTS: dict[str, list[str]] = {
    "device": INT4,
    "host, delay 1": [*INT4, *HOST, "--compression.host_reduce_delay", "1"],
    "host, delay 0": [*INT4, *HOST, "--compression.host_reduce_delay", "0"],
}
BASELINE = "device"
# For --convergence: grad_compression.convergence runs codecs by name from its CODECS table.
CONV = {"host int4+EF delay 1": ["--compression.codec", "int4", *HOST, "--compression.host_reduce_delay", "1"]}


def run_variant(link, run_dir: Path, data: Path, variant: str, steps: int) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc_per_node={gc.NPROC}",
                "--master_addr", "127.0.0.1", "--master_port", str(link.free_port())]
    cmd = [*torchrun, *gc.train_argv(run_dir, data, steps, VARIANTS[variant], 4, 1)]
    r, other = gc.busy_share(lambda: link.run(cmd, env=link.torch_env(), timeout_s=900))
    if r.returncode != 0:
        raise RuntimeError(f"{variant} on {link.label} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    recs = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in x]
    windows = sorted({x["step"]: x for x in recs if x["step"] % 4 == 0}.items())[1:]  # drop the first window
    step_s = [gc.TOKENS_PER_STEP / x["tokens_per_s"] for _, x in windows]
    wire = [x for x in recs if "wire_bytes_per_step" in x]
    out = {"step_s": statistics.median(step_s), "windows": len(step_s), "other_cpu": other,
           "wire_bytes_per_step": wire[-1]["wire_bytes_per_step"] if wire else None,
           "wire_ratio": wire[-1]["wire_ratio_vs_fp32"] if wire else None,
           "final_loss": recs[-1]["loss"] if recs else None}
    if link.simulated:  # compute on the host loopback + the modelled wire time (no overlap modelled)
        out["step_s"] = link.step_seconds(out["step_s"], out["wire_bytes_per_step"] or 0.0, gc.NPROC)
    return out


def step_time_table(rate: str, rounds: int, steps: int, data: Path, tmp: Path) -> dict:
    names = list(VARIANTS)
    results: dict[str, list[dict]] = {v: [] for v in names}
    with open_link(rate) as link:
        label = link.label
        for rnd in range(rounds):
            for variant in names[rnd % len(names):] + names[:rnd % len(names)]:
                res = run_variant(link, tmp / f"{rate}-{rnd}-{variant.replace(' ', '').replace(',', '-')}", data,
                                  variant, steps)
                results[variant].append(res)
                print(f"  [{label}] round {rnd} {variant:>14}: {1e3 * res['step_s']:8.1f} ms/step over "
                      f"{res['windows']} windows (wire {res['wire_ratio']} of fp32; other processes "
                      f"{100 * res['other_cpu']:.0f}% CPU)", flush=True)
        drops = link.qdisc_stats().get("dropped", 0) if not link.simulated else 0
    table = {}
    for variant in names:
        ratios = [b["step_s"] / r["step_s"] for b, r in zip(results[BASELINE], results[variant])]
        table[variant] = {"ms_per_step": [1e3 * r["step_s"] for r in results[variant]],
                          "ms_median": 1e3 * statistics.median(r["step_s"] for r in results[variant]),
                          "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
                          "speedup_max": max(ratios), "wire_ratio": results[variant][-1]["wire_ratio"],
                          "wire_bytes_per_step": results[variant][-1]["wire_bytes_per_step"],
                          "max_other_cpu": max(r["other_cpu"] for r in results[variant])}
    return {"link": label, "qdisc_drops": drops, "variants": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100mbit", help="comma-separated tc rates")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=21, help="steps per timed run (windows of 4 after the first)")
    ap.add_argument("--convergence", action="store_true", help="also final val loss over seeds (unshaped)")
    ap.add_argument("--skip-timing", action="store_true", help="convergence only")
    ap.add_argument("--conv-steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    cache = Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    data = gc.bench_data(cache)
    report = {"cpu": gc.cpu_model(), "avx512": gc.avx512_flags(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg(),
              "command": " ".join(["python", "bench/host_reduce.py", *sys.argv[1:]]), "links": []}
    with tempfile.TemporaryDirectory(prefix="tf-hr-") as tmp:
        for rate in [] if args.skip_timing else args.rates.split(","):
            print(f"step time at {rate}:", flush=True)
            report["links"].append(step_time_table(rate, args.rounds, args.steps, data, Path(tmp)))
        if args.convergence:
            gc.CODECS.update(CONV)
            codecs = ["none", "int4+EF", *CONV]
            print(f"convergence ({args.conv_steps} steps, seeds 1-{args.seeds}, unshaped):", flush=True)
            report["convergence"] = gc.convergence(args.conv_steps, args.seeds, codecs, data, Path(tmp))
    report["load_end"] = os.getloadavg()

    print(f"\n{report['cpu']} (avx512: {' '.join(report['avx512']) or 'none'}), {report['date']}, load average "
          f"{report['load_start'][0]:.1f} at start, {report['load_end'][0]:.1f} at end; {gc.NPROC} ranks x 1 thread, "
          f"tiny (vocab 512), batch {gc.BATCH} x {gc.SEQ} per rank, int4 + EF")
    for link in report["links"]:
        print(f"\n{link['link']} (qdisc drops {link['qdisc_drops']})\n")
        print("| variant | ms/step per round | median | speedup vs device (median of paired ratios, min-max) |")
        print("|---|---|---:|---|")
        for variant, row in link["variants"].items():
            per = ", ".join(f"{v:.0f}" for v in row["ms_per_step"])
            print(f"| {variant} | {per} | {row['ms_median']:.0f} | {row['speedup_median']:.2f}x "
                  f"({row['speedup_min']:.2f}-{row['speedup_max']:.2f}) |")
    if "convergence" in report:
        print(f"\nconvergence, {args.conv_steps} steps, seeds 1-{args.seeds}\n")
        print("| variant | final val loss per seed | mean | regret vs fp32 (mean of paired differences; min-max) |")
        print("|---|---|---:|---|")
        for codec, row in report["convergence"].items():
            per_seed = ", ".join(f"{v:.4f}" for v in row["final_val_loss"])
            regret = "-" if codec == "none" else (f"{row['regret_mean']:+.4f} = {row['regret_pct']:+.2f}% "
                                                  f"({row['regret_min']:+.4f} to {row['regret_max']:+.4f})")
            print(f"| {codec} | {per_seed} | {row['mean']:.4f} | {regret} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
