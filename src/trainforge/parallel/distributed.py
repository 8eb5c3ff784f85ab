"""Process-group setup for runs launched by ``torchrun`` (single-process runs need none).

Backend by device: gloo on CPU, NCCL on CUDA. With ``torchrun --max-restarts``, the
rendezvous store is reused across restarts and gloo can pick up stale peer addresses
from the previous attempt; wrapping it in a ``PrefixStore`` keyed by
``TORCHELASTIC_RESTART_COUNT`` gives every attempt a clean key space.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_type: str = "cpu", timeout_s: float = 300.0) -> DistInfo:
    """Join the job ``torchrun`` started (or do nothing in a plain single process).

    On CUDA each process is pinned to ``cuda:LOCAL_RANK``. Idempotent."""
    if not launched_by_torchrun():
        return DistInfo(0, 1, 0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return DistInfo(rank, world, local_rank)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    # The default env:// rendezvous, wrapped in a per-attempt prefix (see module docstring).
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"trainforge/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank)


def destroy_distributed() -> None:
    """Tear down after a barrier: gloo aborts a rank whose peers close their
    connections while it is still shutting down (seen ~1 in 4 runs without it)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
