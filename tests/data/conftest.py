"""Fixtures of the data-pipeline tests: small prepared sets cut into many shards (from
the session's ``small_data``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.helpers import reshard


@pytest.fixture(scope="session")
def sharded_data(tmp_path_factory, small_data) -> Path:
    """12 train shards of 1100 tokens (17 windows of 65 tokens each at seq_len 64)."""
    return reshard(small_data, tmp_path_factory.mktemp("sharded") / "data", 1100, 12)


@pytest.fixture(scope="session")
def epoch_data(tmp_path_factory, small_data) -> Path:
    """5 train shards of 1100 tokens: 85 windows, 10 batches of 8 per epoch at seq_len 64."""
    return reshard(small_data, tmp_path_factory.mktemp("epoch") / "data", 1100, 5)
