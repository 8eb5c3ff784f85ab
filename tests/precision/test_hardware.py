"""Hardware awareness: flags + measurement decide, the probe is cached, slow dtypes fall back."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trainforge.precision.hardware import (NATIVE_CPU_FLAGS, cpu_capability, decide, native_support, read_cpuinfo,
                                           resolve_compute_dtype)

X86 = """processor\t: 0
model name\t: Test CPU 9000
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: Test CPU 9000
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni
"""
ARM = """processor\t: 0
Features\t: fp asimd fphp asimdhp bf16 i8mm
CPU part\t: 0xd40
"""


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log():
    logger = logging.getLogger("trainforge.test.precision.hardware")
    logger.propagate = False
    handler = ListHandler()
    logger.addHandler(handler)
    logger.messages = handler.messages
    yield logger
    logger.removeHandler(handler)


def test_cpuinfo_flags(tmp_path):
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    model, flags = read_cpuinfo(tmp_path / "x86")
    assert model == "Test CPU 9000"
    assert native_support("bf16", flags) is True and native_support("fp16", flags) is False
    _, arm_flags = read_cpuinfo(tmp_path / "arm")
    assert native_support("bf16", arm_flags) is True and native_support("fp16", arm_flags) is True
    assert read_cpuinfo(tmp_path / "missing") == ("unknown-cpu", None)
    assert native_support("bf16", None) is None


def test_measurement_decides_flags_are_the_fallback():
    # Flags present but this torch build is slow with them: the measurement wins.
    assert not decide("bf16", native=True, slowdown=3.0).fast
    # No flag, but the kernels are fast anyway (e.g. oneDNN emulation on a wide core).
    assert decide("bf16", native=False, slowdown=0.8).fast
    assert decide("bf16", native=True, slowdown=None).fast
    assert not decide("fp16", native=False, slowdown=None).fast
    assert not decide("fp16", native=None, slowdown=None).fast  # nothing known: assume slow
    assert "19.00x" in decide("bf16", native=False, slowdown=19.0).reason


def test_probe_is_cached_per_machine(tmp_path):
    (tmp_path / "cpuinfo").write_text(X86)
    calls = []

    def fake_measure(dtype):
        calls.append(dtype)
        return {torch.bfloat16: 0.6, torch.float16: 25.0}[dtype]

    cap = cpu_capability(tmp_path / "cache", measure=fake_measure, cpuinfo=tmp_path / "cpuinfo")
    assert cap.support["bf16"].fast and not cap.support["fp16"].fast
    assert sorted(map(str, calls)) == ["torch.bfloat16", "torch.float16"]
    cached = json.loads((tmp_path / "cache" / "precision_probe.json").read_text())
    (key,) = cached
    assert key.startswith("Test CPU 9000|") and torch.__version__ in key

    again = cpu_capability(tmp_path / "cache", measure=fake_measure, cpuinfo=tmp_path / "cpuinfo")
    assert len(calls) == 2 and again.support == cap.support  # served from the cache
    cpu_capability(tmp_path / "cache", refresh=True, measure=fake_measure, cpuinfo=tmp_path / "cpuinfo")
    assert len(calls) == 4


def test_slow_dtype_falls_back_and_warns(capability, log):
    slow = capability(bf16_fast=False, fp16_fast=False)
    dtype, reason = resolve_compute_dtype(torch.bfloat16, torch.device("cpu"), capability=slow, log=log)
    assert dtype == torch.float32 and "slower than fp32" in reason
    assert any("precision.force" in m for m in log.messages)
    forced, _ = resolve_compute_dtype(torch.bfloat16, torch.device("cpu"), force=True, capability=slow, log=log)
    assert forced == torch.bfloat16
    fast = capability(bf16_fast=True, fp16_fast=False)
    assert resolve_compute_dtype(torch.bfloat16, torch.device("cpu"), capability=fast)[0] == torch.bfloat16
    # A GPU without bf16: fp16 (with loss scaling), not fp32.
    old_gpu = capability(bf16_fast=False, fp16_fast=True, device_type="cuda")
    assert resolve_compute_dtype(torch.bfloat16, torch.device("cpu"), capability=old_gpu)[0] == torch.float16


def test_probe_on_this_machine(tmp_path):
    """The real probe, on this CPU: its decision follows the measurement, and a dtype
    without native CPU support is reported slow (fp16 on every x86 CPU but Sapphire
    Rapids and later: ~20-30x slower than fp32 through torch's fallback kernels)."""
    if not torch.backends.cpu.get_cpu_capability():
        pytest.skip("no CPU capability information")
    cap = cpu_capability(tmp_path)
    _, flags = read_cpuinfo()
    for name in NATIVE_CPU_FLAGS:
        s = cap.support[name]
        assert s.slowdown is not None and s.slowdown > 0
        assert s.fast == (s.slowdown <= 1.0), s.reason
        if native_support(name, flags) is False:
            assert not s.fast, f"{name} reported fast without native support: {s.reason}"
