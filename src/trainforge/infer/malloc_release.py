"""Hand the memory a model load freed back to the OS (glibc), once the model is ready.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned
to the OS by ``free``; smaller ones come from the heap, which keeps freed memory. The threshold is
dynamic: each freed mmapped block raises it to that block's size (up to 32 MiB on 64-bit), so once
a load has freed one 10 MB tensor, later tensors up to that size land in the heap and stay
resident after they are freed. Loading a quantised model frees many such tensors (GGUF bytes split
into stored forms, stored forms repacked for the kernels: ``gguf_loading.py``, ``blocks.py``):
measured on the 90m benchmark model's q4_0 GGUF, packing left 30 MiB of freed tensors resident.

``malloc_trim(0)`` after the load releases those free pages wherever they lie in the heap. Fixing
the threshold low for the whole process instead (``mallopt``) did the same for the load but made
every later large activation a fresh ``mmap`` whose pages fault in again: a 512-token prefill ran
10-30% slower (BENCHMARKS.md, issue 24).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def release_freed_memory() -> bool:
    """``malloc_trim(0)`` (see the module docstring); returns whether it ran. A no-op, returning
    False, where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
        libc.gnu_get_libc_version  # glibc's own symbol: other C libraries lack malloc_trim or stub it
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
