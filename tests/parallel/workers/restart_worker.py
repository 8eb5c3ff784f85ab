"""Rank 1 dies after the first collective of attempt 0; attempt 1 must rendezvous and finish."""

import os
import sys

import torch
import torch.distributed as dist

from trainforge.parallel.distributed import destroy_distributed, init_distributed

info = init_distributed("cpu", timeout_s=60)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
assert t.item() == sum(range(1, info.world_size + 1))
if attempt == 0 and info.rank == 1:
    os._exit(3)
if attempt == 0:
    dist.barrier()  # rank 0 blocks here until the agent tears the attempt down
if info.rank == 0:
    print(f"attempt {attempt} ok", flush=True)
destroy_distributed()
sys.exit(0)
