"""bench.shaped_link: the bandwidth-limited link the gradient-compression benchmark runs over.

The namespace tests need root + iproute2 + tbf; without them they are skipped with the reason
``namespace_available()`` gives (the benchmark then falls back to its labelled simulated link,
whose arithmetic is checked below without any privileges)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import shaped_link
from bench.shaped_link import (
    ShapedLink, SimulatedLink, measure_allreduce, measure_throughput, namespace_available, open_link, parse_rate,
    ring_allreduce_bytes, tbf_params, wire_bytes,
)

RATE_100MBIT = 100e6 / 8                                   # bytes/s

_ok, _why = namespace_available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"no shaped network namespace here: {_why}")


def _namespaces() -> set[str]:
    return shaped_link._netns_names()


# ------------------------------------------------------------------ no privileges needed

def test_parse_rate_uses_tc_units():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("12.5mbps") == 100_000_000             # bps = BYTES per second, as in tc(8)
    assert parse_rate(5e6) == 5_000_000
    for bad in ("fast", "100", "-1mbit", "0mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_tbf_burst_holds_a_loopback_packet_and_limit_is_generous():
    p = tbf_params("100mbit")
    assert p.burst_bytes >= 2 * shaped_link.LO_MAX_PACKET
    assert p.limit_bytes >= 64 << 20
    assert tbf_params("1gbit").burst_bytes >= 1e9 / 8 / shaped_link.kernel_hz()
    with pytest.raises(ValueError, match="smaller than one loopback packet"):
        tbf_params("100mbit", burst=32 << 10)


def test_simulated_link_formula():
    link = SimulatedLink("100mbit")
    assert link.simulated and link.label.startswith("simulated")
    per_rank = ring_allreduce_bytes(4_000_000, 2)             # 2 (w-1)/w * nbytes
    assert per_rank == 4_000_000
    # shared medium (what ShapedLink builds): every rank's bytes cross the one bucket
    assert wire_bytes(per_rank, 2) == 8_000_000
    assert link.step_seconds(0.1, per_rank, 2) == pytest.approx(0.1 + 8_000_000 * 8 / 100e6)
    per_host = SimulatedLink("100mbit", medium="per-rank", latency_s=0.001)
    assert per_host.step_seconds(0.1, per_rank, 2, n_collectives=3) == pytest.approx(0.1 + 0.003 + 0.32)
    assert SimulatedLink(None).transfer_seconds(per_rank, 2) == 0.0


def test_open_link_falls_back_loudly(monkeypatch, capsys):
    monkeypatch.setattr(shaped_link, "namespace_available", lambda: (False, "not root (test)"))
    with open_link("100mbit") as link:
        assert isinstance(link, SimulatedLink) and link.reason == "not root (test)"
        r = link.run([sys.executable, "-c", "print('hi')"], timeout_s=30)
        assert r.stdout.strip() == "hi"
    err = capsys.readouterr().err
    assert "not root (test)" in err and "SIMULATED" in err
    with pytest.raises(shaped_link.NamespaceUnavailable):
        open_link("100mbit", allow_simulated=False)
    with pytest.raises(ValueError, match="no wire"):
        measure_throughput(SimulatedLink("100mbit"))


# ---------------------------------------------------------------------- real namespaces

@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(120)
def test_100mbit_link_delivers_the_rate_and_cleans_up():
    with ShapedLink("100mbit") as link:
        assert link.name in _namespaces()
        rate = measure_throughput(link, 8 << 20)
        stats = link.qdisc_stats()
    assert link.name not in _namespaces()
    assert 0.5 * RATE_100MBIT <= rate <= 1.3 * RATE_100MBIT, f"measured {rate / 1e6:.2f} MB/s at 100mbit"
    assert stats["dropped"] == 0, stats


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(120)
def test_unshaped_namespace_is_much_faster():
    with ShapedLink(None) as link:
        rate = measure_throughput(link, 8 << 20)
    assert link.name not in _namespaces()
    assert rate > 4 * RATE_100MBIT, f"unshaped loopback only {rate / 1e6:.1f} MB/s"


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_namespace_removed_after_exception_in_block(exc):
    with pytest.raises(exc):
        with ShapedLink("100mbit") as link:
            assert link.name in _namespaces()
            raise exc("boom")
    assert link.name not in _namespaces()


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_leftover_process_is_killed_and_timeouts_end_the_group():
    with ShapedLink("100mbit") as link:
        # a detached process inside the namespace would keep it alive after `ip netns delete`
        r = link.run(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], timeout_s=10)
        pid = int(r.stdout.strip())
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            link.run(["sleep", "30"], timeout_s=0.5)
        assert time.monotonic() - t0 < 10
    assert link.name not in _namespaces()
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} left in the namespace survived its deletion")


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(180)
def test_gloo_allreduce_over_100mbit_matches_shared_medium_model():
    with ShapedLink("100mbit") as link:
        res = measure_allreduce(link, mbytes=2.0, nproc=2, iters=2)
    assert link.name not in _namespaces()
    # 2 ranks, ring: each sends nbytes; both directions share lo's bucket -> 2 * nbytes / rate
    assert res["expected_s"] == pytest.approx(2 * res["nbytes"] / RATE_100MBIT)
    assert 0.7 * res["expected_s"] <= res["median_s"] <= 1.5 * res["expected_s"], res
    assert res["qdisc_dropped"] == 0, res
