"""Auto vs even stage split on a model whose last stage is heavy (large vocabulary).

    torchrun --nproc_per_node=2 tests/parallel/workers/pp_balance.py --out RESULT.json

Every rank profiles the layers on one microbatch at the same time; the averaged costs
give every rank the same boundaries. Then an even-split and an auto-split 1F1B pipeline
take turns, one step each, and every rank records its own stage compute time per step:
wall time and the thread's CPU time (the stage's own work, without time spent waiting
for a core). Rank 0 writes the boundaries, the predicted stage times and the measured
per-step times as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from trainforge.model.config import ModelConfig
from trainforge.model.llama import build_model
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.pipeline import build_pipeline, cross_entropy_loss, even_boundaries, split_model
from trainforge.parallel.stage_balance import average_layer_costs, plan_stages, profile_layer_costs

# 8 small blocks, then an output projection + loss over 8192 classes that costs about
# as much as six blocks: the even split puts 4 blocks + the head on stage 1.
CFG = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden_dim=176, max_seq_len=64)
BATCH, SEQ, MICROBATCHES, SCHEDULE = 8, 64, 4, "1f1b"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    rank, world = info.rank, info.world_size
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()  # (B, T)

    mb = BATCH // MICROBATCHES
    costs = profile_layer_costs(build_model(CFG, seed=0), x[:mb], y[:mb], steps=7, clock=time.thread_time)
    # Every rank profiles at once (the contention training sees); the averages are
    # identical everywhere, so every rank plans the same split.
    plan = plan_stages(average_layer_costs(costs), world, log=rank == 0)
    auto = plan.boundaries
    even = even_boundaries(CFG.n_layers, world)

    pipes = {}
    for name, bounds in (("even", even), ("auto", auto)):
        stages = split_model(build_model(CFG, seed=0), rank, world, bounds, SCHEDULE)
        pipes[name] = build_pipeline(stages, None, rank, world, SCHEDULE, MICROBATCHES, cross_entropy_loss, "cpu",
                                     batch_size=BATCH)
    samples = {name: [] for name in pipes}
    for i in range(args.warmup + args.rounds):
        for name, pipe in pipes.items():
            pipe.step(x if pipe.has_first else None, y if pipe.has_last else None)
            for m in pipe.stage_modules:
                m.zero_grad(set_to_none=True)
            s = pipe.last_step_stats()
            if i >= args.warmup:
                samples[name].append({"compute_s": s.compute_s, "cpu_s": sum(s.stage_cpu_s.values()),
                                      "step_s": s.step_s})
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(samples, gathered, dst=0)
    if rank == 0:
        result = {"boundaries": {"even": even, "auto": auto},
                  "predicted_stage_s": {"even": plan.even_stage_times_s, "auto": plan.stage_times_s},
                  # measured[split][rank][step] = {"compute_s", "cpu_s", "step_s"}
                  "measured": {name: [g[name] for g in gathered] for name in pipes}}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    destroy_distributed()


if __name__ == "__main__":
    main()
