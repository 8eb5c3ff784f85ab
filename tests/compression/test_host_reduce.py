"""``compression.host_reduce``: the inter-node reduction from host memory on a host thread.
Parity against its plain references under torchrun (DDP, 2 ranks, gloo, several
buckets), and the refusals at the edge. Through the real trainer it also runs in
test_compressed_training.py (replicas in sync, wire bytes, exact resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.torchrun import run_torchrun
from trainforge.compression.hooks import check_compression
from trainforge.compression.section import CompressionSection
from trainforge.errors import ConfigError
from trainforge.parallel.dims import ParallelDims

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.slow
def test_host_reduce_matches_its_references_exactly():
    r = run_torchrun(WORKERS / "host_reduce.py", 2, timeout_s=240)
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))
    assert out["buckets"] > 1  # the case where a collective in a future callback hangs on gloo
    # Tolerance 0: the same arithmetic in the same order, only on another thread.
    assert out["delay0_int4_vs_device_int4"] == 0.0  # delay 0 = the on-device compressed all-reduce
    assert out["delay1_fp32_vs_literal_lag"] == 0.0  # delay 1 = "mean gradient of step t-1 applied at t"
    assert out["delay1_accum2_vs_literal_lag_accum2"] == 0.0  # accumulated on the device, reduced once
    assert out["delay1_int4_resumed_vs_straight"] == 0.0  # the pending mean and residuals are the state
    assert out["delay1_fp32_vs_plain"] > 1e-3  # the control: the delay is real
    assert out["replicas_agree"]


def dims(rep: int, shard: int = 1, tp: int = 1) -> ParallelDims:
    return ParallelDims(pp=1, dp_replicate=rep, dp_shard=shard, tp=tp, world_size=rep * shard * tp)


def test_host_reduce_refuses_what_it_cannot_do_by_name():
    on = CompressionSection(codec="int4", host_reduce=True, host_reduce_delay=1)
    assert check_compression(on, dims(2), "ddp") is None
    assert "has no effect" in check_compression(on, dims(1), "none")
    assert check_compression(on, dims(2, 2), "hsdp") is None
    with pytest.raises(ConfigError, match="compression.host_reduce.*DDP or HSDP only.*tp 2"):
        check_compression(on, dims(2, 1, tp=2), "hsdp")
    with pytest.raises(ConfigError, match="host_reduce_delay.*fp16-mixed"):
        check_compression(on, dims(2), "ddp", "fp16-mixed")
    assert check_compression(CompressionSection(host_reduce=True, host_reduce_delay=0), dims(2), "ddp",
                             "fp16-mixed") is None
    for bad in (CompressionSection(host_reduce=True, host_reduce_delay=2),
                CompressionSection(host_reduce=True, codec="powersgd")):
        with pytest.raises(ConfigError, match="compression.host_reduce"):
            bad.validate()
