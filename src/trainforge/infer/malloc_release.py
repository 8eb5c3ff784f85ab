"""The malloc policy of a model load (glibc): what the load frees leaves the process.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned
to the OS by ``free``; smaller ones come from the heap, which keeps freed memory. The threshold is
dynamic: each freed mmapped block raises it to that block's size (up to 32 MiB on 64-bit), so once
a load has freed one 10 MB tensor, later tensors up to that size land in the heap and stay
resident after they are freed. Loading a quantised model frees many such tensors (GGUF bytes split
into stored forms, stored forms fused and repacked for the kernels: ``gguf_loading.py``,
``blocks.py``), and a tensor allocated after one was freed lands in its hole or above it: measured
on the 90m benchmark model's q4_0 GGUF, packing left 30 MiB of freed tensors resident at the peak.

So the load runs under a low fixed threshold (``map_large_blocks_for_load``: every tensor its own
map, freed at once, the block scales too; the q4_0 peak fell 331 -> 313 MiB, and 434 -> 424
for a 287M-parameter model, whose 17 MiB of scales sat in heap holes), and once the model is ready
``release_freed_memory`` fixes it at glibc's ceiling and trims. Left low for the whole run, every
large activation would be a fresh ``mmap`` whose pages fault in again: a 512-token prefill ran
10-30% slower (docs/benchmarks-archive.md, issue 24); from the heap they are reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
LOAD_MMAP_THRESHOLD = 32 << 10  # every tensor of a load but the norms is its own map (the block scales too)
RUN_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the dynamic threshold


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim, libc.mallopt
        libc.gnu_get_libc_version  # glibc's own symbol: other C libraries lack malloc_trim or stub it
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc


def map_large_blocks_for_load() -> bool:
    """Before a model load: serve every block of ``LOAD_MMAP_THRESHOLD`` or more by its own
    ``mmap``, so each tensor the load frees (a read buffer, a stored form once repacked) leaves
    the process at once and the next one cannot land in a hole of the heap. Returns whether it
    ran (glibc only). ``release_freed_memory`` ends it."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD))


def release_freed_memory() -> bool:
    """Once the model is ready: raise the mmap threshold to ``RUN_MMAP_THRESHOLD`` (activations of
    a prefill then come from the heap and are reused, never faulted in again: the module
    docstring), keep the heap's top up to that size, and ``malloc_trim(0)``. Returns whether it ran;
    a no-op, returning False, where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * RUN_MMAP_THRESHOLD)  # what the dynamic rule would pair with it
    libc.malloc_trim(0)
    return True
