"""C++ SIMD kernels for Q8_0 / Q4_0 32-value block formats, as PyTorch custom operators.

`load_kernels()` builds on first use and returns `torch.ops.trainforge_cpu` (ops
`q8_0_linear`, `q4_0_linear`, `isa`, `supports`) or None. The instruction path is the best
the CPU has (avx512 = AVX-512 VNNI, avx2, scalar); set `TRAINFORGE_CPU_ISA=avx2|avx512|scalar`
to force one (read on every call).
"""

from trainforge.infer.cpu_kernels.build import load_kernels

__all__ = ["load_kernels"]
