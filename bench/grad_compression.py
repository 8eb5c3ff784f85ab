"""Gradient compression: wire bytes, step time on a bandwidth-limited link, convergence.

    python bench/grad_compression.py            # ~22 min on 2 cores: 100mbit + 1gbit + convergence
    python bench/grad_compression.py --quick    # ~9 min: 100mbit only, 2 rounds, convergence
    python bench/grad_compression.py --skip-timing             # convergence only: 9 runs, ~3 min quiet
    python bench/grad_compression.py --json out.json

Everything runs the real CLI (``trainforge train`` under ``torchrun``, gloo, 2 ranks,
``parallel.dp_replicate = 2``: DDP with the compression hook), ``tiny`` flavor on a small
built-in-style corpus (13 stdlib modules, vocab 512: 6.2M parameters, 25 MB of fp32
gradients per step), batch 4 x 32 tokens per rank, one thread per rank.

1. Step time on a shaped link. All ranks run inside one network namespace of this run's
   own making whose loopback is shaped by ``tc qdisc ... tbf rate R`` (``bench/shaped_link.py``;
   one shared medium: a 2-rank ring all-reduce of S bytes takes ~2 S x 8 / R). For each
   rate, ``--rounds`` rounds; each round runs every codec once (rotating the order), and
   the step time of a codec is the median of its per-window times after the first window
   (log_interval 4: windows of 4 steps, the first holds DDP's bucket rebuild). The
   headline per codec is the median over rounds of the paired ratio
   t(none) / t(codec) of the same round, with min-max. Compression warm-up is 0 here so
   every timed step is compressed. If no namespace can be made, ``open_link`` falls back
   to a labelled *simulated* link: step time = measured compute (host loopback) +
   bytes x world x 8 / R.
2. Wire bytes per step and the ratio against an fp32 ring all-reduce: counted by the
   hooks themselves (``wire_bytes_per_step``, ``wire_ratio_vs_fp32`` in metrics.jsonl).
3. Convergence on the host (no shaping), over seeds: fp32 (``none``), int4+EF and adaptive
   (``--conv-codecs`` adds others) each train ``--conv-steps`` steps with seeds 1..``--seeds``
   (a seed fixes initial weights and data order), on the setup of
   ``tests/compression/test_convergence.py`` (``tiny`` cut to width 128 and 4 blocks, 0.87M parameters;
   validation on the first 16 batches, the same tokens for every run). Per codec: mean
   final validation loss, its seed std and min-max; regret vs fp32 as the mean of the
   per-seed paired differences (codec seed s - fp32 seed s), with their std and min-max.
   One seed is not a measurement: runs that differ only in rounding end ~+-1.5% apart.

Targets (issue 4): int4+EF cuts wire bytes >= 87%; at 100 Mbit/s int4+EF is >= 3x faster
per step than uncompressed at no loss regret beyond the seed spread; int4 without error
feedback is measurably worse. A benchmark, not a test: prints the tables and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shaped_link import open_link  # noqa: E402
from trainforge.monitor.jsonl import read_jsonl  # noqa: E402

NPROC = 2
BATCH, SEQ = 4, 32
TOKENS_PER_STEP = BATCH * SEQ * NPROC
CODECS: dict[str, list[str]] = {
    "none": ["--compression.codec", "none"],
    "int8+EF": ["--compression.codec", "int8"],
    "int4+EF": ["--compression.codec", "int4"],
    "int4 (no EF)": ["--compression.codec", "int4", "--compression.error_feedback", "false"],
    "adaptive": ["--compression.codec", "adaptive"],
    "topk+int4+EF": ["--compression.codec", "topk+int4", "--compression.topk_ratio", "0.05"],
    "powersgd": ["--compression.codec", "powersgd"],
}
TIMED = ["none", "int8+EF", "int4+EF", "adaptive", "topk+int4+EF", "powersgd"]
CONVERGED = ["none", "int4+EF", "adaptive"]  # the claim: compressed ends like fp32
# Convergence runs: the setup of tests/compression/test_convergence.py (keep in sync).
CONV_ARGS = ["--model.dim", "128", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_hidden_dim", "352",
             "--model.n_layers", "4", "--checkpoint.interval", "0", "--compression.warmup_steps", "10"]
CONV_VAL_BATCHES = 16


def bench_data(root: Path) -> Path:
    """A small prepared corpus (vocab 512), made once per cache dir."""
    import sysconfig

    from trainforge.data.prepare import PrepareOptions, prepare

    out = root / "grad_compression_data"
    if (out / "manifest.json").is_file():
        return out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py", "json/encoder.py",
             "json/decoder.py", "pathlib.py", "random.py", "shutil.py", "textwrap.py", "typing.py")
    prepare([str(stdlib / n) for n in names], out, PrepareOptions(vocab_size=512, val_fraction=0.1),
            log=lambda *_: None)
    return out


def train_argv(run_dir: Path, data: Path, steps: int, extra: list[str], log_interval: int,
               val_batches: int) -> list[str]:
    return ["-m", "trainforge", "train", "--run_dir", str(run_dir), "--data.path", str(data),
            "--model.flavor", "tiny", "--training.seq_len", str(SEQ), "--training.batch_size", str(BATCH),
            "--training.steps", str(steps), "--training.warmup_steps", str(min(20, steps // 10)),
            "--training.log_interval", str(log_interval), "--training.val_interval", "0",
            "--training.val_batches", str(val_batches), "--training.threads", "1",
            "--sample.max_new_tokens", "0", "--parallel.dp_replicate", str(NPROC), *extra]


def busy_share(fn):
    """Run fn(); also return the share of the machine's CPU time used by other processes."""
    def cpu():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals) - vals[3] - vals[4], sum(vals)  # busy, total (jiffies)
    own0 = os.times()
    b0, t0 = cpu()
    out = fn()
    b1, t1 = cpu()
    own1 = os.times()
    own = (own1.children_user + own1.children_system - own0.children_user - own0.children_system) * os.sysconf(
        "SC_CLK_TCK")
    other = max(0.0, (b1 - b0) - own) / max(1, t1 - t0)
    return out, other


def run_on_link(link, run_dir: Path, data: Path, codec: str, steps: int) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc_per_node={NPROC}",
                "--master_addr", "127.0.0.1", "--master_port", str(link.free_port())]
    argv = train_argv(run_dir, data, steps, [*CODECS[codec], "--compression.warmup_steps", "0"], 4, 1)
    cmd = [*torchrun, *argv]
    r, other = busy_share(lambda: link.run(cmd, env=link.torch_env(), timeout_s=900))
    if r.returncode != 0:
        raise RuntimeError(f"{codec} on {link.label} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    recs = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in x]
    windows = sorted({x["step"]: x for x in recs if x["step"] % 4 == 0}.items())[1:]  # drop the first window
    step_s = [TOKENS_PER_STEP / x["tokens_per_s"] for _, x in windows]
    wire = [x for x in recs if "wire_bytes_per_step" in x]
    out = {"step_s": statistics.median(step_s), "other_cpu": other,
           "wire_bytes_per_step": wire[-1]["wire_bytes_per_step"] if wire else None,
           "wire_ratio": wire[-1]["wire_ratio_vs_fp32"] if wire else 1.0}
    if link.simulated:  # compute measured on the host loopback + the modelled wire time
        sent = out["wire_bytes_per_step"] or 2 * (NPROC - 1) / NPROC * 4 * 6.2e6
        out["step_s"] = link.step_seconds(out["step_s"], sent, NPROC)
    return out


def step_time_table(rate: str, rounds: int, steps: int, data: Path, tmp: Path) -> dict:
    results: dict[str, list[dict]] = {c: [] for c in TIMED}
    with open_link(rate) as link:
        label = link.label
        for rnd in range(rounds):
            order = TIMED[rnd % len(TIMED):] + TIMED[:rnd % len(TIMED)]
            for codec in order:
                run_dir = tmp / f"{rate}-{rnd}-{codec.replace(' ', '_')}"
                res = run_on_link(link, run_dir, data, codec, steps)
                results[codec].append(res)
                print(f"  [{label}] round {rnd} {codec:>13}: {1e3 * res['step_s']:8.1f} ms/step "
                      f"(wire {res['wire_ratio']:.3f} of fp32; other processes {100 * res['other_cpu']:.0f}% CPU)",
                      flush=True)
        drops = link.qdisc_stats().get("dropped", 0) if not link.simulated else 0
    table = {}
    for codec in TIMED:
        ratios = [base["step_s"] / res["step_s"] for base, res in zip(results["none"], results[codec])]
        table[codec] = {"ms_per_step": 1e3 * statistics.median(r["step_s"] for r in results[codec]),
                        "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
                        "speedup_max": max(ratios), "wire_ratio": results[codec][-1]["wire_ratio"],
                        "wire_bytes_per_step": results[codec][-1]["wire_bytes_per_step"],
                        "max_other_cpu": max(r["other_cpu"] for r in results[codec])}
    return {"link": label, "qdisc_drops": drops, "codecs": table}


def convergence(steps: int, seeds: int, codecs: list[str], data: Path, tmp: Path) -> dict:
    """Final validation loss of every codec for seeds 1..seeds; seed-major order, so a
    run cut short still has whole seeds for every codec."""
    finals: dict[str, list[float]] = {c: [] for c in codecs}
    for seed in range(1, seeds + 1):
        for codec in codecs:
            tag = codec.replace(" ", "_").replace("(", "").replace(")", "")
            run_dir = tmp / f"conv-{tag}-s{seed}"
            extra = [*CODECS[codec], *CONV_ARGS, "--training.seed", str(seed)]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
                   *train_argv(run_dir, data, steps, extra, 50, CONV_VAL_BATCHES)]
            t0, c0 = time.perf_counter(), os.times()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode != 0:
                raise RuntimeError(f"convergence run {codec} seed {seed} failed:\n{r.stderr[-4000:]}")
            c1 = os.times()  # CPU seconds of the run's processes: a cost figure that load does not inflate much
            cpu_s = c1.children_user + c1.children_system - c0.children_user - c0.children_system
            vals = [x["val_loss"] for x in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in x]
            finals[codec].append(vals[-1])
            print(f"  convergence seed {seed} {codec:>13}: val_loss {vals[0]:.4f} -> {vals[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s wall, {cpu_s:.0f} CPU s, load {os.getloadavg()[0]:.1f})",
                  flush=True)
    out = {}
    base = finals["none"]
    for codec, vals in finals.items():
        diffs = [v - b for v, b in zip(vals, base)]  # paired: same seed, same data order
        out[codec] = {"final_val_loss": vals, "mean": statistics.fmean(vals), "std": _std(vals),
                      "min": min(vals), "max": max(vals), "regret_mean": statistics.fmean(diffs),
                      "regret_std": _std(diffs), "regret_min": min(diffs), "regret_max": max(diffs),
                      "regret_pct": 100 * statistics.fmean(diffs) / statistics.fmean(base)}
    return out


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def avx512_flags() -> list[str]:
    """The CPU's avx512* flags: float rounding of vectorised kernels differs with them."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return sorted({f for f in line.split() if f.startswith("avx512")})
    except OSError:
        pass
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100mbit only, 2 rounds")
    ap.add_argument("--rates", default=None, help="comma-separated tc rates (default 100mbit,1gbit)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=13, help="steps per timed run (windows of 4 after the first)")
    ap.add_argument("--conv-steps", type=int, default=150, help="steps per convergence run (the test's 150)")
    ap.add_argument("--seeds", type=int, default=3, help="convergence seeds per codec (1..N)")
    ap.add_argument("--conv-codecs", default=",".join(CONVERGED),
                    help=f"comma-separated codecs for convergence, from: {', '.join(CODECS)}; or 'all'")
    ap.add_argument("--skip-convergence", action="store_true")
    ap.add_argument("--skip-timing", action="store_true", help="convergence only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rates = (args.rates or ("100mbit" if args.quick else "100mbit,1gbit")).split(",")
    rates = [] if args.skip_timing else rates
    rounds = args.rounds or (2 if args.quick else 3)
    conv_codecs = list(CODECS) if args.conv_codecs == "all" else args.conv_codecs.split(",")
    unknown = [c for c in conv_codecs if c not in CODECS]
    if unknown or args.seeds < 1:
        ap.error(f"--conv-codecs: unknown {unknown}, choose from {list(CODECS)}" if unknown else "--seeds: >= 1")
    conv_codecs = ["none", *(c for c in conv_codecs if c != "none")]  # the reference always runs

    cache = Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    data = bench_data(cache)
    report = {"cpu": cpu_model(), "avx512": avx512_flags(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_start": os.getloadavg(), "nproc": NPROC, "links": [],
              "command": " ".join(["python", "bench/grad_compression.py", *sys.argv[1:]])}
    with tempfile.TemporaryDirectory(prefix="tf-gc-") as tmp:
        for rate in rates:
            print(f"step time at {rate}:", flush=True)
            report["links"].append(step_time_table(rate, rounds, args.steps, data, Path(tmp)))
        if not args.skip_convergence:
            print(f"convergence ({args.conv_steps} steps, seeds 1-{args.seeds}, unshaped):", flush=True)
            report["convergence"] = convergence(args.conv_steps, args.seeds, conv_codecs, data, Path(tmp))
    report["load_end"] = os.getloadavg()

    print(f"\n{report['cpu']} (avx512: {' '.join(report['avx512']) or 'none'}), {report['date']}, load average "
          f"{report['load_start'][0]:.1f} at start, {report['load_end'][0]:.1f} at end; {NPROC} ranks x 1 thread, "
          f"tiny (vocab 512), batch {BATCH} x {SEQ} per rank")
    for link in report["links"]:
        # The uncompressed run has no hook: its bytes are the fp32 ring all-reduce the
        # hooks count as their reference (bytes / ratio of any compressed run).
        ref = next(r["wire_bytes_per_step"] / r["wire_ratio"] for r in link["codecs"].values()
                   if r["wire_bytes_per_step"])
        link["codecs"]["none"]["wire_bytes_per_step"] = ref
        print(f"\n{link['link']} (qdisc drops {link['qdisc_drops']})\n")
        print("| codec | wire bytes/step | vs fp32 | ms/step | speedup vs none (median, min-max) |")
        print("|---|---:|---:|---:|---|")
        for codec, row in link["codecs"].items():
            wb = row["wire_bytes_per_step"]
            print(f"| {codec} | {'-' if wb is None else f'{wb / 1e6:.2f} MB'} | {row['wire_ratio']:.3f} | "
                  f"{row['ms_per_step']:.0f} | {row['speedup_median']:.2f}x ({row['speedup_min']:.2f}-"
                  f"{row['speedup_max']:.2f}) |")
    if "convergence" in report:
        print(f"\nconvergence, {args.conv_steps} steps, tiny at width 128 with 4 blocks, seeds 1-{args.seeds}\n")
        print("| codec | final val loss per seed | mean | seed std | min-max | regret vs none: mean of paired "
              "differences (std; min-max) |")
        print("|---|---|---:|---:|---|---|")
        for codec, row in report["convergence"].items():
            per_seed = ", ".join(f"{v:.4f}" for v in row["final_val_loss"])
            regret = "-" if codec == "none" else (
                f"{row['regret_mean']:+.4f} = {row['regret_pct']:+.2f}% ({row['regret_std']:.4f}; "
                f"{row['regret_min']:+.4f} to {row['regret_max']:+.4f})")
            print(f"| {codec} | {per_seed} | {row['mean']:.4f} | {row['std']:.4f} | {row['min']:.4f}-"
                  f"{row['max']:.4f} | {regret} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
