"""A module on two pipeline stages, kept identical: the token embedding, where the model's
stage plan (``model/pipeline_plans.py``: ``shared``) gives the last stage a copy too.

The first stage embeds the input tokens; the last stage's copy serves the modules there that
read the embedding (``pipeline.py``), under the same FQN. The copies
start equal (every rank builds the model from one seed) and stay equal, as Megatron keeps
its embeddings shared across stages: after each backward both copies' gradients are
replaced by their sum, the gradient of the one shared parameter, so every optimizer
applies the same update. ``duplicates`` (the last stage's copy) is what the global gradient
norm leaves out, so the embedding counts once there, as in one process.

Hand-written: one exchange between the two ranks (point to point over the pp group; each
adds the other's gradient to its own, and float addition commutes, so both hold the same
bits), or a local sum where one rank holds both (the V-shaped schedules put the first and
the last stage on pp rank 0). Middle ranks take no part.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainforge.model.pipeline_plans import stage_plan
from trainforge.parallel.pipeline import stage_ids_for_rank


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards both copies' gradients the same way over the same dp mesh: the local
    # shards line up, and the sum of two gradients means over dp is the mean of the sums.
    return t.to_local() if isinstance(t, DTensor) else t


class SharedEmbeddingGrads:
    """A grad finisher (``StepLayout.grad_finishers``) for this rank's embedding copies.
    ``pipeline``: this rank's ``Pipeline``; ``pp_group``: its process group."""

    def __init__(self, pipeline: Any, pp_group: Any, pp_rank: int, pp_size: int):
        num_stages = len(pipeline.stages) * pp_size
        last_rank = next(r for r in range(pp_size)
                         if num_stages - 1 in stage_ids_for_rank(r, pp_size, pipeline.schedule_name, num_stages))
        shared = stage_plan(pipeline.stage_modules[0].cfg).shared
        params = lambda m: [p for name in shared for p in m.get_submodule(name).parameters()]  # noqa: E731
        # copies[i]: this rank's copies of the i-th shared parameter (first stage's, then last's)
        self.copies: list[list[nn.Parameter]] = [list(ps) for ps in zip(*[
            params(m) for s, m in zip(pipeline.stages, pipeline.stage_modules) if s.is_first or s.is_last])]
        self.duplicates = [p for s, m in zip(pipeline.stages, pipeline.stage_modules) if s.is_last
                           for p in params(m)]
        ranks = {0, last_rank}
        self.peer = (ranks - {pp_rank}).pop() if pp_rank in ranks and len(ranks) == 2 else None
        self.pp_rank, self.group = pp_rank, pp_group

    @torch.no_grad()
    def __call__(self) -> None:
        for copies in self.copies:
            self._sum(copies)

    def _sum(self, copies: list[nn.Parameter]) -> None:
        missing = [p for p in copies if p.grad is None]
        assert not missing, "a shared module's copy received no gradient"  # both copies are used every step
        grads = [_local(p.grad) for p in copies]
        total = grads[0]
        for g in grads[1:]:
            total.add_(g)
        if self.peer is not None:
            theirs = torch.empty_like(total)
            if self.pp_rank < self.peer:  # opposite orders: neither rank waits on the other's send
                dist.send(total, group=self.group, group_dst=self.peer)
                dist.recv(theirs, group=self.group, group_src=self.peer)
            else:
                dist.recv(theirs, group=self.group, group_src=self.peer)
                dist.send(total, group=self.group, group_dst=self.peer)
            total.add_(theirs)
        for g in grads[1:]:
            g.copy_(total)


def shared_embedding_grads(pipeline: Any, pp_group: Any, pp_rank: int, pp_size: int) -> SharedEmbeddingGrads | None:
    """The finisher when the model's stage plan shares modules between the first and the last
    stage (the same answer on every rank, from the config each stage carries), else None."""
    if not stage_plan(pipeline.stage_modules[0].cfg).shared:
        return None
    return SharedEmbeddingGrads(pipeline, pp_group, pp_rank, pp_size)
