"""Energy, power and memory bandwidth: a counter that exists gives a value, one that is
absent gives no value (never 0); RAPL wrap-around; NVML's GPM bandwidth and the
step-bytes estimate (a fake powercap tree and a fake NVML stand in for the hardware)."""

import json
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from trainforge.monitor import rapl
from trainforge.monitor.monitor import Monitor
from trainforge.monitor.section import MonitorSection
from trainforge.monitor.energy import EnergySampler
from trainforge.monitor.nvml_counters import NvmlCounters
from trainforge.monitor.step_bytes import training_step_bytes

MAX_UJ = 262_143_328_850  # a real package zone's max_energy_range_uj


def zone(root: Path, dirname: str, name: str, energy_uj: int | None, max_uj: int = MAX_UJ) -> Path:
    d = root / dirname
    d.mkdir(parents=True)
    (d / "name").write_text(name + "\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    if energy_uj is not None:
        (d / "energy_uj").write_text(f"{energy_uj}\n")
    return d


def set_uj(d: Path, uj: int) -> None:
    (d / "energy_uj").write_text(f"{uj}\n")


@pytest.fixture
def powercap(tmp_path):
    """Two sockets with a DRAM zone each, an MMIO duplicate and a zone without a counter."""
    root = tmp_path / "powercap"
    (root / "intel-rapl").mkdir(parents=True)  # the control type: no counter
    zones = {"pkg0": zone(root, "intel-rapl:0", "package-0", MAX_UJ - 1_000_000),  # wraps in the test
             "dram0": zone(root, "intel-rapl:0:0", "dram", 5_000_000),
             "pkg1": zone(root, "intel-rapl:1", "package-1", 0),
             "mmio": zone(root, "intel-rapl-mmio:0", "package-0", 7)}
    zone(root, "intel-rapl:1:0", "dram", None)  # present, but no readable energy_uj
    return root, zones


def test_rapl_zones_sum_sockets_handle_wraparound_and_skip_unreadable(powercap):
    root, z = powercap
    meter = rapl.RaplMeter(root)
    assert meter.domains == ["dram", "package"]
    assert meter.read() == {"package": 0.0, "dram": 0.0}
    set_uj(z["pkg0"], 2_000_000)  # wrapped: 1 J to the top, then 2 J
    set_uj(z["pkg1"], 4_000_000)
    set_uj(z["dram0"], 5_500_000)
    set_uj(z["mmio"], 10**12)  # ignored: it repeats the package counter
    got = meter.read()
    assert got["package"] == pytest.approx(3.0 + 4.0) and got["dram"] == pytest.approx(0.5)
    assert rapl.wrapped_delta(10, 3, 100) == 93 and rapl.wrapped_delta(3, 10, 100) == 7


def test_no_powercap_means_no_energy_keys_not_zero(tmp_path):
    sampler = EnergySampler(torch.device("cpu"), powercap=tmp_path / "missing")
    sampler.sample(tokens=0.0)
    out = sampler.sample(tokens=1000.0, step_bytes=400, steps_per_s=2.0)
    assert not {"energy_j", "power_w", "energy_per_token_j"} & set(out)
    assert out["memory_bandwidth_bytes_per_s"] == {"step_bytes_estimate": 800.0}  # said to be an estimate
    assert sampler.sources() == {"energy": [], "bandwidth": []}


def test_energy_per_token_and_power_over_the_window(powercap):
    root, z = powercap
    sampler = EnergySampler(torch.device("cpu"), powercap=root)
    first = sampler.sample(tokens=0.0)
    assert "energy_per_token_j" not in first  # no tokens before the first window to divide by
    set_uj(z["pkg0"], MAX_UJ - 1_000_000 + 30_000_000)  # +30 J
    set_uj(z["pkg1"], 10_000_000)  # +10 J
    set_uj(z["dram0"], 9_000_000)  # +4 J
    out = sampler.sample(tokens=2000.0)
    assert out["energy_j"] == pytest.approx({"package": 40.0, "dram": 4.0})
    assert out["energy_per_token_j"] == pytest.approx({"package": 0.02, "dram": 0.002})
    assert out["power_w"]["package"] > 0 and out["power_w"]["package"] / out["power_w"]["dram"] == pytest.approx(10)
    rolled_back = sampler.sample(tokens=1000.0)  # a rollback: tokens went back, no per-token value
    assert "energy_per_token_j" not in rolled_back and rolled_back["energy_j"] == {"package": 0.0, "dram": 0.0}


def test_rapl_is_read_by_local_rank_zero_only(powercap):
    root, _ = powercap
    assert EnergySampler(torch.device("cpu"), local_rank=1, powercap=root).sources()["energy"] == []
    assert EnergySampler(torch.device("cpu"), local_rank=0, powercap=root).sources()["energy"] == ["dram", "package"]


class FakeNvml:
    """The pynvml functions the counters call; a name in ``missing`` raises as NVML does
    for a query the GPU does not support."""

    NVML_CLOCK_MEM, NVML_SUCCESS, NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_DRAM_BW_UTIL = 2, 0, 1, 10

    def __init__(self, missing=(), dram_util_pct=50.0):
        self.missing, self.dram_util_pct, self.energy_mj, self.samples = set(missing), dram_util_pct, 1_000_000, 0

    def __getattribute__(self, name):
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise RuntimeError(f"NVMLError_NotSupported: {name}")
        return object.__getattribute__(self, name)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_000  # mW

    def nvmlDeviceGetMemoryBusWidth(self, h):
        return 5120

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_MEM
        return 2619

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=90, memory=40)

    def nvmlGpmQueryDeviceSupport(self, h):
        return types.SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self):
        return object()

    def nvmlGpmSampleGet(self, h, sample):
        self.samples += 1
        return sample

    def c_nvmlGpmMetricsGet_t(self):
        return types.SimpleNamespace(metrics=[types.SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0)])

    def nvmlGpmMetricsGet(self, get):
        assert get.metrics[0].metricId == self.NVML_GPM_METRIC_DRAM_BW_UTIL and get.sample1 is not get.sample2
        get.metrics[0].value = self.dram_util_pct
        return get


H100_PEAK = 5120 / 8 * 2619e6 * 2  # 3.35 TB/s, the published H100 SXM figure


def test_nvml_gpm_gives_measured_hbm_bandwidth_and_energy(tmp_path):
    nv = FakeNvml()
    sampler = EnergySampler(torch.device("cpu"), nvml=(nv, "h"), powercap=tmp_path)
    assert sampler.sources() == {"energy": ["gpu"], "bandwidth": ["nvml_gpm"]}
    sampler.sample(tokens=0.0)
    nv.energy_mj += 700_000  # +700 J
    out = sampler.sample(tokens=7000.0, step_bytes=1000, steps_per_s=1.0)
    assert out["energy_j"] == pytest.approx({"gpu": 700.0}) and out["energy_per_token_j"] == pytest.approx({"gpu": 0.1})
    assert out["memory_bandwidth_bytes_per_s"] == pytest.approx({"nvml_gpm": 0.5 * H100_PEAK,
                                                                 "step_bytes_estimate": 1000.0})
    assert out["memory_bandwidth_peak_bytes_per_s"] == pytest.approx(3.35e12, rel=0.01)
    assert nv.samples == 3  # one at the start, one per window: each window is its own interval


def test_older_gpu_reports_an_upper_bound_and_power_without_energy(tmp_path):
    nv = FakeNvml(missing={"nvmlGpmQueryDeviceSupport", "nvmlDeviceGetTotalEnergyConsumption"})
    sampler = EnergySampler(torch.device("cpu"), nvml=(nv, "h"), powercap=tmp_path)
    sampler.sample(tokens=0.0)
    out = sampler.sample(tokens=10.0)
    assert "energy_j" not in out and "energy_per_token_j" not in out
    assert out["power_w"] == {"gpu": 350.0}
    assert out["memory_bandwidth_bytes_per_s"] == pytest.approx({"nvml_busy_x_peak": 0.4 * H100_PEAK})


def test_gpu_without_any_counter_gives_no_gpu_keys(tmp_path):
    nv = FakeNvml(missing={n for n in dir(FakeNvml) if n.startswith("nvml")})
    sampler = EnergySampler(torch.device("cpu"), nvml=(nv, "h"), powercap=tmp_path)
    sampler.sample(tokens=0.0)
    assert sampler.sample(tokens=10.0) == {}


def test_step_bytes_of_fp32_adamw_is_40_bytes_per_parameter():
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    # forward 4 + backward 4 + gradient write 4 + AdamW (read p, g, m, v; write p, m, v) 28
    assert training_step_bytes([model], [opt], micro_batches=1) == 40 * n
    # each further micro-batch: weights twice, gradient read + write, saved activations twice
    assert training_step_bytes([model], [opt], micro_batches=3, activation_bytes=1000) == 40 * n + 2 * 16 * n + 6000


def test_monitor_records_power_energy_per_token_and_the_labelled_estimate(tmp_path, monkeypatch):
    """Through the monitor's write path: a package counter that rises at 50 W while two
    windows of two steps (two micro-batches each) run."""
    root = tmp_path / "powercap"
    zone(root, "intel-rapl:0", "package-0", 0)
    monkeypatch.setattr(rapl, "POWERCAP", root)
    monkeypatch.setattr(rapl.RaplZone, "read_uj", lambda self: int(time.perf_counter() * 50e6) % MAX_UJ)
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    steps = [0]
    dims = types.SimpleNamespace(world_size=1, pp=1, dp_replicate=1, dp_shard=1, tp=1)
    mon = Monitor(MonitorSection(interval_steps=0), tmp_path / "metrics.jsonl", [model], [opt], torch.device("cpu"),
                  dims, types.SimpleNamespace(rank=0, local_rank=0), lambda: steps[0])
    tokens_per_step = 256
    try:
        for window in range(2):
            for _ in range(2):
                for _micro in range(2):
                    model(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
                steps[0] += 1
            time.sleep(0.2)
            for s in (steps[0] - 1, steps[0]):
                mon.write({"step": s, "loss": 1.0, "tokens": s * tokens_per_step, "tokens_per_s": 1000.0,
                           **({"mem_activations_fp32_bytes": 1024} if s == steps[0] else {})})
    finally:
        mon.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    n = sum(p.numel() for p in model.parameters())
    first, second = records[0], records[2]
    # 2 micro-batches; the activation bytes arrive with a window's last record, so from window 2 on
    assert first["step_bytes_estimate"] == 40 * n + 16 * n
    assert second["step_bytes_estimate"] == 40 * n + 16 * n + 2 * 2 * 1024
    assert second["memory_bandwidth_bytes_per_s"] == pytest.approx(
        {"step_bytes_estimate": second["step_bytes_estimate"] * 1000.0 / tokens_per_step})
    assert second["power_w"]["package"] == pytest.approx(50.0, rel=0.1)
    # energy between the windows / the 2 x 256 tokens trained in between
    assert second["energy_per_token_j"]["package"] == pytest.approx(second["energy_j"]["package"] / 512)
    assert "energy_per_token_j" not in first  # no earlier window to count tokens from
    # the counter adds each window's energy once, not once per record of the window
    assert mon.registry.value("trainforge_energy_joules_total", domain="package") == pytest.approx(
        first["energy_j"]["package"] + second["energy_j"]["package"])
    mon_registry = {f.name for f in mon.registry.families()}
    assert {"trainforge_power_watts", "trainforge_energy_joules_total", "trainforge_energy_per_token_joules",
            "trainforge_memory_bandwidth_bytes_per_second"} <= mon_registry


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NVML")
def test_real_gpu_reports_power_and_a_bandwidth_that_follows_a_copy_loop():
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra) not installed")
    sampler = EnergySampler(torch.device("cuda"), local_rank=1)  # local rank 1: the GPU only, no RAPL
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 256 MiB
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    copies = 0
    while time.perf_counter() - t0 < 2.0:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
        copies += 20
    copied = 2 * src.numel() * copies / (time.perf_counter() - t0)  # read + write bytes/s
    out = sampler.sample(tokens=0.0)
    assert out["power_w"]["gpu"] > 10  # a busy GPU draws tens of watts at least
    peak = out["memory_bandwidth_peak_bytes_per_s"]
    assert copied < peak * 1.05  # the peak is the theoretical one: nothing beats it
    if "nvml_gpm" in out["memory_bandwidth_bytes_per_s"]:  # Hopper and later: the window's own DRAM counters
        assert out["memory_bandwidth_bytes_per_s"]["nvml_gpm"] == pytest.approx(copied, rel=0.35)


def imc(root: Path, name: str) -> None:
    """A fake Intel IMC PMU in sysfs: CAS counts of 64-byte lines, scale to MiB."""
    d = root / name
    (d / "format").mkdir(parents=True)
    (d / "events").mkdir()
    (d / "type").write_text("13\n")
    (d / "cpumask").write_text("0\n")
    (d / "format" / "event").write_text("config:0-7\n")
    (d / "format" / "umask").write_text("config:8-15\n")
    for event, umask in (("cas_count_read", "0x03"), ("cas_count_write", "0x0c")):
        (d / "events" / event).write_text(f"event=0x04,umask={umask}\n")
        (d / "events" / f"{event}.scale").write_text("6.103515625e-5\n")  # 64 B in MiB
        (d / "events" / f"{event}.unit").write_text("MiB\n")


def test_perf_uncore_counts_bytes_of_every_memory_controller(tmp_path):
    from trainforge.monitor.perf_uncore import UncoreMeter, parse_config

    assert parse_config("event=0x04,umask=0x03", {"event": "config:0-7", "umask": "config:8-15"}) == {"config": 0x0304}
    assert parse_config("event=0x1ff,edge", {"event": "config:0-7,32-35", "edge": "config:18"}) == \
        {"config": 0xff | (1 << 32) | (1 << 18)}
    root = tmp_path / "devices"
    imc(root, "uncore_imc_0")
    imc(root, "uncore_imc_1")
    (root / "cpu").mkdir()  # not a memory controller
    counts, opened = {}, []

    def opener(pmu_type, config, pid, cpu):
        assert pmu_type == 13 and pid == -1 and cpu == 0  # the whole machine, on the PMU's CPU
        opened.append(config["config"])
        counts[len(opened)] = 1000
        return len(opened)

    meter = UncoreMeter(root, opener=opener, reader=lambda fd: counts[fd])
    assert sorted(opened) == [0x0304, 0x0304, 0x0c04, 0x0c04]
    for fd in counts:
        counts[fd] += 2 ** 20  # a million lines on each controller and direction: 64 MiB
    assert meter.read() == pytest.approx({"read": 2 * 64 * 2 ** 20, "write": 2 * 64 * 2 ** 20})
    sampler = EnergySampler(torch.device("cpu"), powercap=tmp_path, uncore=meter)
    assert sampler.sources()["bandwidth"] == ["perf_uncore"]
    for fd in counts:
        counts[fd] += 2 ** 20
    assert sampler.sample(tokens=None)["memory_bandwidth_bytes_per_s"]["perf_uncore"] > 0
    refused = UncoreMeter(root, opener=lambda *a: (_ for _ in ()).throw(PermissionError(13, "paranoid")))
    assert refused.read() == {} and "perf_uncore" not in EnergySampler(torch.device("cpu"), powercap=tmp_path,
                                                                       uncore=refused).sources()["bandwidth"]


def test_perf_event_open_counts_this_process_task_clock():
    """The real syscall on a software event any process may count on itself."""
    import os

    from trainforge.monitor.perf_uncore import perf_event_open, read_count

    try:
        fd = perf_event_open(1, {"config": 1}, 0, -1)  # PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK
    except OSError as e:
        pytest.skip(f"perf_event_open refused here: {e}")
    try:
        before = read_count(fd)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            pass
        assert read_count(fd) - before >= 10_000_000  # >= 10 ms of task clock, in ns, for a 50 ms busy loop
    finally:
        os.close(fd)
