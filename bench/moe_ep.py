"""Expert parallelism: all-to-all bytes per step and step time, ep = world vs ep 1, on
the same global batch, in one run (gloo on CPU, NCCL on CUDA).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/moe_ep.py
    ... bench/moe_ep.py --flavor moe-tiny --batch 4 --seq 128 --steps 20 --json out.json

Each rank builds the same MoE model twice (one seed): ``ep1`` (FSDP2 over all ranks,
experts sharded like any weight) and ``epN`` (experts split over the ranks with
``parallel/expert_parallel.py``, FSDP2 for the rest), both through
``parallelize_module_stack``, each with its AdamW. Every step feeds both models the same
per-rank batch (each rank its own slice of the global batch); the two take turns
(ABBA order), so the machine's load is shared fairly. A step is timed from a barrier to
a barrier (forward, backward, expert-grad all-reduce, optimizer step) and the slower
rank counts. Headline: the median over steps of the paired ratio t(epN) / t(ep1), with
its min and max; the first ``--warmup`` steps are left out.

All-to-all bytes are counted from the collectives actually issued: the bench wraps
``dist.all_to_all_single`` and adds the bytes this rank sends to *other* ranks (its own
chunk stays local), for the token exchanges and the count exchanges apart. Next to it,
the analytic count for balanced routing: per MoE layer and step, the N k routed
(token, choice) rows of ``dim`` values go out and back in forward and again in backward,
a fraction (ep - 1) / ep of them to other ranks: 4 N k dim bytes_per_value (ep - 1) / ep,
plus the per-expert counts (E int64 values, (ep - 1) / ep of them sent, forward only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainforge.model import FLAVORS, build_model
from trainforge.parallel.apply import expert_grad_reducer, parallelize_module_stack
from trainforge.parallel.dims import ParallelDims
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.section import ParallelSection
from trainforge.train.optimizer import build_optimizer
from trainforge.train.section import OptimizerSection


class A2ACounter:
    """Wraps ``dist.all_to_all_single``: bytes this rank sends to other ranks, by kind."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.bytes = rank, world, {"tokens": 0, "counts": 0}
        self._orig = dist.all_to_all_single

    def __enter__(self):
        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            n = dist.get_world_size(group)
            me = dist.get_group_rank(group, self.rank) if group is not None else self.rank
            rows = input_split_sizes or [input.shape[0] // n] * n
            row_bytes = input[0:1].numel() * input.element_size() if input.shape[0] else 0
            kind = "counts" if input.dtype == torch.int64 else "tokens"
            self.bytes[kind] += sum(r for j, r in enumerate(rows) if j != me) * (
                row_bytes if input.dim() > 1 or kind == "tokens" else input.element_size())
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig

    def take(self) -> dict[str, int]:
        out, self.bytes = self.bytes, {"tokens": 0, "counts": 0}
        return out


def build(cfg, world: int, ep: int, device: torch.device, lr: float):
    section = ParallelSection(dp_shard=-1, ep=ep)
    dims = ParallelDims.resolve(SimpleNamespace(pp=1, dp_replicate=1, dp_shard=-1, tp=1, ep=ep), world)
    dims.check_model(cfg)
    mesh = dims.build_mesh(device.type)
    model = parallelize_module_stack(build_model(cfg, device, seed=0), mesh, dims, section, device)
    reducer = expert_grad_reducer([model], mesh, dims)
    opt = build_optimizer(model, OptimizerSection(), lr, device, distributed=True)
    return model, reducer, opt


def step(model, reducer, opt, x, y) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    if reducer is not None:
        reducer()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def cpu_info() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {"model": platform.processor()}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "?").strip(), "cpus": fields.get("CPU(s)", "?").strip(),
            "flags_simd": " ".join(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4"))),
            "flags": " ".join(flags)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="moe-tiny")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(1) if device.type == "cpu" else None
    world, rank = info.world_size, info.rank
    cfg = dataclasses.replace(FLAVORS[args.flavor], max_seq_len=args.seq)
    models = {"ep1": build(cfg, world, 1, device, 1e-4), f"ep{world}": build(cfg, world, world, device, 1e-4)}
    gen = torch.Generator().manual_seed(1000 + rank)  # this rank's slice of the global batch
    times: dict[str, list[float]] = {k: [] for k in models}
    sent: dict[str, list[dict[str, int]]] = {k: [] for k in models}
    with A2ACounter(rank, world) as counter:
        for i in range(args.warmup + args.steps):
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
            order = list(models) if i % 2 == 0 else list(reversed(models))
            for name in order:
                t = step(*models[name], tokens[:, :-1], tokens[:, 1:])
                if i >= args.warmup:
                    times[name].append(t)
                    sent[name].append(counter.take())
                counter.take()
    ep_name = f"ep{world}"
    ratios = [b / a for a, b in zip(times["ep1"], times[ep_name])]
    n_moe, tokens_per_rank = cfg.n_moe_layers, args.batch * args.seq
    frac = (world - 1) / world
    analytic_tokens = n_moe * 4 * tokens_per_rank * cfg.n_activated_experts * cfg.dim * 4 * frac
    analytic_counts = n_moe * cfg.n_routed_experts * 8 * frac
    measured = {k: torch.tensor([statistics.mean(s[k] for s in sent[ep_name])], dtype=torch.float64)
                for k in ("tokens", "counts")}
    for v in measured.values():
        dist.all_reduce(v)
    result = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "world": world, "device": str(device),
        "flavor": args.flavor, "batch_per_rank": args.batch, "seq": args.seq, "global_batch": args.batch * world,
        "moe_layers": n_moe, "experts": cfg.n_routed_experts, "top_k": cfg.n_activated_experts, "dim": cfg.dim,
        "steps": args.steps, "torch": torch.__version__, "cpu": cpu_info(),
        "a2a_bytes_per_step_per_rank": {"tokens_measured": measured["tokens"].item() / world,
                                        "tokens_analytic_balanced": analytic_tokens,
                                        "counts_measured": measured["counts"].item() / world,
                                        "counts_analytic": analytic_counts},
        "a2a_bytes_ep1": statistics.mean(s["tokens"] + s["counts"] for s in sent["ep1"]),
        "step_s_median": {k: statistics.median(v) for k, v in times.items()},
        "ratio_epN_over_ep1": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    if rank == 0:
        shown = {**result, "cpu": {k: v for k, v in result["cpu"].items() if k != "flags"}}  # flags: in --json
        print(json.dumps(shown, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(result, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
