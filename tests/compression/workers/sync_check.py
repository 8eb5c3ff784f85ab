"""Worker: train through the real Trainer under torchrun, then check that every
parameter (this rank's shard) is bit-identical across the dp_replicate ranks.

usage: sync_check.py RUN_DIR -- <config overrides...>"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainforge.config import load_config
from trainforge.parallel.distributed import destroy_distributed
from trainforge.train.trainer import Trainer


def main() -> None:
    run_dir, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_config(None, overrides), run_dir, progress=False)
    trainer.fit()
    group = trainer.mesh["dp_replicate"].get_group()
    n = group.size()
    mismatched, checked = [], 0
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            local = (p.to_local() if isinstance(p, DTensor) else p).detach().contiguous()
            got = [torch.empty_like(local) for _ in range(n)]
            dist.all_gather(got, local, group=group)
            checked += 1
            if not all(torch.equal(g, got[0]) for g in got):
                mismatched.append(name)
    if dist.get_rank() == 0:
        print(f"SYNC checked={checked} mismatched={mismatched}", flush=True)
    trainer.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
