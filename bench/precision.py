"""Precision policies on this machine: peak memory, throughput against fp32, and the loss
after a fixed budget, each measured on trainforge's real ``Trainer``.

    python bench/precision.py                 # ~6 min on 2 idle CPU cores (~12 min when busy)
    python bench/precision.py --quick         # tiny shapes, ~2 min (a smoke run)
    python bench/precision.py --json out.json # also keep every sample
    python bench/precision.py --parts memory --mem_batch 8   # memory only, at the trainer's default shape
    python bench/precision.py --parts memory --mem_batch 8 --mem_seq 1024 --loss_chunk_tokens 1024 \
        --mmap_threshold_kb 1024                         # the headline memory shape (docs/benchmarks-archive.md)

Policies (``[precision]`` overrides; each resolved by the hardware probe like a run is):

fp32          the default
bf16-mixed    fp32 weights, bf16 autocast
fp16-mixed    fp32 weights, fp16 autocast + loss scaling; where fp16 matmuls are slower
              than fp32 (CPUs without avx512_fp16/amx_fp16) it resolves to fp32 compute
              with fp16 saved activations, and that is what is measured
dynamic       starts in bf16, switches on trouble (none in runs this short)
bf16-master   bf16 weights, fp32 master weights + fp32 AdamW state (the Megatron/DeepSpeed
              layout; on one device its bf16 weight copy is kept all the time, while
              bf16-mixed recasts its fp32 weights in backward and keeps no copy)
bf16-pure     bf16 weights and bf16 AdamW state, no master copy: the memory-saving variant
              (small updates round away; see tests/precision/test_casting.py)
fp16-forced   ``force = true``: fp16 matmuls even where slow; throughput only, on ``tiny``
              (A and B both tiny) with 1-step samples (matmuls ~20x slower on such CPUs)

1. Peak memory (``--mem_flavor``, default ``small``): each policy in its own process, since
   peak RSS is per process and never goes down; two optimizer steps (the second holds
   weights, gradients, AdamW state and the forward's saved activations at once). Reports
   the process's peak RSS (includes the Python/torch runtime, ~0.3-0.4 GB) and the bytes
   the trainer's memory report tracks (parameters + gradients + optimizer state incl.
   master weights + saved activations), each against fp32. ``--loss_chunk_tokens`` and
   ``--mmap_threshold_kb`` (glibc's ``MALLOC_MMAP_THRESHOLD_`` for the workers: freed
   activations go back to the OS, so peak RSS follows live tensors) apply to every
   policy, fp32 included.
2. Throughput (``--tps_flavor``, default ``small``): per policy one process holding an fp32
   trainer (A) and the policy's trainer (B); samples of ``k`` steps alternate
   A B A B ... A, pair ratio = tokens/s(B_i) / mean(tokens/s(A_i), tokens/s(A_i+1)) (cancels
   drift); the median of the ratios, with min and max. Per sample, the share of the machine
   other processes used is read from /proc/stat (the machine may be shared).
3. Loss (``--loss_flavor``, default ``tiny``): ``--loss_steps`` steps of ``Trainer.fit`` per
   policy, same seed and data; the final validation loss.

Data: the built-in corpus (vocab 8192), prepared once into ~/.cache/trainforge. CPU only.
A benchmark, not a test: it prints the table and exits 0.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainforge.config import load_config
from trainforge.data.prepare import default_data_dir
from trainforge.precision.hardware import detect_capability
from trainforge.precision.memory import peak_memory
from trainforge.train.trainer import Trainer

POLICIES = {
    "fp32": [],
    "bf16-mixed": ["--precision.policy", "bf16-mixed"],
    "fp16-mixed": ["--precision.policy", "fp16-mixed"],
    "dynamic": ["--precision.policy", "dynamic"],
    "bf16-master": ["--precision.policy", "bf16-mixed", "--precision.param_dtype", "bf16"],
    "bf16-pure": ["--precision.policy", "bf16-mixed", "--precision.param_dtype", "bf16",
                  "--precision.optimizer_state_dtype", "bf16"],
    "fp16-forced": ["--precision.policy", "fp16-mixed", "--precision.force", "true"],
}
MEMORY_TARGET = 0.38  # the goal: peak memory >= 38% below fp32 for mixed policies


def overrides(flavor: str, batch: int, seq: int, policy: str, steps: int = 10, threads: int = 1,
              loss_chunk_tokens: int = 0) -> list[str]:
    return ["--training.threads", str(threads), "--training.loss_chunk_tokens", str(loss_chunk_tokens),
            "--model.flavor", flavor, "--training.batch_size", str(batch), "--training.seq_len", str(seq),
            "--training.steps", str(steps), "--training.warmup_steps", "2", "--training.val_batches", "4",
            "--training.val_interval", "0", "--training.log_interval", str(max(steps, 1)),
            "--checkpoint.interval", "0", "--sample.max_new_tokens", "0", "--training.device", "cpu",
            *POLICIES[policy]]


def make_trainer(args, policy: str, flavor: str, batch: int, seq: int, steps: int = 10) -> Trainer:
    cfg = load_config(None, ["--data.path", str(args.data),
                             *overrides(flavor, batch, seq, policy, steps, args.threads, args.loss_chunk_tokens)])
    run_root = tempfile.mkdtemp(prefix=f"bench-precision-{policy}-")
    atexit.register(shutil.rmtree, run_root, ignore_errors=True)
    return Trainer(cfg, Path(run_root) / "run", progress=False)


def busy_s() -> float:
    """Machine-wide busy CPU-seconds (/proc/stat), NaN where unreadable."""
    try:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq = vals
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def timed(fn) -> tuple[float, float]:
    """(wall seconds, share of the machine other processes used meanwhile)."""
    b0, s0, t0 = busy_s(), sum(os.times()[:2]), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    others = (busy_s() - b0) - (sum(os.times()[:2]) - s0)
    return wall, max(0.0, others) / (wall * (os.cpu_count() or 1))


# -- workers (run in their own processes) ------------------------------------------------

def memory_worker(args) -> dict:
    t = make_trainer(args, args.policy, args.mem_flavor, args.mem_batch, args.mem_seq)
    t.train_step()
    t.measure_memory = True  # the trainer's per-dtype report, taken inside the second step
    t.train_step()
    report = t.mp.memory
    peak, source = peak_memory(torch.device("cpu"))
    return {"policy": args.policy, "resolved": t.mp.policy.describe(), "peak_bytes": peak, "peak_source": source,
            "tracked_bytes": report.tracked_bytes(), "params": report.params, "grads": report.grads,
            "optimizer_state": report.optimizer_state, "activations": report.activations}


def alternating_samples(a: Trainer, b: Trainer, k: int, pairs: int) -> tuple[list, list]:
    """Samples of ``k`` training steps, A B A B ... A after one untimed warm-up each (oneDNN
    kernels, allocator): (A's pairs + 1 samples, B's pairs samples), each ``timed``'s
    (wall seconds, others' share), so B_i sits between A_i and A_i+1."""
    def sample(t):
        return timed(lambda: [t.train_step() for _ in range(k)])

    sample(a), sample(b)
    a_s, b_s = [sample(a)], []
    for _ in range(pairs):
        b_s.append(sample(b))
        a_s.append(sample(a))
    return a_s, b_s


def throughput_worker(args) -> dict:
    forced = args.policy == "fp16-forced"
    flavor = args.tps_forced_flavor if forced else args.tps_flavor
    a = make_trainer(args, "fp32", flavor, args.tps_batch, args.tps_seq)
    b = make_trainer(args, args.policy, flavor, args.tps_batch, args.tps_seq)
    k = args.tps_forced_steps if forced else args.tps_steps
    pairs = args.tps_forced_pairs if forced else args.tps_pairs
    tokens = k * a.tokens_per_step
    a_s, b_s = alternating_samples(a, b, k, pairs)
    ratios = [(tokens / b_s[i][0]) / ((tokens / a_s[i][0] + tokens / a_s[i + 1][0]) / 2) for i in range(pairs)]
    return {"policy": args.policy, "resolved": b.mp.policy.describe(), "ratios": ratios,
            "fp32_tokens_per_s": [tokens / s for s, _ in a_s], "tokens_per_s": [tokens / s for s, _ in b_s],
            "others_share_max": max(o for _, o in a_s + b_s), "steps_per_sample": k, "flavor": flavor}


def run_worker(kind: str, policy: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--policy", policy, "--data", str(args.data)]
    for key in ("threads", "loss_chunk_tokens", "mem_flavor", "mem_batch", "mem_seq", "tps_flavor", "tps_batch",
                "tps_seq", "tps_steps", "tps_pairs", "tps_forced_flavor", "tps_forced_steps", "tps_forced_pairs"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = dict(os.environ)
    if args.mmap_threshold_kb:
        # glibc: blocks at least this large are mmap'd and unmapped on free, so peak RSS
        # follows live tensors instead of what the heap kept (see docs/benchmarks-archive.md).
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_kb * 1024)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} worker for {policy} failed:\n{r.stderr[-3000:]}")
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))


# -- main -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer samples (a smoke run)")
    p.add_argument("--json", default=None, help="also write every sample here")
    p.add_argument("--parts", default="memory,throughput,loss", help="comma-separated subset of memory, "
                   "throughput, loss")
    p.add_argument("--policies", default="fp32,bf16-mixed,fp16-mixed,dynamic,bf16-master,bf16-pure,fp16-forced")
    p.add_argument("--threads", type=int, default=1, help="torch threads per trainer; 1 is robust on a shared "
                   "machine (2 threads on 2 busy cores collapse to ~15x slower)")
    p.add_argument("--loss_chunk_tokens", type=int, default=0,
                   help="training.loss_chunk_tokens for every policy (0 = the whole logits tensor at once)")
    p.add_argument("--mmap_threshold_kb", type=int, default=0,
                   help="run the workers with glibc's MALLOC_MMAP_THRESHOLD_ at this many KiB (0 = glibc's "
                        "default, a dynamic threshold)")
    p.add_argument("--mem_flavor", default="small")
    p.add_argument("--mem_batch", type=int, default=4)
    p.add_argument("--mem_seq", type=int, default=256)
    p.add_argument("--tps_flavor", default="small")
    p.add_argument("--tps_batch", type=int, default=2)
    p.add_argument("--tps_seq", type=int, default=128)
    p.add_argument("--tps_steps", type=int, default=1, help="steps per throughput sample")
    p.add_argument("--tps_pairs", type=int, default=4)
    p.add_argument("--tps_forced_flavor", default="tiny", help="fp16-forced: flavor of both A and B")
    p.add_argument("--tps_forced_steps", type=int, default=1, help="fp16-forced: steps per sample")
    p.add_argument("--tps_forced_pairs", type=int, default=2)
    p.add_argument("--loss_flavor", default="tiny")
    p.add_argument("--loss_steps", type=int, default=100)
    p.add_argument("--loss_batch", type=int, default=8)
    p.add_argument("--loss_seq", type=int, default=64)
    p.add_argument("--worker", choices=["memory", "throughput"], help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p


def main() -> None:
    p = build_parser()
    quick = {"mem_flavor": "tiny", "mem_batch": 8, "mem_seq": 128, "tps_flavor": "tiny", "tps_steps": 2,
             "tps_pairs": 3, "loss_steps": 60}
    if "--quick" in sys.argv[1:]:
        p.set_defaults(**quick)  # explicit options still win
    args = p.parse_args()
    if args.worker:
        args.data = Path(args.data)
        out = memory_worker(args) if args.worker == "memory" else throughput_worker(args)
        print(json.dumps(out))
        return
    args.data = default_data_dir(8192)  # prepares the built-in corpus on first use
    policies = args.policies.split(",")
    cap = detect_capability(torch.device("cpu"))
    t_start = time.perf_counter()
    print(f"machine: {cap.name}, {os.cpu_count()} CPUs, {platform.system()}; torch {torch.__version__}, "
          f"{args.threads} thread(s) per trainer; load average {os.getloadavg()[0]:.1f} at start")
    for name, s in cap.support.items():
        print(f"probe: {s.reason} -> {'fast' if s.fast else 'slow'}")

    parts = set(args.parts.split(","))
    if not parts or not parts <= {"memory", "throughput", "loss"}:
        raise ValueError(f"--parts {args.parts!r}: a comma-separated subset of memory, throughput, loss")
    results: dict[str, dict] = {name: {} for name in policies}
    for name in policies:
        if name != "fp16-forced" and "memory" in parts:  # same dtype widths as bf16-mixed; two steps would take minutes
            results[name]["memory"] = run_worker("memory", name, args)
            print(f"memory {name}: peak {results[name]['memory']['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    for name in policies:
        if name != "fp32" and "throughput" in parts:
            results[name]["throughput"] = run_worker("throughput", name, args)
            print(f"throughput {name}: ratios {[round(r, 3) for r in results[name]['throughput']['ratios']]}",
                  flush=True)
    for name in policies:
        if name == "fp16-forced" or "loss" not in parts:
            continue
        t = make_trainer(args, name, args.loss_flavor, args.loss_batch, args.loss_seq, steps=args.loss_steps)
        summary = t.fit()
        t.close()
        results[name]["loss"] = {"final_val_loss": summary["final_val_loss"], "final_loss": summary["final_loss"]}
        print(f"loss {name}: val {summary['final_val_loss']:.4f}", flush=True)

    base = results.get("fp32", {}).get("memory")
    print(f"\nloss chunk: {args.loss_chunk_tokens or 'off'} tokens; glibc mmap threshold: "
          f"{str(args.mmap_threshold_kb) + ' KiB' if args.mmap_threshold_kb else 'default'}")
    print(f"memory: {args.mem_flavor}, batch {args.mem_batch} x seq {args.mem_seq}, 2 steps; throughput: "
          f"{args.tps_flavor}, batch {args.tps_batch} x seq {args.tps_seq}, {args.tps_pairs} pairs of "
          f"{args.tps_steps} steps (fp16-forced: {args.tps_forced_flavor}, {args.tps_forced_pairs} pairs of "
          f"{args.tps_forced_steps} step); loss: "
          f"{args.loss_flavor}, batch {args.loss_batch} x seq {args.loss_seq}, {args.loss_steps} steps")
    header = (f"{'policy':<12} {'peak RSS MiB':>12} {'vs fp32':>8} {'tracked MiB':>11} {'vs fp32':>8} "
              f"{'tok/s vs fp32 (median [min, max])':>34} {'final val loss':>14}")
    print(header)
    print("-" * len(header))
    for name in policies:
        r = results[name]
        mem, tps, loss = r.get("memory"), r.get("throughput"), r.get("loss")
        cells = [f"{name:<12}"]
        if mem and base:
            cells += [f"{mem['peak_bytes'] / 2**20:>12.0f}", f"{mem['peak_bytes'] / base['peak_bytes'] - 1:>+8.1%}",
                      f"{mem['tracked_bytes'] / 2**20:>11.0f}",
                      f"{mem['tracked_bytes'] / base['tracked_bytes'] - 1:>+8.1%}"]
        else:
            cells += [f"{'-':>12}", f"{'-':>8}", f"{'-':>11}", f"{'-':>8}"]
        if tps:
            rs = tps["ratios"]
            cells.append(f"{statistics.median(rs):>14.3f} [{min(rs):.3f}, {max(rs):.3f}]".rjust(34))
        else:
            cells.append(f"{'1 (reference)' if name == 'fp32' and 'throughput' in parts else '-':>34}")
        cells.append(f"{loss['final_val_loss']:>14.4f}" if loss else f"{'-':>14}")
        print(" ".join(cells))
    print("\nresolved policies (this machine):")
    for name in policies:
        src = results[name].get("memory") or results[name].get("throughput")
        if src:
            print(f"  {name:<12} {src['resolved']}")
    if base:
        print("\ntracked bytes per category (MiB):")
        for name in policies:
            mem = results[name].get("memory")
            if mem:
                parts = [f"{c} " + "+".join(f"{d}:{n / 2**20:.0f}" for d, n in sorted(mem[c].items()))
                         for c in ("params", "grads", "optimizer_state", "activations")]
                print(f"  {name:<12} " + ", ".join(parts))
        best = {n: 1 - results[n]["memory"]["peak_bytes"] / base["peak_bytes"] for n in policies
                if n != "fp32" and results[n].get("memory")}
        print(f"\npeak-memory target >= {MEMORY_TARGET:.0%} below fp32: "
              + ", ".join(f"{n} {'PASS' if v >= MEMORY_TARGET else 'FAIL'} ({v:.1%})" for n, v in best.items()))
    shares = [results[n]["throughput"]["others_share_max"] for n in policies if results[n].get("throughput")]
    if shares:
        print(f"other processes used up to {max(shares):.0%} of the machine during throughput samples")
    print(f"total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
