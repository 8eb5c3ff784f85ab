"""What the cost model charges for each collective on a measured CPU cluster: every op priced
by the probe's own fit for its group size, FSDP2's collectives counted per unit as the
trainer issues them, and the per-collective synchronisation cost counted on every layout
that blocks on collectives. On the GPU table (no fits, no sync) nothing changes: sequence
parallel's all-gather + reduce-scatter pair costs what the all-reduce it replaced did."""

from __future__ import annotations

import dataclasses

import pytest

from tests.plan.test_probe import _profile
from trainforge.model import FLAVORS
from trainforge.plan import comm_model as cm
from trainforge.plan import probe
from trainforge.plan.cost_model import estimate
from trainforge.plan.hardware import cluster
from trainforge.plan.probe import OpFit
from trainforge.plan.spec import Layout, Workload

W = Workload(model=FLAVORS["debug"], seq_len=32, global_batch=8, precision="fp32", flavor="debug")
LAYERS = FLAVORS["debug"].n_layers  # 2


def _measured(n: int = 2, **changes) -> probe.MeasuredCluster:
    return dataclasses.replace(probe.cluster_from_profile(_profile(n=n)), **changes)


def test_a_measured_group_prices_each_op_by_its_own_fit():
    fits = {"all_reduce": {2: OpFit(1e-3, 1e-9, 0.0)}, "all_gather": {2: OpFit(2e-3, 2e-9, 0.0)},
            "reduce_scatter": {2: OpFit(3e-3, 3e-9, 0.0)}, "send_recv": {2: OpFit(4e-3, 4e-9, 0.0)}}
    c = _measured(collectives=fits, sync_s={2: 5e-4})
    link = cm.group_link(c, 2, 1)
    assert link.sync_s == 5e-4
    n = 1e6
    assert cm.all_reduce_s(n, 2, link) == pytest.approx(1e-3 + 1e-9 * n)
    assert cm.all_gather_s(n, 2, link) == pytest.approx(2e-3 + 2e-9 * n)
    assert cm.reduce_scatter_s(n, 2, link) == pytest.approx(3e-3 + 3e-9 * n)
    assert cm.p2p_s(n, link) == pytest.approx(4e-3 + 4e-9 * n)
    # A group size the probe did not time falls back to the one tier's formulas.
    other = cm.group_link(c, 3, 1)
    assert other.fits is None and other.sync_s == 0.0
    assert cm.all_gather_s(n, 3, other) == pytest.approx(2 / 3 * n / c.intra.bandwidth_bytes_per_s
                                                          + 2 * c.intra.latency_s)


def test_gpu_links_price_the_sequence_parallel_pair_as_the_all_reduce():
    link = cm.group_link(cluster("h100", 8), 8, 1)
    assert link.fits is None and link.sync_s == 0.0
    n = 3e7
    assert cm.all_gather_s(n, 8, link) + cm.reduce_scatter_s(n, 8, link) == pytest.approx(cm.all_reduce_s(n, 8, link))


def test_fsdp2_pays_each_unit_its_collectives():
    """Per micro-step: all-gathers of every unit forward and every block but the last backward,
    a reduce-scatter per unit (parallel/data_parallel.py's units: each block, then the root).
    On a latency-only link each costs one latency."""
    latency = 1e-3
    c = _measured(collectives={op: {2: OpFit(latency, 1e-18, 0.0)} for op in probe.OPS})
    est = estimate(W, Layout(dp_shard=2), c)
    units = LAYERS + 1  # the blocks and the root
    collectives = units + (LAYERS - 1) + units
    assert est.breakdown["dp_comm_s"] == pytest.approx(collectives * latency, rel=1e-3)


@pytest.mark.parametrize(("layout", "count"), [
    (Layout(dp_replicate=2), 1),  # DDP: one bucket (the trainer sizes it to the whole model)
    (Layout(dp_shard=2), (LAYERS + 1) + (LAYERS - 1) + (LAYERS + 1)),
    # TP: per block 4 all-reduce-sized messages, +2 for the embedding and +2 for the head, each
    # an all-gather and a reduce-scatter under sequence parallel; 3 for the loss; 1 for the norms' gradients
    (Layout(tp=2), 2 * (4 * LAYERS + 4) + 3 + 1),
    (Layout(pp=2, microbatches=4, pp_schedule="1f1b"), 2 * 4),  # a receive each way per microbatch
])
def test_the_sync_cost_is_paid_per_blocking_collective(layout, count):
    sync = 2e-3
    with_sync, without = _measured(sync_s={2: sync}), _measured()
    est, ref = estimate(W, layout, with_sync), estimate(W, layout, without)
    assert est.breakdown["sync_s"] == pytest.approx(count * sync)
    if layout.pp == 1:  # a pipeline stretches its share by the bubble as well
        assert est.step_s - ref.step_s == pytest.approx(count * sync)
    else:
        assert est.step_s - ref.step_s > count * sync


def test_the_probe_keeps_the_sync_cost_beyond_back_to_back():
    prof = _profile(n=4)
    prof["samples"]["sync_s"] = {"between_compute": {"2": 2e-3, "3": 1e-3, "4": 1e-4},
                                 "back_to_back": {"2": 5e-4, "3": 5e-4, "4": 3e-4}}
    c = probe.cluster_from_profile(prof)
    assert c.sync_s == pytest.approx({2: 1.5e-3, 3: 5e-4, 4: 0.0})
    assert "4 ranks +0.00 ms" in c.sources["sync_s"]
    assert probe.cluster_from_profile(_profile(n=4)).sync_s == {}  # an older profile: nothing added


@pytest.mark.parametrize(("n", "pp", "cores", "charged"), [
    (2, 2, 2, 1.0),  # a core per rank: waiting is idle time
    (4, 1, 2, 1.0),  # no pipeline: every rank waits at the same collectives at once
    (8, 2, 2, 0.0),  # one stage's 4 ranks wait while the other 4 keep both cores busy
    (8, 4, 8, 1.0),
    (6, 3, 4, 0.0),
    (4, 2, 3, 1 / 3),  # 2 ranks run while 2 wait: one of 3 cores idles
])
def test_waiting_is_charged_only_where_no_other_rank_can_take_the_core(n, pp, cores, charged):
    from trainforge.plan.cost_model import waiting_charged

    assert waiting_charged(dataclasses.replace(cluster("h100", 8), cores=0), n, pp) == 1.0  # GPUs
    assert waiting_charged(_measured(cores=cores), n, pp) == pytest.approx(charged)


def test_oversubscribed_pipeline_pays_no_bubble_or_sync():
    """8 ranks on 2 cores in 2 stages: while one stage waits the other's 4 ranks run, so the
    bubble and the per-collective waits cost nothing; on 8 cores they cost in full."""
    lay = Layout(dp_shard=2, tp=2, pp=2, microbatches=2, pp_schedule="1f1b")
    base = probe.cluster_from_profile(_profile(n=8))
    busy = dataclasses.replace(base, cores=2, sync_s={2: 1e-3})
    spare = dataclasses.replace(base, cores=8, sync_s={2: 1e-3})
    assert estimate(W, lay, busy).breakdown["bubble_s"] == 0.0
    assert estimate(W, lay, busy).breakdown["sync_s"] == 0.0
    assert estimate(W, lay, spare).breakdown["bubble_s"] > 0 and estimate(W, lay, spare).breakdown["sync_s"] > 0
