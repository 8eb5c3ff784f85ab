"""torchrun worker for ``bench.shaped_link.measure_allreduce``: times a gloo all-reduce of an
fp32 tensor and prints one JSON line (rank 0). Not a benchmark on its own.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P bench/_link_probe.py --mbytes 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=float, default=4.0, help="tensor size in MB (1e6 bytes)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(args.mbytes * 1e6) // 4
    x = torch.ones(numel, dtype=torch.float32)
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
    # the slowest rank bounds the collective: report the per-iteration max over ranks
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"nbytes": numel * 4, "world_size": world, "seconds": t.tolist(),
                          "median_s": statistics.median(t.tolist())}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
