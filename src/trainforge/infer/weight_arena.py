"""CPU inference weights in transparent huge pages: one weight stream per decode step, read
through as few TLB entries as possible.

A decode step reads every weight once, so each 4 KiB page costs a TLB miss (and, in a VM, a
two-level page walk). On Linux with THP in ``madvise`` mode (the common default) an anonymous
private map advised ``MADV_HUGEPAGE`` is backed by 2 MiB pages. Measured on a 2-vCPU Zen 4 KVM
(``python -m bench.cpu_kernels``, weight stream: fp32 ``f32_linear_into`` over 32 weights of
2048 x 768, the two sets allocated alternately): 1.04-1.15x the GB/s of ``torch.empty`` weights at
1 and 2 threads; the file cache's pages (large folios) that llama.cpp's mmap reads were 7-15%
faster than our plain copies for the same reason. (Python's ``mmap.mmap(-1, n)`` is
``MAP_SHARED``, shmem, whose THP setting is ``never`` there: the arena maps ``MAP_PRIVATE``.)

Weights are bump-allocated from ``CHUNK``-sized maps, 64-byte aligned inside (one cache line
and one AVX-512 load), so the rounding of huge pages costs at most one partly used 2 MiB page
per chunk rather than one per tensor (a 1.7 MiB tensor in its own map would take a whole
2 MiB page). A tensor larger than ``CHUNK / 4`` gets its own map. A chunk is unmapped when the
last tensor in it (and the arena, for the chunk being filled) lets go of it. Where the platform
has no ``MADV_HUGEPAGE`` the tensors come from torch's allocator, which is 64-byte aligned too.
"""

from __future__ import annotations

import mmap
import threading

import torch

CHUNK = 64 << 20
HUGE = 2 << 20
ALIGN = 64
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _huge_map(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new private anonymous map of ``nbytes`` (rounded up to ``HUGE``),
    starting on a 2 MiB boundary and advised for huge pages."""
    size = _round_up(nbytes, HUGE)
    mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor's storage keeps the map alive
    start = (-whole.data_ptr()) % HUGE
    try:
        mm.madvise(_HUGEPAGE, start, size)
    except OSError:  # advice only: a kernel that refuses it gives 4 KiB pages, the same bytes
        pass
    return whole[start:start + size]


class WeightArena:
    """Bump allocator of weight tensors over huge-page maps (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if _HUGEPAGE is None:
            return torch.empty(shape, dtype=dtype)
        # At least one element's bytes, so an empty tensor still views as ``dtype``.
        nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
        if nbytes > CHUNK // 4:
            raw = _huge_map(nbytes)[:nbytes]
        else:
            with self._lock:
                if self._chunk is None or self._used + nbytes > self._chunk.numel():
                    self._chunk, self._used = _huge_map(CHUNK), 0
                raw = self._chunk[self._used:self._used + nbytes]
                self._used = _round_up(self._used + nbytes, ALIGN)
        return raw.view(dtype)[:torch.Size(shape).numel()].view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (contiguous) in the arena."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out


_ARENA = WeightArena()


def empty_weight(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in the process's weight arena."""
    return _ARENA.empty(shape, dtype)


def place_weight(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the process's weight arena (CPU tensors only; others are returned as they are)."""
    return _ARENA.place(t) if t.device.type == "cpu" else t
