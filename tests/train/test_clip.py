"""Gradient clipping on local shards (``step_layout.scale_grads_to_norm_``) gives the bits
``torch.nn.utils.clip_grads_with_norm_`` gives, on plain tensors and on DTensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from trainforge.train.step_layout import scale_grads_to_norm_


@pytest.fixture
def mesh():
    """A one-rank gloo group and its 1-D mesh (an in-memory store: no port, no file)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def params_with_grads(mesh, placements) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape, dtype in [((8, 6), torch.float32), ((6,), torch.float32), ((4, 4), torch.bfloat16)]:
        w, g = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        if mesh is not None:
            w, g = distribute_tensor(w, mesh, placements), distribute_tensor(g, mesh, placements)
        p = torch.nn.Parameter(w)
        p.grad = g
        out.append(p)
    out.append(torch.nn.Parameter(torch.ones(3)))  # no gradient: left alone
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("kind", ["plain", "shard", "replicate"])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipped, and a coefficient clamped to 1
def test_scaling_local_shards_matches_torch(mesh, kind, max_norm):
    placements = {"plain": None, "shard": [Shard(0)], "replicate": [Replicate()]}[kind]
    m = None if kind == "plain" else mesh
    got, want = params_with_grads(m, placements), params_with_grads(m, placements)
    norm = torch.tensor(7.25)
    scale_grads_to_norm_(got, max_norm, norm)
    torch.nn.utils.clip_grads_with_norm_(want, max_norm, norm, foreach=True)
    for a, b in zip(got, want):
        if b.grad is None:
            assert a.grad is None
            continue
        assert isinstance(a.grad, DTensor) == (kind != "plain") and a.grad.dtype == b.grad.dtype
        assert torch.equal(full(a.grad), full(b.grad))
    if max_norm < 7.25:  # the gradients did shrink
        before = params_with_grads(m, placements)[0].grad
        assert full(got[0].grad).abs().sum() < full(before).abs().sum()
