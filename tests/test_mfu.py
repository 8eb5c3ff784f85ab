"""MFU's peak: published for known GPUs, else the best of short probes that load cannot
spoil for long (a stale low cache is corrected, a window that beats the peak raises it),
and MFU never above 1."""

import json

import pytest
import torch

from trainforge.train import mfu as mfu_mod
from trainforge.train.mfu import PeakFlops, _device_key, _store_peak, published_peak

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path))
    return tmp_path / "peak_flops.json"


def scripted_probes(monkeypatch, *values):
    """measure_matmul_peak returns ``values`` in turn (the last one from then on)."""
    calls = []

    def fake(device, dtype=torch.float32, n=None, probes=mfu_mod.PROBES, **kw):
        calls.append(probes)
        return values[min(len(calls) - 1, len(values) - 1)]
    monkeypatch.setattr(mfu_mod, "measure_matmul_peak", fake)
    return calls


def test_a_stale_low_cached_peak_is_raised_at_startup(cache):
    key = _device_key(CPU, torch.float32)
    cache.write_text(json.dumps({key: 1e6}))  # 1 MFLOP/s: measured under load (or by an older version)
    peak = PeakFlops(CPU, world_size=2)
    assert peak.per_device > 1e8  # any CPU does 100 MFLOP/s on a 1024 x 1024 matmul
    assert json.loads(cache.read_text())[key] == peak.per_device  # the next run starts from it
    assert peak.total == 2 * peak.per_device
    assert peak.source == "measured: best of 5 fp32 matmul probes"


def test_a_window_faster_than_a_too_low_peak_raises_it_and_mfu_stays_at_most_1(cache, monkeypatch):
    scripted_probes(monkeypatch, 1e6)  # every probe runs on a machine busy with something else
    peak = PeakFlops(CPU, world_size=2)
    assert peak.record() == {"mfu_peak_flops": 2e6, "mfu_peak_source": "measured: best of 5 fp32 matmul probes"}
    achieved = 2 * 5e8  # the job: 500 MFLOP/s per device, far above the spoiled peak
    assert peak.mfu(achieved, step=7) == 1.0  # not 500
    assert peak.per_device == 5e8 and peak.total == 1e9
    assert peak.source == "achieved: step 7 beat the best of 5 fp32 matmul probes"
    assert json.loads(cache.read_text())[_device_key(CPU, torch.float32)] == 5e8
    assert peak.mfu(achieved / 10) == pytest.approx(0.1)  # below the raised peak: a plain ratio


def test_a_re_probe_that_beats_the_window_becomes_the_peak(cache, monkeypatch):
    calls = scripted_probes(monkeypatch, 1e6, 2e9)  # busy at startup, idle at the re-probe
    lines = []
    peak = PeakFlops(CPU, log=lines.append)
    assert peak.mfu(5e8, step=3) == pytest.approx(0.25)
    assert calls == [5, 5] and peak.per_device == 2e9
    assert peak.source == "measured: best of 5 fp32 matmul probes, re-probed at step 3"
    assert len(lines) == 1 and "raised from 1 MFLOP/s to 2 GFLOP/s" in lines[0] and "step 3" in lines[0]


def test_the_cache_is_never_lowered(cache):
    assert _store_peak(CPU, torch.float32, 5e9) == 5e9
    assert _store_peak(CPU, torch.float32, 1e9) == 5e9  # a later run on a busy machine
    assert json.loads(cache.read_text())[_device_key(CPU, torch.float32)] == 5e9


def test_a_probe_takes_the_best_of_several_short_rounds():
    peak = mfu_mod.measure_matmul_peak(CPU, n=128, probes=3, probe_s=0.01, pause_s=0.0)
    assert 1e7 < peak < 1e14  # 10 MFLOP/s .. 100 TFLOP/s: a plausible CPU, and not zero


@pytest.mark.parametrize("name, dtype, tf32, tflops, label", [
    ("NVIDIA H200", torch.bfloat16, False, 989.4, "published: NVIDIA H200 bf16 dense"),
    ("NVIDIA H100 80GB HBM3", torch.float16, False, 989.4, "published: NVIDIA H100 80GB HBM3 fp16 dense"),
    ("NVIDIA H100 PCIe", torch.float32, True, 378.0, "published: NVIDIA H100 PCIe tf32 dense"),
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5, "published: NVIDIA A100-SXM4-80GB fp32 dense"),
    ("NVIDIA L4", torch.bfloat16, False, 121.0, "published: NVIDIA L4 bf16 dense"),
    ("NVIDIA L40S", torch.bfloat16, False, 362.05, "published: NVIDIA L40S bf16 dense"),
])
def test_published_dense_peaks_by_device_name(name, dtype, tf32, tflops, label):
    flops, source = published_peak(name, dtype, tf32=tf32)
    assert flops == pytest.approx(tflops * 1e12) and source == label


@pytest.mark.parametrize("name, dtype", [("NVIDIA GH200 480GB", torch.bfloat16),  # not an H200 row
                                         ("Tesla V100-SXM2-16GB", torch.bfloat16),  # no bf16 tensor cores
                                         ("Some Future GPU", torch.bfloat16)])
def test_devices_or_dtypes_outside_the_table_have_no_published_peak(name, dtype):
    assert published_peak(name, dtype) is None


def test_a_known_gpu_uses_its_published_peak_and_an_unknown_one_is_probed(cache, monkeypatch):
    calls = scripted_probes(monkeypatch, 3e13)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = PeakFlops(torch.device("cuda", 0), world_size=4, dtype=torch.bfloat16)
    assert calls == [] and peak.total == pytest.approx(4 * 989.4e12)
    assert peak.source == "published: NVIDIA H200 bf16 dense"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    peak = PeakFlops(torch.device("cuda", 0), dtype=torch.bfloat16)
    assert calls == [5] and peak.per_device == 3e13 and peak.source == "measured: best of 5 bf16 matmul probes"
