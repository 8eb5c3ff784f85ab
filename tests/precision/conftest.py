"""Shared helpers: a hand-made hardware capability (so policy tests never run the probe)
and a tiny model. bf16/fp16 matmuls can be orders of magnitude slower than fp32 on CPUs
without native support, so every low-precision test here uses tiny tensors."""

from __future__ import annotations

import pytest
import torch

from trainforge.model import build_model
from trainforge.model.config import FLAVORS
from trainforge.precision.hardware import Capability, DtypeSupport


def make_capability(bf16_fast: bool, fp16_fast: bool, device_type: str = "cpu") -> Capability:
    def support(name: str, fast: bool) -> DtypeSupport:
        return DtypeSupport(fast, fast, 0.5 if fast else 20.0, f"{name} {'fast' if fast else 'slow'} (test)")

    return Capability(device_type, f"test-{device_type}", {"bf16": support("bf16", bf16_fast),
                                                           "fp16": support("fp16", fp16_fast)})


@pytest.fixture
def capability():
    return make_capability


@pytest.fixture
def debug_model():
    """The 'debug' flavor (< 1M parameters); use with (2, 16) token batches."""
    return build_model(FLAVORS["debug"], seed=0)


@pytest.fixture
def tokens():
    return torch.randint(0, FLAVORS["debug"].vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
