"""The CPU AdamW kernel (``optim/adamw.cpp``) against torch's fused CPU AdamW and against the
machine's memory bound, in one process, interleaved.

    python -m bench.cpu_adamw                       # ~2 min on 2 cores: both instruction paths
    python -m bench.cpu_adamw --isa avx512 --rounds 5 --numel 10_000_000   # a quick look

AdamW is memory-bound: per parameter an fp32 step reads the parameter, gradient and two moments
(16 B) and writes the parameter and moments (12 B): 28 B; with bf16 moments 12 + 8 = 20 B. The
bound is the time of the same memory traffic without the arithmetic (``trainforge_optim.stream_``:
the same 4 streams read and 3 written in place, the same chunks and threads), measured in the
same rounds; its bandwidth (bytes / time) is the machine's stream bandwidth for this access
pattern. Also shown: an in-place triad by torch (``a += s * b``, 12 B per element), a common
stream figure, which reads lower here than what AdamW itself reaches. Each round, at 1 and 2
intra-op threads, on one flat buffer of ``--numel`` fp32 parameters (default 100M, 1.6 GB of fp32
state), times in an order alternated per round: the triad, the two bounds (fp32 and bf16
moments), ``torch._fused_adamw_`` (torch's fused CPU AdamW, fp32 moments), ours with fp32
moments and ours with bf16 moments. Reported per configuration: the median over rounds of the
paired ratio torch / ours (> 1: ours faster), min-max over all rounds, and ours as a share of
the bound (bound time / ours, paired per round; 100% = at stream bandwidth).

The AVX2 path runs in a child process with ``TRAINFORGE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2``: both kernels then run their AVX2 code on this CPU (an emulation of an
AVX2-only machine: same memory system, narrower vectors). Then the optimizer's share of a
training step of the ``tiny`` and ``small`` models (forward + backward of one micro-batch, then
the optimizer step, fused vs ours, 1 and 2 threads).

Hold /tmp/cpu.lock on a shared machine (the script takes it itself with ``--lock``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.advise import locked
from bench.cpu_kernels import machine
from trainforge.optim.cpu_adamw import adamw_step_, load_adamw_kernel

BYTES = {"fp32": 28, "bf16": 20}  # read + written per parameter
HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_rounds(numel: int, rounds: int, threads: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-2
    m, v = torch.zeros(numel), torch.full((numel,), 1e-4)
    m16, v16 = m.bfloat16(), v.bfloat16()
    step = [0]

    ops = load_adamw_kernel()

    def triad():
        p.add_(g, alpha=1e-12)

    def bound32():
        ops.stream_(p, g, m, v)

    def bound16():
        ops.stream_(p, g, m16, v16)

    def fused():
        step[0] += 1
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step[0]))], amsgrad=False, maximize=False,
                            lr=HP["lr"], beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)

    def ours32():
        step[0] += 1
        adamw_step_(p, g, m, v, step=step[0], **HP)

    def ours16():
        step[0] += 1
        adamw_step_(p, g, m16, v16, step=step[0], **HP)

    fns = {"triad": triad, "bound_fp32": bound32, "bound_bf16": bound16, "fused": fused, "ours_fp32": ours32,
           "ours_bf16": ours16}
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fn in fns.values():  # warm: first touch, the kernel's load
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for k in order:
                times[k].append(_timed(fns[k]))
    finally:
        torch.set_num_threads(old)
    triad_bw = [12 * numel / t for t in times["triad"]]  # bytes per second, per round
    bw = [BYTES["fp32"] * numel / t for t in times["bound_fp32"]]
    out = {"threads": threads, "stream_GBps": statistics.median(bw) / 1e9,
           "stream_GBps_range": [min(bw) / 1e9, max(bw) / 1e9], "triad_GBps": statistics.median(triad_bw) / 1e9}
    for name, key in (("fp32", "ours_fp32"), ("bf16", "ours_bf16")):
        ratios = [f / o for f, o in zip(times["fused"], times[key])]
        bound = [b / o for b, o in zip(times[f"bound_{name}"], times[key])]  # bound time / ours, paired
        out[name] = {"ms": statistics.median(times[key]) * 1e3, "vs_fused": statistics.median(ratios),
                     "vs_fused_range": [min(ratios), max(ratios)], "of_bound": statistics.median(bound),
                     "of_bound_range": [min(bound), max(bound)]}
    fb = [b / f for b, f in zip(times["bound_fp32"], times["fused"])]
    out["fused"] = {"ms": statistics.median(times["fused"]) * 1e3, "of_bound": statistics.median(fb),
                    "of_bound_range": [min(fb), max(fb)]}
    return out


def step_share(flavor: str, rounds: int, threads: int) -> dict:
    """Forward + backward of one micro-batch (batch 8 x 256 tokens for tiny, 2 x 256 for small),
    then the optimizer step: fused vs ours (fp32 moments), the step's share of the total."""
    from trainforge.model.config import FLAVORS
    from trainforge.model.llama import build_model
    from trainforge.optim.adamw_optimizer import CpuAdamW

    cfg = FLAVORS[flavor]
    model = build_model(cfg, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = 8 if flavor == "tiny" else 2
    tokens = torch.randint(0, cfg.vocab_size, (batch, 257), generator=torch.Generator().manual_seed(0))
    opts = {"fused": torch.optim.AdamW(params, lr=1e-4, fused=True),
            "ours": CpuAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)}
    old = torch.get_num_threads()
    torch.set_num_threads(threads)

    def fwd_bwd():
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    try:
        fwd_bwd()
        for o in opts.values():
            o.step()
        times: dict[str, list[float]] = {"fwd_bwd": [], "fused": [], "ours": []}
        for r in range(rounds):
            times["fwd_bwd"].append(_timed(fwd_bwd))
            for k in (("fused", "ours") if r % 2 == 0 else ("ours", "fused")):
                times[k].append(_timed(opts[k].step))
    finally:
        torch.set_num_threads(old)
    fb = statistics.median(times["fwd_bwd"])
    ratios = [f / o for f, o in zip(times["fused"], times["ours"])]
    return {"flavor": flavor, "threads": threads, "params_M": sum(p.numel() for p in params) / 1e6,
            "fwd_bwd_ms": fb * 1e3, "share_fused": statistics.median(times["fused"]) / (fb + statistics.median(times["fused"])),
            "share_ours": statistics.median(times["ours"]) / (fb + statistics.median(times["ours"])),
            "opt_vs_fused": statistics.median(ratios), "opt_vs_fused_range": [min(ratios), max(ratios)]}


def _fmt_kernel(isa: str, r: dict) -> str:
    lo, hi = r["stream_GBps_range"]
    lines = [f"{isa:7s} {r['threads']} thread(s): stream {r['stream_GBps']:.1f} GB/s [{lo:.1f}-{hi:.1f}] "
             f"(torch triad {r['triad_GBps']:.1f})  "
             f"torch fused {r['fused']['ms']:.0f} ms = {r['fused']['of_bound']:.0%} of bound"]
    for name in ("fp32", "bf16"):
        x = r[name]
        lines.append(f"        ours {name} moments {x['ms']:.0f} ms: {x['vs_fused']:.2f}x torch fused "
                     f"[{x['vs_fused_range'][0]:.2f}-{x['vs_fused_range'][1]:.2f}], {x['of_bound']:.0%} of the "
                     f"{BYTES[name]} B/param bound [{x['of_bound_range'][0]:.0%}-{x['of_bound_range'][1]:.0%}]")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--isa", choices=["avx512", "avx2", "both"], default="both")
    ap.add_argument("--steps", choices=["yes", "no"], default="yes", help="the training-step share section")
    ap.add_argument("--lock", default="/tmp/cpu.lock", help="flock this file while measuring ('' = none)")
    ap.add_argument("--json", action="store_true", help="(child) print one JSON line of kernel rounds")
    args = ap.parse_args()
    if load_adamw_kernel() is None:
        print("the CPU AdamW kernel did not build; nothing to compare")
        return 1
    if args.json:
        print(json.dumps([kernel_rounds(args.numel, args.rounds, t) for t in (1, 2)]))
        return 0
    print(machine())
    print(f"AdamW on one flat buffer of {args.numel / 1e6:.0f}M fp32 parameters, {args.rounds} paired rounds; "
          "median [min-max] over rounds")
    with locked(args.lock):
        for isa in (["avx512", "avx2"] if args.isa == "both" else [args.isa]):
            env = {**os.environ, "TRAINFORGE_CPU_ISA": isa}
            if isa == "avx2":
                env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
            child = subprocess.run([sys.executable, "-m", "bench.cpu_adamw", "--json", "--numel", str(args.numel),
                                    "--rounds", str(args.rounds), "--lock", ""], env=env, capture_output=True,
                                   text=True)
            if child.returncode != 0:
                print(f"{isa}: failed\n{child.stderr[-2000:]}")
                continue
            for r in json.loads(child.stdout.strip().splitlines()[-1]):
                print(_fmt_kernel(isa, r), flush=True)
        if args.steps == "yes":
            print("optimizer step's share of a training step (fwd+bwd of one micro-batch + step), fp32 moments:")
            for flavor in ("tiny", "small"):
                for threads in (1, 2):
                    s = step_share(flavor, max(5, args.rounds // 2), threads)
                    print(f"  {flavor:5s} ({s['params_M']:.0f}M params) {threads} thread(s): fwd+bwd "
                          f"{s['fwd_bwd_ms']:.0f} ms; optimizer share {s['share_fused']:.1%} (torch fused) -> "
                          f"{s['share_ours']:.1%} (ours), step {s['opt_vs_fused']:.2f}x "
                          f"[{s['opt_vs_fused_range'][0]:.2f}-{s['opt_vs_fused_range'][1]:.2f}]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
