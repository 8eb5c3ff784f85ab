"""``compression.host_reduce``: the inter-node reduction from host memory on a host thread.
Parity against its plain references under torchrun (DDP, 2 ranks, gloo, several
buckets), and the refusals at the edge. Through the real trainer it also runs in
test_compressed_training.py (replicas in sync, wire bytes, exact resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parallel.torchrun import run_torchrun
from trainforge.compression.compressor import PENDING_KEY, GradientCompressor
from trainforge.compression.hooks import check_compression
from trainforge.compression.host_reduce import HostReduce
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


class _TwoRanks:
    """Stands in for a 2-rank group where no collective runs (loading state only)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def _host(delay: int):
    sec = CompressionSection(codec="int4", warmup_steps=0, host_reduce=True, host_reduce_delay=delay)
    return HostReduce(GradientCompressor(sec, _TwoRanks(), torch.device("cpu")), delay, torch.device("cpu"))


def _saved(pending: dict) -> dict:
    state = GradientCompressor(CompressionSection(codec="int4"), _TwoRanks(), torch.device("cpu")).state_dict()
    return {**state, PENDING_KEY: pending} if pending else state


def test_a_resumed_delayed_reduction_applies_the_saved_mean_first():
    mean = torch.arange(6, dtype=torch.float32)
    host = _host(1)
    assert host.load_state_dict(_saved({"ddp.0": mean})) is None
    # The hook's first call returns the checkpoint's pending mean, not this step's gradient.
    assert torch.equal(host.all_reduce_mean("ddp.0", torch.ones(6)), mean) and host.update_ready()


def test_switching_host_reduce_on_or_off_at_resume_warns_what_is_lost():
    host = _host(1)
    assert "first step applies no update" in host.load_state_dict(_saved({}))
    assert "dropped" in _host(0).load_state_dict(_saved({"ddp.0": torch.zeros(6)}))
    device = GradientCompressor(CompressionSection(codec="int4"), _TwoRanks(), torch.device("cpu"))
    assert "dropped" in device.load_state_dict(_saved({"ddp.0": torch.zeros(6)}))
    assert device.load_state_dict(_saved({})) is None
