"""MFU against a cached peak that was measured while the machine was busy."""

import json

import torch

from trainforge.train.mfu import PeakFlops, _device_key


def test_a_run_faster_than_the_cached_peak_corrects_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    key = _device_key(cpu, torch.float32)
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: 1e6}))  # 1 MFLOP/s: measured under load
    peak = PeakFlops(cpu, world_size=2)
    assert peak.total == 2e6
    achieved = 2 * 5e8  # 500 MFLOP/s per device: beats the stale peak
    assert peak.mfu(achieved) <= 1.0
    stored = json.loads((tmp_path / "peak_flops.json").read_text())[key]
    assert stored >= 5e8 and peak.per_device == stored  # the next run starts from it
    assert peak.mfu(achieved / 10) == (achieved / 10 / 2) / stored  # below the peak: a plain ratio
