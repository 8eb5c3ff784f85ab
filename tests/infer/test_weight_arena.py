"""The weight arena (infer/weight_arena.py): aligned, huge-page backed, values exact, freed with its tensors."""

import gc
import re

import pytest
import torch

from trainforge.infer import weight_arena as wa


def _anon_huge_kib() -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+)", open("/proc/self/smaps_rollup").read()).group(1))


def test_placed_tensors_are_exact_aligned_and_apart():
    arena = wa.WeightArena()
    ts = [torch.randn(37, 45), torch.arange(11, dtype=torch.int8), torch.randn(3).half()]
    placed = [arena.place(t) for t in ts]
    for t, p in zip(ts, placed):
        assert torch.equal(p, t) and p.dtype == t.dtype and p.is_contiguous()
        assert p.data_ptr() % wa.ALIGN == 0
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)  # empty, of a multi-byte dtype
    placed[0].zero_()  # neighbours in one chunk do not overlap
    assert torch.equal(placed[1], ts[1]) and torch.equal(placed[2], ts[2])


@pytest.mark.skipif(wa._HUGEPAGE is None, reason="no MADV_HUGEPAGE on this platform: the arena is torch.empty")
def test_a_large_weight_gets_huge_pages_when_the_kernel_grants_them():
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip()})")
    before = _anon_huge_kib()
    w = wa.place_weight(torch.ones((32 << 20) // 4))  # 32 MiB (> CHUNK / 4): a map of its own
    assert w.data_ptr() % wa.HUGE == 0
    assert _anon_huge_kib() - before >= 16384  # at least half of its 16 pages are 2 MiB ones
    del w
    gc.collect()
    assert _anon_huge_kib() - before < 2048  # its map went with it
