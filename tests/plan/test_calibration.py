"""Calibration of a measured CPU cluster (plan/calibration.py): the arithmetic recovers the
efficiency and overheads that made a set of timings, a calibrated estimate replays the
trainer's measured step, contention and TP's DTensor cost land on the layouts that pay them,
and a CPU with no spare core adds data-parallel traffic instead of hiding it."""

from __future__ import annotations

import dataclasses

import pytest

from tests.plan.test_probe import _profile
from trainforge.model import FLAVORS
from trainforge.plan import calibration as cal
from trainforge.plan import probe
from trainforge.plan.cost_model import estimate
from trainforge.plan.spec import Layout, Workload

W = Workload(model=FLAVORS["debug"], seq_len=32, global_batch=8, precision="fp32", flavor="debug")
EFF, PASS, STEP, TP_PASS, TP_SEQ, TP_STEP = 0.5, 0.01, 0.05, 0.02, 0.001, 0.002
FSDP_PASS, FSDP_SEQ = 0.03, 0.0005


def _cluster(n: int) -> probe.MeasuredCluster:
    """A profile whose N-process rates equal the lone-process ones (contention shows only in
    the concurrent pass timings)."""
    c = probe.cluster_from_profile(_profile(n=max(n, 2)))
    c = dataclasses.replace(c, peak_flops={"fp32": c.solo["fp32_flops_per_s"]},
                            memory_bandwidth_bytes_per_s=c.solo["memory_bytes_per_s"])
    return dataclasses.replace(c, n_gpus=n, gpus_per_node=n) if n == 1 else c


def _samples(slowdown: float = 1.5) -> dict:
    """Timings as a CPU with EFF and the overheads above would give them."""
    b = {k: estimate(dataclasses.replace(W, global_batch=k), Layout(), _cluster(1)).breakdown for k in (2, 8)}
    work = {str(k): b[k]["compute_s"] / EFF + b[k]["memory_bound_s"] for k in (2, 8)}
    return {"date": "2026-12-02 06:00 UTC", "flavor": "debug", "seq_len": 32, "batch_sizes": [2, 8],
            "trainer_step_s": {k: PASS + w + b[8]["optimizer_s"] + STEP for k, w in work.items()},
            "pass_s": {k: PASS + w for k, w in work.items()},
            "tp_pass_s": {k: PASS + w + TP_PASS + TP_SEQ * int(k) for k, w in work.items()},
            "fsdp_pass_s": {k: PASS + w + FSDP_PASS + FSDP_SEQ * int(k) for k, w in work.items()},
            "opt_s": 0.003, "tp_opt_s": 0.003 + TP_STEP,
            "concurrent": {"2": {"pass_s": {k: PASS + slowdown * w for k, w in work.items()}}}}


def test_fit_recovers_the_figures_that_made_the_timings():
    c = cal.fit_calibration(_cluster(1), W, _samples())
    assert c.matmul_efficiency == pytest.approx(EFF, rel=1e-6)
    assert c.pass_overhead_s == pytest.approx(PASS, rel=1e-6)
    assert c.step_overhead_s == pytest.approx(STEP, rel=1e-6)
    assert c.tp_pass_overhead_s == pytest.approx(TP_PASS, rel=1e-6)
    assert c.tp_token_overhead_s == pytest.approx(TP_SEQ / 32, rel=1e-6)
    assert c.tp_step_overhead_s == pytest.approx(TP_STEP, rel=1e-6)
    assert c.fsdp_pass_overhead_s == pytest.approx(FSDP_PASS, rel=1e-6)
    assert c.fsdp_token_overhead_s == pytest.approx(FSDP_SEQ / 32, rel=1e-6)
    assert "trainer steps" in c.source and "FSDP2 (on a one-rank mesh) adds 30 ms per pass" in c.source and "debug at batch 2 and 8" in c.source


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_calibrated_estimate_replays_the_trainers_measured_step(batch):
    """One process: compute / efficiency + memory-bound + AdamW + pass + step overhead is the
    trainer's step at the batch sizes measured, and on the line between them."""
    s = _samples()
    one = cal.calibrate(_cluster(1), W, s)
    lo, hi = (s["trainer_step_s"][k] for k in ("2", "8"))
    expected = lo + (hi - lo) * (batch - 2) / 6
    assert estimate(dataclasses.replace(W, global_batch=batch), Layout(), one).step_s == pytest.approx(expected,
                                                                                                       rel=1e-6)
    assert "measured on this machine" in one.sources["step_overhead_s"]


def test_contention_slows_compute_and_overheads_on_a_shared_cpu():
    s = _samples(slowdown=1.5)
    assert cal.contention(s, 1) == 1.0
    assert cal.contention(s, 2) == pytest.approx(1.5, rel=1e-6)
    two = cal.calibrate(_cluster(2), W, s)
    # A rank's per-sequence cost is the lone trainer's x 1.5, its fixed costs too.
    step = {b: estimate(dataclasses.replace(W, global_batch=b), Layout(), two).step_s for b in (2, 8)}
    t = s["trainer_step_s"]
    assert step[8] - step[2] == pytest.approx(1.5 * (t["8"] - t["2"]), rel=1e-6)
    assert two.step_overhead_s == pytest.approx(1.5 * STEP, rel=1e-6)
    assert two.pass_overhead_s == pytest.approx(1.5 * PASS, rel=1e-6)
    with pytest.raises(ValueError, match="4 processes"):
        cal.contention(s, 4)


def test_dtensor_overhead_lands_on_tensor_parallel_layouts_only():
    c = cal.calibrate(_cluster(2), W, _samples())
    plain = dataclasses.replace(c, tp_pass_overhead_s=0.0, tp_token_overhead_s=0.0, tp_step_overhead_s=0.0)
    tp, ddp = Layout(tp=2), Layout(dp_replicate=2)
    assert estimate(W, ddp, c).step_s == pytest.approx(estimate(W, ddp, plain).step_s)
    extra = estimate(W, tp, c).step_s - estimate(W, tp, plain).step_s
    # One pass of the whole model per step, its DTensor costs (the shard: 8 x 32 / 2 tokens), x contention.
    k = cal.contention(_samples(), 2)
    assert extra == pytest.approx(k * (TP_PASS + TP_SEQ * 8 / 2 + TP_STEP), rel=1e-6)


def test_fsdp2_overhead_lands_on_fsdp2_layouts_only():
    """FSDP2's hooks and buffer copies (timed on a one-rank mesh): per pass and per token of the
    rank's micro-batch, x contention; DDP and TP do not pay it."""
    s = _samples()
    c = cal.calibrate(_cluster(2), W, s)
    plain = dataclasses.replace(c, fsdp_pass_overhead_s=0.0, fsdp_token_overhead_s=0.0)
    for lay in (Layout(dp_replicate=2), Layout(tp=2)):
        assert estimate(W, lay, c).step_s == pytest.approx(estimate(W, lay, plain).step_s)
    extra = estimate(W, Layout(dp_shard=2), c).step_s - estimate(W, Layout(dp_shard=2), plain).step_s
    k = cal.contention(s, 2)  # each rank runs 4 of the 8 sequences in one pass
    assert extra == pytest.approx(k * (FSDP_PASS + FSDP_SEQ * 4), rel=1e-6)
    older = {key: v for key, v in s.items() if key != "fsdp_pass_s"}  # samples from before it was measured
    assert cal.fit_calibration(_cluster(2), W, older).fsdp_pass_overhead_s == 0.0


def test_pipeline_pays_the_pass_overhead_per_microbatch_for_its_share_of_layers():
    c = dataclasses.replace(_cluster(2), pass_overhead_s=0.1)
    base = dataclasses.replace(c, pass_overhead_s=0.0)
    lay = Layout(pp=2, microbatches=4, pp_schedule="1f1b")
    est, ref = estimate(W, lay, c), estimate(W, lay, base)
    # 4 microbatches x half the layers x 0.1 s, stretched by the bubble like compute
    assert est.breakdown["pass_overhead_s"] == pytest.approx(4 * 0.5 * 0.1)
    assert est.step_s - ref.step_s == pytest.approx(0.2 / (1 - ref.breakdown["bubble_s"] / (
        ref.breakdown["bubble_s"] + ref.breakdown["compute_s"] + ref.breakdown["memory_bound_s"])), rel=1e-6)


def test_no_spare_core_adds_data_parallel_traffic_to_the_step(monkeypatch):
    monkeypatch.setattr(probe.os, "cpu_count", lambda: 2)
    prof = _profile(n=2)
    prof["samples"].pop("cpu_count", None)
    busy = probe.cluster_from_profile(prof)
    assert busy.comm_overlaps_compute is False and "added to the step" in busy.sources["comm_overlaps_compute"]
    prof["samples"]["cpu_count"] = 16
    spare = probe.cluster_from_profile(prof)
    assert spare.comm_overlaps_compute is True
    ddp = Layout(dp_replicate=2)
    hidden, added = estimate(W, ddp, spare), estimate(W, ddp, busy)
    assert added.step_s - hidden.step_s == pytest.approx(
        added.breakdown["dp_comm_s"] - hidden.breakdown["exposed_comm_s"], rel=1e-6)
    assert added.breakdown["exposed_comm_s"] == pytest.approx(added.breakdown["dp_comm_s"], rel=1e-6)


def test_trainer_windows_after_the_first_give_the_step_time():
    records = [{"step": 0, "val_loss": 3.0}]
    for step, (t, tps) in enumerate([(10.0, 100.0)] * 4 + [(11.0, 400.0)] * 4 + [(12.0, 200.0)] * 4, start=1):
        records.append({"step": step, "time_unix_s": t, "tokens_per_s": tps})
    assert cal.window_step_s(records, tokens_per_step=100) == [0.25, 0.5]


def test_calibration_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="b_lo < b_hi"):
        cal.measure_samples(W, batch_sizes=(4, 4))
    with pytest.raises(ValueError, match="fp32"):
        cal.fit_calibration(_cluster(1), dataclasses.replace(W, precision="bf16-mixed"), _samples())
