"""Sources: a hung or slow source ends in a clear error within data.timeout_s, never a
hang; URLs are checked at config time without fetching anything."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from conftest import debug_config
from tests.data.helpers import serve
from trainforge.config import load_config
from trainforge.data.pipeline import build_loader, open_data
from trainforge.data.sources import FsspecSource, LocalSource, SourceTimeoutError
from trainforge.errors import ConfigError


def test_hung_local_file_times_out_naming_it(tmp_path):
    os.mkfifo(tmp_path / "train_00000.bin")  # a read blocks forever: nothing ever writes
    t0 = time.perf_counter()
    with pytest.raises(SourceTimeoutError, match=r"train_00000.bin.*data.timeout_s = 0.3"):
        LocalSource(tmp_path, timeout_s=0.3).read("train_00000.bin")
    assert time.perf_counter() - t0 < 3


def test_slow_http_source_times_out_in_the_loader(sharded_data):
    with serve(sharded_data, delay_s={"train_00004.bin": 5.0}) as url:
        assert FsspecSource(url, 2.0).read("train_00000.bin") == (sharded_data / "train_00000.bin").read_bytes()
        cfg = load_config(None, ["--data.path", url, "--data.timeout_s", "0.5", "--data.prefetch_depth", "0"]).data
        loader = build_loader(open_data(cfg), "train", cfg, 64, 8, 3)
        t0 = time.perf_counter()
        with pytest.raises(SourceTimeoutError, match=r"train_00004.bin did not arrive within data.timeout_s"):
            for _ in range(30):
                loader.next()
        assert time.perf_counter() - t0 < 5
        loader.close()


def test_missing_http_file_is_reported_as_missing(sharded_data):
    with serve(sharded_data) as url:
        with pytest.raises(FileNotFoundError):
            FsspecSource(url, 2.0).read("train_99999.bin")
        with pytest.raises(Exception, match="manifest.json does not exist"):
            open_data(load_config(None, ["--data.path", url + "/nowhere"]).data)


def test_url_protocols_are_checked_without_fetching(small_data):
    with pytest.raises(ConfigError, match="data.path.*protocol 'nosuchproto'"):
        load_config(None, ["--data.path", "nosuchproto://host/data"])
    cfg = debug_config(small_data)  # local paths keep their manifest check
    assert cfg.data.path == str(small_data)
    load_config(None, ["--data.path", "http://127.0.0.1:9/never-contacted"])  # nothing listens there; no error


def test_file_url_reads_the_same_tokens(sharded_data):
    data = open_data(load_config(None, ["--data.path", sharded_data.as_uri()]).data)
    rows = data.cache.read_windows("train_00002.bin", np.array([0, 100]), 10)
    ref = np.fromfile(sharded_data / "train_00002.bin", dtype="<u2")
    assert rows.tolist() == [ref[:10].tolist(), ref[100:110].tolist()]
