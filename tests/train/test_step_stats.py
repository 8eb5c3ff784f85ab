"""The communication-share probe: collective time read from the profiler's raw events is
what ``prof.events()`` (the public, slow path) gives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from trainforge.train.step_stats import COMM_EVENT_PREFIXES, CommShareProbe, collective_us


@pytest.fixture
def one_rank_group():
    """A gloo group of one process (an in-memory store: no port, no file)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_time_matches_the_profiler_events(one_rank_group):
    x = torch.randn(256, 256, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            y = (x @ x).relu().sum()  # operators that are not collectives, which must not count
            y.backward()
            dist.all_reduce(x.grad)
            dist.broadcast(x.grad, src=0)
    want = sum(e.cpu_time_total for e in prof.events() if e.name.startswith(COMM_EVENT_PREFIXES))
    assert want > 0  # the collectives were seen
    assert collective_us(prof) == pytest.approx(want, rel=1e-9)


def test_probe_reports_a_share_of_the_step(one_rank_group):
    probe = CommShareProbe(torch.device("cpu"))
    with probe.measure(enabled=False):
        dist.all_reduce(torch.ones(8))
    assert probe.last_share is None
    with probe.measure(enabled=True):
        dist.all_reduce(torch.ones(1 << 16))
        torch.randn(512, 512) @ torch.randn(512, 512)
    assert 0 < probe.last_share <= 1
