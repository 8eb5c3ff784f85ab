"""The tiered shard cache against a plain reader: every byte served equals the source,
budgets hold (also under concurrent prefetch), eviction uses the future, and bad
copies are re-fetched or the shard is quarantined / the run fails, per on_corrupt."""

from __future__ import annotations

import hashlib
import math
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainforge.data.integrity import Quarantine, ShardInfo, ShardQuarantined
from trainforge.data.loader_metrics import DataMetrics
from trainforge.data.sources import LocalSource
from trainforge.data.tiered_cache import TieredShardCache
from trainforge.errors import ConfigError, DataError


def write_shards(root: Path, sizes: list[int], seed: int = 0) -> tuple[dict[str, ShardInfo], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    infos, arrays = {}, {}
    for i, n in enumerate(sizes):
        name = f"train_{i:05d}.bin"
        arr = rng.integers(0, 65535, n, dtype=np.uint16)
        raw = arr.astype("<u2").tobytes()
        (root / name).write_bytes(raw)
        infos[name] = ShardInfo(name, len(raw), hashlib.sha256(raw).hexdigest())
        arrays[name] = arr
    return infos, arrays


def make_cache(root: Path, infos, memory: int, disk_dir: Path | None, disk: int = 0, on_corrupt: str = "fail",
               source=None, log=None) -> TieredShardCache:
    metrics = DataMetrics()
    log = log or (lambda _: None)
    quarantine = Quarantine(on_corrupt, str(root), log, metrics)
    return TieredShardCache(source or LocalSource(root, 10.0), infos, np.uint16, memory, disk_dir, disk,
                            quarantine, metrics, log)


def dir_bytes(path: Path) -> int:
    total = 0
    for e in os.scandir(path):
        try:
            total += e.stat().st_size if e.is_file() else 0
        except FileNotFoundError:  # renamed or deleted meanwhile
            pass
    return total


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(40, 300), min_size=1, max_size=6),
       memory_frac=st.floats(0, 1.2), disk_frac=st.one_of(st.none(), st.floats(0, 1.2)),
       ops=st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1), st.integers(1, 40), st.booleans()),
                    min_size=1, max_size=30),
       future_aware=st.booleans())
def test_every_byte_served_equals_the_source(sizes, memory_frac, disk_frac, ops, future_aware):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        root.mkdir()
        infos, arrays = write_shards(root, sizes)
        total = sum(i.nbytes for i in infos.values())
        memory = int(memory_frac * total)
        disk_dir, disk = (None, 0) if disk_frac is None else (Path(tmp) / "cache", int(disk_frac * total))
        largest = max(i.nbytes for i in infos.values())
        if largest > max(memory, disk if disk_dir else 0):
            with pytest.raises(ConfigError, match="data.cache.memory_mb"):
                make_cache(root, infos, memory, disk_dir, disk)
            return
        cache = make_cache(root, infos, memory, disk_dir, disk)
        files = sorted(infos)
        seq = [files[op[0] % len(files)] for op in ops]
        now = [0]
        if future_aware:  # the true future: Belady's oracle
            cache.next_use = lambda f: next((j - now[0] for j in range(now[0], len(seq)) if seq[j] == f), math.inf)
        for i, ((_, frac, length, prefetch), file) in enumerate(zip(ops, seq)):
            now[0] = i
            arr = arrays[file]
            length = min(length, len(arr))
            if prefetch:
                cache.prefetch(file)
            else:
                offsets = np.array([int(frac * (len(arr) - length)), 0, len(arr) - length])
                rows = cache.read_windows(file, offsets, length)
                want = np.stack([arr[o:o + length] for o in offsets])
                np.testing.assert_array_equal(rows, want)
            assert cache.memory.used <= memory
            if disk_dir is not None:
                assert cache.disk.used <= disk and dir_bytes(disk_dir) <= disk


class SlowSource(LocalSource):
    def __init__(self, root, delay_s):
        super().__init__(root, 10.0)
        self.delay_s = delay_s

    def read(self, file):
        time.sleep(self.delay_s * random.random())
        return super().read(file)


def test_budgets_hold_under_concurrent_prefetch(tmp_path):
    (tmp_path / "src").mkdir()
    infos, arrays = write_shards(tmp_path / "src", [2000] * 12)  # 4000 bytes each
    memory, disk = 10_000, 18_000  # 2.5 and 4.5 shards
    cache = make_cache(tmp_path / "src", infos, memory, tmp_path / "cache", disk,
                       source=SlowSource(tmp_path / "src", 0.004))
    files = sorted(infos)
    peak_dir, stop = [0], threading.Event()

    def poll():
        while not stop.is_set():
            peak_dir[0] = max(peak_dir[0], dir_bytes(tmp_path / "cache"))

    def read(seed):
        rng = random.Random(seed)
        for _ in range(60):
            f = rng.choice(files)
            o = rng.randrange(0, 1900)
            np.testing.assert_array_equal(cache.read_windows(f, np.array([o]), 100)[0], arrays[f][o:o + 100])

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cache.prefetch, random.Random(i).choice(files)) for i in range(150)]
        futures += [pool.submit(read, s) for s in range(3)]
        for f in futures:
            f.result()
    stop.set()
    poller.join()
    assert 0 < cache.memory.peak <= memory
    assert 0 < cache.disk.peak <= disk
    assert peak_dir[0] <= disk, "temporary files count too: the directory itself stays within data.cache.disk_mb"
    assert cache.metrics.bytes["source"] > 0


def test_future_aware_eviction_beats_lru_on_a_cyclic_scan(tmp_path):
    infos, _ = write_shards(tmp_path, [500] * 3)  # 1000 bytes each; memory holds two
    seq = sorted(infos) * 6
    hits = {}
    for future_aware in (False, True):
        cache = make_cache(tmp_path, infos, 2000, None)
        now = [0]
        if future_aware:
            cache.next_use = lambda f: next((j - now[0] for j in range(now[0], len(seq)) if seq[j] == f), math.inf)
        for i, f in enumerate(seq):
            now[0] = i
            cache.read_windows(f, np.array([0]), 10)
        hits[future_aware] = cache.metrics.hits["memory"]
    assert hits[False] == 0  # LRU always evicts what the cyclic scan needs next
    assert hits[True] >= 7  # Belady keeps one of the two resident shards for its next use


def test_flipped_byte_in_the_disk_tier_is_fetched_again_from_the_source(tmp_path):
    (tmp_path / "src").mkdir()
    infos, arrays = write_shards(tmp_path / "src", [1000] * 3)
    files = sorted(infos)
    cache = make_cache(tmp_path / "src", infos, 2000, tmp_path / "cache", 10_000)
    for f in files:
        cache.read_windows(f, np.array([0]), 8)
    on_disk = {f: next((tmp_path / "cache").glob(f"*-{f}")) for f in files}

    def flip(path, at):
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x5A
        path.write_bytes(bytes(raw))

    # Same process: train_00000 left memory (LRU), its disk copy is flipped, then promoted again.
    assert cache.resident_tier(files[0]) == "disk"
    flip(on_disk[files[0]], 100)
    np.testing.assert_array_equal(cache.read_windows(files[0], np.array([0, 40]), 20),
                                  np.stack([arrays[files[0]][:20], arrays[files[0]][40:60]]))
    assert cache.metrics.corrupt_refetched == 1

    # A later run adopting the directory: a flipped copy is caught on its first read.
    flip(on_disk[files[2]], 7)
    logs = []
    later = make_cache(tmp_path / "src", infos, 2000, tmp_path / "cache", 10_000, log=logs.append)
    np.testing.assert_array_equal(later.read_windows(files[2], np.array([0]), 1000)[0], arrays[files[2]])
    assert later.metrics.corrupt_refetched == 1 and later.metrics.hits["source"] == 1
    assert any(files[2] in m and "fetching it again" in m for m in logs)
    assert hashlib.sha256(next((tmp_path / "cache").glob(f"*-{files[2]}")).read_bytes()).hexdigest() == \
        infos[files[2]].sha256  # the disk tier holds a good copy again
    later.read_windows(files[1], np.array([0]), 8)  # an intact adopted copy is served from disk
    assert later.metrics.hits["disk"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_a_bad_source_shard_stops_the_run_or_is_quarantined(tmp_path, damage):
    infos, arrays = write_shards(tmp_path, [1000] * 3)
    bad = tmp_path / "train_00001.bin"
    if damage == "flip":
        raw = bytearray(bad.read_bytes())
        raw[10] ^= 1
        bad.write_bytes(bytes(raw))
    elif damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:-2])
    else:
        bad.unlink()
    reason = {"flip": "sha256", "truncate": "truncated", "missing": "missing"}[damage]
    with pytest.raises(DataError, match=f"train_00001.bin.*{reason}.*on_corrupt") as e:
        make_cache(tmp_path, infos, 10_000, None).read_windows("train_00001.bin", np.array([0]), 8)
    assert not isinstance(e.value, ShardQuarantined)

    logs = []
    cache = make_cache(tmp_path, infos, 10_000, None, on_corrupt="skip", log=logs.append)
    for _ in range(2):  # quarantined once, then skipped without asking the source again
        with pytest.raises(ShardQuarantined, match="train_00001.bin"):
            cache.read_windows("train_00001.bin", np.array([0]), 8)
    assert cache.metrics.quarantined == 1 and cache.metrics.hits["source"] == 0
    assert len([m for m in logs if "train_00001.bin" in m and "quarantined" in m]) == 1
    np.testing.assert_array_equal(cache.read_windows("train_00002.bin", np.array([3]), 5)[0],
                                  arrays["train_00002.bin"][3:8])
