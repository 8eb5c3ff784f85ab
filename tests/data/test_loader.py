"""The trainer's loader (background assembly, tiered cache, prefetch) against the plain
reference ``TokenBatches`` over memory maps: same batches, same resume, disjoint ranks;
a quarantined shard's windows are replaced, never read; the metrics add up."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from trainforge.config import load_config
from trainforge.data.dataset import TokenBatches, load_prepared
from trainforge.data.pipeline import CachedData, build_loader, open_data
from trainforge.errors import DataError

SEQ, BATCH, SEED = 64, 8, 3


def dcfg(path, *extra):
    return load_config(None, ["--data.path", str(path), *extra]).data


def reference(path, n, rank=0, world=1):
    data = load_prepared(path)
    ref = TokenBatches(data.splits["train"], SEQ, BATCH, SEED, rank=rank, world_size=world)
    return [ref.next() for _ in range(n)]


def assert_same(got, want):
    for (x, y), (rx, ry) in zip(got, want, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("cache", ["url", "url+disk", "local+disk"])
def test_cached_prefetching_loader_reads_exactly_the_reference_batches(sharded_data, tmp_path, cache):
    path = sharded_data.as_uri() if cache.startswith("url") else sharded_data
    extra = ["--data.cache.dir", str(tmp_path / "c"), "--data.cache.disk_mb", "1"] if "disk" in cache else []
    # A memory tier of 0 MiB forces every read through the disk tier or the source.
    extra += ["--data.cache.memory_mb", "0" if "disk" in cache else "1"]
    data = open_data(dcfg(path, *extra))
    assert isinstance(data, CachedData)
    n = 2 * 25 + 7  # two epochs (204 windows / 8 = 25 batches) and a bit
    for world in (1, 2):
        loaders = [build_loader(data, "train", dcfg(path, *extra), SEQ, BATCH, SEED, rank=r, world_size=world)
                   for r in range(world)]
        for r, loader in enumerate(loaders):
            try:
                assert_same([loader.next() for _ in range(n // world)], reference(sharded_data, n // world, r, world))
            finally:
                loader.close()
    stats = loaders[0].window_stats()
    assert stats["data_bytes_source"] > 0
    assert sum(stats[f"data_hit_rate_{t}"] for t in ("memory", "disk", "source")) == pytest.approx(1.0)


def test_resume_mid_epoch_and_across_epochs_reads_the_same_batches(sharded_data, tmp_path):
    cfg = dcfg(sharded_data.as_uri(), "--data.cache.dir", str(tmp_path / "c"))
    want = reference(sharded_data, 60)
    data = open_data(cfg)
    for stop in (9, 25, 33):  # mid-epoch, at the boundary, mid second epoch
        first = build_loader(data, "train", cfg, SEQ, BATCH, SEED)
        got = [first.next() for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # plain values, as in a checkpoint
        first.close()
        again = build_loader(open_data(cfg), "train", cfg, SEQ, BATCH, SEED)
        again.load_state_dict(state)
        got += [again.next() for _ in range(60 - stop)]
        again.close()
        assert_same(got, want)
    # Two ranks resume a one-rank position at the same global batch: each reads its half.
    one = build_loader(data, "train", cfg, SEQ, BATCH, SEED)
    for _ in range(11):
        one.next()
    state, ref = one.state_dict(), one.next()[0]
    one.close()
    halves = []
    for rank in range(2):
        half = build_loader(data, "train", cfg, SEQ, BATCH // 2, SEED, rank=rank, world_size=2)
        half.load_state_dict(state)
        halves.append(half.next()[0])
        half.close()
    assert torch.equal(torch.cat(halves), ref)
    with pytest.raises(DataError, match="training.batch_size = 4"):
        build_loader(data, "train", cfg, SEQ, BATCH, SEED, rank=0, world_size=2).load_state_dict(state)


def corrupt_copy(src, dst, shard="train_00003.bin"):
    shutil.copytree(src, dst)
    raw = bytearray((dst / shard).read_bytes())
    raw[500] ^= 0xFF
    (dst / shard).write_bytes(bytes(raw))
    return dst


def test_quarantined_shard_is_replaced_not_read_and_fail_names_it(sharded_data, tmp_path):
    bad = corrupt_copy(sharded_data, tmp_path / "bad")
    ref = load_prepared(sharded_data)
    bad_tokens = {tuple(np.asarray(ref.splits["train"][3][o:o + SEQ]).tolist()) for o in range(0, 1100 - SEQ, SEQ)}
    good_rows = {tuple(x.tolist()) for x, _ in reference(sharded_data, 25) for x in x}

    cfg = dcfg(bad.as_uri(), "--data.on_corrupt", "skip")
    loader = build_loader(open_data(cfg), "train", cfg, SEQ, BATCH, SEED)
    rows = [tuple(r.tolist()) for _ in range(25) for r in loader.next()[0]]
    assert len(rows) == 25 * BATCH  # full batches
    assert not set(rows) & bad_tokens
    assert set(rows) <= good_rows  # replacements are real windows of healthy shards
    assert loader.window_stats()["data_quarantined"] == 1
    loader.close()

    cfg = dcfg(bad.as_uri())  # on_corrupt = "fail" (the default)
    loader = build_loader(open_data(cfg), "train", cfg, SEQ, BATCH, SEED)
    with pytest.raises(DataError, match="train_00003.bin.*sha256"):
        for _ in range(25):
            loader.next()
    with pytest.raises(DataError, match="train_00003.bin"):  # stays failed
        loader.next()
    loader.close()


def test_metrics_show_prefetch_and_the_second_epoch_served_from_cache(sharded_data, tmp_path):
    cfg = dcfg(sharded_data.as_uri(), "--data.cache.dir", str(tmp_path / "c"), "--data.prefetch_depth", "4")
    loader = build_loader(open_data(cfg), "train", cfg, SEQ, BATCH, SEED)
    for _ in range(25):
        loader.next()
    first = loader.window_stats()
    for _ in range(25):
        loader.next()
    second = loader.window_stats()
    loader.close()
    total = 12 * 1100 * 2
    assert first["data_bytes_source"] == total  # each shard fetched once (prefetch or demand), never twice
    assert second["data_bytes_source"] == 0 and second["data_hit_rate_memory"] == 1.0
    assert 0 < first["data_prefetch_depth"] <= 4
    assert 0 <= second["data_io_wait_frac"] <= 1


def test_local_path_without_cache_is_memory_mapped_as_before(sharded_data):
    cfg = dcfg(sharded_data)
    data = open_data(cfg)
    assert not isinstance(data, CachedData)
    loader = build_loader(data, "train", cfg, SEQ, BATCH, SEED)
    assert_same([loader.next() for _ in range(30)], reference(sharded_data, 30))
    stats = loader.window_stats()
    loader.close()
    assert set(stats) == {"data_io_wait_frac"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_yields_the_reference_batches_on_the_device_and_resumes(sharded_data):
    cfg = dcfg(sharded_data.as_uri())
    data = open_data(cfg)
    loader = build_loader(data, "train", cfg, SEQ, BATCH, SEED, device="cuda")
    got = [loader.next() for _ in range(9)]
    assert all(x.is_cuda and y.is_cuda for x, y in got)
    state = loader.state_dict()  # the batch staged ahead is not counted as read
    loader.close()
    again = build_loader(data, "train", cfg, SEQ, BATCH, SEED, device="cuda")
    again.load_state_dict(state)
    got += [again.next() for _ in range(5)]
    again.close()
    assert_same([(x.cpu(), y.cpu()) for x, y in got], reference(sharded_data, 14))
