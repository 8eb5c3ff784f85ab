"""The machine probe behind ``trainforge plan --gpu measured``: the alpha-beta fit recovers
known latency and bandwidth, a profile becomes the Cluster the cost model reads, the cache
spares a second probe, and a real 2-process probe measures plausible figures."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

import pytest

from trainforge.model import FLAVORS
from trainforge.plan import comm_model as cm
from trainforge.plan import probe
from trainforge.plan.cost_model import estimate
from trainforge.plan.spec import Cluster, Layout, Workload

SIZES = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]


def test_fit_recovers_alpha_beta_of_exact_samples():
    alpha, beta = 40e-6, 1 / 2.5e9
    fit = probe.fit_alpha_beta(SIZES, [alpha + beta * n for n in SIZES])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.max_rel_error < 1e-9


def test_fit_recovers_latency_despite_noise_at_large_sizes():
    """Multiplicative noise of 10%: at 16 MB that is 0.7 ms, 17x the latency; an unweighted
    fit's intercept would be mostly that noise."""
    rng = random.Random(0)
    alpha, beta = 40e-6, 1 / 2.5e9
    errors = []
    for _ in range(20):
        t = [(alpha + beta * n) * (1 + rng.uniform(-0.1, 0.1)) for n in SIZES]
        fit = probe.fit_alpha_beta(SIZES, t)
        errors.append((abs(fit.alpha_s / alpha - 1), abs(fit.beta_s_per_byte / beta - 1)))
        assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0
    assert max(e[0] for e in errors) < 0.25
    assert max(e[1] for e in errors) < 0.15


def test_fit_keeps_latency_and_bandwidth_positive():
    # Latency-bound at small sizes with a dip: the unconstrained intercept is negative.
    fit = probe.fit_alpha_beta([1000, 2000, 1e6], [3e-4, 1e-4, 1e-3])
    assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0
    flat = probe.fit_alpha_beta([1000, 1e6], [1e-3, 1e-3])
    assert flat.alpha_s == pytest.approx(1e-3) and flat.beta_s_per_byte > 0


def test_fit_rejects_too_few_or_nonpositive_samples():
    with pytest.raises(ValueError, match=">= 2"):
        probe.fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        probe.fit_alpha_beta([1, 2], [1.0, 0.0])


def _cost_model_samples(n: int, bandwidth: float, latency: float) -> dict:
    """Samples as the cost model's formulas would time them on a (bandwidth, latency) tier."""
    link = cm.Link(bandwidth, latency, "intra")
    ops = {"all_reduce": cm.all_reduce_s, "all_gather": cm.all_gather_s, "reduce_scatter": cm.reduce_scatter_s,
           "send_recv": lambda b, k, lk: cm.p2p_s(b, lk)}
    return {op: {str(k): [[s, f(s, k, link)] for s in SIZES] for k in range(2, n + 1)} for op, f in ops.items()}


def _profile(n: int = 4, bandwidth: float = 2e9, latency: float = 5e-5) -> dict:
    samples = {"threads": 1, "matmul_n": 1024, "matmul_fp32_flops_per_s": 1e11, "matmul_fp32_solo_flops_per_s": 1.2e11,
               "memory_bytes_per_s": 5e9, "memory_solo_bytes_per_s": 8e9, "probe_s": 12.0,
               "collectives": _cost_model_samples(n, bandwidth, latency)}
    fits = probe.fit_samples(samples)
    return {"n_procs": n, "date": "2026-12-02 03:00 UTC", "cpu_model": "Test CPU", "cpu_flags": "avx2 fma",
            "bf16_reason": "bf16: not measured", "samples": samples,
            "fits": {op: {str(k): [f.alpha_s, f.beta_s_per_byte, f.max_rel_error] for k, f in by_k.items()}
                     for op, by_k in fits.items()}}


def test_tier_fit_recovers_the_link_the_cost_model_formulas_timed():
    """One latency and bandwidth across ops and group sizes, in comm_model's convention
    (all-reduce: 2 log2(k) latencies and 2(k-1)/k of the bytes), so estimates on the
    measured cluster replay the samples."""
    tier, err = probe.fit_tier(_cost_model_samples(8, 1.5e9, 3e-5), "test")
    assert tier.bandwidth_bytes_per_s == pytest.approx(1.5e9, rel=1e-6)
    assert tier.latency_s == pytest.approx(3e-5, rel=1e-6)
    assert err < 1e-6


def test_profile_becomes_a_one_node_cluster():
    c = probe.cluster_from_profile(_profile(n=4, bandwidth=2e9, latency=5e-5))
    assert isinstance(c, Cluster)
    assert (c.n_gpus, c.gpus_per_node, c.n_nodes) == (4, 4, 1)
    assert c.peak_flops == {"fp32": 1e11}  # no bf16 sample: bf16 is slow here
    assert c.memory_bandwidth_bytes_per_s == 5e9
    assert c.intra.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert c.intra.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert c.inter == c.intra
    assert set(c.collectives) == set(probe.OPS) and set(c.collectives["send_recv"]) == {2, 3, 4}
    # send/recv is one latency + the bytes: its own fit is the tier itself
    assert c.collectives["send_recv"][3].alpha_s == pytest.approx(5e-5, rel=1e-6)
    assert "Test CPU" in c.name and c.sources["cpu_model"] == "Test CPU"
    assert c.sources["cpu_key_flags"] == "avx2 fma"


def test_cost_model_estimates_on_a_measured_cluster():
    """The cost model reads a measured profile like a GPU table entry: a DDP step on it
    costs the compute at the probed rate plus an all-reduce."""
    c = probe.cluster_from_profile(_profile(n=2))
    w = Workload(model=FLAVORS["debug"], seq_len=32, global_batch=4, precision="fp32")
    one, two = estimate(w, Layout(), c), estimate(w, Layout(dp_replicate=2), c)
    assert one.feasible and two.feasible
    assert two.breakdown["dp_comm_s"] > 0 and two.breakdown["compute_s"] == pytest.approx(one.breakdown["compute_s"] / 2)


def test_measured_cluster_probes_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(probe, "measure_profile", lambda n: calls.append(n) or _profile(n))
    a = probe.measured_cluster(3)
    b = probe.measured_cluster(3)
    assert calls == [3] and a == b
    assert (tmp_path / probe.CACHE_FILE).is_file()
    probe.measured_cluster(2)  # another process count is another profile
    probe.measured_cluster(3, cache=False)  # asked to re-measure
    assert calls == [3, 2, 3]


def test_damaged_cache_entry_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path))
    (tmp_path / probe.CACHE_FILE).write_text('{"%s": {"n_procs": 2}}' % probe.machine_key(2))
    monkeypatch.setattr(probe, "measure_profile", lambda n: _profile(n))
    assert probe.measured_cluster(2).n_gpus == 2


def test_bad_process_count_names_the_flag():
    with pytest.raises(ValueError, match="--gpus"):
        probe.measured_cluster(0)


@pytest.mark.slow
def test_two_process_probe_measures_this_machine(tmp_path, monkeypatch):
    """A real probe under torchrun (gloo, 2 processes, about 15 s): positive rates, fits that
    describe their samples, and the second call served from the cache."""
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path))
    monkeypatch.setenv("TRAINFORGE_PROBE_LOCK", str(tmp_path / "lock"))  # the caller may hold the shared one
    c = probe.measured_cluster(2)
    assert 1e8 < c.peak_flops["fp32"] < 1e13  # 0.1 GFLOP/s .. 10 TFLOP/s for one thread
    assert 1e8 < c.memory_bandwidth_bytes_per_s < 1e12
    assert c.intra.bandwidth_bytes_per_s > 1e6 and 0 < c.intra.latency_s < 0.1
    # The fits describe their samples: over 44 fits on a shared 2-core VM (2..8 processes) the
    # median relative residual per fit reached 0.42 and the largest single one 0.93 (4 KB
    # samples, scheduler noise); the bounds sit above that spread.
    samples = json.loads((tmp_path / probe.CACHE_FILE).read_text())[probe.machine_key(2)]["samples"]
    for op in probe.OPS:
        fit = c.collectives[op][2]
        assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0
        errors = [abs(fit.alpha_s + fit.beta_s_per_byte * n - t) / t for n, t in samples["collectives"][op]["2"]]
        assert statistics.median(errors) < 0.6 and max(errors) < 1.5, (op, errors)
    # A collective between compute costs more than back to back, never less (clamped at 0), and
    # stays in the range of a scheduler's wake-up (measured 0.3 ms at 2 processes on a 2-vCPU VM).
    assert set(c.sync_s) == {2} and 0.0 <= c.sync_s[2] < 0.05
    monkeypatch.setattr(probe, "run_probe", lambda *a, **k: pytest.fail("probed again despite the cache"))
    assert probe.measured_cluster(2) == c
