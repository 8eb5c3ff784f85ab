"""C++ SIMD kernels for CPU inference, as PyTorch custom operators (``torch.ops.trainforge_cpu``).

- ``blocks.cpp``: Q8_0 / Q4_0 linears on weights packed in groups of 8 rows (``formats.pack_x8``),
  ``q8_0_linear`` / ``q4_0_linear`` and their ``_into`` forms; the fp32 GEMV ``f32_linear(_into)``.
- ``attention.cpp``: the decode step's ``rope_into`` and ``paged_attention_into``.
- ``norm_act.cpp``: ``rms_norm_into`` and ``silu_mul_into``.

`load_kernels()` builds them on first use and returns the op namespace or None (one warning).
The instruction path is the best the CPU has (avx512 = AVX-512 VNNI, avx2, scalar); set
`TRAINFORGE_CPU_ISA=avx2|avx512|scalar` to force one (read on every call).
"""

from trainforge.infer.cpu_kernels.build import load_kernels

__all__ = ["load_kernels"]
