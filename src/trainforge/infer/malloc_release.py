"""Make glibc's malloc hand large freed blocks back to the OS, for a process that loads a model.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned
to the OS by ``free``; smaller ones come from the heap, which keeps freed memory. The threshold is
dynamic: each freed mmapped block raises it to that block's size (up to 32 MiB on 64-bit), so once
a load has freed one 10 MB tensor, every later tensor up to that size lands in the heap and stays
resident after it is freed. Loading a quantised model frees many such tensors (GGUF bytes split
into stored forms, stored forms repacked for the kernels: ``gguf_loading.py``, ``blocks.py``):
measured on the 90m benchmark model's q4_0 GGUF, packing left 30 MiB of freed tensors resident,
6 MiB with the threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``). Setting it with ``mallopt``
also turns the dynamic adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_THRESHOLD_BYTES = 128 * 1024  # glibc's default starting value: small blocks stay on the heap (fast)


def release_freed_tensors_to_os() -> bool:
    """Fix glibc's mmap threshold at 128 KiB for this process (see the module docstring);
    returns whether it was set. A no-op, returning False, where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc's own symbol: musl has mallopt as a stub that does nothing
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES) == 1
