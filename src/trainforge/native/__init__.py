"""Building and loading trainforge's C++ libraries (PyTorch custom operators), below both
training and inference: the decode kernels (``infer/cpu_kernels/``) and the CPU AdamW
(``optim/``) each hand their own source list to ``build.build``.

- ``build.py``: compile a source list with ``torch.utils.cpp_extension`` once per source + torch
  into a cache, load it, report a failure once per cache.
- ``build_cache.py``: the cache entry a killed builder cannot wedge.
- ``isa.h``: the instruction-path choice every kernel file shares (``TRAINFORGE_CPU_ISA``).
"""
