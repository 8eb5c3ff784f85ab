"""Worker: train through the real Trainer under torchrun, then check that every
parameter (this rank's shard) is bit-identical across the dp_replicate ranks. Several
runs, one after another in the same launch (a launch costs more than such a run on 2 cores).

usage: sync_check.py RUNS_JSON   (a JSON list of [RUN_DIR, [config overrides...]])

Rank 0 prints one line per run: ``SYNC RUN_DIR checked=N mismatched=[names]``."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainforge.config import load_config
from trainforge.parallel.distributed import destroy_distributed
from trainforge.train.trainer import Trainer


def check(run_dir: str, overrides: list[str]) -> None:
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
        print(f"SYNC {run_dir} checked={checked} mismatched={mismatched}", flush=True)
    trainer.close()


def main() -> None:
    for run_dir, overrides in json.loads(sys.argv[1]):
        check(run_dir, overrides)
    destroy_distributed()


if __name__ == "__main__":
    main()
