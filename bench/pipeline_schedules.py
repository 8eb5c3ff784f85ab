"""Pipeline schedules on CPU: measured bubble fraction against the analytic value, step
time, and the auto stage split against the even split on a model with a heavy head.

    python bench/pipeline_schedules.py                 # re-launches itself: torchrun, 4 processes
    python bench/pipeline_schedules.py --json out.json # also keep every sample

One torchrun launch of 4 processes, one intra-op thread each, gloo. Stages = 2 runs on
ranks 0-1 (a 2-rank group; ranks 2-3 wait in a barrier), stages = 4 on all four ranks.

Part 1, schedules. A balanced model (8 blocks, dim 128, vocab 256, so the embedding and
head are small) with 8 microbatches, for gpipe, 1f1b, interleaved-1f1b (2 stages per
rank, loop), zbv and dualpipev (2 per rank, V). Each runs ``--warmup`` untimed steps then
``--steps`` timed ones; no optimizer step in between, so steps run back to back and
each rank's step time is the pipeline's period. Measured bubble (per rank) =
1 - (time inside its stages' forward/backward/loss calls) / (its step time), averaged
over ranks, median over steps.

Analytic value (``trainforge.plan.pipeline_sim``, the planner's simulator): torch's own
action list for the schedule (``schedule.pipeline_order``, every rank's) replayed with
F = I = W = 1 time unit per chunk (full backward B = I + W = 2), chunks of a rank sharing
its work (one unit = 1/v of it), no communication cost; bubble = 1 - busy / makespan,
averaged over ranks. For gpipe and 1f1b this is exactly (p-1)/(m+p-1); for
interleaved-1f1b the textbook value is (p-1)/(v·m+p-1); zero-bubble schedules approach 0
under F = I = W. Both textbook values are printed beside it.

Part 2, balancing. A model with a heavy head (4 blocks per stage, dim 64, vocab 8192:
output projection + loss cost about six blocks) under 1f1b. Every rank profiles one
microbatch at once (thread CPU time), ``average_layer_costs`` makes the numbers the same
everywhere, ``plan_stages`` picks the split, then the even and the auto pipelines
alternate step by step. Reported: predicted and measured slowest
stage per step (profile x microbatches; measured: the largest over ranks of the median
over steps of the rank's stage CPU time, the stage's own work, steadier than wall time
under the machine's other load, though a VM's stolen time still counts) and median step
wall time.

This machine has 2 cores: with 4 stages, 4 single-threaded processes share them, so
wall times there include waiting for a core, which shows as compute and hides bubble.
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
import torch.distributed as dist

from trainforge.model.config import ModelConfig
from trainforge.model.llama import build_model
from trainforge.parallel.distributed import destroy_distributed, init_distributed, launched_by_torchrun
from trainforge.parallel.pipeline import (
    SCHEDULES,
    build_pipeline,
    cross_entropy_loss,
    even_boundaries,
    split_model,
)
from trainforge.parallel.stage_balance import average_layer_costs, plan_stages, profile_layer_costs
# The replay lives in the planner's simulator, so the bench checks what the cost model uses.
from trainforge.plan.pipeline_sim import one_f_one_b_order, simulated_bubble

BALANCED = ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=352,
                       max_seq_len=128)
# Heavy head: the output projection + loss over 8192 classes cost about six of these
# blocks, so an even split overloads the last stage (predicted ~1.4x on 2 stages with 8
# blocks, ~1.5x on 4 stages with 16).
UNEVEN = {p: ModelConfig(dim=64, n_layers=4 * p, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden_dim=176,
                         max_seq_len=64) for p in (2, 4)}
BATCH, MICROBATCHES = 16, 8


def textbook_bubble(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def batch(cfg: ModelConfig, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, cfg.vocab_size, (BATCH, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()  # (B, T) each


def run_steps(pipe, x, y, warmup: int, steps: int) -> list[dict]:
    out = []
    for i in range(warmup + steps):
        pipe.step(x if pipe.has_first else None, y if pipe.has_last else None)
        for m in pipe.stage_modules:
            m.zero_grad(set_to_none=True)
        s = pipe.last_step_stats()
        if i >= warmup:
            out.append({"step_s": s.step_s, "compute_s": s.compute_s, "bubble": s.bubble_fraction,
                        "cpu_s": sum(s.stage_cpu_s.values())})
    return out


def gather(obj, group, group_rank: int):
    box = [None] * dist.get_world_size(group) if group_rank == 0 else None
    dist.gather_object(obj, box, dst=dist.get_global_rank(group, 0), group=group)
    return box


def bench_schedules(p: int, group, rank: int, args) -> list[dict]:
    x, y = batch(BALANCED, BALANCED.max_seq_len)
    rows = []
    for name in SCHEDULES:
        stages = split_model(build_model(BALANCED, seed=0), rank, p, None, name)
        pipe = build_pipeline(stages, group, rank, p, name, MICROBATCHES, cross_entropy_loss, "cpu",
                              batch_size=BATCH)
        samples = run_steps(pipe, x, y, args.warmup, args.steps)
        per_rank = gather(samples, group, rank)
        if rank == 0:
            v = len(stages)
            n = len(samples)
            bubble = statistics.median(statistics.fmean(r[i]["bubble"] for r in per_rank) for i in range(n))
            rows.append({"stages": p, "schedule": name, "microbatches": MICROBATCHES, "v": v,
                         "bubble_measured": bubble,
                         "bubble_per_rank": [statistics.median(s["bubble"] for s in r) for r in per_rank],
                         "bubble_analytic": simulated_bubble(
                             one_f_one_b_order(p, MICROBATCHES) if name == "1f1b" else pipe.schedule.pipeline_order,
                             v),
                         "bubble_textbook": textbook_bubble(name, p, MICROBATCHES, v),
                         "step_ms": 1e3 * statistics.median(max(r[i]["step_s"] for r in per_rank) for i in range(n)),
                         "samples": per_rank})
    return rows


def bench_balance(p: int, group, rank: int, args) -> dict | None:
    cfg = UNEVEN[p]
    x, y = batch(cfg, cfg.max_seq_len, seed=1)
    mb = BATCH // MICROBATCHES
    costs = profile_layer_costs(build_model(cfg, seed=0), x[:mb], y[:mb], steps=7, clock=time.thread_time)
    plan = plan_stages(average_layer_costs(costs, group), p, log=rank == 0)
    auto = plan.boundaries
    pipes = {}
    for name, bounds in (("even", even_boundaries(cfg.n_layers, p)), ("auto", auto)):
        stages = split_model(build_model(cfg, seed=0), rank, p, bounds, "1f1b")
        pipes[name] = build_pipeline(stages, group, rank, p, "1f1b", MICROBATCHES, cross_entropy_loss, "cpu",
                                     batch_size=BATCH)
    samples = {name: [] for name in pipes}
    for i in range(args.warmup + args.steps):
        for name, pipe in pipes.items():
            sample = run_steps(pipe, x, y, 0, 1)  # even and auto alternate step by step
            if i >= args.warmup:
                samples[name] += sample
    per_rank = gather(samples, group, rank)
    if rank != 0:
        return None
    out = {"stages": p}
    for name in pipes:
        ranks = [r[name] for r in per_rank]
        n = len(ranks[0])
        out[name] = {
            "boundaries": plan.boundaries if name == "auto" else plan.even_boundaries,
            # The profile is per microbatch; a step runs MICROBATCHES of them through each stage.
            "predicted_slowest_ms": 1e3 * MICROBATCHES * max(plan.stage_times_s if name == "auto"
                                                             else plan.even_stage_times_s),
            "per_rank_cpu_ms": [1e3 * statistics.median(s["cpu_s"] for s in r) for r in ranks],
            "step_ms": 1e3 * statistics.median(max(r[i]["step_s"] for r in ranks) for i in range(n)),
        }
        out[name]["slowest_stage_cpu_ms"] = max(out[name]["per_rank_cpu_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not launched_by_torchrun():
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__,
               *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    if info.world_size != 4:
        raise SystemExit("run with 4 processes (python bench/pipeline_schedules.py launches them)")
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    t0 = time.time()
    load0 = os.getloadavg()
    schedules, balance = [], []
    for p, group in groups.items():
        if info.rank < p:
            schedules += bench_schedules(p, group, info.rank, args)
        dist.barrier()
    for p, group in groups.items():
        if info.rank < p:
            r = bench_balance(p, group, info.rank, args)
            balance += [r] if r else []
        dist.barrier()
    if info.rank == 0:
        report(schedules, balance, load0, os.getloadavg(), time.time() - t0, args)
    destroy_distributed()


def report(schedules, balance, load0, load1, wall_s, args) -> None:
    print("\nstages  schedule          m  v  bubble measured  analytic  textbook  step ms   per-rank bubble")
    for r in schedules:
        tb = "" if r["bubble_textbook"] is None else f"{r['bubble_textbook']:.3f}"
        pr = " ".join(f"{b:.2f}" for b in r["bubble_per_rank"])
        print(f"{r['stages']:>6}  {r['schedule']:<16} {r['microbatches']:>2} {r['v']:>2}  {r['bubble_measured']:>15.3f}"
              f"  {r['bubble_analytic']:>8.3f}  {tb:>8}  {r['step_ms']:>7.1f}   {pr}")
    print("\nstages  split  boundaries        predicted slowest ms  measured slowest ms  step ms  per-rank CPU ms")
    for b in balance:
        for name in ("even", "auto"):
            r = b[name]
            pr = " ".join(f"{t:.0f}" for t in r["per_rank_cpu_ms"])
            print(f"{b['stages']:>6}  {name:<5}  {str(r['boundaries']):<16}  {r['predicted_slowest_ms']:>20.1f}"
                  f"  {r['slowest_stage_cpu_ms']:>19.1f}  {r['step_ms']:>7.1f}  {pr}")
    print(f"\nload average {load0[0]:.2f} before, {load1[0]:.2f} after; {wall_s:.0f} s; "
          f"{args.warmup} warm-up + {args.steps} timed steps each; torch {torch.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schedules": schedules, "balance": balance, "load": [load0, load1], "wall_s": wall_s}, f,
                      indent=1)


if __name__ == "__main__":
    main()
